"""What each save cost the training, recorded in its step's manifest (issue 26).

A Checkpointer keeps one :class:`SaveCosts`. Every rank reports, with its
commit report, what it measured of this save and of its previous one; the
coordinator writes the maximum over the ranks into the manifest's optional
``cost`` member (docs/FORMAT.md §11.2), which ``lazyckpt advise``
(lazyckpt/advise.py) reads back. In synchronous data-parallel training the
slowest rank sets the pace, hence the maximum.

What is known when step S commits goes into S's manifest: ``save()``'s
blocking time, the capture and flush times, the bytes written, and the
iteration times seen by ``attach()`` since the previous commit. The time the
training waited at the capture barrier for S is only complete once S's
capture is done *and* the training thread has woken up and added it up,
which may be after S's commit; so it is recorded in the manifest of the
*next* save of the same process (``previous_save``), together with that
save's time from ``save()`` to committed. The last save of a process never
has its wait recorded.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger("lazyckpt")

#: Iteration samples kept between two commits (a bound, not a sample size).
MAX_SAMPLES = 4096


class IterationClock:
    """Times the iterations of the first optimizer handed to ``attach()``:
    from one ``step()`` (after its barrier wait) to the next, less the
    barrier waits and ``save()`` calls in between, so that what remains is the
    training's own work. An iteration is *busy* when a save was in flight
    (queued, capturing or flushing) during it, *quiet* otherwise; comparing
    the two shows how much a save in flight slows the training down."""

    def __init__(self, engine: Any, costs: "SaveCosts"):
        self._engine = weakref.ref(engine)
        self._costs = costs
        self._lock = threading.Lock()
        self._last: Optional[Tuple[float, float, float, int, bool]] = None
        self._busy: List[float] = []
        self._quiet: List[float] = []

    def tick(self) -> None:
        engine = self._engine()
        if engine is None:
            return
        now = time.perf_counter()
        waited, blocked, calls = engine.waited_s, self._costs.blocked_s, self._costs.calls
        in_flight = engine.has_pending()
        last = self._last
        self._last = (now, waited, blocked, calls, in_flight)
        if last is None:
            return
        t, waited0, blocked0, calls0, in_flight0 = last
        work = (now - t) - (waited - waited0) - (blocked - blocked0)
        busy = in_flight0 or in_flight or calls != calls0
        with self._lock:
            samples = self._busy if busy else self._quiet
            if len(samples) < MAX_SAMPLES:
                samples.append(max(0.0, work))

    def take(self) -> Optional[Dict[str, List[float]]]:
        """``{"busy": [n, median_s], "quiet": [n, median_s]}`` of the iterations
        since the last call (an empty class: ``[0, None]``), or None if none."""
        with self._lock:
            busy, quiet = self._busy, self._quiet
            self._busy, self._quiet = [], []
        if not busy and not quiet:
            return None
        return {name: [len(s), statistics.median(s) if s else None] for name, s in (("busy", busy),
                                                                                  ("quiet", quiet))}


class SaveCosts:
    """One Checkpointer's cost records (every rank keeps one)."""

    def __init__(self, mtbf_s: float = 0.0):
        #: save() calls accepted and the seconds they blocked (for the iteration clock).
        self.calls = 0
        self.blocked_s = 0.0
        self.clock: Optional[IterationClock] = None
        #: (step, handle, save() start) of the latest save() call that was queued.
        self._previous: Optional[Tuple[int, Any, float]] = None
        #: The advice is logged once, after enough saves (knob ``advise_mtbf``).
        self.mtbf_s = mtbf_s
        self.records: List[Dict[str, Any]] = []
        self._advised = False

    def clock_for(self, engine: Any) -> Optional[Any]:
        """What the barrier's step hook of an optimizer being attached calls after
        its wait: the iteration clock's tick for the first optimizer attached, None
        for the others (the steps of several optimizers are parts of one iteration)."""
        if self.clock is not None:
            return None
        self.clock = IterationClock(engine, self)
        return self.clock.tick

    @property
    def last(self) -> Optional[Tuple[int, Any, float]]:
        """The latest save queued, which the next save's commit reports on."""
        return self._previous

    def queued(self, step: int, handle: Any, t0: float) -> None:
        """A save was queued (on the caller's thread)."""
        if handle.skipped:
            return
        self.calls += 1
        self.blocked_s += handle.blocking_s
        self._previous = (step, handle, t0)

    def report(self, job: Any, t0: float, previous: Optional[Tuple[int, Any, float]]) -> Dict[str, Any]:
        """This rank's figures, once its file is durable (on the job's thread)."""
        handle = job.handle
        out: Dict[str, Any] = {"blocking_s": handle.blocking_s, "capture_s": handle.capture_s,
                               "flush_s": time.perf_counter() - handle._t0}
        if previous is not None:
            step, prev, prev_t0 = previous
            committed = prev.done() and prev.error is None
            out["previous_save"] = {"step": step, "interval_s": t0 - prev_t0,
                                    "barrier_wait_s": prev.barrier_wait_s if committed else None,
                                    "committed_s": prev.flush_s if committed else None}
        if self.clock is not None:
            iterations = self.clock.take()
            if iterations is not None:
                out["iterations"] = iterations
        return out

    def committed(self, step: int, cost: Optional[Dict[str, Any]]) -> None:
        """The coordinator committed a step with ``cost``: log the advice once
        there are enough figures, if an MTBF was given."""
        if cost is None or not self.mtbf_s or self._advised:
            return
        from . import advise
        self.records.append({"step": step, "cost": cost})
        del self.records[:-advise.MIN_SAVES_TO_LOG * 4]
        if sum(1 for r in self.records if _wait_of(r["cost"]) is not None) < advise.MIN_SAVES_TO_LOG:
            return
        self._advised = True
        try:
            result = advise.advise(self.records, self.mtbf_s)
        except ValueError as exc:           # figures that cannot give advice: say so, once
            log.info("lazyckpt: no checkpoint-interval advice: %s", exc)
            return
        log.info("lazyckpt: %s", advise.one_line(result))


