"""Which interval to checkpoint at: ``lazyckpt advise RUN --mtbf 8h``.

Reads the save costs every committed step records (``cost`` in its manifest,
lazyckpt/saving/costs.py, docs/FORMAT.md §11.2) and the mean time between failures
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
from typing import Any, Dict, List, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.knobs import parse_duration
from lazyckpt.loading.resolve import read_manifest
from lazyckpt.saving.costs import advise, problems, steps_text, time_text
from lazyckpt.storage.stores import for_path
from .inspect import list_directory


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


# --------------------------------------------------------------------------- from recorded costs


def read_run(run: str) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]], str]:
    """(records, skipped steps with the reason, the run's location): every
    committed step of a Checkpointer directory (local or s3://)."""
    listing = list_directory(run)
    if not listing["steps"]:
        raise CheckpointNotFoundError(f"{listing['directory']}: no committed step (nothing to advise from)",
                                      path=listing["directory"])
    records, skipped = [], []
    store = for_path(listing["directory"])
    for row in listing["steps"]:
        if "error" in row:
            skipped.append({"step": row["step"], "reason": f"manifest unreadable: {row['error']}"})
            continue
        manifest = read_manifest(store, store.join(listing["directory"], row["name"]))
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


def render(a: Dict[str, Any], run: str, skipped: List[Dict[str, Any]]) -> List[str]:
    c, cur, adv = a["cost"], a["current"], a["advised"]
    steps = a["steps"]
    out = [f"{run}: {len(steps)} step{'s' if len(steps) != 1 else ''} with recorded save costs "
           f"({steps[0]}..{steps[-1]})" + (f"; {a['ranks']} ranks: every figure is the maximum over the ranks"
                                           if a["ranks"] > 1 else "")]
    for s in skipped:
        out.append(f"  skipped step {s['step']}: {s['reason']}")
    n = c["samples"]
    slow = "unknown" if c["slowdown_s"] is None else time_text(c["slowdown_s"]) + (
        " (not measurable: busy iterations were not slower)" if c["slowdown_s"] <= 0 else "")
    out += ["", "cost of one checkpoint to the training (medians):",
            f"  save() blocking         {time_text(c['blocking_s'])}  ({n['blocking']} saves)",
            f"  barrier wait            {time_text(c['barrier_wait_s'])}  ({n['barrier_wait']} saves)",
            f"  iteration slow-down     {slow}  ({n['slowdown']} saves; quiet iteration "
            f"{time_text(c['iteration_quiet_s'])})",
            f"  C                       {time_text(c['total_s'])}" + ("" if c["complete"] else
                                                          "  (a lower bound: unknown parts counted as 0)")]
    for u in c["unknown"]:
        out.append(f"    unknown: {u}")
    out += [f"  not paid by the training: capture {time_text(a['capture_s'])}, flush {time_text(a['flush_s'])}, "
            f"{a['bytes'] / 1e6:.4g} MB written per save",
            f"  L (save() to committed) {time_text(a['latency_s'])}  (from {a['latency_from']})",
            "", f"M (MTBF of the whole job)  {time_text(a['mtbf_s'])} = {a['mtbf_s']:.6g} s",
            "", "interval that minimises the expected lost time:",
            f"  Young, first order:  {a['young']['formula']} = sqrt(2 x {a['young']['C_s']:.6g} s x "
            f"{a['mtbf_s']:.6g} s) = {a['young']['interval_s']:.6g} s",
            f"  Daly, higher order:  {a['daly']['formula']}",
            f"                       tau = {a['daly']['tau_s']:.6g} s, T = {a['daly']['interval_s']:.6g} s",
            f"  advised: a save() every {time_text(adv['interval_s'])}{steps_text(adv['steps'])}  (Daly)",
            "", f"expected work lost per failure, {a['lost_per_failure_formula']} (the time to restart not "
            f"included), and fraction of the time lost, {a['lost_fraction_formula']}:",
            f"  current interval {time_text(cur['interval_s'])}{steps_text(cur['steps'])}: "
            + ("unknown (needs two saves of one process)" if cur["interval_s"] is None else
               f"{time_text(cur['lost_per_failure_s'])} per failure, {cur['lost_fraction'] * 100:.3g} % of the time"),
            f"  advised interval {time_text(adv['interval_s'])}: {time_text(adv['lost_per_failure_s'])} per failure, "
            f"{adv['lost_fraction'] * 100:.3g} % of the time"]
    return out


def add_parser(sub: Any) -> None:
    """Register ``lazyckpt advise`` (called by lazyckpt/cli/__init__.py)."""
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
