"""Helpers shared by the benchmark scripts: raw O_DIRECT ceilings, cache
dropping, timing and table printing. Benchmarks print ratios measured in the
same run, because absolute figures on this machine drift between runs."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch

CHUNK = 32 << 20


def drop_caches() -> bool:
    """Drop the page cache so loads read from disk; False where not permitted."""
    from lazyckpt.cli.bench import drop_caches_global   # one implementation, shared with `lazyckpt bench`
    return drop_caches_global()


def remove(path: str) -> None:
    if os.path.isdir(path):
        import shutil
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)
    os.sync()   # let block freeing/discard finish outside the timed region


def raw_write(path: str, nbytes: int, threads: int = 4) -> float:
    """Seconds to write ``nbytes`` with O_DIRECT from an aligned buffer, fsynced: the ceiling."""
    from lazyckpt.cli.bench import raw_write as measure     # one implementation, shared with `lazyckpt bench`
    return measure(path, nbytes, threads)[0]


def raw_read(path: str, nbytes: int, threads: int = 2) -> float:
    """Seconds to read ``nbytes`` with O_DIRECT into fresh aligned memory: the ceiling."""
    from lazyckpt.cli.bench import raw_read as measure
    return measure(path, nbytes, threads)


def emit_json(blob: dict, path: str = None, **dumps_kwargs) -> None:
    """Print the results as one ``JSON {...}`` line, and write them to ``path`` if given."""
    line = json.dumps(blob, **dumps_kwargs)
    print("JSON " + line)
    if path:
        with open(path, "w") as f:
            f.write(line + "\n")


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def median_spread(values: List[float]) -> str:
    med = statistics.median(values)
    return f"{med:.3f}" + (f" ±{(max(values) - min(values)) / 2:.3f}" if len(values) > 1 else "")


def time_call(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def machine_line() -> str:
    return (f"machine: {platform.node()} {os.cpu_count()} cores, Linux {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def print_table(headers: List[str], rows: List[List[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def state_bytes(state: Dict) -> int:
    total = 0
    stack = [state]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def restore_state_args(description: str, reps: int):
    """The arguments of the restore A/B scripts (``--gib --tensors --reps
    --dir``), parsed; the directory made. Returns (args, state, nbytes): the
    state of fp32 and bf16 tensors the issue-38 benchmarks use."""
    import argparse
    from lazyckpt.cli import bench as raw
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--gib", type=float, default=0.75)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-restore"))
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = raw.make_state(int(args.gib * (1 << 30)), args.tensors, raw.parse_dtypes("fp32,bf16"))
    return args, state, raw.state_bytes(state)


def print_against(times: Dict[str, List[float]], ceiling: str, nbytes: int, width: int = 34) -> None:
    """One line per method: median with half-range, GB/s, and the fraction of
    ``ceiling``'s median (the raw method of the same run)."""
    top = statistics.median(times[ceiling])
    for name, v in times.items():
        print(f"{name:{width}s} {median_spread(v)} s  {nbytes / statistics.median(v) / 1e9:.2f} GB/s  "
              f"{top / statistics.median(v):.2f} of {ceiling}")
