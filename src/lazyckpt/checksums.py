"""The process's checksum threads, shared by every save and load.

A block's checksum is computed beside the I/O that moves it, never on the
thread that moves it: a writer hands its chunk's hashing to these threads and
issues its write at once; a reader hands the block it read to them and
starts its next read. A thread that hashed its own block left the disk one
request short for the length of each hash: 0.8 GB saved in 0.261 s with the
writers hashing, 0.242 s with no hashing at all, raw O_DIRECT 0.227 s; the
verified load was 5-8 % slower than the unverified one (BENCHMARKS section
33). xxh3 runs here at 12-14 GB/s on one thread over bytes in memory (where
a read leaves them) and 13-16 GB/s on two: memory bandwidth, not cores,
bounds it, and no candidate measured was faster (benchmarks/bench_checksums.py:
CRC32C, xxh3-128). It releases the GIL above 64 KiB (xxhash >= 4.0), so the
readers and the caller's Python run while it hashes.
"""

from __future__ import annotations

import concurrent.futures as cf

from lazyckpt.keptpools import KeptPool

#: Threads hashing at once (a second adds little: memory-bound, see above).
THREADS = 2

_pool = KeptPool(THREADS, "lazyckpt-checksum")


def pool() -> cf.Executor:
    """The shared pool, kept for the process (its threads end when idle)."""
    return _pool.get()


def threads() -> frozenset:
    """The pool's threads now (it starts them one at a time as hashing needs
    them, up to THREADS): kept for the process on purpose."""
    return _pool.threads()
