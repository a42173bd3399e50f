"""A/B: load(into=) filling each tensor as its entry arrives (the default)
vs after the whole file is read (the previous behaviour), same file, same
process, interleaved, page cache dropped before each load.

    python benchmarks/ab_streaming_fill.py [--gb 1.0] [--reps 10] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch

import lazyckpt
import lazyckpt.loading.loader as loader


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    n = int(a.gb * 1e9 / 4 / a.tensors)
    state = {f"t{i}": torch.randn(n) for i in range(a.tensors)}
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    streaming = loader.direct_fills
    times = {"as bytes arrive": [], "after the read": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        path = os.path.join(d, "s.lzc")
        size = lazyckpt.save(state, path)
        print(f"machine: {os.cpu_count()} cores, {platform.platform()}; torch {torch.__version__}; "
              f"{size / 1e9:.3f} GB in {a.tensors} fp32 tensors, {a.reps} interleaved reps, cold cache")
        for rep in range(a.reps):
            order = list(times) if rep % 2 == 0 else list(reversed(times))
            for mode in order:
                loader.direct_fills = streaming if mode == "as bytes arrive" else (lambda *args: {})
                drop(path)
                t0 = time.perf_counter()
                lazyckpt.load(path, into=into)
                times[mode].append(time.perf_counter() - t0)
        loader.direct_fills = streaming
    assert all(torch.equal(into[k], state[k]) for k in state)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  into= filled {k:16s} median {v:.3f} s  ({size / v / 1e9:.2f} GB/s)")
    print(f"  ratio (after / as arrive): {med['after the read'] / med['as bytes arrive']:.2f}x")


if __name__ == "__main__":
    main()
