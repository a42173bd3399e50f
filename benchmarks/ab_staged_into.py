"""A/B: load(into=) reading the entries it copies out into a few reused
staging buffers (the default) vs into a fresh buffer per run (the previous
behaviour, restored here by patching ``loader.staged_entries``); plain
``lazyckpt.load`` and the raw O_DIRECT read of the same bytes alongside. Same
file, same process, interleaved, page cache dropped before every read.

    python benchmarks/ab_staged_into.py --gib 0.75 --tensors 64 --reps 9 --dir /work/bench-restore
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
import lazyckpt.loading.loader as loader  # noqa: E402
from _common import machine_line, print_against, restore_state_args  # noqa: E402
from lazyckpt.cli import bench as raw  # noqa: E402


def main() -> None:
    args, state, nbytes = restore_state_args(__doc__.splitlines()[0], reps=9)
    if not raw.drop_caches_global():
        sys.exit("needs to drop the page cache (root)")
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
    print_against(times, "raw O_DIRECT", nbytes, width=28)
    print(f"staged / fresh buffers: {statistics.median(times['load(into=) staged']) / statistics.median(times['load(into=) fresh buffers']):.2f} (time)")
    os.unlink(path)


if __name__ == "__main__":
    main()
