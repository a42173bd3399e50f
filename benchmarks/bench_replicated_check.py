"""What the value check of named replicated= keys costs (issue 22, case 9).

Each of 2 gloo ranks (real processes on this machine) saves a DDP-like
state -- a model of ``--mib`` MiB and two optimizer moments, identical on
every rank, plus a per-rank RNG state -- with ``replicated=["model",
"optim"]``, ``--saves`` times, with the check ("check", what the library
does) and with the per-rank hashing replaced by nothing ("nocheck", the
code before issue 22). Modes are interleaved over ``--reps`` repetitions.
Printed per mode: medians over the steady-state saves (the first of each
run is left out) of the slowest rank's time from save() until the state
may be modified again (capture) and until committed (durable); and the
xxh3 rate of this machine over the same bytes, hashed in one thread.

    python benchmarks/bench_replicated_check.py [--mib 64 --saves 5 --reps 3]
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


from bench_auto_replicated import _state  # noqa: E402  (the same DDP-like state)


def _run(rank, world, directory, mode, mib, saves):
    import lazyckpt
    from lazyckpt.saving.planner import StepPlanner
    if mode == "nocheck":       # the A/B's baseline: no per-rank hashing, nothing reported
        StepPlanner._hash_named_replicated = lambda self, part, resources: None
    out = {"capture": [], "durable": []}
    with lazyckpt.Checkpointer(directory, keep=2,
                               distributed=lazyckpt.Distributed(identical_keys=["model", "optim"])) as ckpt:
        for step in range(1, saves + 1):
            state = _state(rank, mib, step)
            t0 = time.perf_counter()
            handle = ckpt.save(state, step=step)
            handle.wait_for_snapshot()
            out["capture"].append(time.perf_counter() - t0)
            handle.wait()
            out["durable"].append(time.perf_counter() - t0)
    return out


def _hash_rate(mib):
    import torch
    import xxhash
    data = _state(0, mib, 1)
    arrays = [t.view(-1).view(torch.uint8).numpy() for t in (data["model"]["w"], data["optim"]["exp_avg"],
                                                            data["optim"]["exp_avg_sq"])]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        h = xxhash.xxh3_64()
        for a in arrays:
            h.update(a)
        times.append(time.perf_counter() - t0)
    nbytes = sum(a.nbytes for a in arrays)
    return nbytes, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    results = {"check": {"capture": [], "durable": []}, "nocheck": {"capture": [], "durable": []}}
    root = tempfile.mkdtemp(prefix="bench_repcheck_")
    try:
        for rep in range(args.reps):
            for mode in (("check", "nocheck") if rep % 2 == 0 else ("nocheck", "check")):
                directory = os.path.join(root, f"{mode}{rep}")
                per_rank = run_ranks(2, _run, directory, mode, args.mib, args.saves, timeout=600)
                for metric in ("capture", "durable"):
                    slowest = [max(r[metric][i] for r in per_rank) for i in range(1, args.saves)]
                    results[mode][metric].extend(slowest)
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes, hash_s = _hash_rate(args.mib)
    print(f"state: {nbytes / 1e6:.0f} MB replicated (model + 2 moments), 2 ranks, "
          f"{args.reps} reps x {args.saves - 1} steady saves per mode")
    for mode, r in results.items():
        print(f"{mode:8s} capture median {statistics.median(r['capture']) * 1e3:7.1f} ms   "
              f"durable median {statistics.median(r['durable']) * 1e3:7.1f} ms")
    print(f"xxh3 of the replicated bytes in one thread: {hash_s * 1e3:.1f} ms ({nbytes / hash_s / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
