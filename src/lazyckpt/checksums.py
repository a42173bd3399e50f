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
import os
import threading
from typing import Optional

#: Threads hashing at once (each ~20 GB/s of xxh3 on this machine).
THREADS = 2

_pool: Optional[cf.ThreadPoolExecutor] = None
_lock = threading.Lock()


def pool() -> cf.ThreadPoolExecutor:
    """The shared pool, started at first use and kept for the process."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = cf.ThreadPoolExecutor(THREADS, thread_name_prefix="lazyckpt-checksum")
        return _pool


def threads() -> frozenset:
    """The pool's threads now (it starts them one at a time as hashing needs
    them, up to THREADS): what a check for leaked threads must allow, since
    they are kept for the process on purpose."""
    current = _pool
    return frozenset(getattr(current, "_threads", ())) if current is not None else frozenset()


def _forget_in_child() -> None:
    """After a fork: the parent's pool has no threads here (a job submitted to
    it would wait forever) and its lock may be held; the child starts its own."""
    global _pool, _lock
    _pool = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
