"""Frameworks' own checkpointing versus lazyckpt through the adapters, same
model, same run, 2 gloo processes on this machine:

* DeepSpeed ZeRO-2: ``engine.save_checkpoint`` with DeepSpeed's default engine
  (torch.save) versus ``lazyckpt.integrations.deepspeed.enable(engine)``.
* DCP with FSDP2: ``dcp.save`` / ``dcp.async_save`` with FileSystemWriter versus
  LazyStorageWriter, and ``dcp.load`` with FileSystemReader versus
  LazyStorageReader.

For each: blocking time of the save call, time until durable, load time with
the page cache dropped (median over --reps, max over the ranks).

    DS_ACCELERATOR=cpu python benchmarks/bench_integrations.py --mib 256 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from _common import machine_line, print_table  # noqa: E402
from _dist import run_ranks  # noqa: E402


def _model(mib: int):
    import torch
    # Square layers of width w: 4*w*w bytes each; enough layers for ~mib MiB of fp32 parameters.
    width = 1024
    layers = max(1, (mib << 20) // (4 * width * width))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _sync(path: str) -> None:
    """fsync every file under path (torch.save and DCP's FileSystemWriter may leave data in the cache)."""
    for root, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _cold(rank: int) -> None:
    """Loads read from the disk: the buffered writers' files would otherwise be
    read back from the page cache, lazyckpt's (written with O_DIRECT) would not."""
    import torch.distributed as dist
    from _common import drop_caches
    if rank == 0:
        drop_caches()
    dist.barrier()


def _deepspeed(rank, world, directory, mib, reps, lazy):
    import logging

    import deepspeed
    import importlib
    import torch
    import torch.distributed as dist
    # `import deepspeed.comm.torch as m` would bind the real torch (deepspeed.comm imports it).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None       # skip a minutes-long JIT build we do not need
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = _model(mib)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}, "steps_per_print": 10 ** 6}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    if lazy:
        import lazyckpt.integrations.deepspeed as lds
        lds.enable(engine)
    out = {"blocking": [], "durable": [], "load": []}
    for rep in range(reps):
        loss = engine(torch.randn(2, 1024)).square().mean()
        engine.backward(loss)
        engine.step()
        dist.barrier()
        tag = f"rep{rep}"
        t0 = time.perf_counter()
        engine.save_checkpoint(directory, tag=tag)
        out["blocking"].append(time.perf_counter() - t0)
        if lazy:
            lds.wait(engine)
        else:
            _sync(os.path.join(directory, tag))
        dist.barrier()
        out["durable"].append(time.perf_counter() - t0)
        _cold(rank)
        t0 = time.perf_counter()
        engine.load_checkpoint(directory, tag=tag)
        dist.barrier()
        out["load"].append(time.perf_counter() - t0)
        if rank == 0:
            shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
        dist.barrier()
    if lazy:
        engine.checkpoint_engine.close()
    return out


def _dcp(rank, world, directory, mib, reps, mode):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
    mesh = init_device_mesh("cpu", (world,))
    model = _model(mib)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lazy, use_async = mode.startswith("lazy"), mode.endswith("async")
    writer = LazyStorageWriter(directory) if lazy else None
    out = {"blocking": [], "durable": [], "load": []}
    for rep in range(reps):
        model(torch.randn(2, 1024)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        path = os.path.join(directory, f"rep{rep}")
        dist.barrier()
        if lazy:
            writer.reset(path)
        else:
            writer = dcp.FileSystemWriter(path)
        t0 = time.perf_counter()
        if use_async:
            response = dcp.async_save(state, storage_writer=writer)
            out["blocking"].append(time.perf_counter() - t0)
            future = getattr(response, "upload_completion", response)
            future.result()
        else:
            dcp.save(state, storage_writer=writer)
            out["blocking"].append(time.perf_counter() - t0)
        if not lazy:
            _sync(path)
        dist.barrier()
        out["durable"].append(time.perf_counter() - t0)
        _cold(rank)
        t0 = time.perf_counter()
        reader = LazyStorageReader(path) if lazy else dcp.FileSystemReader(path)
        dcp.load(state, storage_reader=reader)
        dist.barrier()
        out["load"].append(time.perf_counter() - t0)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    if lazy:
        writer.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="parameter MiB (the checkpoint is ~3x with AdamW)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=os.path.join(os.getcwd(), "bench-out", "integrations"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(machine_line())
    print(f"2 gloo processes, {args.mib} MiB of fp32 parameters + AdamW; reps={args.reps}; "
          f"figures: median over reps of the slowest rank")
    results = {}
    cases = [("DeepSpeed ZeRO-2", "torch.save engine (default)", _deepspeed, False),
             ("DeepSpeed ZeRO-2", "lazyckpt engine", _deepspeed, True),
             ("DCP + FSDP2", "dcp.save FileSystemWriter", _dcp, "fs"),
             ("DCP + FSDP2", "dcp.save LazyStorageWriter", _dcp, "lazy"),
             ("DCP + FSDP2", "dcp.async_save FileSystemWriter", _dcp, "fs-async"),
             ("DCP + FSDP2", "dcp.async_save LazyStorageWriter", _dcp, "lazy-async")]
    rows = []
    for framework, name, fn, mode in cases:
        directory = os.path.join(args.dir, name.replace(" ", "_"))
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory, exist_ok=True)
        try:
            per_rank = run_ranks(2, fn, directory, args.mib, args.reps, mode, timeout=1800)
        except Exception as exc:     # a framework that does not run here is reported, not fatal
            rows.append([framework, name, "failed", "", "", str(exc).splitlines()[0][:60]])
            continue
        fig = {k: statistics.median(max(r[k][i] for r in per_rank) for i in range(args.reps))
               for k in ("blocking", "durable", "load")}
        results[f"{framework} / {name}"] = fig
        rows.append([framework, name, f"{fig['blocking']:.3f}", f"{fig['durable']:.3f}", f"{fig['load']:.3f}", ""])
        shutil.rmtree(directory, ignore_errors=True)
    print_table(["framework", "checkpointing", "save call blocks s", "durable after s", "load s", "note"], rows)
    for framework, base, lazy in (("DeepSpeed ZeRO-2", "torch.save engine (default)", "lazyckpt engine"),
                                  ("DCP + FSDP2", "dcp.async_save FileSystemWriter", "dcp.async_save LazyStorageWriter"),
                                  ("DCP + FSDP2", "dcp.save FileSystemWriter", "dcp.save LazyStorageWriter")):
        a, b = results.get(f"{framework} / {base}"), results.get(f"{framework} / {lazy}")
        if a and b:
            print(f"{framework}: {lazy} vs {base}: save call {a['blocking'] / b['blocking']:.1f}x shorter, "
                  f"durable {a['durable'] / b['durable']:.2f}x sooner, load {a['load'] / b['load']:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
