"""Where one save stands on one tier beyond its local commit.

A :class:`~lazyckpt.saving.engine.SaveHandle` holds one :class:`TierState`
per tier its step was queued on (``handle.tier_states[PERSISTENT]``,
``[REPLICA]``). The tier's drain (:mod:`lazyckpt.tiers.drain`) creates it
when the committed step is queued and ends it exactly once -- done, failed,
or superseded by a newer step's state -- through the methods below; the
handle only reads it. It lives here, below the tiers, because the handle
waits on it and the saving layer never imports the tiers.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

#: The tiers' names, the keys of ``SaveHandle.tier_states``.
PERSISTENT = "persistent"
REPLICA = "replica"


class TierState:
    """One save on one tier: pending until its drain ends it."""

    def __init__(self, t0: float):
        #: "pending", then the tier's word for done ("persisted", "replicated"),
        #: "failed" (the replica tier adds why), "superseded by step N" (a newer step took
        #: its place in the queue) or "abandoned" (a rollback superseded it while it was sent).
        self.state = "pending"
        self.error: Optional[BaseException] = None
        #: Its error was raised once (by the handle's wait or the Checkpointer's): never again.
        self.reported = False
        #: Seconds from save() until the tier ended it (done or failed); None while
        #: pending and when superseded.
        self.seconds: Optional[float] = None
        #: Where the tier put it (the persistent tier's object URL), if it says.
        self.where: Optional[str] = None
        #: The newer step's state that took this one's place in the drain queue.
        self.superseded_by: Optional["TierState"] = None
        self._t0 = t0
        self._ended = threading.Event()

    def done(self, state: str, where: Optional[str] = None) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.state, self.where = state, where
        self._ended.set()

    def failed(self, error: BaseException, state: str = "failed") -> None:
        self.seconds = time.perf_counter() - self._t0
        self.state, self.error = state, error
        self._ended.set()

    def abandoned(self) -> None:
        """The save was superseded on the local tier (a rollback committed an older
        step) while this tier was sending it: dropped, not failed -- nothing was lost."""
        self.seconds = time.perf_counter() - self._t0
        self.state = "abandoned"
        self._ended.set()

    def superseded(self, by: "TierState", step: int) -> None:
        """A newer step (``step``) was chosen before this one's transfer started:
        waiting for this one means waiting for that one."""
        self.state, self.superseded_by = f"superseded by step {step}", by
        self._ended.set()

    def final(self, timeout: Optional[float] = None) -> Optional["TierState"]:
        """Wait until this save, or the newer one that superseded it, ended on the
        tier; return that state (None if ``timeout`` seconds passed first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        state = self
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not state._ended.wait(left):
                return None
            if state.superseded_by is None:
                return state
            state = state.superseded_by

    def raise_error(self) -> None:
        """Raise its error, if any, and mark it reported: a waiter that raises only
        what nobody raised yet (``Checkpointer.wait``) skips it from now on."""
        if self.error is not None:
            self.reported = True
            raise self.error
