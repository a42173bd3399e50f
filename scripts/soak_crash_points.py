#!/usr/bin/env python
"""Soak run of the crash-point test (issue 33 item 4; tests/_crashpoints.py).

Longer programs than the CI ones -- several saves, rollbacks, prunes and
restarts in one process, on one directory, optionally with keep_last -- each
generated from a seed; each one is crashed at a random point (of the whole
program, counted by a dry run), in a random mode (kill or power loss, the
un-fsynced tails cut, zeroed or half kept), and the invariants are checked
against the oracle of the operation the crash interrupted (the line before
it or after it). Runs until --minutes have
passed; prints every seed and every failure with its reproducer.

    .venv/bin/python scripts/soak_crash_points.py --minutes 10 --seed 7
    .venv/bin/python scripts/soak_crash_points.py --seed 123 --once --point 57 --mode power   # replay one
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import _crashpoints as cp  # noqa: E402
from _crashpoints import KNOBS, Ctx, Interceptor, Program, World, make_state  # noqa: E402

Op = Tuple[str, int]


def random_ops(seed: int, length: int) -> Tuple[Optional[int], List[Op]]:
    rng = random.Random(seed)
    keep_last = rng.choice([None, None, 2, 3])
    weights = {"save": 5, "rollback": 2, "prune": 1, "restart": 1}
    ops = [(rng.choices(list(weights), list(weights.values()))[0], rng.randrange(1 << 16)) for _ in range(length)]
    return keep_last, ops


def _values(seed: int, i: int) -> Any:
    return make_state(seed * 1000 + i)


def simulate(seed: int, keep_last: Optional[int], ops: List[Op]) -> List[Tuple["OrderedDict[int, Any]", set]]:
    """(line, steps that must be present) before the program and after each op.
    The program starts from a directory holding steps 1 and 2."""
    line: "OrderedDict[int, Any]" = OrderedDict((s, _values(seed, -s)) for s in (1, 2))
    present = set(line)
    states = [(OrderedDict(line), set(present))]
    next_step = 3
    for i, (op, arg) in enumerate(ops):
        if op in ("save", "rollback"):
            if op == "rollback" and line:
                next_step = list(line)[arg % len(line)] + 1
            for s in [s for s in line if s >= next_step]:
                del line[s]
            line[next_step] = _values(seed, i)
            present = {s for s in present if s in line} | {next_step}
            if keep_last is not None:
                present = set(sorted(present)[-keep_last:])
            next_step += 1
        elif op == "prune":
            keep = 1 + arg % 3
            present = set(sorted(present)[-keep:])
        states.append((OrderedDict(line), set(present)))
    return states


def make_program(seed: int, length: int) -> Program:
    keep_last, ops = random_ops(seed, length)
    states = simulate(seed, keep_last, ops)

    def ck(ctx: Ctx) -> Any:
        import lazyckpt
        from _groups import groups
        return lazyckpt.Checkpointer(os.path.join(ctx.case, "run"), keep=keep_last, **groups(KNOBS))

    def prepare(ctx: Ctx) -> None:
        with ck(ctx) as c:
            for s in (1, 2):
                c.save(_values(seed, -s), step=s).wait()

    def run(ctx: Ctx, icp: Interceptor) -> None:
        from lazyckpt.cli.prune import prune
        with icp.operation():
            c = ck(ctx)
            next_step = 3
            for i, (op, arg) in enumerate(ops):
                icp.tag = str(i)
                if op in ("save", "rollback"):
                    if op == "rollback":
                        listed = [s for s in c.steps()]
                        line = list(states[i][0])
                        next_step = line[arg % len(line)] + 1
                        if next_step - 1 in listed:
                            c.load(step=next_step - 1)
                    c.save(_values(seed, i), step=next_step).wait()
                    next_step += 1
                elif op == "prune":
                    c.close()
                    prune(os.path.join(ctx.case, "run"), 1 + arg % 3)
                    c = ck(ctx)
                else:
                    c.close()
                    c = ck(ctx)
            icp.tag = None
            c.close()

    def worlds_at(tag: Optional[str]) -> List[World]:
        def world(name: str, j: int) -> World:
            line, present = states[j]
            return World(name, next(reversed(line)) if line else None, dict(line), tuple(sorted(present)))
        if tag is None:
            return [world("end", len(ops))]
        i = int(tag)
        if ops[i][0] in ("prune", "restart"):
            # They change no line: a prune deletes its doomed steps newest first, so any
            # of them may be gone mid-prune; only what it keeps must stay.
            return [world(f"during op {i} {ops[i][0]}", i + 1)]
        return [world(f"before op {i} {ops[i][0]}", i), world(f"after op {i} {ops[i][0]}", i + 1)]

    return Program(f"soak-{seed}", prepare, run, [], kwargs={"keep": keep_last}, worlds_at=worlds_at)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=None, help="first program seed (default: random)")
    ap.add_argument("--length", type=int, default=8, help="operations per program")
    ap.add_argument("--crashes", type=int, default=4, help="random crash points per program")
    ap.add_argument("--once", action="store_true", help="one program only")
    ap.add_argument("--point", type=int, default=None, help="with --once: this crash point")
    modes = ("kill",) + tuple(cp.POWER_TAILS)       # kill, and the power loss with each tail
    ap.add_argument("--mode", choices=modes, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    deadline = time.monotonic() + args.minutes * 60
    failures: List[str] = []
    programs = cases = 0
    while True:
        program = make_program(seed, args.length)
        keep_last, ops = random_ops(seed, args.length)
        work = tempfile.mkdtemp(prefix="soak-crash-")
        try:
            n, _ = cp.dry_run(program, work)
            rng = random.Random(seed)
            points = [args.point] if args.point else sorted(rng.sample(range(1, n + 1), min(args.crashes, n)))
            print(f"seed {seed}: keep_last={keep_last} ops={[o for o, _ in ops]} {n} points; crashing at {points}",
                  flush=True)
            for k in points:
                mode = args.mode or rng.choice(modes)
                result = cp.run_case(program, work, k, mode)
                cases += 1
                if result["problems"]:
                    line = (f"FAIL seed {seed} --point {k} --mode {mode} (op {result.get('tag')}): before "
                            f"{result['op']}: {result['problems']}")
                    failures.append(line)
                    print(line, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        programs += 1
        seed += 1
        if args.once or time.monotonic() > deadline:
            break
    print(f"{programs} programs, {cases} crashes, {len(failures)} failures")
    for f in failures:
        print(" ", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
