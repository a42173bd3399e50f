"""The process's checksum threads, and the incremental form of the format's checksum.

A save's checksums are computed beside the I/O that moves them, never on the
thread that moves them: a writer hands its chunk's hashing to these threads
and issues its write at once. A writer that hashed its own chunk left the
disk one request short for the length of each hash: 0.8 GB saved in 0.261 s
with the writers hashing, 0.242 s with no hashing at all, raw O_DIRECT 0.227 s.
A load verifies on the reader instead, each slice hashed right after it lands
while the other readers' requests keep the disk busy (loading/reader.py):
handing each block to these threads cost a GIL round trip per entry and left
the last block's whole hash after the last read. xxh3 runs here at 12-14 GB/s on one
thread over bytes in memory and 13-16 GB/s on two: memory bandwidth, not
cores, bounds it, and no candidate measured was faster
(benchmarks/bench_checksums.py: CRC32C, xxh3-128). It releases the GIL above
64 KiB (xxhash >= 4.0), so the other threads' Python runs while it hashes.
"""

from __future__ import annotations

import concurrent.futures as cf

import xxhash

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


def running() -> "xxhash.xxh3_64":
    """An incremental xxh3-64 (``update()`` piece by piece, then ``intdigest()``):
    the same value as ``formats.datafile.checksum`` over the pieces joined, for
    a checksum span whose bytes arrive in several reads."""
    return xxhash.xxh3_64()
