"""Preemption: a signal (SLURM's, Kubernetes') asks the run to stop; the step at
the next step boundary is saved and committed before the loop ends.

``Checkpointer(preemption=True)`` (= ``Preemption()``) installs a handler for
SIGTERM and SIGUSR1 that only records the signal: Python runs signal handlers
on the main thread between two bytecodes, possibly while that thread holds a
lock (logging's, the save engine's), so the handler takes none and does no I/O.
The training loop asks at each step boundary::

    for step in range(start, steps):
        train_one_step()
        if ckpt.should_save(step):
            ckpt.save(state, step)      # the preempted save blocks until committed (bounded by the grace)
        if ckpt.preempted:
            break

The handler that was installed before (the user's own, if it is a Python
callable) is called once the preempted save is committed, from the training
thread (or at ``close()`` when no save came); the default action (SIG_DFL:
terminate) is never taken on the run's behalf -- the loop ends itself. The
handlers are restored by ``close()``. See docs/preemption.md.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple, Union

from .knobs import parse_duration

log = logging.getLogger("lazyckpt")

#: Signals a process cannot handle.
_UNCATCHABLE = {getattr(signal, name) for name in ("SIGKILL", "SIGSTOP") if hasattr(signal, name)}


@dataclasses.dataclass(frozen=True)
class Preemption:
    """Save at the next step boundary when one of ``signals`` arrives.

    ``grace``: how long the preempted ``save()`` may block for its step to be
    committed (and persisted, with a persistent tier), counted from the signal:
    a number of seconds or a duration ("60s", "2min"). Keep it below the time
    the scheduler leaves between the signal and SIGKILL (SLURM ``--signal=TERM@120``,
    Kubernetes ``terminationGracePeriodSeconds``), less the time the process
    needs to exit."""

    signals: Tuple[Any, ...] = (signal.SIGTERM, signal.SIGUSR1)
    grace: Union[float, str] = "60s"

    def __post_init__(self) -> None:
        signals = self.signals
        if isinstance(signals, (int, signal.Signals)):
            signals = (signals,)
        try:
            chosen = tuple(dict.fromkeys(signal.Signals(s) for s in signals))
        except (TypeError, ValueError):
            raise ValueError(f"Preemption(signals=) must be signal numbers, e.g. (signal.SIGTERM, signal.SIGUSR1); "
                             f"got {self.signals!r}") from None
        if not chosen:
            raise ValueError("Preemption(signals=) is empty: name at least one, e.g. (signal.SIGTERM,)")
        bad = [s.name for s in chosen if s in _UNCATCHABLE]
        if bad:
            raise ValueError(f"Preemption(signals=): {', '.join(bad)} cannot be caught by any process; "
                             f"schedulers send SIGTERM (or a signal you choose) before it")
        try:
            grace = parse_duration(self.grace)
        except ValueError as exc:
            raise ValueError(f"Preemption(grace=): {exc}") from None
        object.__setattr__(self, "signals", chosen)
        object.__setattr__(self, "grace", grace)


def as_preemption(value: Any) -> Optional[Preemption]:
    """``preemption=``: False/None (off), True (= ``Preemption()``) or a ``Preemption``."""
    if value is None or value is False:
        return None
    if value is not True and not isinstance(value, Preemption):
        raise TypeError(f"preemption= must be True, False or lazyckpt.Preemption(signals=..., grace=...), "
                        f"got {value!r}")
    _require_main_thread()
    return Preemption() if value is True else value


def _require_main_thread() -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ValueError("preemption= installs signal handlers, which Python allows only in the main "
                         "thread: create the Checkpointer in the main thread (or pass preemption=False "
                         "and end the loop on your own signal handling)")


class SignalWatch:
    """The installed handlers of one ``Preemption``: records the first signal,
    chains the handler it replaced, restores them on ``close()``."""

    def __init__(self, preemption: Preemption):
        _require_main_thread()
        self.preemption = preemption
        #: The first preemption signal received (set by the handler), and when (time.monotonic()).
        self.signum: Optional[int] = None
        self.at: Optional[float] = None
        self._previous: Dict[int, Any] = {}
        self._chained = False
        self._closed = False
        for sig in preemption.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def signalled(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        # Attribute stores only: no lock, no logging, no I/O (see the module's docstring).
        if self.signum is None:
            self.at = time.monotonic()
            self.signum = signum

    def chain(self) -> None:
        """Call, once, the Python handler the received signal had before ours
        (``frame`` is None: the signal was received earlier). On the caller's
        thread; what it raises (SystemExit) propagates."""
        if self.signum is None or self._chained:
            return
        self._chained = True
        previous: Optional[Callable[..., Any]] = self._previous.get(self.signum)
        if callable(previous):
            log.info("lazyckpt: calling the %s handler installed before preemption=", signal.Signals(self.signum).name)
            previous(self.signum, None)

    def close(self) -> None:
        """Put the previous handlers back (where ours is still installed), then chain."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is not threading.main_thread():
            log.warning("lazyckpt: close() outside the main thread cannot restore the signal handlers "
                        "preemption= installed (%s); they stay installed and only record the signal",
                        ", ".join(signal.Signals(s).name for s in self._previous))
        else:
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self.chain()


__all__ = ["Preemption", "as_preemption", "SignalWatch"]
