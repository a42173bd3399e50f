"""Synchronous save/load throughput on a >= 1 GB model+AdamW-like state.

Prints, from one run (every method once per repetition, interleaved): the raw
methods on the same number of bytes -- O_DIRECT pwrite/pread from lazyckpt's
writer/reader thread counts, buffered write() + fsync / sequential read() from
one thread, and mmap (every page touched) for reads -- then lazyckpt.save/load,
torch.save/torch.load and safetensors save_file/load_file, each as seconds
(median ± half-range over --reps), GB/s, the ratio to the best raw method of
the run (the ceiling: the fastest raw write, the fastest raw read) and to
torch.save; under the table each raw method's figure and lazyckpt as a
fraction of the best raw method and of each one.

    python benchmarks/bench_core.py --gib 1 --reps 3 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
from _common import (drop_caches, fsync_file, machine_line, median_spread, print_table,  # noqa: E402
                     remove, state_bytes, time_call)
from lazyckpt.cli import bench as ceiling  # noqa: E402  (the raw methods, shared with `lazyckpt bench`)


def make_state(gib: float) -> dict:
    """Parameters (fp32) with AdamW moments (fp32) and a bf16 copy of the
    weights, plus the objects a trainer saves next to them."""
    torch.manual_seed(0)
    per_param = int(gib * (1 << 30) / (4 + 4 + 4 + 2))      # bytes per element of all copies
    shapes = []
    left = per_param
    while left > 0:
        n = min(left, random.Random(len(shapes)).choice([4 << 20, 8 << 20, 1 << 20, 3 << 20 | 4096]))
        shapes.append(n)
        left -= n
    params = {f"layers.{i}.weight": torch.randn(n) for i, n in enumerate(shapes)}
    params.update({f"layers.{i}.bias": torch.randn(1024) for i in range(len(shapes))})
    optim = {"state": {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(p),
                           "exp_avg_sq": torch.rand_like(p)} for i, p in enumerate(params.values())},
             "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                               "params": list(range(len(params)))}]}
    return {"model": params,
            "bf16": {k: v.to(torch.bfloat16) for k, v in params.items()},
            "optim": optim,
            "step": 1000, "config": {"name": "bench", "layers": len(shapes), "dropout": 0.0},
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                    "python": random.getstate()}}


def tensors_only(state: dict) -> dict:
    out = {}
    def walk(v, prefix):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{prefix}.{k}" if prefix else str(k))
        elif isinstance(v, torch.Tensor):
            out[prefix] = v
    walk(state, "")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out"))
    p.add_argument("--skip-peers", action="store_true", help="only the ceiling and lazyckpt")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = make_state(args.gib)
    nbytes = state_bytes(state)
    dropped = drop_caches()
    opts = lazyckpt.Options()
    print(machine_line())
    print(f"state: {nbytes / 1e9:.3f} GB of tensors ({len(tensors_only(state))} tensors), "
          f"reps={args.reps}, page-cache drop before loads: {'yes' if dropped else 'not permitted'}; "
          f"raw O_DIRECT with {opts.writer_threads} writer / {opts.reader_threads} reader threads")
    path = lambda name: os.path.join(args.dir, name)  # noqa: E731
    results = {}

    def record(name, kind, seconds):
        results.setdefault((name, kind), []).append(seconds)

    raw_rows = {"raw O_DIRECT": "O_DIRECT", "raw buffered": "buffered", "raw mmap": "mmap"}
    for _ in range(args.reps):
        # The ceiling: every raw method on the same number of bytes, in this repetition.
        remove(path("raw.bin"))
        record("raw O_DIRECT", "save", ceiling.raw_write(path("raw.bin"), nbytes, opts.writer_threads)[0])
        drop_caches()
        record("raw O_DIRECT", "load", ceiling.raw_read(path("raw.bin"), nbytes, opts.reader_threads))
        remove(path("raw.bin"))
        record("raw buffered", "save", ceiling.raw_write_buffered(path("raw.bin"), nbytes))
        drop_caches()
        record("raw buffered", "load", ceiling.raw_read_buffered(path("raw.bin"), nbytes))
        remove(path("raw.bin"))
        ceiling.raw_write(path("raw.bin"), nbytes, opts.writer_threads)    # untimed: a file not read before
        drop_caches()
        record("raw mmap", "load", ceiling.raw_read_mmap(path("raw.bin"), nbytes))
        remove(path("raw.bin"))

        remove(path("ckpt.lzc"))
        record("lazyckpt", "save", time_call(lambda: lazyckpt.save(state, path("ckpt.lzc"))))
        drop_caches()
        record("lazyckpt", "load", time_call(lambda: lazyckpt.load(path("ckpt.lzc"))))
        remove(path("ckpt.lzc"))

        if args.skip_peers:
            continue
        remove(path("ckpt.pt"))
        def torch_save():
            torch.save(state, path("ckpt.pt"))
            fsync_file(path("ckpt.pt"))
        record("torch.save", "save", time_call(torch_save))
        drop_caches()
        record("torch.save", "load", time_call(lambda: torch.load(path("ckpt.pt"), weights_only=False)))
        remove(path("ckpt.pt"))
        try:
            import safetensors.torch as st
        except ImportError:
            continue
        flat = tensors_only(state)
        remove(path("ckpt.safetensors"))
        def st_save():
            st.save_file(flat, path("ckpt.safetensors"))
            fsync_file(path("ckpt.safetensors"))
        record("safetensors", "save", time_call(st_save))
        drop_caches()
        record("safetensors", "load", time_call(lambda: st.load_file(path("ckpt.safetensors"))))
        remove(path("ckpt.safetensors"))

    med = {k: statistics.median(v) for k, v in results.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    write = {short: gbps[(name, "save")] for name, short in raw_rows.items() if (name, "save") in gbps}
    read = {short: gbps[(name, "load")] for name, short in raw_rows.items() if (name, "load") in gbps}
    best_write, best_read = ceiling.best_raw(write)[1], ceiling.best_raw(read)[1]
    rows = []
    for name in dict.fromkeys(n for n, _ in results):
        row = [name]
        if (name, "save") in med:
            s = med[(name, "save")]
            row += [median_spread(results[(name, "save")]), f"{gbps[(name, 'save')]:.2f}",
                    f"{gbps[(name, 'save')] / best_write:.0%}",
                    f"{med[('torch.save', 'save')] / s:.2f}x" if ("torch.save", "save") in med else "-"]
        else:
            row += ["-", "-", "-", "-"]
        row += [median_spread(results[(name, "load")]), f"{gbps[(name, 'load')]:.2f}",
                f"{gbps[(name, 'load')] / best_read:.0%}"]
        rows.append(row)
    print_table(["method", "save s", "save GB/s", "of best raw write", "speed vs torch.save",
                 "load s", "load GB/s", "of best raw read"], rows)
    for line in ceiling.ceiling_lines(write, read):
        print(line)
    print(ceiling.fraction_line("lazyckpt", gbps[("lazyckpt", "save")], gbps[("lazyckpt", "load")], write, read))
    peers = [n for n in dict.fromkeys(n for n, _ in results) if n not in raw_rows and n != "lazyckpt"]
    for what, kind in (("save", "save"), ("load", "load")):
        if peers:
            best = max(peers, key=lambda n: gbps[(n, kind)])
            print(f"fastest peer, {what}: {best} {gbps[(best, kind)]:.2f} GB/s; lazyckpt "
                  f"{gbps[('lazyckpt', kind)] / gbps[(best, kind)]:.2f}x")


if __name__ == "__main__":
    main()
