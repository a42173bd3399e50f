"""How long ``Checkpointer.save()`` blocks the caller, by number of tensors.

Builds a transformer-like model (many small vectors, some large matrices),
steps AdamW once (so its state holds exp_avg, exp_avg_sq and a step tensor per
parameter) and saves ``{"model": model.state_dict(), "optim":
opt.state_dict(), "step": i, "rng": torch.get_rng_state()}`` -- a fresh
state_dict() per save, as a training loop does -- ``--saves`` times, waiting
for each save to commit before the next (so the queue never blocks). Prints
per size: the first save's blocking time, the median and p90 of the others
(``handle.blocking_s`` and the wall time of the call) with the plan cache
(lazyckpt/state/plancache.py) and without it (a full walk per save), interleaved in the
same run, their ratio, and the time of ``flatten()`` alone on the same state.

    python benchmarks/bench_blocking.py                       # 100, 1000, 5000 tensors
    python benchmarks/bench_blocking.py --tensors 1000 --saves 50 --profile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
from lazyckpt.state.providers import flatten  # noqa: E402

from _common import emit_json, machine_line  # noqa: E402


def make_model(tensors: int) -> torch.nn.Module:
    """About ``tensors`` tensors in model + AdamW state (4 per parameter:
    the parameter, exp_avg, exp_avg_sq, step): per block two LayerNorms (4
    small vectors), attention and MLP (4 matrices, 4 bias vectors)."""
    d = 64
    params = max(1, tensors // 4)
    blocks = max(1, round((params - 2) / 12))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.fc1, self.fc2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

        def forward(self, x):
            q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
            x = x + self.proj(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)
            return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4096, d)          # the large one
            self.blocks = torch.nn.Sequential(*[Block() for _ in range(blocks)])
            self.norm = torch.nn.LayerNorm(d)

        def forward(self, idx):
            return self.norm(self.blocks(self.embed(idx)))

    torch.manual_seed(0)
    return Net()


def make_training(tensors: int):
    model = make_model(tensors)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 4096, (2, 8))).sum().backward()
    opt.step()
    return model, opt


def state_of(model, opt, i: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": i, "rng": torch.get_rng_state()}


def count_tensors(state) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_tensors(v) for v in state)
    return 0


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def measure(tensors: int, saves: int, root: str, profile: bool) -> dict:
    """Saves with the plan cache on and off, interleaved (the same machine noise for both)."""
    model, opt = make_training(tensors)
    n = count_tensors(state_of(model, opt, 0))
    flat_s = []
    for i in range(max(saves, 20)):
        state = state_of(model, opt, i)
        t0 = time.perf_counter()
        flatten(state)
        flat_s.append(time.perf_counter() - t0)
    modes = ("cached", "walk")
    blocking = {m: [] for m in modes}
    wall = {m: [] for m in modes}
    dirs = {m: tempfile.mkdtemp(prefix=f"bench_blocking_{m}_", dir=root) for m in modes}
    profiler = cProfile.Profile() if profile else None
    ckpts = {m: lazyckpt.Checkpointer(dirs[m], keep=2) for m in modes}
    plans = getattr(ckpts["walk"], "_plans", None)
    if plans is not None:
        plans.enabled = False           # the full walk at every save, as before plans
    try:
        for i in range(saves + 1):
            for m in modes:
                state = state_of(model, opt, i)
                if profiler is not None and i and m == "cached":
                    profiler.enable()
                t0 = time.perf_counter()
                h = ckpts[m].save(state, step=i)
                wall[m].append(time.perf_counter() - t0)
                profiler is not None and profiler.disable()
                blocking[m].append(h.blocking_s)
                h.wait()
        hits = getattr(getattr(ckpts["cached"], "_plans", None), "hits", None)
    finally:
        for m in modes:
            ckpts[m].close()
            shutil.rmtree(dirs[m], ignore_errors=True)
    if profiler is not None:
        print(f"--- cProfile of {saves} save() calls, {n} tensors ---")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    row = {"tensors": n, "plan_hits": hits,
           "flatten_median_ms": statistics.median(flat_s) * 1e3, "flatten_p90_ms": pct(flat_s, 0.9) * 1e3}
    for m in modes:
        rest_b, rest_w = blocking[m][1:], wall[m][1:]
        row[m] = {"first_ms": blocking[m][0] * 1e3,
                  "blocking_median_ms": statistics.median(rest_b) * 1e3, "blocking_p90_ms": pct(rest_b, 0.9) * 1e3,
                  "wall_median_ms": statistics.median(rest_w) * 1e3, "wall_p90_ms": pct(rest_w, 0.9) * 1e3}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000, 5000],
                    help="approximate tensors in the state (model + AdamW)")
    ap.add_argument("--saves", type=int, default=20, help="saves per size after the first")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--profile", action="store_true", help="cProfile the save() calls")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = [measure(t, args.saves, args.dir, args.profile) for t in args.tensors]
    print(f"{'tensors':>8} {'mode':>7} {'first':>7} {'blocking med/p90 ms':>20} {'call med/p90 ms':>17} "
          f"{'walk/cached':>11} {'flatten() med/p90 ms':>21}")
    for r in rows:
        for m in ("walk", "cached"):
            x = r[m]
            ratio = r["walk"]["blocking_median_ms"] / x["blocking_median_ms"]
            extra = f"{r['flatten_median_ms']:>10.2f} / {r['flatten_p90_ms']:<8.2f}" if m == "walk" else ""
            print(f"{r['tensors']:>8} {m:>7} {x['first_ms']:>7.2f} {x['blocking_median_ms']:>9.2f} / "
                  f"{x['blocking_p90_ms']:<8.2f} {x['wall_median_ms']:>7.2f} / {x['wall_p90_ms']:<7.2f} "
                  f"{ratio:>10.2f}x {extra}")
    print("cached: save() with the plan of the previous save (lazyckpt/state/plancache.py); walk: the plan cache off "
          "(a full flatten() per save); first: the first save's blocking time (no plan yet)")
    emit_json({"bench": "blocking", "rows": rows}, args.json)


if __name__ == "__main__":
    main()
