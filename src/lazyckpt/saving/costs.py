"""What each save cost the training, recorded in its step's manifest.

A Checkpointer keeps one :class:`SaveCosts`. Every rank reports, with its
commit report, what it measured of this save and of its previous one; the
coordinator writes the maximum over the ranks into the manifest's optional
``cost`` member (docs/FORMAT.md §11.2), which ``lazyckpt advise``
(lazyckpt/cli/advise.py) reads back. In synchronous data-parallel training the
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
import math
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
        self.records.append({"step": step, "cost": cost})
        del self.records[:-MIN_SAVES_TO_LOG * 4]
        if sum(1 for r in self.records if _wait_of(r["cost"]) is not None) < MIN_SAVES_TO_LOG:
            return
        self._advised = True
        try:
            result = advise(self.records, self.mtbf_s)
        except ValueError as exc:           # figures that cannot give advice: say so, once
            log.info("lazyckpt: no checkpoint-interval advice: %s", exc)
            return
        log.info("lazyckpt: %s", one_line(result))


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


#: The Checkpointer logs its advice (knob ``advise_mtbf``) once this many saves have their barrier wait recorded.
MIN_SAVES_TO_LOG = 5


def young(c: float, m: float) -> float:
    """Young (1974), first order: the compute time between checkpoints sqrt(2 C M)."""
    return math.sqrt(2 * c * m)


def daly(c: float, m: float) -> float:
    """Daly (2006), higher order: sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C for C < 2M, else M."""
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def lost_per_failure(interval: float, latency: float) -> float:
    """Expected work lost by a failure at a uniformly random time: the age of the
    latest committed step, T/2 on average, plus a save's time to committed L."""
    return interval / 2 + latency


def lost_fraction(c: float, interval: float, latency: float, m: float) -> float:
    """The expected fraction of time lost: checkpoints C/T, failures (T/2 + L)/M."""
    return c / interval + lost_per_failure(interval, latency) / m


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def advise(records: List[Dict[str, Any]], mtbf_s: float) -> Dict[str, Any]:
    """The advice from ``records`` (``{"step", "cost"}``, costs well-formed,
    lazyckpt/saving/costs.py) and the MTBF in seconds."""
    if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
        raise ValueError(f"the MTBF must be a positive number of seconds, got {mtbf_s!r}")
    if not records:
        raise ValueError("no recorded save costs")
    costs = [(r["step"], r["cost"]) for r in records]
    prevs = [(s, c["previous_save"]) for s, c in costs if isinstance(c.get("previous_save"), dict)]
    blocking = [c["blocking_s"] for _, c in costs]
    waits = [p["barrier_wait_s"] for _, p in prevs if p.get("barrier_wait_s") is not None]
    committed = [p["committed_s"] for _, p in prevs if p.get("committed_s") is not None]
    intervals = [p["interval_s"] for _, p in prevs if p.get("interval_s") is not None]
    steps_apart = [s - p["step"] for s, p in prevs if s > p["step"]]
    per_second = [(s - p["step"]) / p["interval_s"] for s, p in prevs
                  if s > p["step"] and p.get("interval_s")]
    # Slow-down: busy iterations x (busy median - the quiet baseline of the run).
    its = [(c["iterations"]) for _, c in costs if isinstance(c.get("iterations"), dict)]
    quiet = [i["quiet"][1] for i in its if i["quiet"][0] and i["quiet"][1] is not None]
    baseline = _median(quiet)
    slowdowns = []
    if baseline is not None:
        for i in its:
            n, busy = i["busy"]
            slowdowns.append(n * (busy - baseline) if n and busy is not None else 0.0)
    slowdown = _median(slowdowns)

    unknown = []
    wait = _median(waits)
    if wait is None:
        unknown.append("barrier wait (recorded by the next save of the same process: needs two saves)")
    if slowdown is None:
        unknown.append("iteration slow-down (needs attach(optimizer) and iterations with no save in flight)")
    c = _median(blocking) + (wait or 0.0) + max(0.0, slowdown or 0.0)
    if not c > 0:
        raise ValueError("the recorded cost of a checkpoint is 0 s: no interval minimises anything")
    latency, latency_from = _median(committed), "committed_s"
    if latency is None:
        # Only the files' durability is known (the step's own figure): a lower bound.
        latency, latency_from = _median([c_["flush_s"] for _, c_ in costs]), "flush_s (lower bound)"
    m = mtbf_s
    t_young = young(c, m)
    tau_daly = daly(c, m)
    advised_t = tau_daly + c
    sps = _median(per_second)
    current_t = _median(intervals)

    def at(interval: Optional[float], steps: Optional[float]) -> Dict[str, Any]:
        if interval is None:
            return {"interval_s": None, "steps": None, "lost_per_failure_s": None, "lost_fraction": None}
        return {"interval_s": interval, "steps": steps,
                "lost_per_failure_s": lost_per_failure(interval, latency),
                "lost_fraction": lost_fraction(c, interval, latency, m)}

    ranks = max(c_["ranks"] for _, c_ in costs)
    return {
        "steps": [s for s, _ in costs], "ranks": ranks, "mtbf_s": m,
        "cost": {"blocking_s": _median(blocking), "barrier_wait_s": wait, "slowdown_s": slowdown,
                 "total_s": c, "complete": not unknown, "unknown": unknown,
                 "samples": {"blocking": len(blocking), "barrier_wait": len(waits), "slowdown": len(slowdowns)},
                 "iteration_quiet_s": baseline},
        "capture_s": _median([c_["capture_s"] for _, c_ in costs]),
        "flush_s": _median([c_["flush_s"] for _, c_ in costs]),
        "bytes": int(_median([c_["bytes"] for _, c_ in costs])),
        "latency_s": latency, "latency_from": latency_from,
        "young": {"formula": "T = sqrt(2*C*M)", "C_s": c, "M_s": m, "interval_s": t_young},
        "daly": {"formula": "tau = sqrt(2*C*M) * (1 + sqrt(C/(2*M))/3 + (C/(2*M))/9) - C  (C < 2M; else tau = M); "
                            "T = tau + C", "C_s": c, "M_s": m, "tau_s": tau_daly, "interval_s": advised_t},
        "lost_per_failure_formula": "T/2 + L",
        "lost_fraction_formula": "C/T + (T/2 + L)/M",
        "current": at(current_t, _median(steps_apart)),
        "advised": at(advised_t, max(1, round(advised_t * sps)) if sps else None),
    }


def time_text(seconds: Optional[float]) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def steps_text(n: Optional[float]) -> str:
    return "" if n is None else f" (every {n:g} steps)"


def one_line(a: Dict[str, Any]) -> str:
    c = a["cost"]
    cur, adv = a["current"], a["advised"]
    return (f"checkpoint cost C = {time_text(c['total_s'])}{'' if c['complete'] else ' (incomplete: a lower bound)'}; "
            f"with MTBF M = {time_text(a['mtbf_s'])}, Daly's interval is {time_text(adv['interval_s'])}{steps_text(adv['steps'])} "
            f"(Young sqrt(2CM) = {time_text(a['young']['interval_s'])}), the current one {time_text(cur['interval_s'])}; "
            f"expected work lost per failure {time_text(cur['lost_per_failure_s'])} now, "
            f"{time_text(adv['lost_per_failure_s'])} at the advised interval")
