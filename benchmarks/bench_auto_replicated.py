"""replicated="auto" (issue 12): what DDP ranks write per checkpoint without naming keys.

Each of ``--worlds`` gloo ranks (real processes on this machine) saves a
DDP-like state: a model of ``--mib`` MiB and two optimizer moments (identical
on every rank) plus a per-rank RNG state, ``--saves`` times, with
``replicated`` unset (every rank writes everything; the hint warns),
``replicated=["model", "optim"]`` (named) and ``replicated="auto"``.
Modes are interleaved over ``--reps`` repetitions. Printed per mode: bytes
of the step's files (sum over ranks; the steady state, after the first
save, which auto uses to learn) and the median time from save() until
committed, the slowest rank's.

    python benchmarks/bench_auto_replicated.py [--worlds 2,4 --mib 64 --saves 4 --reps 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from _dist import run_ranks  # noqa: E402

MODES = {"unset": None, "named": ["model", "optim"], "auto": "auto"}


def _state(rank, mib, step):
    import torch
    n = int(mib * (1 << 20) // 4)
    g = torch.Generator().manual_seed(step)
    w = torch.randn(n, generator=g)
    return {"model": {"w": w}, "optim": {"exp_avg": w * 0.1, "exp_avg_sq": w * w},
            "rng": torch.full((1264,), float(rank * 1000 + step)), "step": step}


def _run(rank, world, directory, mode, mib, saves):
    import lazyckpt
    out = {"bytes": [], "durable": []}
    with lazyckpt.Checkpointer(directory, keep=2,
                               distributed=lazyckpt.Distributed(identical_keys=MODES[mode])) as ckpt:
        for step in range(1, saves + 1):
            state = _state(rank, mib, step)
            t0 = time.perf_counter()
            ckpt.save(state, step=step).wait()
            out["durable"].append(time.perf_counter() - t0)
            path = ckpt.step_path(step)
            out["bytes"].append(sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                                    if f.endswith(".lzc")))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--mib", type=float, default=64.0, help="model MiB (the state is ~3x that per rank)")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="lzc-auto-", dir=args.dir)
    try:
        print(f"model {args.mib} MiB + 2 moments per rank, {args.saves} saves, {args.reps} interleaved reps")
        print(f"{'world':>5} {'mode':>6} {'first save MB':>14} {'steady MB':>10} {'of unset':>9} "
              f"{'committed s':>12} {'of unset':>9}")
        for world in [int(w) for w in args.worlds.split(",")]:
            got = {m: {"first": [], "steady": [], "durable": []} for m in MODES}
            for rep in range(args.reps):
                for mode in (list(MODES) if rep % 2 == 0 else list(reversed(MODES))):
                    d = os.path.join(base, f"{world}-{mode}-{rep}")
                    res = run_ranks(world, _run, d, mode, args.mib, args.saves, timeout=900)
                    got[mode]["first"].append(res[0]["bytes"][0])
                    got[mode]["steady"].extend(res[0]["bytes"][1:])
                    got[mode]["durable"].extend(max(r["durable"][i] for r in res) for i in range(1, args.saves))
                    shutil.rmtree(d, ignore_errors=True)
            ref_b = statistics.median(got["unset"]["steady"])
            ref_t = statistics.median(got["unset"]["durable"])
            for mode in MODES:
                b = statistics.median(got[mode]["steady"])
                t = statistics.median(got[mode]["durable"])
                print(f"{world:>5} {mode:>6} {statistics.median(got[mode]['first']) / 1e6:>14.1f} "
                      f"{b / 1e6:>10.1f} {b / ref_b:>9.2f} {t:>12.3f} {t / ref_t:>9.2f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
