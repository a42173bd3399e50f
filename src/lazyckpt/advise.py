"""Which interval to checkpoint at: ``lazyckpt advise RUN --mtbf 8h`` (issue 26).

Reads the save costs every committed step records (``cost`` in its manifest,
lazyckpt/costs.py, docs/FORMAT.md §11.2) and the mean time between failures
the user gives, and prints:

* C, the measured cost of one checkpoint *to the training*: the median
  ``save()`` blocking time + the median time the training waited at the
  capture barrier + the median slow-down of the iterations that ran while a
  save was in flight (busy iterations x (busy median - quiet median)); a
  part the run could not measure is reported unknown, and C is then marked
  incomplete (a lower bound), never filled in with a guess;
* the interval that minimises the expected lost time: Young's first-order
  T = sqrt(2 C M) and Daly's higher-order
  tau = sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C (C < 2M; else
  tau = M), the compute time between checkpoints, so the period between
  ``save()`` calls is T = tau + C (J. T. Daly, "A higher order estimate of the
  optimum checkpoint interval for restart dumps", FGCS 22, 2006);
* the expected work lost per failure at an interval T: T / 2 + L, where L is
  a save's time from ``save()`` to committed (a failure before then falls
  back to the previous step); the time to restart is not included (it does
  not depend on the interval);
* the expected fraction of time lost, C / T + (T / 2 + L) / M.

M is the MTBF of the job as a whole: any rank failing stops it (a node MTBF
of 1000 h on 125 nodes is a job MTBF of 8 h).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
from typing import Any, Dict, List, Optional, Tuple

from .costs import problems
from .errors import CheckpointError, CheckpointNotFoundError

#: The Checkpointer logs its advice (knob ``advise_mtbf``) once this many saves have their barrier wait recorded.
MIN_SAVES_TO_LOG = 5

_UNITS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "mins": 60,
          "minute": 60, "minutes": 60, "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
          "d": 86400, "day": 86400, "days": 86400, "w": 604800, "week": 604800, "weeks": 604800}
_TERM = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*", re.IGNORECASE)


def parse_duration(text: Any) -> float:
    """'8h', '30min', '1h30m', '2d', '90s' -> seconds; a Python number is seconds.
    A string needs a unit: '8' could be seconds or hours."""
    if type(text) in (int, float):
        seconds = float(text)
    else:
        s = str(text).strip()
        pos, seconds, terms = 0, 0.0, 0
        while pos < len(s):
            m = _TERM.match(s, pos)
            if not m or m.group(2).lower() not in _UNITS:
                hint = " (a unit is required: s, min, h, d, w)" if re.fullmatch(r"\s*[\d.]+\s*", s) else ""
                raise ValueError(f"bad duration {text!r}{hint}; examples: 8h, 30min, 1h30m, 2d")
            seconds += float(m.group(1)) * _UNITS[m.group(2).lower()]
            pos, terms = m.end(), terms + 1
        if not terms:
            raise ValueError(f"bad duration {text!r}; examples: 8h, 30min, 1h30m, 2d")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"a duration must be positive and finite, got {text!r}")
    return seconds


def parse_failure_rate(text: str) -> float:
    """'3/day', '0.5/h', '1/8h' (failures per time) -> the MTBF in seconds."""
    count, sep, per = str(text).partition("/")
    try:
        failures = float(count)
    except ValueError:
        failures = float("nan")
    if not sep or not per.strip() or not (failures > 0 and math.isfinite(failures)):
        raise ValueError(f"bad failure rate {text!r}: failures per time, e.g. 3/day, 0.5/h, 1/8h")
    per = per.strip()
    period = parse_duration(per if per[0].isdigit() or per[0] == "." else "1" + per)
    return period / failures


# --------------------------------------------------------------------------- the formulas


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


# --------------------------------------------------------------------------- from recorded costs


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def advise(records: List[Dict[str, Any]], mtbf_s: float) -> Dict[str, Any]:
    """The advice from ``records`` (``{"step", "cost"}``, costs well-formed,
    lazyckpt/costs.py) and the MTBF in seconds."""
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


def read_run(run: str) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], str]:
    """(records, skipped steps with the reason, the run's location): every
    committed step of a Checkpointer directory (local or s3://)."""
    from .tools import list_directory, read_manifest
    listing = list_directory(run)
    if not listing["steps"]:
        raise CheckpointNotFoundError(f"{listing['directory']}: no committed step (nothing to advise from)",
                                      path=listing["directory"])
    records, skipped = [], []
    for row in listing["steps"]:
        if "error" in row:
            skipped.append({"step": row["step"], "reason": f"manifest unreadable: {row['error']}"})
            continue
        if "url" in row:
            from .knobs import resolve
            from .tiers import read_manifest as read_object_manifest
            manifest = read_object_manifest(row["url"], resolve())
        else:
            manifest = read_manifest(os.path.join(listing["directory"], row["name"]))
        cost = manifest.get("cost")
        if cost is None:
            skipped.append({"step": row["step"], "reason": "no save costs recorded (saved by a lazyckpt "
                                                           "that did not record them)"})
        elif problems(cost):
            skipped.append({"step": row["step"], "reason": "ill-formed cost: " + "; ".join(problems(cost))})
        else:
            records.append({"step": row["step"], "cost": cost})
    if not records:
        raise CheckpointError(
            f"{listing['directory']}: none of its {len(listing['steps'])} committed steps records what its save "
            f"cost ({skipped[0]['reason']}); save a few steps with this version of lazyckpt (attach() the "
            f"optimizer to measure the barrier waits and the iteration slow-down), then run advise again",
            path=listing["directory"])
    return records, skipped, listing["directory"]


# --------------------------------------------------------------------------- output


def _t(seconds: Optional[float]) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _steps(n: Optional[float]) -> str:
    return "" if n is None else f" (every {n:g} steps)"


def one_line(a: Dict[str, Any]) -> str:
    c = a["cost"]
    cur, adv = a["current"], a["advised"]
    return (f"checkpoint cost C = {_t(c['total_s'])}{'' if c['complete'] else ' (incomplete: a lower bound)'}; "
            f"with MTBF M = {_t(a['mtbf_s'])}, Daly's interval is {_t(adv['interval_s'])}{_steps(adv['steps'])} "
            f"(Young sqrt(2CM) = {_t(a['young']['interval_s'])}), the current one {_t(cur['interval_s'])}; "
            f"expected work lost per failure {_t(cur['lost_per_failure_s'])} now, "
            f"{_t(adv['lost_per_failure_s'])} at the advised interval")


def render(a: Dict[str, Any], run: str, skipped: List[Dict[str, Any]]) -> List[str]:
    c, cur, adv = a["cost"], a["current"], a["advised"]
    steps = a["steps"]
    out = [f"{run}: {len(steps)} step{'s' if len(steps) != 1 else ''} with recorded save costs "
           f"({steps[0]}..{steps[-1]})" + (f"; {a['ranks']} ranks: every figure is the maximum over the ranks"
                                           if a["ranks"] > 1 else "")]
    for s in skipped:
        out.append(f"  skipped step {s['step']}: {s['reason']}")
    n = c["samples"]
    slow = "unknown" if c["slowdown_s"] is None else _t(c["slowdown_s"]) + (
        " (not measurable: busy iterations were not slower)" if c["slowdown_s"] <= 0 else "")
    out += ["", "cost of one checkpoint to the training (medians):",
            f"  save() blocking         {_t(c['blocking_s'])}  ({n['blocking']} saves)",
            f"  barrier wait            {_t(c['barrier_wait_s'])}  ({n['barrier_wait']} saves)",
            f"  iteration slow-down     {slow}  ({n['slowdown']} saves; quiet iteration "
            f"{_t(c['iteration_quiet_s'])})",
            f"  C                       {_t(c['total_s'])}" + ("" if c["complete"] else
                                                          "  (a lower bound: unknown parts counted as 0)")]
    for u in c["unknown"]:
        out.append(f"    unknown: {u}")
    out += [f"  not paid by the training: capture {_t(a['capture_s'])}, flush {_t(a['flush_s'])}, "
            f"{a['bytes'] / 1e6:.4g} MB written per save",
            f"  L (save() to committed) {_t(a['latency_s'])}  (from {a['latency_from']})",
            "", f"M (MTBF of the whole job)  {_t(a['mtbf_s'])} = {a['mtbf_s']:.6g} s",
            "", "interval that minimises the expected lost time:",
            f"  Young, first order:  {a['young']['formula']} = sqrt(2 x {a['young']['C_s']:.6g} s x "
            f"{a['mtbf_s']:.6g} s) = {a['young']['interval_s']:.6g} s",
            f"  Daly, higher order:  {a['daly']['formula']}",
            f"                       tau = {a['daly']['tau_s']:.6g} s, T = {a['daly']['interval_s']:.6g} s",
            f"  advised: a save() every {_t(adv['interval_s'])}{_steps(adv['steps'])}  (Daly)",
            "", f"expected work lost per failure, {a['lost_per_failure_formula']} (the time to restart not "
            f"included), and fraction of the time lost, {a['lost_fraction_formula']}:",
            f"  current interval {_t(cur['interval_s'])}{_steps(cur['steps'])}: "
            + ("unknown (needs two saves of one process)" if cur["interval_s"] is None else
               f"{_t(cur['lost_per_failure_s'])} per failure, {cur['lost_fraction'] * 100:.3g} % of the time"),
            f"  advised interval {_t(adv['interval_s'])}: {_t(adv['lost_per_failure_s'])} per failure, "
            f"{adv['lost_fraction'] * 100:.3g} % of the time"]
    return out


def add_parser(sub: Any) -> None:
    """Register ``lazyckpt advise`` (called by lazyckpt/cli.py)."""
    sp = sub.add_parser("advise", help="the checkpoint interval that minimises expected lost time",
                        description="From the save costs the committed steps of RUN record and a mean time "
                        "between failures: the cost C of one checkpoint to the training, Young's and Daly's "
                        "optimal intervals (formulas shown) and the expected work lost per failure at the "
                        "current and the advised interval.")
    sp.add_argument("run", metavar="RUN", help="a Checkpointer directory or s3:// prefix")
    g = sp.add_mutually_exclusive_group(required=True)
    g.add_argument("--mtbf", metavar="DURATION", help="mean time between failures of the whole job, e.g. 8h, "
                   "30min, 2d")
    g.add_argument("--failure-rate", metavar="RATE", help="failures per time of the whole job, e.g. 3/day, 1/8h")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    import json
    import sys
    mtbf = parse_duration(args.mtbf) if args.mtbf is not None else parse_failure_rate(args.failure_rate)
    records, skipped, where = read_run(args.run)
    result = advise(records, mtbf)
    if args.json:
        json.dump({"run": where, "skipped": skipped, **result}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print("\n".join(render(result, where, skipped)))
    return 0
