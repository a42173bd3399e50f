"""A/B of the training benchmark: this tree's lazyckpt against another source
tree (e.g. a checkout of an earlier commit), in one run, interleaved.

Runs ``bench_training.py --modes none,lazyckpt`` alternately with this
tree's ``src`` and the baseline's on ``PYTHONPATH`` (same model, seed,
batches, disk), ``--rounds`` times in ABBA order (which version goes first
alternates, so a disk that drifts steadily during the run favours neither),
and prints per version the medians of
s/iter, overhead against that run's own no-checkpoint baseline, save()
blocking, optimizer stall and time to durable, and the ratios new/old.

    git worktree add /tmp/base <commit>
    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ab_training.py --baseline-src /tmp/base/src \\
        --rounds 2 -- --hidden 768 --layers 8 --seq 512 --batch 2 --iters 8 --every 1 --cache-mib 2048
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
KEYS = ("iter_s", "overhead_pct", "blocking_s", "stall_s", "durable_s")


def bench_script(src: str) -> str:
    """The tree's own bench_training.py where it has one: the script imports
    helpers from the package, whose module paths a refactor may move."""
    own = os.path.join(os.path.dirname(src), "benchmarks", "bench_training.py")
    return own if os.path.exists(own) else os.path.join(HERE, "bench_training.py")


def run(src: str, extra: list, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    cmd = [sys.executable, bench_script(src), "--modes", "none,lazyckpt",
           "--json", out, *extra]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    s = doc["summary"]["lazyckpt"]
    return {**{k: s[k] for k in KEYS}, "verify": doc.get("verify")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline-src", required=True, help="the src/ directory of the baseline tree")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then bench_training.py arguments")
    args = p.parse_args()
    extra = [a for a in args.rest if a != "--"]
    versions = {"baseline": os.path.abspath(args.baseline_src), "this tree": SRC}
    results = {name: [] for name in versions}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = list(versions.items())
            for name, src in (order if rnd % 2 == 0 else order[::-1]):
                r = run(src, extra, os.path.join(tmp, f"{rnd}-{len(results[name])}.json"))
                results[name].append(r)
                print(f"round {rnd + 1} {name}: " + ", ".join(f"{k} {r[k]:.4f}" for k in KEYS)
                      + f", bit-exact {r['verify']}", flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in results.items()}
    print(f"\nmedians of {args.rounds} interleaved rounds ({' '.join(extra)}):")
    print(f"{'':10s} " + " ".join(f"{k:>13s}" for k in KEYS))
    for name, m in med.items():
        print(f"{name:10s} " + " ".join(f"{m[k]:13.4f}" for k in KEYS))
    ratio = {k: (med["this tree"][k] / med["baseline"][k] if med["baseline"][k] else None) for k in KEYS}
    print("this/base  " + " ".join(f"{v:13.3f}" if v is not None else f"{'-':>13s}" for v in ratio.values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": extra, "rounds": results, "medians": med, "ratios": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