def merge(reports: Dict[int, Optional[Dict[str, Any]]], file_bytes: int) -> Optional[Dict[str, Any]]:
    """The manifest's ``cost``: every figure the maximum over the ranks (a
    figure any rank lacks is left out), ``bytes`` the sum of the files."""
    if not reports or any(not isinstance(r, dict) for r in reports.values()):
        return None
    ranks = list(reports.values())
    out: Dict[str, Any] = {"ranks": len(ranks), "bytes": file_bytes}
    for name in ("blocking_s", "capture_s", "flush_s"):
        out[name] = max(r[name] for r in ranks)
    prevs = [r.get("previous_save") for r in ranks]
    if all(isinstance(p, dict) for p in prevs) and len({p["step"] for p in prevs}) == 1:
        merged: Dict[str, Any] = {"step": prevs[0]["step"]}
        for name in ("interval_s", "barrier_wait_s", "committed_s"):
            values = [p.get(name) for p in prevs]
            merged[name] = max(values) if all(v is not None for v in values) else None
        out["previous_save"] = merged
    its = [r.get("iterations") for r in ranks]
    if all(isinstance(i, dict) for i in its):
        out["iterations"] = {}
        for name in ("busy", "quiet"):
            n = min(i[name][0] for i in its)
            medians = [i[name][1] for i in its]
            out["iterations"][name] = [n, max(medians) if n and None not in medians else None]
    return out


def _wait_of(cost: Dict[str, Any]) -> Optional[float]:
    prev = cost.get("previous_save")
    return prev.get("barrier_wait_s") if isinstance(prev, dict) else None


def _number(v: Any) -> bool:
    return type(v) in (int, float) and v == v and v >= 0 and v != float("inf")


def problems(cost: Any) -> List[str]:
    """What is wrong with a manifest's ``cost`` member ([] if well-formed); a
    reader skips a step whose figures are ill-formed, naming the reason."""
    if not isinstance(cost, dict):
        return ["cost is not an object"]
    out = []
    if type(cost.get("ranks")) is not int or cost["ranks"] < 1:
        out.append("cost.ranks is not a positive integer")
    if type(cost.get("bytes")) is not int or cost["bytes"] < 0:
        out.append("cost.bytes is not a non-negative integer")
    for name in ("blocking_s", "capture_s", "flush_s"):
        if not _number(cost.get(name)):
            out.append(f"cost.{name} is not a non-negative number")
    prev = cost.get("previous_save")
    if prev is not None:
        if not isinstance(prev, dict) or type(prev.get("step")) is not int:
            out.append("cost.previous_save is not an object with an integer step")
        else:
            for name in ("interval_s", "barrier_wait_s", "committed_s"):
                if prev.get(name) is not None and not _number(prev.get(name)):
                    out.append(f"cost.previous_save.{name} is not a non-negative number or null")
    its = cost.get("iterations")
    if its is not None:
        if not isinstance(its, dict):
            out.append("cost.iterations is not an object")
        else:
            for name in ("busy", "quiet"):
                v = its.get(name)
                if not (isinstance(v, list) and len(v) == 2 and type(v[0]) is int and v[0] >= 0
                        and (v[1] is None or _number(v[1]))):
                    out.append(f"cost.iterations.{name} is not [count, median seconds or null]")
    return out
