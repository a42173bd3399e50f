"""A/B: load(into=) reading the entries it copies out into a few reused
staging buffers (the default) vs into a fresh buffer per run (the previous
behaviour, restored here by patching ``loader.staged_entries``); plain
``lazyckpt.load`` and the raw O_DIRECT read of the same bytes alongside. Same
file, same process, interleaved, page cache dropped before every read.

    python benchmarks/ab_staged_into.py --gib 0.75 --tensors 64 --reps 9 --dir /work/bench-restore
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
import lazyckpt.loading.loader as loader  # noqa: E402
from _common import machine_line, median_spread  # noqa: E402
from lazyckpt.cli import bench as raw  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=0.75)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-restore"))
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    if not raw.drop_caches_global():
        sys.exit("needs to drop the page cache (root)")
    state = raw.make_state(int(args.gib * (1 << 30)), args.tensors, raw.parse_dtypes("fp32,bf16"))
    nbytes = raw.state_bytes(state)
    path = os.path.join(args.dir, "ab.lzc")
    lazyckpt.save(state, path)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    staged = loader.staged_entries

    def fresh(*a):
        return set()

    def into_with(fn):
        def go():
            loader.staged_entries = fn
            try:
                lazyckpt.load(path, into=into)
            finally:
                loader.staged_entries = staged
        return go
    methods = {"raw O_DIRECT": lambda: raw.raw_read(path, nbytes, lazyckpt.Options().reader_threads),
               "load": lambda: lazyckpt.load(path),
               "load(into=) staged": into_with(staged),
               "load(into=) fresh buffers": into_with(fresh)}
    times = {k: [] for k in methods}
    names = list(methods)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            raw.drop_caches_global()
            t = time.perf_counter()
            r = methods[name]()
            times[name].append(r if isinstance(r, float) else time.perf_counter() - t)
            del r
    for k, v in state.items():
        assert torch.equal(into[k], v), k
    print(machine_line())
    print(f"{nbytes / 1e9:.3f} GB in {len(state)} tensors, {args.reps} interleaved repetitions, cold cache")
    ceiling = statistics.median(times["raw O_DIRECT"])
    for name, v in times.items():
        print(f"{name:28s} {median_spread(v)} s  {nbytes / statistics.median(v) / 1e9:.2f} GB/s  "
              f"{ceiling / statistics.median(v):.2f} of raw O_DIRECT")
    print(f"staged / fresh buffers: {statistics.median(times['load(into=) staged']) / statistics.median(times['load(into=) fresh buffers']):.2f} (time)")
    os.unlink(path)


if __name__ == "__main__":
    main()
