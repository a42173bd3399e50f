"""Megatron-Core's own dist_checkpointing saves versus lazyckpt's LazySaveStrategy,
side by side on one tiny GPTModel (tensor parallel 2, 2 gloo ranks, CPU):

* ``megatron-sync``: ``dist_checkpointing.save(sd, dir)`` (TorchDistSaveShardedStrategy).
* ``megatron-async``: the same with ``async_sharded_save=True`` on Megatron's
  ``AsyncCallsQueue`` (``async_strategy="mcore"``: nvidia-resiliency-ext does
  not install here); the write runs in a forked process.
* ``lazyckpt-sync`` / ``lazyckpt-async``: the same calls with ``LazySaveStrategy``.
* ``raw O_DIRECT`` / ``raw buffered``: each rank's model bytes written to one
  file with ``lazyckpt bench``'s raw methods (aligned O_DIRECT pwrites from
  lazyckpt's writer thread count, or plain write() calls), fsynced, both ranks
  at once: the ceiling for "save to committed" on this disk (no training step
  is timed after them).

Each repetition, modes interleaved: a save at the start of an iteration, then
``--steps`` training steps (forward, backward, optimizer step); Megatron's
queue is polled after every step (``maybe_finalize_async_calls(blocking=False)``,
as megatron.training does) and drained after the last. Printed per mode
(medians over repetitions, max over the ranks): the blocking time of the save
call (async: save() + schedule), the first step after it (where a pending copy
or a background write slows training), the time until committed, and the
step time without a save measured in the same run.

    DS_ACCELERATOR=cpu python benchmarks/bench_megatron.py --hidden 512 --layers 4 --reps 5

CPU shims (tests/_megatron.py): Triton's MoE kernels stubbed, torch.cuda's
synchronize/current_device on the CPU; the forward's dropout RNG fork is a
no-op (Megatron forks a CUDA RNG state; dropout is 0 here).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from _common import machine_line, print_table  # noqa: E402
from _dist import run_ranks  # noqa: E402
from _megatron import stub_triton_kernels  # noqa: E402

MODES = ["megatron-sync", "megatron-async", "lazyckpt-sync", "lazyckpt-async"]
RAW = ["raw O_DIRECT", "raw buffered"]


def _rank(rank, world, root, hidden, layers, vocab, seq, batch, steps, reps):
    import contextlib

    from _megatron import cpu_shims, init_tp, make_dir, tiny_gpt
    cpu_shims()
    init_tp(2)
    import torch
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from lazyckpt.cli import bench as raw
    from lazyckpt.integrations.megatron import LazySaveStrategy
    from lazyckpt.knobs import resolve
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model = tiny_gpt(layers=layers, hidden=hidden, vocab=vocab, max_seq=seq)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (batch, seq))
    positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(ids, positions, mask, labels=ids).float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    lazy = LazySaveStrategy()
    queue = AsyncCallsQueue()
    for _ in range(2):
        step()                  # warm up (and Adam's state exists: it is saved too)
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()
                      if isinstance(t, torch.Tensor))
    results = {m: {"blocking": [], "first_step": [], "committed": []} for m in MODES}
    raw_writes = {m: [] for m in RAW}
    writer_threads = resolve(None).writer_threads
    plain_steps = []
    # Repetition -1 warms up (Megatron's results queue starts a manager process at its first
    # save, lazyckpt sizes its buffers) and is not counted.
    for rep in range(-1, reps):
        if rep >= 0:
            plain_steps.append(step())
        for mode in MODES:
            path = f"{root}/{mode}/{rep + 1}"
            make_dir(path)
            strategy = lazy if mode.startswith("lazyckpt") else None
            # The model's sharded state (Megatron saves the optimizer's through its own
            # wrapper, which needs CUDA): what both sides write here.
            sd = model.sharded_state_dict()
            torch.distributed.barrier()
            t0 = time.perf_counter()
            if mode.endswith("async"):
                request = dist_checkpointing.save(sd, path, strategy, async_sharded_save=True,
                                                  async_strategy="mcore")
                queue.schedule_async_request(request)
            else:
                dist_checkpointing.save(sd, path, strategy)
            blocking = time.perf_counter() - t0
            first = None
            for _ in range(steps):
                s = step()
                first = s if first is None else first
                queue.maybe_finalize_async_calls(blocking=False)
            queue.maybe_finalize_async_calls(blocking=True)
            committed = time.perf_counter() - t0
            r = results[mode] if rep >= 0 else {"blocking": [], "first_step": [], "committed": []}
            r["blocking"].append(blocking)
            r["first_step"].append(first)
            r["committed"].append(committed)
            torch.distributed.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        for mode in RAW:
            path = f"{root}/raw-{rank}.bin"
            torch.distributed.barrier()
            if mode == "raw O_DIRECT":
                seconds, _ = raw.raw_write(path, state_bytes, writer_threads)
            else:
                seconds = raw.raw_write_buffered(path, state_bytes)
            if rep >= 0:
                raw_writes[mode].append(seconds)
            raw.remove(path)
    lazy.close()
    return {"results": results, "raw": raw_writes, "plain_step": plain_steps, "state_bytes": state_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="training steps after each save")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    stub_triton_kernels()
    root = tempfile.mkdtemp(prefix="bench-megatron-", dir=args.dir)
    try:
        out = run_ranks(2, _rank, root, args.hidden, args.layers, args.vocab, args.seq, args.batch,
                        args.steps, args.reps, timeout=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    plain = med([max(o["plain_step"][i] for o in out) for i in range(args.reps)])
    print(machine_line())
    print(f"GPTModel tensor parallel 2: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{sum(o['state_bytes'] for o in out) / 2**20:.1f} MiB of model tensors saved over 2 ranks; "
          f"step (Adam) without a save {plain * 1e3:.0f} ms; median of {args.reps}, max over 2 ranks")
    rows, record = [], {}
    for mode in MODES:
        per = {k: med([max(o["results"][mode][k][i] for o in out) for i in range(args.reps)])
               for k in ("blocking", "first_step", "committed")}
        record[mode] = per
        rows.append([mode, f"{per['blocking'] * 1e3:.0f}", f"{per['first_step'] * 1e3:.0f}",
                     f"{(per['first_step'] - plain) * 1e3:+.0f}", f"{per['committed'] * 1e3:.0f}"])
    for mode in RAW:
        record[mode] = {"committed": med([max(o["raw"][mode][i] for o in out) for i in range(args.reps)])}
    best = min(RAW, key=lambda m: record[m]["committed"])
    for mode in RAW:
        rows.append([mode, "-", "-", "-", f"{record[mode]['committed'] * 1e3:.0f}"])
    print_table(["mode", "blocking ms", "first step ms", "vs plain step", "save to committed ms"], rows)
    print(f"best raw write: {best} {record[best]['committed'] * 1e3:.0f} ms; save to committed of the best raw "
          "write: " + ", ".join(f"{m} {record[m]['committed'] / record[best]['committed']:.1f}x" for m in MODES))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain_step": plain, "modes": record, "best_raw_write": best, "args": vars(args)}, f,
                      indent=1)


if __name__ == "__main__":
    main()
