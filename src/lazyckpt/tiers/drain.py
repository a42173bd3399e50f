"""A background queue of committed steps where the newest step wins: the base
of the persistent tier (:mod:`lazyckpt.tiers.persistent`) and the replica tier
(:mod:`lazyckpt.tiers.replicas`), which only say how one step is sent.

Every committed local step is queued with a read lock on it (local retention
keeps it until sent) and a :class:`~lazyckpt.saving.tierstate.TierState` on
its handle. One thread, started by the first queued step and gone when the
queue is empty, runs *rounds*: each takes the newest waiting step and sends
it; older waiting steps are superseded (their states point at the chosen
one), newer ones wait for the next round. Why: a tier exists for the newest
state a restart wants, and sending every step of a save schedule faster than
the link would grow the backlog, and the local disk held for it, without
bound. A transfer in progress is never abandoned for a newer step (it would
never finish under a steady save rate). With several ranks the coordinator
chooses each round's step and publishes it through the store, so every rank
sends the same step. :class:`RateLimit` caps what a tier sends.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, List, Optional

from lazyckpt.errors import CheckpointError
from lazyckpt.saving.tierstate import TierState


class RateLimit:
    """At most ``rate`` bytes/s on average (0: no limit), shared by a tier's sending
    threads (``persist_bandwidth``, ``replica_bandwidth``)."""

    def __init__(self, rate: float):
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        """Called before sending ``nbytes``: returns when they fit the budget
        (the first send waits for its own share too, so no burst exceeds it)."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(now, self._next) + nbytes / self.rate
            wake = self._next
        time.sleep(max(0.0, wake - now))


class Waiting:
    """A committed step queued on a drain: its tier state, the read lock that keeps
    local retention off it, and where its local step directory is."""

    def __init__(self, state: TierState, step: int, call: int, local_path: str, hold: contextlib.ExitStack,
                 save_id: Optional[str] = None, opened: Any = None):
        self.state, self.step, self.call, self.local_path, self.hold = state, step, call, local_path, hold
        self.save_id = save_id
        #: What the tier opened of the step when it was queued (the replica tier: its
        #: manifest's bytes and its rank file's descriptor, closed with ``hold``), so that
        #: a rollback moving the step away before its round cannot break the round.
        self.opened = opened


class NewestWinsDrain:
    """The queue, its thread, the choice of each round's step, superseding, waiting
    and error reporting. A tier sets the class attributes and implements
    :meth:`_send` (and, where it differs, :meth:`_round_failed`, :meth:`_not_drained`)."""

    #: The handle's key for this tier's state (saving/tierstate.py).
    tier = ""
    thread_name = "lazyckpt-drain"
    #: Prefix of each round's store keys (the coordinator's choice, the agreement).
    round_prefix = ""
    #: What a rank waits for when the coordinator chooses, and whose wait it is
    #: (the store's timeout message: "<choice_of>: timed out ... waiting for <choice_what>").
    choice_what = ""
    choice_of = ""

    def __init__(self, world: Any, label: str):
        #: The ranks that send together (distributed.rank_info): coordinator, store, timeout.
        self.world = world
        #: Names the tier in messages (its URL, "replicas").
        self.label = label
        self._cond = threading.Condition()
        self._pending: "collections.deque[Waiting]" = collections.deque()
        self._busy = False
        self._thread: Optional[threading.Thread] = None
        self._round = 0
        #: How many rounds failed (the replica tier's stats report it): a count, not
        #: the errors, so a long outage keeps no tracebacks (each failed step's state has its own).
        self.failed_rounds = 0
        #: Failed steps whose error no wait() raised yet.
        self._unraised: List[TierState] = []

    # ---------------------------------------------------------------- queue

    def _queue(self, handle: Any, step: int, call: int, local_path: str, hold: contextlib.ExitStack,
               save_id: Optional[str] = None, opened: Any = None) -> None:
        """Queue a committed step (``hold``: its read lock, released once sent or superseded)."""
        item = Waiting(handle.track_tier(self.tier), step, call, local_path, hold, save_id, opened)
        with self._cond:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _drop_waiting(self, end: Callable[[Waiting], None]) -> None:
        """End every waiting step with ``end`` and empty the queue (cancelled, or
        a broken round that cannot send them)."""
        with self._cond:
            for item in self._pending:
                item.hold.close()
                end(item)
            self._pending.clear()

    def _fail(self, item: Waiting, error: BaseException) -> None:
        """``item`` failed on this tier: its state says so, and the next wait() raises it
        unless its handle's wait(persisted=True) did first."""
        item.state.failed(error)
        with self._cond:
            self._unraised.append(item.state)

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._busy = True
            try:
                key = f"{self.round_prefix}/{self._round}"
                self._round += 1
                item = self._take(self._choose(key))
                try:
                    self._send(item, key)
                finally:
                    item.hold.close()
            except BaseException as exc:        # recorded, reported by the tier; never kills training
                self.failed_rounds += 1
                self._round_failed(exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _choose(self, key: str) -> int:
        """The call (save number) of this round's step: the newest waiting one, on
        every rank the coordinator's choice."""
        w = self.world
        if not w.distributed:
            with self._cond:
                return max(x.call for x in self._pending)
        if w.coordinator:
            with self._cond:
                target = max(self._pending, key=lambda x: x.call)
            w.publish(f"{key}/target", {"call": target.call, "step": target.step})
            call = target.call
        else:
            call = w.wait_for([f"{key}/target"], self.choice_what, self.choice_of)[f"{key}/target"]["call"]
        deadline = time.monotonic() + w.timeout_s
        with self._cond:        # this rank's commit of that step may not have reached its queue yet
            while not any(x.call == call for x in self._pending):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{self.label}: the step of call {call} never reached this rank's "
                                          f"drain queue")
                self._cond.wait(0.1)
        return call

    def _take(self, call: int) -> Waiting:
        """Remove and return the waiting step of ``call``; older waiting steps are
        superseded by it (their read locks released before this round's transfer,
        so local retention may go on), newer ones stay queued."""
        with self._cond:
            chosen = next(x for x in self._pending if x.call == call)
            for x in self._pending:
                if x.call < call:
                    x.hold.close()
                    x.state.superseded(chosen.state, chosen.step)
            self._pending = collections.deque(x for x in self._pending if x.call > call)
            return chosen

    def _send(self, item: Waiting, key: str) -> None:
        """Send one step to the tier (every rank of the round with the same step)
        and end its state; raise to fail the round."""
        raise NotImplementedError

    def _round_failed(self, exc: BaseException) -> None:
        """A round raised ``exc`` (already counted in :attr:`failed_rounds`)."""

    # ---------------------------------------------------------------- waiting

    def _not_drained(self, timeout: float) -> CheckpointError:
        return CheckpointError(f"{self.label}: not finished within the timeout")

    def wait(self, timeout: Optional[float] = None, raise_errors: bool = True) -> None:
        """Until every queued step is sent (or superseded, or failed); raise the
        first failure no wait raised yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise self._not_drained(timeout)
                self._cond.wait(left if left is not None else 0.5)
            # Raised once: not one its handle's wait(persisted=True) already raised.
            unraised = [s for s in self._unraised if not s.reported]
            self._unraised = []
        if raise_errors and unraised:
            unraised[0].raise_error()
