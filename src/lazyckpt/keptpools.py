"""Thread pools kept for the process: started at first use, never shut down.

Two kinds of work run beside every save and load and must not wait for a pool
to start or be torn down with a Checkpointer: the checksums computed next to
the I/O (:mod:`lazyckpt.checksums`) and the freeing of a replaced or removed
file's blocks (:func:`lazyckpt.storage.fileio.replace_releasing_later`). A check for
leaked threads allows exactly :func:`threads`.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import weakref
from typing import Optional

_all: "weakref.WeakSet[KeptPool]" = weakref.WeakSet()


class KeptPool:
    """A ``ThreadPoolExecutor`` of ``size`` threads named ``name_N``, made at
    the first :meth:`get` and kept; a forked child makes its own."""

    def __init__(self, size: int, name: str):
        self.size, self.name = size, name
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        _all.add(self)

    def get(self) -> cf.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.size, thread_name_prefix=self.name)
            return self._pool

    def threads(self) -> frozenset:
        """Its threads now (the executor starts them one at a time, as work needs them)."""
        current = self._pool
        return frozenset(getattr(current, "_threads", ())) if current is not None else frozenset()

    def _forget(self) -> None:
        # After a fork the parent's executor has no threads here (a job submitted
        # to it would wait forever) and its lock may be held.
        self._pool = None
        self._lock = threading.Lock()


def threads() -> frozenset:
    """The threads of every kept pool: what a check for leaked threads allows."""
    out: frozenset = frozenset()
    for kept in list(_all):
        out |= kept.threads()
    return out


def _forget_in_child() -> None:
    for kept in list(_all):
        kept._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
