"""The save side: the engine (queue, capture thread, errors, exit), capture, the
host cache, the writer of one file, the barrier, the save planner (incremental
references and automatic replication), commit strategies, foreign file layouts."""
