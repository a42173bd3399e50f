"""The save side: the engine (queue, capture thread, errors, exit), capture, the
host cache, the writer of one file, the barrier, commit strategies, incremental
references and automatic replication, foreign file layouts."""
