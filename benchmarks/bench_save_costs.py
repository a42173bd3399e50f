"""What recording the save costs costs (issue 26): A/B in one run.

Recording adds, per optimizer step of the first attached optimizer, one
step pre-hook (lazyckpt/saving/costs.py ``IterationClock.tick``: a clock read and a
look at the save queue), and per save a few figures in the commit report and
the manifest. Variant "off" disables both by patching them out in its
process (``SaveCosts.clock_for`` gives no clock, ``SaveCosts.report`` reports
nothing: no ``cost`` in the manifest); the wait accounting in
``wait_for_snapshot`` (a clock read when it actually waits) stays in both.

Each run is a fresh process; the variants alternate (off-on, on-off, ...), and medians of the
per-run medians are printed with the ratio on/off:

    .venv/bin/python benchmarks/bench_save_costs.py --runs 7
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


def measure(variant: str, iters: int, saves: int) -> dict:
    import torch
    import lazyckpt
    from lazyckpt.saving import costs
    if variant == "off":
        costs.SaveCosts.clock_for = lambda self, engine: None
        costs.SaveCosts.report = lambda self, job, t0, previous: None
    torch.set_num_threads(1)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        with lazyckpt.Checkpointer(os.path.join(d, "run"), keep=2) as ckpt:
            ckpt.attach(opt)
            # Iterations with no save: the hook's cost on a step of ~tens of microseconds.
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                times.append(time.perf_counter() - t0)
            out["iter_us"] = statistics.median(times) * 1e6
            # save() -> committed of a tiny state (fixed costs show; the report and manifest grow).
            commits = []
            for step in range(saves):
                t0 = time.perf_counter()
                ckpt.save({"w": model.state_dict()}, step=step).wait()
                commits.append(time.perf_counter() - t0)
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            out["commit_ms"] = statistics.median(commits) * 1e3
            # The hook alone: the clock's tick, timed directly (the iteration figure is noisier).
            clock = ckpt._costs.clock
            if clock is not None:
                import timeit
                out["tick_us"] = min(timeit.repeat(clock.tick, number=2000, repeat=5)) / 2000 * 1e6
            else:
                out["tick_us"] = 0.0
            with open(os.path.join(ckpt.step_path(saves - 1), "manifest.json"), "rb") as f:
                out["manifest_bytes"] = len(f.read())
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--iters", type=int, default=3000)
    p.add_argument("--saves", type=int, default=30)
    p.add_argument("--child", choices=["on", "off"])
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.iters, args.saves)))
        return
    results = {"on": [], "off": []}
    for run in range(args.runs):
        for variant in (("off", "on") if run % 2 == 0 else ("on", "off")):     # no order bias
            raw = subprocess.run([sys.executable, __file__, "--child", variant, "--iters", str(args.iters),
                                  "--saves", str(args.saves)], check=True, capture_output=True, text=True).stdout
            results[variant].append(json.loads(raw.strip().splitlines()[-1]))
    for variant in ("off", "on"):
        print(variant, "iteration us per run:", " ".join(f"{r['iter_us']:.0f}" for r in results[variant]))
    print(f"runs {args.runs} x (iterations {args.iters}, saves {args.saves}); medians of per-run medians")
    print(f"{'figure':<28}{'off':>12}{'on':>12}{'on/off':>9}")
    for key, label in (("iter_us", "iteration (us)"), ("commit_ms", "save() -> committed (ms)"),
                       ("manifest_bytes", "manifest (bytes)"), ("tick_us", "iteration clock tick (us)")):
        off = statistics.median(r[key] for r in results["off"])
        on = statistics.median(r[key] for r in results["on"])
        print(f"{label:<28}{off:>12.4g}{on:>12.4g}" + (f"{on / off:>9.3f}" if off else f"{'-':>9}"))


if __name__ == "__main__":
    main()
