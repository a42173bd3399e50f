"""What the job-wide round of a rollback with ``replicas=`` costs (issue 33;
lazyckpt/saving/jobcommit.py), this tree against another source tree.

Each round, per tree, one child process runs a job of 2 gloo ranks, one per
node (``replicas=1, node_size=1``), each saving a ``--mib`` MiB state:
3 warm-up saves, then ``--saves`` forward saves (steps 4, 5, ...: no round)
and ``--saves`` rollback saves (the latest step saved again: each supersedes
the one before it, so each takes the round). Figures per kind, rank 0's
medians: ``save()`` blocking time and ``save().wait()`` (commit latency).
Rounds alternate which tree goes first (benchmarks/_ab.py).

    python benchmarks/ab_job_commit.py --baseline-src /path/to/other/src [--rounds 5 --mib 16 --saves 8]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _rank(rank: int, port: int, base: str, mib: int, saves: int, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    import lazyckpt
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    state = {"w": torch.randn(mib << 18), "step": 0}
    figures = {"forward_block_ms": [], "forward_commit_ms": [], "rollback_block_ms": [], "rollback_commit_ms": []}
    with lazyckpt.Checkpointer(os.path.join(base, f"node{rank}"), replicas=1, node_size=1, keep_last=2,
                               commit_timeout_s=120) as ckpt:
        for step in range(1, 4):
            ckpt.save(state, step=step).wait()
        ckpt.wait()
        plan = [("forward", 4 + i) for i in range(saves)] + [("rollback", 3 + saves)] * saves
        for kind, step in plan:
            state["w"].add_(1.0)
            dist.barrier()
            t0 = time.perf_counter()
            handle = ckpt.save(state, step=step)
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            figures[f"{kind}_block_ms"].append((t1 - t0) * 1e3)
            figures[f"{kind}_commit_ms"].append((t2 - t0) * 1e3)
            ckpt.wait()         # the replica round: each save measured on its own
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: statistics.median(v) for k, v in figures.items()}, f)
    dist.destroy_process_group()


def child(mib: int, saves: int) -> None:
    import multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as base:
        out = os.path.join(base, "figures.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, port, base, mib, saves, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.exitcode != 0:
                raise SystemExit(f"a rank failed ({p.exitcode})")
        with open(out) as f:
            print(json.dumps(json.load(f)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", help="the other tree's src/ (e.g. a worktree of the commit before)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.mib, args.saves)
        return
    from _ab import print_medians, run_abba
    if not args.baseline_src:
        ap.error("--baseline-src is required")
    results = run_abba(args.baseline_src, args.rounds,
                       lambda name: [os.path.abspath(__file__), "--child", "--mib", str(args.mib),
                                     "--saves", str(args.saves)])
    print_medians(results, ["forward_block_ms", "forward_commit_ms", "rollback_block_ms", "rollback_commit_ms"],
                  f"2 nodes x 1 rank, replicas=1, {args.mib} MiB a rank, {args.saves} saves of each kind, "
                  f"medians of {args.rounds} rounds (ms)")


if __name__ == "__main__":
    main()
