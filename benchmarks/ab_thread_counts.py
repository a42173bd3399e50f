"""A/B: lazyckpt's reader and writer thread counts (4, the default, against
8), beside the raw O_DIRECT read and write at the same counts. Same file,
same process, shuffled order every repetition (seeded), page cache dropped
before every read, saves durable before the clock stops. Answers whether
more requests in flight would follow the disk better than the default.

    python benchmarks/ab_thread_counts.py --gib 0.75 --tensors 64 --reps 9 --dir /work/bench-restore
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
from _common import machine_line, median_spread, restore_state_args  # noqa: E402
from lazyckpt.cli import bench as raw  # noqa: E402

COUNTS = (4, 8)


def main() -> None:
    args, state, nbytes = restore_state_args(__doc__.splitlines()[0], reps=9)
    if not raw.drop_caches_global():
        sys.exit("needs to drop the page cache (root)")
    path = lambda name: os.path.join(args.dir, name)  # noqa: E731
    lazyckpt.save(state, path("threads.lzc"))
    raw.raw_write(path("threads.bin"), nbytes, 4)
    into = {k: torch.empty_like(v) for k, v in state.items()}

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def write_fresh(name, fn):
        raw.remove(path(name))
        os.sync()
        return fn()
    methods = {}
    for n in COUNTS:
        methods[f"raw O_DIRECT read, {n} threads"] = lambda n=n: raw.raw_read(path("threads.bin"), nbytes, n)
        methods[f"load, {n} readers"] = lambda n=n: timed(lambda: lazyckpt.load(path("threads.lzc"), reader_threads=n))
        methods[f"load(into=), {n} readers"] = lambda n=n: timed(
            lambda: lazyckpt.load(path("threads.lzc"), into=into, reader_threads=n))
        methods[f"raw O_DIRECT write, {n} threads"] = lambda n=n: write_fresh(
            "w.bin", lambda: raw.raw_write(path("w.bin"), nbytes, n)[0])
        methods[f"save, {n} writers"] = lambda n=n: write_fresh(
            "s.lzc", lambda: timed(lambda: lazyckpt.save(state, path("s.lzc"), writer_threads=n)))
    for fn in methods.values():         # each Options' pools and cache made before the clock
        fn()
    times = {k: [] for k in methods}
    for rep in range(args.reps):
        names = list(methods)
        random.Random(rep).shuffle(names)
        for name in names:
            if "read" in name or "load" in name:
                raw.drop_caches_global()
            times[name].append(methods[name]())
    print(machine_line())
    print(f"{nbytes / 1e9:.3f} GB in {len(state)} tensors, {args.reps} shuffled repetitions")
    for name, v in times.items():
        print(f"{name:34s} {median_spread(v)} s  {nbytes / statistics.median(v) / 1e9:.2f} GB/s")
    a, b = COUNTS
    for kind in ("raw O_DIRECT read, {} threads", "load, {} readers", "load(into=), {} readers",
                 "raw O_DIRECT write, {} threads", "save, {} writers"):
        pairs = [x / y for x, y in zip(times[kind.format(b)], times[kind.format(a)])]
        print(f"{kind.format(b)} / {a}: {statistics.median(pairs):.3f} (time, median of paired ratios)")
    for name in ("threads.lzc", "threads.bin", "w.bin", "s.lzc"):
        raw.remove(path(name))


if __name__ == "__main__":
    main()
