"""Peak host memory of checkpointing a state 4x larger than lazyckpt's host cache.

Each case runs in a fresh subprocess (so peaks never mix). The child builds a
state of --gib GiB of fp32 tensors in place (no temporaries), imports every
module it will use, then records its baseline RSS (VmRSS) and resets the peak
(VmHWM, via /proc/self/clear_refs; where that is refused the peak is taken from
a 1 ms sampler thread instead). It then does --saves checkpoints, waiting for
each, and reports the peak RSS increase over the baseline (VmHWM - baseline),
its ratio to the host cache size (host_cache_bytes = state/4), and the RSS
still held after the saves (and after Checkpointer.close()).

Cases:
    lazyckpt.Checkpointer  many tensors, each smaller than the cache
    lazyckpt.Checkpointer  ONE tensor holding the whole state (4x the cache)
    lazyckpt.save          the synchronous functional API, same cache size
    torch.save (+fsync)    many tensors / one tensor, for contrast
    dcp.async_save         default stager (a full CPU copy), for contrast

Expected for lazyckpt: extra ~= cache (ratio ~1.0), whatever the tensor sizes.

Full size, from the repository root:

    cd /work/main && .venv/bin/python benchmarks/bench_memory.py --gib 1 --saves 3 \\
        --dir ./bench-out/memory --json bench-out/memory.json

Tiny smoke run (< 60 s):

    cd /work/main && .venv/bin/python benchmarks/bench_memory.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = {
    "lazy_many": ("lazyckpt.Checkpointer", "many"),
    "lazy_one": ("lazyckpt.Checkpointer", "one"),
    "lazy_save_many": ("lazyckpt.save", "many"),
    "torch_many": ("torch.save", "many"),
    "torch_one": ("torch.save", "one"),
    "dcp_async_many": ("dcp.async_save", "many"),
}


# ----------------------------------------------------------------------------- child

def proc_status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Fallback peak tracker where clear_refs is refused."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, proc_status()["VmRSS"])
            time.sleep(0.001)


def build_state(total: int, layout: str, cache: int) -> Dict[str, Any]:
    import torch
    torch.manual_seed(0)
    n_elems = total // 4
    if layout == "one":
        return {"blob": torch.empty(n_elems).uniform_()}
    # Tensor sizes cycle through cache/4, cache/16, cache/64 bytes: all smaller than the cache.
    sizes, left, k = [], n_elems, 0
    cycle = [max(1, cache // 16), max(1, cache // 64), max(1, cache // 256)]
    while left > 0:
        n = min(left, cycle[k % 3])
        sizes.append(n)
        left -= n
        k += 1
    return {"model": {f"t{i}": torch.empty(n).uniform_() for i, n in enumerate(sizes)}, "step": 7}


def child(args) -> None:
    import gc
    import shutil

    import torch
    sys.path.insert(0, HERE)
    import lazyckpt
    import lazyckpt.saving.writer  # noqa: F401
    from _common import fsync_file
    method, layout = CASES[args.child]
    if method == "dcp.async_save":
        import warnings
        warnings.filterwarnings("ignore")
        import torch.distributed.checkpoint as dcp
    total = int(args.gib * (1 << 30))
    cache = total // 4 // 4096 * 4096
    state = build_state(total, layout, cache)
    nbytes = sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)) \
        if layout == "one" else sum(t.numel() * 4 for t in state["model"].values())
    largest = max(t.numel() * 4 for t in (state.values() if layout == "one" else state["model"].values())
                  if isinstance(t, torch.Tensor))
    directory = os.path.join(args.dir, args.child)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    gc.collect()
    base = proc_status()["VmRSS"]
    exact = reset_peak()
    sampler = None
    if not exact:
        sampler = Sampler()
        sampler.start()
    times = []
    after_close = None
    if method == "lazyckpt.Checkpointer":
        ckpt = lazyckpt.Checkpointer(directory, keep=1, host_cache_bytes=cache)
        for i in range(args.saves):
            t = time.perf_counter()
            ckpt.save(state, step=i).wait()
            times.append(time.perf_counter() - t)
        after = proc_status()["VmRSS"]
        ckpt.close()
        gc.collect()
        after_close = proc_status()["VmRSS"]
    elif method == "lazyckpt.save":
        for i in range(args.saves):
            t = time.perf_counter()
            lazyckpt.save(state, os.path.join(directory, "ckpt.lzc"), host_cache_bytes=cache)
            times.append(time.perf_counter() - t)
        after = proc_status()["VmRSS"]
    elif method == "torch.save":
        for i in range(args.saves):
            path = os.path.join(directory, "ckpt.pt")
            t = time.perf_counter()
            torch.save(state, path)
            fsync_file(path)
            times.append(time.perf_counter() - t)
        after = proc_status()["VmRSS"]
    else:
        for i in range(args.saves):
            path = os.path.join(directory, f"step_{i}")
            t = time.perf_counter()
            dcp.async_save(state, checkpoint_id=path, no_dist=True).result()
            times.append(time.perf_counter() - t)
            if i:
                shutil.rmtree(os.path.join(directory, f"step_{i - 1}"), ignore_errors=True)
        gc.collect()
        after = proc_status()["VmRSS"]
    if sampler is not None:
        sampler.stop.set()
        sampler.join()
        peak = sampler.peak
    else:
        peak = proc_status()["VmHWM"]
    shutil.rmtree(directory, ignore_errors=True)
    print("RESULT " + json.dumps({
        "case": args.child, "method": method, "layout": layout, "state_bytes": nbytes,
        "largest_tensor": largest, "cache_bytes": cache if method.startswith("lazyckpt") else None,
        "baseline_rss": base, "peak_rss": peak, "peak_extra": peak - base,
        "after_extra": after - base, "after_close_extra": None if after_close is None else after_close - base,
        "peak_exact": exact, "save_s": times}), flush=True)


# ----------------------------------------------------------------------------- parent

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (the cache is a quarter)")
    p.add_argument("--saves", type=int, default=3, help="saves per case (each waited for)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out", "memory"))
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="tiny smoke run: 64 MiB state, 2 saves")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.gib, args.saves = 1 / 16, 2
    if args.child:
        child(args)
        return
    sys.path.insert(0, HERE)
    from _common import emit_json, machine_line, print_table
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"unknown cases {bad}; choose from {list(CASES)}")
    os.makedirs(args.dir, exist_ok=True)
    print(machine_line())
    results: List[Dict[str, Any]] = []
    for case in cases:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--gib", str(args.gib),
               "--saves", str(args.saves), "--dir", args.dir]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"[{case}] FAILED (rc {proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
            results.append({"case": case, "error": proc.stderr[-2000:]})
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
        r = results[-1]
        print(f"[{case}] peak extra {r['peak_extra'] / 2**20:.1f} MiB", flush=True)

    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["case"], "error"] + ["-"] * 8)
            continue
        cache = r["cache_bytes"]
        rows.append([r["method"], r["layout"], mib(r["state_bytes"]), mib(r["largest_tensor"]),
                     mib(cache), mib(r["peak_extra"]),
                     f"{r['peak_extra'] / cache:.2f}" if cache else f"({r['peak_extra'] / r['state_bytes']:.2f} of state)",
                     mib(r["after_extra"]), mib(r["after_close_extra"]),
                     f"{sum(r['save_s']) / len(r['save_s']):.2f}"])
    print()
    print_table(["method", "tensors", "state MiB", "largest tensor MiB", "cache MiB", "peak extra RSS MiB",
                 "extra/cache", "extra after saves MiB", "after close() MiB", "s/save"], rows)
    if any(not r.get("peak_exact", True) for r in results):
        print("note: /proc/self/clear_refs refused: peaks from a 1 ms RSS sampler (may miss short spikes)")
    emit_json({"machine": machine_line(), "gib": args.gib, "saves": args.saves, "results": results}, args.json)


if __name__ == "__main__":
    main()
