"""What the line of history costs a save (issue 22): time until committed and
load() with and without ``persist_to``, A/B against another source tree.

The line of history adds, per commit: one ``history.json`` write (atomic,
fsynced) on the local tier and, with ``persist_to``, one empty event object
on the store before the upload is queued; ``load()`` with ``persist_to``
reads every local manifest and one listing of the store. This benchmark
measures those paths end to end on a tiny state (so the fixed costs show),
against a real SeaweedFS, for the tree it imports and -- with ``--ab SRC``
-- for another tree (e.g. main before issue 22), in interleaved runs:

    git worktree add /tmp/before 25b1be9
    .venv/bin/python benchmarks/bench_history.py --ab /tmp/before/src --runs 5

Each run is a fresh process (the import decides the tree); medians of the
per-run medians are printed, with the ratio new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(saves: int) -> dict:
    import torch
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from _s3server import SeaweedServer
    import lazyckpt

    out = {}
    d = tempfile.mkdtemp()
    srv = SeaweedServer(os.path.join(d, "sw")).start()
    try:
        bucket = srv.make_bucket()
        opts = {"endpoint_url": srv.endpoint, "access_key_id": srv.access_key,
                "secret_access_key": srv.secret_key, "region": srv.region}
        url = f"s3://{bucket}/run"
        if hasattr(lazyckpt, "Persist"):
            persist = {"keep": 3, "persist": lazyckpt.Persist(url, storage_options=opts)}
        else:                           # --ab against a tree from before the option groups
            persist = {"keep_last": 3, "persist_to": url, "storage_options": opts}
        local = {k: v for k, v in persist.items() if k in ("keep", "keep_last")}
        for name, kwargs in (("local", local), ("persist", persist)):
            with lazyckpt.Checkpointer(os.path.join(d, name), **kwargs) as ckpt:
                times = []
                for step in range(saves):
                    t0 = time.perf_counter()
                    ckpt.save({"w": torch.randn(1000)}, step=step).wait()
                    times.append(time.perf_counter() - t0)
                out[f"{name}_commit_ms"] = statistics.median(times) * 1e3
                ckpt.wait()
                loads = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    ckpt.load()
                    loads.append(time.perf_counter() - t0)
                out[f"{name}_load_ms"] = statistics.median(loads) * 1e3
    finally:
        srv.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--runs", type=int, default=3, help="interleaved runs per tree")
    p.add_argument("--ab", default=None, help="another tree's src/ directory to compare against")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.saves)))
        return
    trees = {"this tree": os.path.join(HERE, "..", "src")}
    if args.ab:
        trees = {"other tree": os.path.abspath(args.ab), **trees}
    results = {name: [] for name in trees}
    for run in range(args.runs):
        for name, src in trees.items():
            env = dict(os.environ, PYTHONPATH=src)
            raw = subprocess.run([sys.executable, __file__, "--child", "--saves", str(args.saves)], env=env,
                                 check=True, capture_output=True, text=True).stdout
            results[name].append(json.loads(raw.strip().splitlines()[-1]))
            print(f"run {run} {name}: {results[name][-1]}", flush=True)
    keys = list(results["this tree"][0])
    print(f"\nmedians of {args.runs} interleaved runs, {args.saves} saves of a 4 KB state each:")
    print(f"{'':22}" + "".join(f"{n:>14}" for n in trees) + ("   new/old" if args.ab else ""))
    for k in keys:
        med = {n: statistics.median(r[k] for r in rs) for n, rs in results.items()}
        row = f"{k:22}" + "".join(f"{med[n]:14.1f}" for n in trees)
        if args.ab:
            row += f"   {med['this tree'] / med['other tree']:.2f}x"
        print(row)


if __name__ == "__main__":
    main()
