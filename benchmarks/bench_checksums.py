"""Checksum candidates alone against memcpy, on this machine: which hash keeps
up with a fast disk's reads, on how many threads, at which block size.

Every candidate hashes (or copies) a buffer larger than the CPU caches, cut
into blocks of one size, as a load verifies the blocks that O_DIRECT reads
just put in memory (cold in cache). On 1 thread and on 2 (each thread takes
every other block). Every (candidate, block size, threads) cell runs once per
repetition, the cells in a new seeded-shuffled order each repetition; each
figure is the median GB/s with its half-range, and each ratio divides two
medians of the same run (memcpy with the same block size and threads).

Then each hash over data in cache (the rate a hash of a block just read,
still in cache, could reach), and the GIL probe: the main thread's longest
pause while a second thread is inside one call of the hash, of the call's
length (held throughout: ~1; calls shorter than a thread's wake-up cannot
tell, so the sizes probed are large). xxhash >= 4.0 releases it in its one-shot
functions above 64 KiB, xxhash 3.x never does there, only in ``update()``.)

    python benchmarks/bench_checksums.py --mib 512 --reps 7
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import threading
import time
import zlib
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_line, median_spread, print_table  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = [64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]


def candidates() -> Dict[str, Callable[[memoryview], object]]:
    """name -> a function of one block (those whose package is installed).
    google-crc32c is not among them: its ``value`` takes only ``bytes``
    (a memoryview of a read buffer is refused), so it would need a copy of
    every block first."""
    import xxhash
    out: Dict[str, Callable] = {
        "xxh3_64": xxhash.xxh3_64_intdigest,
        "xxh3_128": xxhash.xxh3_128_intdigest,
        "crc32 (zlib)": zlib.crc32,
    }
    try:
        import crc32c
        out["crc32c (crc32c)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        from isal import isal_zlib
        out["crc32 (isal)"] = isal_zlib.crc32
    except ImportError:
        pass
    return out


def copies(src: np.ndarray, dst: np.ndarray) -> Dict[str, Callable[[int, int], None]]:
    """memcpy of bytes [a, b) of ``src`` into ``dst``, by numpy and by torch."""
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    return {
        "memcpy (numpy copyto)": lambda a, b: np.copyto(dst[a:b], src[a:b]),
        "memcpy (torch copy_)": lambda a, b: tdst[a:b].copy_(tsrc[a:b]),
    }


def run_cell(fn: Callable[[int, int], object], total: int, block: int, threads: int,
             pool: cf.ThreadPoolExecutor) -> float:
    """Seconds for ``fn`` over every block of [0, total) on ``threads`` threads."""
    spans = [(a, min(total, a + block)) for a in range(0, total, block)]

    def part(k: int) -> None:
        for a, b in spans[k::threads]:
            fn(a, b)
    t = time.perf_counter()
    if threads == 1:
        part(0)
    else:
        list(pool.map(part, range(threads)))
    return time.perf_counter() - t


def gil_probe(fn: Callable[[memoryview], object], buf: memoryview, block: int, trials: int = 15) -> float:
    """How much of one ``block``-sized call of ``fn`` on a second thread the
    main thread spent unable to run: its longest pause inside the call, of
    the call's length (the median of ``trials`` calls). Near 1: the GIL held
    throughout; well below: released (down to a thread's wake-up, which on a
    busy 2-core VM is hundreds of us: a short call cannot tell)."""
    shares = []
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)             # the main thread asks for the GIL at once
    try:
        for _ in range(trials):
            window: List[float] = []
            done = threading.Event()

            def one_call() -> None:
                t0 = time.perf_counter()
                fn(buf[:block])
                window.extend((t0, time.perf_counter()))
                done.set()
            ticks = []
            worker = threading.Thread(target=one_call)
            worker.start()
            while not done.is_set():
                ticks.append(time.perf_counter())
            worker.join()
            inside = [window[0]] + [t for t in ticks if window[0] < t < window[1]] + [window[1]]
            shares.append(max(b - a for a, b in zip(inside, inside[1:])) / (window[1] - window[0]))
    finally:
        sys.setswitchinterval(old)
    return statistics.median(shares)


def in_cache(fn: Callable[[memoryview], object], buf: memoryview, block: int, seconds: float = 0.2) -> float:
    """GB/s of ``fn`` over the same ``block`` bytes again and again (in cache)."""
    view, n = buf[:block], 0
    fn(view)
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        for _ in range(10):
            fn(view)
        n += 10
    return n * block / (time.perf_counter() - t) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="bytes hashed per cell (larger than the caches)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--blocks", default=",".join(str(b // KiB) for b in BLOCKS), help="block sizes in KiB")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    total = args.mib * MiB
    blocks = [int(x) * KiB for x in args.blocks.split(",")]
    src = np.frombuffer(np.random.default_rng(0).bytes(total), dtype=np.uint8).copy()
    dst = np.zeros_like(src)                    # faulted in before any clock
    view = memoryview(src)
    methods: Dict[str, Callable[[int, int], object]] = dict(copies(src, dst))
    hashes = candidates()
    for name, h in hashes.items():
        methods[name] = (lambda h: lambda a, b: h(view[a:b]))(h)
    cells: List[Tuple[str, int, int]] = [(m, b, t) for m in methods for b in blocks for t in (1, 2)]
    times: Dict[Tuple[str, int, int], List[float]] = {}
    print(machine_line())
    print(f"{total / MiB:.0f} MiB per cell (random bytes), {args.reps} interleaved repetitions; blocks "
          f"{', '.join(f'{b // KiB} KiB' for b in blocks)}; 1 and 2 threads")
    with cf.ThreadPoolExecutor(2) as pool:
        for m in methods:                       # warm: imports, first calls, page faults
            run_cell(methods[m], total, blocks[-1], 2, pool)
        for rep in range(args.reps):
            order = list(cells)
            random.Random(rep).shuffle(order)
            for cell in order:
                m, b, t = cell
                times.setdefault(cell, []).append(run_cell(methods[m], total, b, t, pool))
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)

    med = {c: statistics.median(v) for c, v in times.items()}
    gbps = {c: total / v / 1e9 for c, v in med.items()}
    base = "memcpy (numpy copyto)"
    rows = []
    for m in methods:
        for t in (1, 2):
            row = [m, str(t)]
            for b in blocks:
                row.append(f"{gbps[(m, b, t)]:.1f} ({gbps[(m, b, t)] / gbps[(base, b, t)]:.2f})")
            rows.append(row)
    print("\nGB/s (of numpy memcpy, same block size and threads), medians:")
    print_table(["method", "threads"] + [f"{b // KiB} KiB" for b in blocks], rows)
    print("\nspread (median ±half-range, s) at the largest block:")
    print_table(["method", "1 thread", "2 threads"],
                [[m, median_spread(times[(m, blocks[-1], 1)]), median_spread(times[(m, blocks[-1], 2)])]
                 for m in methods])
    print("\n2 threads / 1 thread:")
    print_table(["method"] + [f"{b // KiB} KiB" for b in blocks],
                [[m] + [f"{gbps[(m, b, 2)] / gbps[(m, b, 1)]:.2f}" for b in blocks] for m in methods])

    cached = {m: in_cache(h, view, 1 * MiB) for m, h in hashes.items()}
    print("\nover data in cache (the same 1 MiB again and again), GB/s: "
          + ", ".join(f"{m} {v:.1f}" for m, v in cached.items()))
    import hashlib
    import xxhash
    probe_sizes = [4 * MiB, 16 * MiB, 64 * MiB]
    controls = {"control: hashlib.sha256 (releases it)": lambda v: hashlib.sha256(v).digest(),
                "control: sum(range(n)) in C (holds it)": lambda v: sum(range(len(v) // 16))}
    probe = {m: [gil_probe(h, view, s) for s in probe_sizes] for m, h in {**hashes, **controls}.items()}
    print(f"\nGIL probe (xxhash {xxhash.VERSION}): the share of single calls on a second thread during which "
          "the main thread's longest pause inside one call on a second thread, of the call (~1: the GIL held; "
          "well below: released):")
    print_table(["hash"] + [f"{s // MiB} MiB" for s in probe_sizes],
                [[m] + [f"{x:.2f}" for x in probe[m]] for m in probe])
    summary = {"bytes": total, "reps": args.reps, "gbps": {f"{m}|{b}|{t}": v for (m, b, t), v in gbps.items()},
               "in_cache_gbps": cached,
               "gil_probe": {m: dict(zip(map(str, probe_sizes), v)) for m, v in probe.items()}}
    print("JSON " + json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
