"""A/B of a cold ``lazyckpt.load`` in a warm process: this tree against
another source tree, for states of the same bytes in more or fewer tensors.

``ab_trees.py`` times every load as a process's first (a restart, CPU-bound
on faulting in fresh memory); this one times a process's later loads, where
a load's fixed costs per tensor (the footer's checks, the tree's walks and
decode) show against the reads. Each round runs one child per tree (ABBA),
each child does one untimed load, then 5 cold loads alternating with the raw
reads of the same file (O_DIRECT from 4 threads and buffered; the faster of
the two is the ceiling); medians per child, then medians over the rounds,
and the median of the per-round ratios raw/load.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_load_trees.py --baseline-src /tmp/base/src --tensors 64,2000 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
THIS_SRC = os.path.join(os.path.dirname(HERE), "src")

CHILD = r'''
import sys, time, statistics, json
sys.path.insert(0, sys.argv[1])
import lazyckpt
from lazyckpt.cli import bench as raw
path, nbytes = sys.argv[2], int(sys.argv[3])
lazyckpt.load(path)
loads, raws = [], []
for _ in range(5):
    raw.drop_caches_global(); t = time.perf_counter(); lazyckpt.load(path); loads.append(time.perf_counter() - t)
    raw.drop_caches_global(); direct = raw.raw_read(path, nbytes, 4)
    raw.drop_caches_global(); raws.append(min(direct, raw.raw_read_buffered(path, nbytes)))
print(json.dumps([statistics.median(loads), statistics.median(raws)]))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline-src", required=True, help="the other tree's src/ folder")
    ap.add_argument("--tensors", default="64,2000", help="comma-separated tensor counts")
    ap.add_argument("--gib", type=float, default=0.75)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-restore"))
    args = ap.parse_args()
    sys.path.insert(0, THIS_SRC)
    import torch
    import lazyckpt
    from lazyckpt.cli import bench as raw
    if not raw.drop_caches_global():
        sys.exit("needs to drop the page cache (root)")
    os.makedirs(args.dir, exist_ok=True)
    results = {}
    for n in (int(x) for x in args.tensors.split(",")):
        state = raw.make_state(int(args.gib * (1 << 30)), n, [torch.float32, torch.bfloat16])
        path = os.path.join(args.dir, f"ab-load-{n}.lzc")
        lazyckpt.save(state, path)          # written by this tree; both read format 1
        del state
        nbytes = os.path.getsize(path) // 4096 * 4096
        for rnd in range(args.rounds):
            order = [("this", THIS_SRC), ("baseline", args.baseline_src)]
            for name, src in (order if rnd % 2 == 0 else order[::-1]):
                out = subprocess.run([sys.executable, "-c", CHILD, src, path, str(nbytes)], check=True,
                                     capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=src))
                results.setdefault((n, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
        os.unlink(path)
    print(f"{args.gib:g} GiB, cold loads in a warm process, medians of {args.rounds} rounds (ABBA)")
    for (n, name), v in sorted(results.items()):
        load = statistics.median(x for x, _ in v)
        ceiling = statistics.median(y for _, y in v)
        print(f"{n:6d} tensors  {name:9s} load {load * 1000:7.1f} ms  best raw {ceiling * 1000:7.1f} ms  "
              f"of raw {statistics.median(y / x for x, y in v):.2f}")


if __name__ == "__main__":
    main()
