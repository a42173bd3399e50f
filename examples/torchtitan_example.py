"""torchtitan's CheckpointManager with lazyckpt's writer, on 2 gloo ranks with FSDP2.

In a torchtitan run this is one flag (the job's checkpoint config, every field
kept, becomes lazyckpt's)::

    torchrun ... -m torchtitan.train --override.imports lazyckpt.integrations.torchtitan.lazy_checkpoint

This script builds the same manager directly and runs torchtitan's own save,
purge (``keep_latest_k``) and load code: the checkpoints are DCP's layout,
written through lazyckpt's engine, and the resumed losses equal those of the
run that never stopped.

    python examples/torchtitan_example.py                          # starts 2 ranks itself
    torchrun --nproc_per_node 2 examples/torchtitan_example.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import launch  # noqa: E402

from lazyckpt.integrations.torchtitan import LazyCheckpointManager  # noqa: E402

FOLDER = os.path.join(tempfile.gettempdir(), f"lazyckpt-torchtitan-example-{os.getppid()}")


class Optimizers:
    """What torchtitan's OptimizersContainer gives the checkpointer: a Stateful
    over DCP's (FQN-keyed, sharded) optimizer state dict."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, sd):
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=sd)


class Nothing:
    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def build(world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    config = LazyCheckpointManager.Config(enable=True, async_mode="async_with_pinned_mem", folder="checkpoint",
                                          interval=1, keep_latest_k=2, lazyckpt={"host_cache_bytes": 8 << 20})
    manager = config.build(dataloader=None, model_parts=[model], optimizers=Optimizers(model, optimizer),
                           lr_schedulers=Nothing(), states={}, sd_adapter=None, base_folder=FOLDER)
    return model, optimizer, manager


def step(model, optimizer, manager, i, rank):
    """torchtitan's train_step order: forward/backward, wait for staging, optimizer step."""
    torch.manual_seed(100 * i + rank)
    loss = model(torch.randn(4, 16)).square().mean()
    loss.backward()
    manager.maybe_wait_for_staging()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main(rank: int, world: int) -> None:
    model, optimizer, manager = build(world)
    for i in range(1, 5):
        step(model, optimizer, manager, i, rank)
        manager.save(curr_step=i)                     # torchtitan's own save: staging, write, purge
    manager.maybe_wait_for_saving()
    reference = [step(model, optimizer, manager, i, rank) for i in range(5, 8)]
    manager.close()

    model, optimizer, manager = build(world)          # a restarted job
    assert manager.load(step=-1)                      # torchtitan's own load of the latest step
    resumed = [step(model, optimizer, manager, i, rank) for i in range(5, 8)]
    manager.close()
    same = torch.tensor(int(resumed == reference))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print("kept:", sorted(os.listdir(os.path.join(FOLDER, "checkpoint"))))
        if not same.item():
            raise SystemExit(f"losses after resuming differ: {resumed} != {reference}")
        print(f"restored step 4 on {world} ranks bit-exact: the losses after resuming equal the "
              f"uninterrupted run's {['%.6f' % x for x in reference]}")
        shutil.rmtree(FOLDER)


if __name__ == "__main__":
    launch(main, world=2)
