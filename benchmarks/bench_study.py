"""Studying a run (issue 26): ``history`` of one statistic over every step of
a run, against loading each step whole and computing it from the state.

A state of ``--size`` bytes (``--tensors`` float32 tensors, every one changed
at every step: full saves, nothing for references to skip) is saved at
``--steps`` steps by a Checkpointer, and the same states with ``torch.save``
(one file per step). Then, each in a fresh child process (peak RSS is the
child's high-water mark), the norm of every tensor at every step by:

* ``history``: ``lazyckpt.trajectory(run, fn="norm")`` -- pieces of one chunk;
* ``history 1/8 keys``: the same for an eighth of the tensors (``keys=`` glob);
* ``lazyckpt.load``: each step loaded whole, then ``t.double().norm()``;
* ``torch.load``: each step's file loaded whole (``mmap=False``), then the same;
* ``torch.load mmap``: ``torch.load(mmap=True)``, the same (pages read on demand);
* ``history-old`` (with ``--old-study FILE``): ``history`` by another version
  of study.py, for an A/B (``git show 44fcb01:src/lazyckpt/study.py >
  /tmp/study_44fcb01.py``: the code that folded every statistic per slice).

Reported per method: median seconds over ``--reps`` interleaved repetitions
(page cache dropped before each where permitted) and their ratio to
``lazyckpt.load``'s and ``torch.load``'s, bytes read (``rchar`` of the child:
what it asked the kernel for; for ``history`` also its own counter), and the
child's peak RSS (``VmHWM``) and how far it rose above the RSS it had before
the work (torch and lazyckpt imported). Every method's norms are checked
against ``history``'s.

    .venv/bin/python benchmarks/bench_study.py --size 1G --steps 20 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _peak_rss() -> int:
    """VmHWM: reset by exec (ru_maxrss is not: it keeps the parent's high-water mark)."""
    return _status("VmHWM")


def _old_trajectory(path: str):
    """``trajectory`` of the study.py at ``path``, loaded as a module of the package."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("lazyckpt._study_ab", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.trajectory


def child(method: str, base: str, steps: int, old_study: str = None) -> None:
    import torch
    import lazyckpt
    torch.set_num_threads(1)
    run = os.path.join(base, "run")
    rss_start = _status("VmRSS")                 # the interpreter with torch and lazyckpt imported
    t0, r0 = time.perf_counter(), _rchar()
    norms = {}
    if method.startswith("history"):
        keys = "w00[0-7]*" if method == "history-keys" else None
        trajectory = _old_trajectory(old_study) if method == "history-old" else lazyckpt.trajectory
        traj = trajectory(run, keys=keys, fn="norm", progress=False)
        for step, key, value in traj:
            norms[f"{step}/{key}"] = value
        counted = traj.counter.bytes_read
    else:
        counted = None
        for step in range(1, steps + 1):
            if method == "lazyckpt.load":
                state = lazyckpt.load(os.path.join(run, f"step_{step:010d}"))
            else:
                state = torch.load(os.path.join(base, "torch", f"{step}.pt"), mmap=method == "torch.load-mmap",
                                   weights_only=True)
            for key, t in state.items():
                norms[f"{step}/{key}"] = t.double().norm().item()
            del state
    seconds = time.perf_counter() - t0
    print(json.dumps({"method": method, "seconds": seconds, "rchar": _rchar() - r0, "counted": counted,
                      "peak_rss": _peak_rss(), "rss_start": rss_start, "norms": norms}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1G", help="state size (default 1G)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", help="where to write (default: a temporary directory under the current one)")
    p.add_argument("--old-study", help="a study.py of another version: adds method history-old (an A/B)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.base, args.steps, args.old_study)
        return
    import torch
    import lazyckpt
    from lazyckpt.knobs import parse_size
    from _common import drop_caches
    size = parse_size(args.size)
    base = tempfile.mkdtemp(prefix="bench-study-", dir=args.dir or os.getcwd())
    try:
        numel = size // 4 // args.tensors
        torch.manual_seed(0)
        state = {f"w{i:03d}": torch.randn(numel // 1024, 1024) for i in range(args.tensors)}
        os.makedirs(os.path.join(base, "torch"))
        t0 = time.perf_counter()
        with lazyckpt.Checkpointer(os.path.join(base, "run")) as ck:
            for step in range(1, args.steps + 1):
                for t in state.values():
                    t.mul_(1.001).add_(0.001)
                ck.save(state, step=step).wait()
                torch.save(state, os.path.join(base, "torch", f"{step}.pt"))
        written = time.perf_counter() - t0
        state_bytes = sum(t.nbytes for t in state.values())
        del state
        print(f"state {state_bytes / 2**30:.2f} GiB in {args.tensors} tensors, {args.steps} steps "
              f"(written in {written:.0f} s), torch {torch.__version__}, {os.cpu_count()} cpus")
        methods = ["history", "history-keys", "lazyckpt.load", "torch.load", "torch.load-mmap"]
        if args.old_study:
            methods.insert(1, "history-old")
        results = {m: [] for m in methods}
        dropped = True
        for rep in range(args.reps):
            for m in (methods if rep % 2 == 0 else list(reversed(methods))):       # interleaved
                dropped = drop_caches() and dropped
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", m, "--base", base,
                                      "--steps", str(args.steps)] + (["--old-study", os.path.abspath(args.old_study)]
                                                                     if args.old_study else []),
                                     check=True, capture_output=True, text=True)
                results[m].append(json.loads(out.stdout.strip().splitlines()[-1]))
        reference = results["history"][0]["norms"]
        for m in methods:
            for r in results[m]:
                norms = r["norms"]
                assert all(abs(norms[k] - reference[k]) <= 1e-9 * abs(reference[k]) for k in norms), m
                assert m == "history-keys" or set(norms) == set(reference), m
        print(f"page cache dropped before each run: {dropped}")
        total = state_bytes * args.steps

        def median(m: str, field: str) -> float:
            return statistics.median(r[field] for r in results[m])

        # Ratios are seconds / the baseline's seconds: below 1 is faster than it.
        load_t, torch_t = median("lazyckpt.load", "seconds"), median("torch.load", "seconds")
        print(f"{'method':18} {'seconds':>8} {'x lz.load':>9} {'x torch':>8} {'GB/s':>6} {'read GiB':>9} "
              f"{'counted GiB':>11} {'peak RSS MiB':>13} {'above start':>11}")
        for m in methods:
            sec = median(m, "seconds")
            counted = median(m, "counted") / 2**30 if m.startswith("history") else float("nan")
            share = 8 if m == "history-keys" else 1
            print(f"{m:18} {sec:8.2f} {sec / load_t:9.2f} {sec / torch_t:8.2f} {total / share / sec / 1e9:6.2f} "
                  f"{median(m, 'rchar') / 2**30:9.2f} {counted:11.2f} {median(m, 'peak_rss') / 2**20:13.0f} "
                  f"{(median(m, 'peak_rss') - median(m, 'rss_start')) / 2**20:11.0f}")
        print("JSON " + json.dumps({m: [{k: v for k, v in r.items() if k != "norms"} for r in results[m]]
                                    for m in methods}))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
