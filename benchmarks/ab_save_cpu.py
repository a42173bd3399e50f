"""A/B of what one save costs the process, this tree's lazyckpt against another
source tree, in one run, interleaved: the CPU a refactor could add without the
disk hiding it.

``ab_trees.py`` times saves and loads end to end, which on this disk is mostly
the disk. This script separates what the library itself spends:

- ``first_save_s``: the first ``lazyckpt.save`` of a fresh process (512 MiB,
  durable on return). Bimodal on this machine for every tree (the capture's
  copy runs at ~10 or ~2 GB/s), so read it over many rounds.
- ``warm_save_s``: the median of saves 2..8 of the same process to new names.
- ``step_cpu_ms`` / ``step_wall_ms``: a Checkpointer step save of a
  model-like state (192 weight tensors, 96 optimizer entries with Python
  objects, 48 MiB in all), median of saves 5..24: user+system CPU of every
  thread of the process, and wall time until committed. CPU is what a save
  takes away from training on the same cores.

Each round runs one child process per tree (``PYTHONPATH=<tree>/src``), in
ABBA order; the parent prints medians per tree and this/baseline.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_save_cpu.py --baseline-src /tmp/base/src --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import tempfile
import time

from _ab import print_medians, run_abba

METRICS = ("first_save_s", "warm_save_s", "step_cpu_ms", "step_wall_ms")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(work: str) -> None:
    import torch

    import lazyckpt
    torch.manual_seed(0)
    big = {f"l{i}": torch.randn((512 << 20) // 4 // 32) for i in range(32)}
    model = {"model": {f"layers.{i}.{k}": torch.randn(256, 256) for i in range(48) for k in "qkvo"},
             "optim": {"state": {i: {"exp_avg": torch.randn(256, 256), "step": i} for i in range(96)}, "lr": 1e-3},
             "step": 0}
    out = {}
    warm = []
    for i in range(8):
        path = os.path.join(work, f"s{i}.lzc")
        t0 = time.perf_counter()
        lazyckpt.save(big, path)
        seconds = time.perf_counter() - t0
        if i == 0:
            out["first_save_s"] = seconds
        else:
            warm.append(seconds)
        if i >= 2:
            os.unlink(os.path.join(work, f"s{i - 2}.lzc"))
    out["warm_save_s"] = statistics.median(warm)
    cpu, wall = [], []
    with lazyckpt.Checkpointer(os.path.join(work, "run"), keep_last=2) as ck:
        for step in range(1, 25):
            c0, t0 = _cpu_s(), time.perf_counter()
            ck.save(model, step=step).wait()
            cpu.append((_cpu_s() - c0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
    out["step_cpu_ms"] = statistics.median(cpu[4:])
    out["step_wall_ms"] = statistics.median(wall[4:])
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="the other tree's src/ folder")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work = tempfile.mkdtemp(prefix="ab-save-cpu-", dir=args.dir or None)
        try:
            return child(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    results = run_abba(args.baseline_src, args.rounds,
                       lambda name: [__file__, "--baseline-src", "-", "--child", "--dir", args.dir or ""])
    print_medians(results, METRICS, f"medians of {args.rounds} rounds (ABBA); lower is better")

if __name__ == "__main__":
    main()
