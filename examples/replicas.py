"""Replicas on partner nodes: a node that lost its local disk restores from a partner.

Two gloo ranks play two nodes of one rank each, each with its own node-local
directory. ``replicas=lazyckpt.Replicas(1, node_size=1)``: every committed
rank file is also sent, in the background, to the same local rank on the next
node. The script deletes node 1's directory (a replaced machine), and a
restarted job's ``ckpt.load()`` streams node 1's files back from node 0's
replica, verified block by block.

    python examples/replicas.py                        # starts 2 ranks itself
    torchrun --nproc_per_node 2 examples/replicas.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import launch  # noqa: E402

import lazyckpt  # noqa: E402

BASE = os.path.join(tempfile.gettempdir(), f"lazyckpt-replicas-example-{os.getppid()}")


def node_dir(rank: int) -> str:
    return os.path.join(BASE, f"node{rank}")             # node-local: NVMe or /dev/shm in a real job


def checkpointer(rank: int) -> lazyckpt.Checkpointer:
    return lazyckpt.Checkpointer(node_dir(rank), keep=2, replicas=lazyckpt.Replicas(1, node_size=1),
                                 distributed=lazyckpt.Distributed(commit_timeout="60s"))


def state_of(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {"model": {"w": torch.randn(256, 64, generator=g)}, "rank": rank, "step": step}


def main(rank: int, world: int) -> None:
    with checkpointer(rank) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_of(rank, step), step=step).wait()
        ckpt.wait()                                       # committed locally and replicated
        print(f"rank {rank}: {ckpt.replica_stats()['holds']} held for its partner")

    dist.barrier()
    if rank == 1:
        shutil.rmtree(node_dir(1))                        # node 1 is replaced: its disk is empty
    dist.barrier()

    with checkpointer(rank) as ckpt:                      # the restarted job
        state = ckpt.load()                               # collective: the newest step every node can get
        tier = ckpt.loaded_from["tier"]
    expected = state_of(rank, 3)
    ok = state["step"] == 3 and torch.equal(state["model"]["w"], expected["model"]["w"])
    print(f"rank {rank}: loaded step {state['step']} from the {tier} tier")
    good = torch.tensor(int(ok and tier == ("replica" if rank == 1 else "local")))
    dist.all_reduce(good, op=dist.ReduceOp.MIN)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(BASE)
        if not good.item():
            raise SystemExit("a rank did not restore step 3 from the tier expected")
        print("restored step 3 bit-exact on both nodes: node 1 from its partner's replica")


if __name__ == "__main__":
    launch(main, world=2)
