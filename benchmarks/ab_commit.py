"""A/B of what a commit costs, this tree's lazyckpt against another source
tree, in one run, interleaved (ABBA, ``_ab.py``): the bookkeeping a change to
the commit protocol adds, with the disk's share made small.

- ``blocking_ms``: median time ``save()`` takes to return (4 KiB state).
- ``commit_ms``: median ``save().wait()`` of a 4 KiB state into a directory
  that keeps its last 3 steps (saves 11..110): writes, fsyncs, the record,
  the renames, retention, ``latest``.
- ``commit_keepall_ms``: the same with ``keep_last=None`` over steps 1..100
  (the record and the listing grow with the steps kept).
- ``rollback_ms``: median ``save().wait()`` of a rollback (steps 1..5 kept,
  load step 2, save step 3: three steps superseded), 10 times.
- ``open_load_ms``: a Checkpointer opened on the 100-step directory and its
  latest step loaded.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_commit.py --baseline-src /tmp/base/src --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from _ab import print_medians, run_abba

METRICS = ("blocking_ms", "commit_ms", "commit_keepall_ms", "rollback_ms", "open_load_ms")


def child(work: str) -> None:
    import torch

    import lazyckpt
    state = {"w": torch.randn(1024), "step": 0}
    out = {}
    blocking, commit = [], []
    with lazyckpt.Checkpointer(os.path.join(work, "keep3"), keep_last=3) as ck:
        for step in range(1, 111):
            t0 = time.perf_counter()
            handle = ck.save(state, step=step)
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            if step > 10:
                blocking.append((t1 - t0) * 1e3)
                commit.append((t2 - t0) * 1e3)
    out["blocking_ms"] = statistics.median(blocking)
    out["commit_ms"] = statistics.median(commit)
    keepall = []
    directory = os.path.join(work, "keepall")
    with lazyckpt.Checkpointer(directory) as ck:
        for step in range(1, 101):
            t0 = time.perf_counter()
            ck.save(state, step=step).wait()
            keepall.append((time.perf_counter() - t0) * 1e3)
    out["commit_keepall_ms"] = statistics.median(keepall)
    t0 = time.perf_counter()
    with lazyckpt.Checkpointer(directory) as ck:
        ck.load()
    out["open_load_ms"] = (time.perf_counter() - t0) * 1e3
    rollback = []
    for i in range(10):
        directory = os.path.join(work, f"rollback{i}")
        with lazyckpt.Checkpointer(directory) as ck:
            for step in range(1, 6):
                ck.save(state, step=step).wait()
            ck.load(step=2)
            t0 = time.perf_counter()
            ck.save(state, step=3).wait()
            rollback.append((time.perf_counter() - t0) * 1e3)
    out["rollback_ms"] = statistics.median(rollback)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="the other tree's src/ folder")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        work = tempfile.mkdtemp(prefix="ab-commit-", dir=args.dir or None)
        try:
            return child(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    results = run_abba(args.baseline_src, args.rounds,
                       lambda name: [__file__, "--baseline-src", "-", "--child", "--dir", args.dir or ""])
    print_medians(results, METRICS, f"medians of {args.rounds} rounds (ABBA); lower is better")


if __name__ == "__main__":
    main()
