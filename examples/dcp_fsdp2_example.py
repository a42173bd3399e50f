"""torch.distributed.checkpoint with FSDP2, written and read by lazyckpt.

Two gloo ranks on CPU shard a small MLP with ``fully_shard``; ``dcp.async_save``
through ``LazyStorageWriter`` returns as soon as the state is staged (the bytes
are copied while the next steps run), a fresh model with other weights loads
it through ``LazyStorageReader``, and its next losses equal those of the run
that never stopped.

    python examples/dcp_fsdp2_example.py                          # starts 2 ranks itself
    torchrun --nproc_per_node 2 examples/dcp_fsdp2_example.py     # or let torchrun start them
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import launch  # noqa: E402

from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter  # noqa: E402

CHECKPOINT = os.path.join(tempfile.gettempdir(), f"lazyckpt-dcp-example-{os.getppid()}", "step3")


def build(seed: int, world: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)                        # parameters are DTensors, one shard per rank
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def train(model, optimizer, steps, rank):
    losses = []
    for step in steps:
        torch.manual_seed(100 * step + rank)             # this rank's batch of this step
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main(rank: int, world: int) -> None:
    model, optimizer = build(seed=0, world=world)
    train(model, optimizer, range(1, 4), rank)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    writer = LazyStorageWriter(CHECKPOINT)
    writer.attach(optimizer)            # optimizer.step() waits for the staging copy, no longer
    # The save's collectives run on a thread while training runs its own: a group of their own.
    save_group = dist.new_group(backend="gloo")
    response = dcp.async_save({"model": model_sd, "optim": optim_sd}, storage_writer=writer,
                              process_group=save_group)
    reference = train(model, optimizer, range(4, 7), rank)   # training goes on meanwhile
    response.upload_completion.result()                       # committed: .metadata written last
    writer.close()

    fresh, fresh_optimizer = build(seed=123, world=world)     # other weights: they must be replaced
    model_sd, optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=LazyStorageReader(CHECKPOINT))
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = train(fresh, fresh_optimizer, range(4, 7), rank)
    same = torch.tensor(int(resumed == reference))
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    dist.barrier()                                       # every rank done with the files
    if rank == 0:
        print("files:", sorted(os.listdir(CHECKPOINT)))
        if not same.item():
            raise SystemExit(f"losses after resuming differ: {resumed} != {reference}")
        print(f"restored step 3 on {world} ranks bit-exact: the losses after resuming equal the "
              f"uninterrupted run's {['%.6f' % x for x in reference]}")
        shutil.rmtree(os.path.dirname(CHECKPOINT))


if __name__ == "__main__":
    launch(main, world=2)
