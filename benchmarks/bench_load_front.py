"""A load's front and tail for many entries, this tree against a baseline, alternated.

    .venv/bin/python benchmarks/bench_load_front.py --baseline /tmp/lz-before/src [--reps 21] [--dir D]
        [--cases 4k:buf:1,4k:direct:1,268k:buf:1,268k:direct:1,268k:direct:0,4k:buf:into,268k:direct:into]

Writes two states of ``lazyckpt.cli.bench.make_state`` (2,000 tensors of 4 KiB:
per-tensor costs; 2,000 of 268 KB: 0.54 GB) with this tree, then keeps one
child process per tree (its ``src`` first on ``PYTHONPATH``) and asks them for
one load at a time, every case of both trees once per repetition in a
shuffled order (the first of each dropped). A case is FILE:buf|direct:1|0|into
(page cache or O_DIRECT; checksums on, off, or ``into=`` tensors of the state).
Per case and tree, min / median of: CPU (``time.process_time``, every thread),
wall, ``ttfs`` (the call to the first read's submission), ``ttfr`` (to the
first read's start), ``tail`` (the last read's end to the return), and the
cyclic GC's time and full collections over all repetitions. The children time
the reader's methods by wrapping them (``_read_and_verify``, ``_read_block``):
nothing is left in the library. BENCHMARKS §32.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

CHILD = r'''
import gc, json, sys, time
import lazyckpt
from lazyckpt.loading import reader as R
assert lazyckpt.__file__.startswith(sys.argv[1]), lazyckpt.__file__
marks, G = {}, {"t": 0.0, "s": 0.0, "full": 0}
def gc_cb(phase, info):
    if phase == "start":
        G["s"] = time.perf_counter()
    else:
        G["t"] += time.perf_counter() - G["s"]
        G["full"] += info["generation"] == 2
gc.callbacks.append(gc_cb)
submit, read = R.CheckpointFile._read_and_verify, R.CheckpointFile._read_block
def timed_submit(self, *a, **k):
    marks.setdefault("submit", time.perf_counter())
    return submit(self, *a, **k)
def timed_read(self, *a, **k):
    marks.setdefault("read", time.perf_counter())
    try:
        return read(self, *a, **k)
    finally:
        marks["read_end"] = time.perf_counter()
R.CheckpointFile._read_and_verify, R.CheckpointFile._read_block = timed_submit, timed_read
files, into = json.loads(sys.argv[2]), {}
for line in sys.stdin:
    name, mode, verify = line.split()
    kw = {}
    if verify == "into":
        if name not in into:
            into[name] = {k: v.clone() for k, v in lazyckpt.load(files[name]).items()}
        kw["into"] = into[name]
    marks.clear(); G["t"] = 0.0; G["full"] = 0
    c0, t0 = time.process_time(), time.perf_counter()
    state = lazyckpt.load(files[name], o_direct=mode == "direct", verify_checksums=verify != "0", **kw)
    t1, c1 = time.perf_counter(), time.process_time()
    del state
    print(json.dumps({"cpu": (c1 - c0) * 1e3, "wall": (t1 - t0) * 1e3, "ttfs": (marks["submit"] - t0) * 1e3,
                      "ttfr": (marks["read"] - t0) * 1e3, "tail": (t1 - marks["read_end"]) * 1e3,
                      "gc": G["t"] * 1e3, "full": G["full"]}), flush=True)
'''


def write_states(directory: str) -> dict:
    import torch
    import lazyckpt
    from lazyckpt.cli.bench import make_state
    files = {}
    for name, per in (("4k", 4096), ("268k", 268_435)):
        path = os.path.join(directory, f"front_{name}.lzc")
        if not os.path.exists(path):
            lazyckpt.save(make_state(2000 * per, 2000, [torch.float32, torch.bfloat16]), path)
        files[name] = path
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", required=True, help="the baseline tree's src folder")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--dir", default="/tmp/lzb-front")
    ap.add_argument("--cases", default="4k:buf:1,4k:direct:1,268k:buf:1,268k:direct:1,268k:direct:0,"
                                       "4k:buf:into,268k:direct:into")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    files = write_states(args.dir)
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    trees = {"before": os.path.abspath(args.baseline), "after": here}
    kids = {t: subprocess.Popen([sys.executable, "-c", CHILD, src, json.dumps(files)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=src))
            for t, src in trees.items()}
    cases = args.cases.split(",")

    def one(tree: str, case: str) -> dict:
        kids[tree].stdin.write(case.replace(":", " ") + "\n")
        kids[tree].stdin.flush()
        return json.loads(kids[tree].stdout.readline())
    for case in cases:
        for tree in trees:
            one(tree, case)                 # warm-up, dropped
    results = {(t, c): [] for t in trees for c in cases}
    load0, start = os.getloadavg()[0], time.time()
    for _ in range(args.reps):
        order = [(t, c) for t in trees for c in cases]
        random.shuffle(order)
        for t, c in order:
            results[(t, c)].append(one(t, c))
    print(f"{args.reps} repetitions in {time.time() - start:.0f} s, load average {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}; min / median ms")
    for c in cases:
        for t in trees:
            rs = results[(t, c)]
            cells = " ".join(f"{k} {min(r[k] for r in rs):7.2f}/{statistics.median(r[k] for r in rs):7.2f}"
                             for k in ("cpu", "wall", "ttfs", "ttfr", "tail"))
            print(f"{c:17s} {t:6s} {cells} gc {sum(r['gc'] for r in rs):6.1f} ms, "
                  f"full {sum(r['full'] for r in rs)}")
    for kid in kids.values():
        kid.stdin.close()
        kid.wait()


if __name__ == "__main__":
    main()
