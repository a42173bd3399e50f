"""Thread pools kept for the process: started at first use, idle threads end.

Two kinds of work run beside every save and load and must not wait for a pool
to be made or be torn down with a Checkpointer: the checksums computed next to
the I/O (:mod:`lazyckpt.checksums`) and the freeing of a replaced or removed
file's blocks (:func:`lazyckpt.storage.fileio.replace_releasing_later`). The
pool object lives as long as the process; its threads do not. A thread that
has had nothing to do for ``IDLE_S`` ends, and the next task starts one
again: starting a thread costs tens of microseconds, against milliseconds for
the smallest save (``benchmarks/bench_kept_pools.py`` measures both), and a
process that has stopped checkpointing keeps no lazyckpt thread.

Checks for leaked threads: :func:`threads` is what they should allow (the
threads these pools started, alive or ending). The threads are daemon threads
with a ``stop()`` that ends one after its current task and waits for it (the
pool starts another for its next task): the check Lightning's own test suite
runs after every test stops a daemon thread that has one, as it does for
tqdm's monitor.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import os
import threading
import time
import weakref
from typing import Any, Callable, Deque, Optional, Set, Tuple

#: Seconds a kept thread waits for a task before it ends. Long beside the gaps
#: inside one save or load (a task every few milliseconds), short beside the
#: time between checkpoints.
IDLE_S = 1.0

_all: "weakref.WeakSet[KeptPool]" = weakref.WeakSet()

_Task = Tuple[cf.Future, Callable[..., Any], tuple, dict]


class _Worker(threading.Thread):
    def __init__(self, pool: "KeptPool", name: str):
        super().__init__(name=name, daemon=True)
        self.pool = pool
        self.stopping = False

    def run(self) -> None:
        self.pool._work(self)

    def stop(self) -> None:
        """End this thread after its current task and wait for it; the pool
        starts another for its next task. For checks that stop the daemon
        threads a test left running (Lightning's)."""
        self.pool._stop(self)
        if threading.current_thread() is not self:
            self.join()


class KeptPool(cf.Executor):
    """An executor of at most ``size`` threads named ``name_N``: a thread
    starts when a task finds none free and ends after ``idle_s`` without one.
    Tasks start in the order submitted (with ``size=1`` they run one after
    another, in that order). The pool is never shut down; a forked child starts
    afresh (a task submitted before the fork does not run there). ``shutdown``
    is ``Executor``'s, which does nothing: the pool serves the whole process."""

    def __init__(self, size: int, name: str, idle_s: Optional[float] = None):
        if size < 1:
            raise ValueError(f"a kept pool needs at least one thread, not {size}")
        self.size, self.name = size, name
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self._forget()
        _all.add(self)

    def _forget(self) -> None:
        # Also after a fork: the parent's threads do not exist here and its lock may be held.
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: Deque[_Task] = collections.deque()
        self._workers: Set[_Worker] = set()
        self._idle = 0                            # workers waiting for a task
        self._closing = False                     # the interpreter is exiting: no thread waits
        self._started: "weakref.WeakSet[_Worker]" = weakref.WeakSet()

    def get(self) -> "KeptPool":
        """The pool itself (an ``Executor``)."""
        return self

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            self._queue.append((future, fn, args, kwargs))
            self._staff()
        return future

    def threads(self) -> frozenset:
        """The threads it has started that still exist, alive or ending (a
        thread that ends between a leak check's listing and this call is
        still here)."""
        with self._lock:
            return frozenset(self._started)

    # -- under the lock

    def _staff(self) -> None:
        """Wake a waiting thread for a queued task, or start one if none waits."""
        if len(self._queue) <= self._idle:
            self._wake.notify()
        elif len(self._workers) < self.size:
            worker = _Worker(self, f"{self.name}_{self._free_index()}")
            self._workers.add(worker)
            self._started.add(worker)
            worker.start()

    def _free_index(self) -> int:
        used = {w.name for w in self._workers}
        return next(i for i in range(self.size + 1) if f"{self.name}_{i}" not in used)

    # -- on a worker

    def _work(self, me: _Worker) -> None:
        while True:
            with self._lock:
                task = self._next(me)
                if task is None:
                    self._workers.discard(me)
                    if self._queue:           # stopped with tasks queued: another thread takes them
                        self._staff()
                    return
            future, fn, args, kwargs = task
            del task
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs

    def _next(self, me: _Worker) -> Optional[_Task]:
        """The next task, or None when ``me`` should end (stopped, or idle too long)."""
        deadline = time.monotonic() + self.idle_s
        while not me.stopping:
            if self._queue:
                return self._queue.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closing:
                return None
            self._idle += 1
            try:
                self._wake.wait(remaining)
            finally:
                self._idle -= 1
        return None

    def _stop(self, worker: _Worker) -> None:
        with self._lock:
            worker.stopping = True
            self._wake.notify_all()

    def _close(self) -> None:
        """At interpreter exit: the queued tasks still run, then every thread ends."""
        with self._lock:
            self._closing = True
            self._wake.notify_all()
            workers = list(self._workers)
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join()


def threads() -> frozenset:
    """The threads of every kept pool: what a check for leaked threads allows."""
    out: frozenset = frozenset()
    for kept in list(_all):
        out |= kept.threads()
    return out


def _forget_in_child() -> None:
    for kept in list(_all):
        kept._forget()


def _close_all() -> None:
    for kept in list(_all):
        kept._close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
# Before the interpreter joins its threads and tears down modules: a release or
# a checksum queued by the last save still runs (concurrent.futures does the same).
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_close_all)
else:                                                   # pragma: no cover
    import atexit
    atexit.register(_close_all)
