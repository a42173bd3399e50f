"""Files the frameworks read, through the engine: synchronous save time of one
flat dict of tensors (model-like: fp32 weights and AdamW moments, bf16 copies)
written as

* torch.save (+ fsync) and safetensors.torch.save_file (+ fsync): the peers;
* lazyckpt.save with file_format "lazyckpt", "torch" and "safetensors";
* the raw methods on the same number of bytes: O_DIRECT pwrite from the
  writer thread count, and buffered write() + fsync from one thread.

Every method once per repetition, interleaved; medians (± half-range) of
--reps, ratios to the best raw write and to torch.save. Then: what the
torch zip's CRC-32 costs (zlib.crc32 over the same bytes on one thread, and
lazyckpt torch vs safetensors format, which differ by the CRC and the
pickle), and the time AsyncFileWriter.save() blocks the caller per format.

    python benchmarks/bench_file_formats.py --gib 1 --reps 3 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import zlib

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
from _common import fsync_file, machine_line, median_spread, print_table, remove, time_call  # noqa: E402
from bench_core import make_state, tensors_only  # noqa: E402
from lazyckpt.cli import bench as ceiling  # noqa: E402
from lazyckpt.integrations._async import AsyncFileWriter  # noqa: E402

FORMATS = ("lazyckpt", "torch", "safetensors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out"))
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    import safetensors.torch as st
    state = tensors_only(make_state(args.gib))
    # safetensors holds no tied tensors and no scalars' shared storages: all distinct here.
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    opts = lazyckpt.Options()
    print(machine_line())
    print(f"state: {nbytes / 1e9:.3f} GB in {len(state)} tensors (flat dict), reps={args.reps}, "
          f"raw O_DIRECT with {opts.writer_threads} writer threads")
    path = lambda name: os.path.join(args.dir, name)  # noqa: E731
    results = {}

    def record(name, seconds):
        results.setdefault(name, []).append(seconds)

    def peer(fn, target):
        def run():
            fn(target)
            fsync_file(target)
        return run

    for _ in range(args.reps):
        remove(path("raw.bin"))
        record("raw O_DIRECT", ceiling.raw_write(path("raw.bin"), nbytes, opts.writer_threads)[0])
        remove(path("raw.bin"))
        record("raw buffered", ceiling.raw_write_buffered(path("raw.bin"), nbytes))
        remove(path("raw.bin"))
        record("torch.save", time_call(peer(lambda f: torch.save(state, f), path("peer.pt"))))
        remove(path("peer.pt"))
        record("safetensors save_file", time_call(peer(lambda f: st.save_file(state, f), path("peer.st"))))
        remove(path("peer.st"))
        for fmt in FORMATS:
            record(f"lazyckpt {fmt}", time_call(lambda: lazyckpt.save(state, path(f"l.{fmt}"), file_format=fmt)))
            remove(path(f"l.{fmt}"))
        # The CRC-32 the torch zip needs, on one thread over the same bytes.
        t = time.perf_counter()
        for v in state.values():
            zlib.crc32(v.reshape(-1).view(torch.uint8).numpy())
        record("zlib.crc32, 1 thread (no I/O)", time.perf_counter() - t)

    # Blocking time of the async writer's save() (pickle / header planning on the caller's thread).
    blocking = {}
    writer = AsyncFileWriter()
    try:
        for _ in range(args.reps):
            for fmt in FORMATS:
                t = time.perf_counter()
                h = writer.save(state, path(f"a.{fmt}"), file_format=fmt)
                blocking.setdefault(fmt, []).append(time.perf_counter() - t)
                h.wait()
                remove(path(f"a.{fmt}"))
    finally:
        writer.close()

    med = {k: statistics.median(v) for k, v in results.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    best_raw = max(gbps["raw O_DIRECT"], gbps["raw buffered"])
    rows = [[name, median_spread(results[name]), f"{gbps[name]:.2f}", f"{gbps[name] / best_raw:.0%}",
             f"{med['torch.save'] / med[name]:.2f}x"] for name in results]
    print_table(["method", "save s", "GB/s", "of best raw write", "speed vs torch.save"], rows)
    print(f"lazyckpt torch / torch.save: {med['torch.save'] / med['lazyckpt torch']:.2f}x faster; "
          f"lazyckpt safetensors / save_file: "
          f"{med['safetensors save_file'] / med['lazyckpt safetensors']:.2f}x faster")
    print(f"torch zip (CRC-32 + pickle) vs safetensors layout through the engine: "
          f"+{med['lazyckpt torch'] - med['lazyckpt safetensors']:.3f} s "
          f"({med['lazyckpt torch'] / med['lazyckpt safetensors'] - 1:+.0%}); "
          f"vs lazyckpt layout (xxh3): {med['lazyckpt torch'] / med['lazyckpt lazyckpt'] - 1:+.0%}")
    print("AsyncFileWriter.save() blocking, ms (median ± half-range): " + ", ".join(
        f"{fmt} {median_spread([b * 1e3 for b in blocking[fmt]])}" for fmt in FORMATS))


if __name__ == "__main__":
    main()
