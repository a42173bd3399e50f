"""How many small reads to keep in flight: the measurement behind
``lazyckpt.loading.reader.SMALL_READ_BYTES`` and ``SMALL_READ_DEPTH``.

Raw O_DIRECT reads of every other block of one file (a ``keys=`` selection
leaves such holes), for several block sizes, with 4 and with 16 reads in
flight, each against a sequential read of the whole file (4 threads, 32 MiB
pieces) per byte. Then ``lazyckpt.load(keys=half)`` of a file of many
tensors with small runs read deeper (the default) and with every run at the
readers' depth (``SMALL_READ_BYTES = 0``), per byte of the whole file, against
the same sequential read. Every method once per repetition, in a new shuffled
order each time, the page cache dropped before each; medians of the
repetitions; every ratio divides two medians of the same run.

    python benchmarks/bench_read_depth.py --gib 0.5 --tensors 2000 --reps 9
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import drop_caches, machine_line, print_table  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt.cli import bench as raw  # noqa: E402
from lazyckpt.loading import reader  # noqa: E402
from lazyckpt.sizes import parse_size  # noqa: E402

MiB = 1 << 20


def read_every_other(path: str, size: int, block: int, threads: int) -> int:
    """O_DIRECT reads of blocks 0, 2, 4, ... of ``path``, ``threads`` at a time; bytes read."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offsets = list(range(0, size - block + 1, 2 * block))
        buf = mmap.mmap(-1, len(offsets) * block)
        view = memoryview(buf)

        def one(k: int) -> None:
            os.preadv(fd, [view[k * block:(k + 1) * block]], offsets[k])
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(offsets))))
        view.release()
        buf.close()
        return len(offsets) * block
    finally:
        os.close(fd)


def read_all(path: str, size: int, threads: int = 4, piece: int = 32 * MiB) -> int:
    """O_DIRECT reads of the whole file in ``piece`` s, ``threads`` at a time (the sequential baseline)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, -(-size // 4096) * 4096)
        view = memoryview(buf)

        def one(offset: int) -> None:
            n = -(-min(piece, size - offset) // 4096) * 4096
            os.preadv(fd, [view[offset:offset + n]], offset)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, piece)))
        view.release()
        buf.close()
        return size
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--tensors", type=int, default=2000, help="tensors of the lazyckpt file (keys=half)")
    ap.add_argument("--blocks", default="64K,264K,1M,4M", help="block sizes of the raw reads")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--dir", default="bench-read-depth")
    args = ap.parse_args()
    if not drop_caches():
        sys.exit("bench_read_depth needs to drop the page cache (root)")
    os.makedirs(args.dir, exist_ok=True)
    size = int(args.gib * 2 ** 30) // (4 * MiB) * (4 * MiB)
    state = raw.make_state(size, args.tensors, raw.parse_dtypes("fp32,bf16"))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw_path, lzc = os.path.join(args.dir, "raw.bin"), os.path.join(args.dir, "state.lzc")
    with open(raw_path, "wb") as f:
        for t in state.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.truncate(size)
    lazyckpt.save(state, lzc)
    half = sorted(state)[::2]
    half_bytes = sum(state[k].numel() * state[k].element_size() for k in half)
    del state

    def keys(small_read_bytes: int) -> Callable[[], float]:
        def run() -> float:
            reader.SMALL_READ_BYTES, before = small_read_bytes, reader.SMALL_READ_BYTES
            try:
                t = time.perf_counter()
                lazyckpt.load(lzc, keys=half)
                return (time.perf_counter() - t) / half_bytes        # seconds per byte read
            finally:
                reader.SMALL_READ_BYTES = before
        return run

    def timed(fn: Callable[[], int]) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            n = fn()
            return (time.perf_counter() - t) / n
        return run

    methods: Dict[str, Callable[[], float]] = {"sequential, 4 x 32 MiB": timed(lambda: read_all(raw_path, size))}
    for spec in filter(None, args.blocks.split(",")):
        block = parse_size(spec, "--blocks")
        for depth in (4, 16):
            methods[f"every other {spec}, {depth} in flight"] = timed(
                lambda b=block, d=depth: read_every_other(raw_path, size, b, d))
    methods[f"keys=half of {args.tensors} tensors, small runs deeper"] = keys(reader.SMALL_READ_BYTES)
    methods[f"keys=half of {args.tensors} tensors, all at 4"] = keys(0)
    per_byte: Dict[str, List[float]] = {name: [] for name in methods}
    for rep in range(args.reps):
        order = list(methods)
        random.Random(rep).shuffle(order)
        for name in order:
            drop_caches()
            per_byte[name].append(methods[name]())
        print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr)
    print(machine_line())
    print(f"{nbytes / 1e9:.3f} GB in {args.tensors} tensors; raw file {size / 1e9:.3f} GB; {args.reps} shuffled "
          f"repetitions, page cache dropped before each; load average {os.getloadavg()[0]:.1f} at the end")
    base = statistics.median(per_byte["sequential, 4 x 32 MiB"])
    rows = []
    for name, values in per_byte.items():
        m = statistics.median(values)
        rows.append([name, f"{1 / m / 1e9:.2f}", f"{base / m:.2f}"])
    print_table(["reads", "GB/s (median)", "per byte, of the sequential read"], rows)


if __name__ == "__main__":
    main()
