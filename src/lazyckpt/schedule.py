"""When to save: ``interval=`` and ``preemption=``, asked through ``Checkpointer.should_save(step)``.

``interval``: None (the loop decides; ``should_save`` is then True only on
preemption), ``Every(steps=, seconds=)`` (either due: save), ``"auto"`` or
``Auto(mtbf=, first_steps=)``: the period between saves that minimises the
expected lost time (Daly's higher-order interval, lazyckpt/saving/costs.py
``advise``, the formula of ``lazyckpt advise``) from the costs this run's own
saves measured and the job's MTBF, re-decided as the costs change.

Under torch.distributed every rank must save the same step. ``Every(steps=)``
is the same on every rank by construction (the step numbers are), so without
preemption ``should_save`` is local. A clock (``Every(seconds=)``, ``Auto``) is
rank 0's and a preemption signal may reach one rank only: then every call is
one round through the commit group's store (the same store the commits use,
lazyckpt/distributed.py): each rank adds its flag to one counter, the last to
arrive publishes the sum, the others wait for it -- O(1) requests per rank and
call, like an all_reduce(MAX) of two bits. Every rank must then call
``should_save`` at every step boundary (as it calls ``save()``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import time
from typing import Any, Dict, Optional, Union

from lazyckpt.saving.costs import advise, problems, time_text
from .distributed import RankInfo
from .knobs import parse_duration
from .preemption import Preemption, SignalWatch, as_preemption

log = logging.getLogger("lazyckpt")

#: Auto: saves measured before the first decision, the decision retaken every this many
#: measured saves after it, from at most the last AUTO_WINDOW saves (bounded: constant cost).
AUTO_FIRST = 3
AUTO_EVERY = 4
AUTO_WINDOW = 8
#: Auto without an MTBF: the environment variable, else this (logged as an assumption).
MTBF_ENV = "LAZYCKPT_MTBF"
DEFAULT_MTBF = "24h"
#: The metadata key of the interval Auto decided, in the manifest of every save made under it.
METADATA_KEY = "lazyckpt.interval"


def _positive_int(value: Any, name: str, example: str) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r} (e.g. {example})")
    return value


@dataclasses.dataclass(frozen=True)
class Every:
    """Save every ``steps`` steps (``step % steps == 0``, step 0 excepted) and/or
    every ``seconds`` (a number or a duration, "30min"; since the last save,
    rank 0's clock): when either is due."""

    steps: Optional[int] = None
    seconds: Union[None, float, str] = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None:
            raise ValueError("Every() needs steps=, seconds= or both, e.g. Every(steps=1000) or "
                             "Every(seconds='30min')")
        if self.steps is not None:
            _positive_int(self.steps, "Every(steps=)", "Every(steps=1000)")
        if self.seconds is not None:
            try:
                object.__setattr__(self, "seconds", parse_duration(self.seconds))
            except ValueError as exc:
                raise ValueError(f"Every(seconds=): {exc}") from None


@dataclasses.dataclass(frozen=True)
class Auto:
    """The interval from Young/Daly, from this run's measured save costs and ``mtbf``
    (the mean time between failures of the whole job: a number of seconds or
    "8h"; None: ``$LAZYCKPT_MTBF``, else 24 h, logged as an assumption). Until
    AUTO_FIRST saves were measured, a save every ``first_steps`` steps."""

    mtbf: Union[None, float, str] = None
    first_steps: int = 100

    def __post_init__(self) -> None:
        if self.mtbf is not None:
            try:
                object.__setattr__(self, "mtbf", parse_duration(self.mtbf))
            except ValueError as exc:
                raise ValueError(f"Auto(mtbf=): {exc}") from None
        _positive_int(self.first_steps, "Auto(first_steps=)", "Auto(first_steps=100)")

    def mtbf_s(self) -> "tuple[float, str]":
        """(the MTBF in seconds, where it came from)."""
        if self.mtbf is not None:
            return float(self.mtbf), "Auto(mtbf=)"
        env = os.environ.get(MTBF_ENV, "").strip()
        if env:
            try:
                return parse_duration(env), f"${MTBF_ENV}"
            except ValueError as exc:
                raise ValueError(f"{MTBF_ENV}={env!r}: {exc}") from None
        return parse_duration(DEFAULT_MTBF), "assumed"


def as_interval(interval: Any) -> Union[None, Every, Auto]:
    """``interval=``: None, ``Every``, ``Auto`` or "auto"."""
    if interval is None or isinstance(interval, (Every, Auto)):
        return interval
    if isinstance(interval, str):
        if interval.strip().lower() == "auto":
            return Auto()
        raise ValueError(f"interval={interval!r}: the only string is 'auto'; else lazyckpt.Every(steps=1000), "
                         f"Every(seconds='30min') or Auto(mtbf='8h')")
    if type(interval) is int:
        raise TypeError(f"interval={interval!r}: say which unit, lazyckpt.Every(steps={interval}) or "
                        f"Every(seconds={interval})")
    raise TypeError(f"interval= must be None, 'auto', lazyckpt.Every(...) or lazyckpt.Auto(...), got {interval!r}")


class SaveSchedule:
    """Decides, at each step boundary, whether this step is saved.

    ``interval``: None, ``Every``, ``Auto`` or "auto"; ``preemption``: False,
    True or a ``Preemption`` (handlers installed now: the main thread only);
    ``dist``: the RankInfo of the ranks that must save the same step (decisions
    that could differ between them are agreed on through its store).

    The Checkpointer calls ``annotate(metadata)`` and ``saved(step)`` in every
    ``save()``, ``observe(step, cost)`` with each committed save's merged cost
    (the coordinator: lazyckpt/saving/costs.py), ``close()`` in its close."""

    def __init__(self, interval: Any = None, preemption: Any = False, dist: Optional[RankInfo] = None):
        self.interval = as_interval(interval)
        self.preemption: Optional[Preemption] = as_preemption(preemption)
        self.dist = dist if dist is not None else RankInfo()
        self._mtbf_s, self._mtbf_from = (self.interval.mtbf_s() if isinstance(self.interval, Auto) else (0.0, ""))
        clock = isinstance(self.interval, Auto) or (isinstance(self.interval, Every)
                                                    and self.interval.seconds is not None)
        #: Whether a call is a round through the store (see the module's docstring).
        self._collective = self.dist.distributed and (clock or self.preemption is not None)
        self._round = 0
        #: Rank 0's clock: the last save() (or the first should_save), and the step then.
        self._mark: Optional[float] = None
        self._mark_step: Optional[int] = None
        #: Auto's decision: the period between saves (None: every first_steps steps), and what
        #: the manifests record of it.
        self._interval_s: Optional[float] = None
        self._records: Any = collections.deque(maxlen=AUTO_WINDOW)
        self._measured = 0
        self._decision: Optional[Dict[str, Any]] = None
        if isinstance(self.interval, Auto):
            first = self.interval.first_steps
            self._decision = {"mode": "first_steps", "steps": first, "mtbf_s": self._mtbf_s,
                              "mtbf_from": self._mtbf_from,
                              "reason": f"saving every {first} steps until {AUTO_FIRST} saves are measured"}
            if self._mtbf_from == "assumed":
                log.info("lazyckpt: interval='auto' assumes a job MTBF of %s (set Auto(mtbf=...) or $%s to "
                         "the mean time between failures of the whole job)", DEFAULT_MTBF, MTBF_ENV)
        #: Preemption: agreed on (every rank saw the flag); the save that follows is the preempted one.
        self._agreed = False
        self._agreed_at: Optional[float] = None
        self._final_pending = False
        self._watch: Optional[SignalWatch] = SignalWatch(self.preemption) if self.preemption is not None else None
        self._closed = False

    # ------------------------------------------------------------------ asking

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal arrived (on one rank: once ``should_save``
        agreed on it, the same call on every rank)."""
        if self._agreed:
            return True
        return self._watch is not None and self._watch.signalled and not self.dist.distributed

    @property
    def wants_costs(self) -> bool:
        """Whether ``observe`` uses the committed saves' costs (Auto, on the coordinator)."""
        return isinstance(self.interval, Auto) and self.dist.coordinator

    def should_save(self, step: int) -> bool:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        interval = self.interval
        due = isinstance(interval, Every) and interval.steps is not None and step > 0 and step % interval.steps == 0
        if self._collective:
            flag = self._watch is not None and self._watch.signalled
            clock = not due and self.dist.coordinator and self._clock_due(step)
            preempt, clock = self._agree(flag, clock)
        else:
            preempt = self._watch is not None and self._watch.signalled
            clock = not due and self._clock_due(step)
        if preempt and not self._agreed:
            self._agree_preempted(step)
        return due or clock or self._final_pending

    def _clock_due(self, step: int) -> bool:
        """Rank 0's: whether Every(seconds=) or Auto says this step is due."""
        now = time.monotonic()
        if self._mark is None:
            self._mark, self._mark_step = now, step
            return False
        interval = self.interval
        if isinstance(interval, Every):
            return interval.seconds is not None and now - self._mark >= interval.seconds
        if isinstance(interval, Auto):
            if self._interval_s is None:
                return step - self._mark_step >= interval.first_steps
            return now - self._mark >= self._interval_s
        return False

    def _agree(self, flag: bool, clock: bool) -> "tuple[bool, bool]":
        """One round: (any rank's preemption flag, rank 0's clock). Each rank adds
        1 + M*flag + M*M*clock (M = world + 1: digits that cannot carry) to the round's
        counter; the last to arrive publishes the sum and deletes the previous round's
        keys (every rank has read them: each one is in this round)."""
        d = self.dist
        n, self._round = self._round, self._round + 1
        m = d.world_size + 1
        key = f"sched/{n}"
        total = d.store.add(key, 1 + m * int(flag) + m * m * int(clock))
        if total % m == d.world_size:
            d.publish(f"{key}/sum", total)
            if n:
                d.delete([f"sched/{n - 1}", f"sched/{n - 1}/sum"])
        else:
            total = d.wait_for([f"{key}/sum"], "every rank at the step boundary (should_save)", "should_save")[
                f"{key}/sum"]
        return (total // m) % m > 0, total // (m * m) > 0

    def _agree_preempted(self, step: int) -> None:
        self._agreed = True
        self._final_pending = True
        watch = self._watch
        self._agreed_at = watch.at if watch is not None and watch.at is not None else time.monotonic()
        got = signal.Signals(watch.signum).name if watch is not None and watch.signum is not None else None
        log.warning("lazyckpt: preemption (%s): step %d is saved and waited for (grace %.0f s); the training "
                    "loop should stop after it (ckpt.preempted)", got or "a signal on another rank", step,
                    self.preemption.grace if self.preemption is not None else 0.0)

    # ------------------------------------------------------------------ told by the Checkpointer

    def annotate(self, metadata: Dict[str, Any]) -> Dict[str, Any]:
        """A save's metadata, with the interval Auto chose (rank 0's: the manifest's)."""
        decision = self._decision
        if decision is not None and self.dist.coordinator:
            metadata[METADATA_KEY] = decision
        return metadata

    def saved(self, step: int) -> bool:
        """A save() of ``step`` was queued: rank 0's clock restarts. Returns whether it
        is the preempted save (which the Checkpointer waits for)."""
        self._mark, self._mark_step = time.monotonic(), step
        if not self._agreed and not self.dist.distributed and self._watch is not None and self._watch.signalled:
            # One process whose loop saves without asking should_save: this is the save after the signal.
            self._agree_preempted(step)
        final, self._final_pending = self._final_pending, False
        return final

    def grace_left(self) -> Optional[float]:
        """Seconds left of the grace (from the signal, or from the agreement on a rank
        that did not receive it)."""
        if self.preemption is None or self._agreed_at is None:
            return None
        return max(0.0, self.preemption.grace - (time.monotonic() - self._agreed_at))

    def chain(self) -> None:
        """The user's own handler of the received signal, once (after the preempted save)."""
        if self._watch is not None:
            self._watch.chain()

    def observe(self, step: int, cost: Optional[Dict[str, Any]]) -> None:
        """A committed save's merged cost (the coordinator, on the save's thread):
        Auto decides again every AUTO_EVERY measured saves. Never raises."""
        if not isinstance(self.interval, Auto) or not isinstance(cost, dict):
            return
        if problems(cost):
            return
        self._records.append({"step": step, "cost": cost})
        self._measured += 1
        if self._measured < AUTO_FIRST or (self._measured - AUTO_FIRST) % AUTO_EVERY:
            return
        try:
            self.decide(list(self._records))
        except Exception as exc:        # the training goes on at the interval it had
            log.warning("lazyckpt: interval='auto' could not decide at step %d: %s", step, exc)

    def decide(self, records: Any) -> Optional[Dict[str, Any]]:
        """Daly's interval from ``records`` (``{"step", "cost"}``) and the MTBF: set, logged and
        recorded (the next saves' manifests, METADATA_KEY). Returns the decision, or None
        when the figures give none (the interval is kept)."""
        try:
            a = advise(records, self._mtbf_s)
        except ValueError as exc:
            log.info("lazyckpt: interval='auto' keeps %s: %s", self._current_text(), exc)
            return None
        c, adv = a["cost"], a["advised"]
        interval_s = adv["interval_s"]
        steps = f" (about {adv['steps']:g} steps)" if adv["steps"] else ""
        reason = (f"Daly's interval for a checkpoint cost C = {time_text(c['total_s'])}"
                  f"{'' if c['complete'] else ' (a lower bound: ' + '; '.join(c['unknown']) + ')'} and a job MTBF "
                  f"M = {time_text(self._mtbf_s)} ({self._mtbf_from}), measured over {len(records)} saves")
        decision = {"mode": "daly", "interval_s": interval_s, "steps": adv["steps"], "cost_s": c["total_s"],
                    "cost_complete": c["complete"], "mtbf_s": self._mtbf_s, "mtbf_from": self._mtbf_from,
                    "saves": len(records), "at_step": records[-1]["step"], "reason": reason}
        self._interval_s = interval_s
        self._decision = decision
        log.info("lazyckpt: interval='auto': a save every %s%s: %s", time_text(interval_s), steps, reason)
        return decision

    def _current_text(self) -> str:
        if self._interval_s is None:
            return f"a save every {self.interval.first_steps} steps"
        return f"a save every {time_text(self._interval_s)}"

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Restore the signal handlers installed for preemption, then call the user's
        own handler of a signal received and not yet passed on (once)."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.close()


__all__ = ["Every", "Auto", "SaveSchedule", "as_interval", "METADATA_KEY"]
