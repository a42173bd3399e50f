"""DeepSpeed (ZeRO stage 2, CPU accelerator, gloo) with lazyckpt's checkpoint engine.

``lazyckpt.integrations.deepspeed.enable(engine)`` swaps the engine's
checkpoint engine: ``engine.save_checkpoint`` returns before the data is
durable (the bytes are copied while training goes on), DeepSpeed's own files
and ``latest`` tag appear once committed, and a fresh engine's
``load_checkpoint`` resumes with the same losses as the run that never stopped.

    DS_ACCELERATOR=cpu python examples/deepspeed_example.py            # one rank
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_example.py
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import launch  # noqa: E402

import lazyckpt.integrations.deepspeed as lds  # noqa: E402

CHECKPOINTS = os.path.join(tempfile.gettempdir(), f"lazyckpt-deepspeed-example-{os.getppid()}")


def build(seed: int):
    # DeepSpeed's CPU accelerator would compile a shared-memory all-reduce op on first use
    # (minutes); gloo alone is enough here.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    lds.enable(engine, host_cache_bytes="16M")          # the one line lazyckpt needs
    return engine


def train(engine, steps, rank):
    losses = []
    for step in steps:
        torch.manual_seed(100 * step + rank)
        loss = engine(torch.randn(4, 16)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def main(rank: int, world: int) -> None:
    deepspeed.utils.logger.setLevel(logging.WARNING)
    engine = build(seed=0)
    train(engine, range(1, 4), rank)
    engine.save_checkpoint(CHECKPOINTS, tag="step3")     # returns before the data is durable
    reference = train(engine, range(4, 7), rank)         # training goes on
    lds.wait(engine)                                     # every save committed

    fresh = build(seed=123)                              # other weights: they must be replaced
    path, _ = fresh.load_checkpoint(CHECKPOINTS)         # DeepSpeed's own load, the `latest` tag
    resumed = train(fresh, range(4, 7), rank)
    lds.wait(fresh)
    same = torch.tensor(int(resumed == reference))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    dist.barrier()                                       # every rank done with the files
    if rank == 0:
        print("tag:", open(os.path.join(CHECKPOINTS, "latest")).read(), "files:",
              sorted(os.listdir(os.path.join(CHECKPOINTS, "step3"))))
        if not same.item():
            raise SystemExit(f"losses after resuming differ: {resumed} != {reference}")
        print(f"restored step 3 on {world} rank(s) bit-exact: the losses after resuming equal the "
              f"uninterrupted run's {['%.6f' % x for x in reference]}")
        shutil.rmtree(CHECKPOINTS)


if __name__ == "__main__":
    launch(main, world=1)
