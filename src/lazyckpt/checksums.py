"""The process's checksum threads, shared by every save and load.

A block's checksum is computed beside the I/O that moves it, never on the
thread that moves it: a writer hands its chunk's hashing to these threads and
issues its write at once; a reader hands the block it read to them and
starts its next read. A thread that hashed its own block left the disk one
request short for the length of each hash: 0.8 GB saved in 0.261 s with the
writers hashing, 0.242 s with no hashing at all, raw O_DIRECT 0.227 s; the
verified load was 5-8 % slower than the unverified one (BENCHMARKS section
33). xxh3 runs at ~20 GB/s a core here and releases the GIL, so two threads
keep up with 2-3x the fastest disk measured.
"""

from __future__ import annotations

import concurrent.futures as cf

from lazyckpt.keptpools import KeptPool

#: Threads hashing at once (each ~20 GB/s of xxh3 on this machine).
THREADS = 2

_pool = KeptPool(THREADS, "lazyckpt-checksum")


def pool() -> cf.Executor:
    """The shared pool, kept for the process (its threads end when idle)."""
    return _pool.get()


def threads() -> frozenset:
    """The pool's threads now (it starts them one at a time as hashing needs
    them, up to THREADS): kept for the process on purpose."""
    return _pool.threads()
