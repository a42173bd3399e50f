"""Run ``main(rank, world)`` on every rank: under ``torchrun`` as it starts
the processes, or, when the script is run with plain ``python``, on ``world``
gloo ranks this helper starts on this machine (CPU, loopback)."""

from __future__ import annotations

import os
import socket


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, main) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        main(rank, world)
    finally:
        dist.destroy_process_group()


def launch(main, world: int = 2) -> None:
    """``main(rank, world)`` on each rank; returns once every rank returned (raises if one failed)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:          # torchrun started us
        _rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
              int(os.environ.get("MASTER_PORT", "29500")), main)
        return
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(world, _free_port(), main), nprocs=world)
