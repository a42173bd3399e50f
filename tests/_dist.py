"""Run a function in N gloo ranks (spawned processes) on this machine.

``run_ranks(n, fn, *args)`` starts ``n`` processes with a fresh free port,
initializes a gloo process group in each, calls ``fn(rank, world, *args)``
and returns the list of results. Any failure or timeout kills every child
(no orphans) and raises with the child's traceback.

Ranks are forked from a fork server that imported torch and lazyckpt once
(``PRELOAD``): a new interpreter per rank spent 2-3 s of both cores importing
torch, and the suite starts ranks a few hundred times. Every rank is still a
new process of its own (nothing a test does outlives it), forked from one that
never ran a torch operation or started a thread; it takes the environment and
working directory of the test that started it (``_child`` sets them), not the
fork server's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable, List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Imported once by the fork server, so that no rank imports them again.
PRELOAD = ["torch", "torch.distributed", "numpy", "boto3", "lazyckpt", "_dist"]


def rank_context() -> Any:
    """The multiprocessing context ranks start from: the fork server above."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple,
           env: dict, cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"{rank}.pkl")
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        value = fn(rank, world, *args)
        payload = ("ok", value)
    except BaseException:
        payload = ("error", traceback.format_exc())
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(result_path + ".tmp", result_path)
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 120.0,
              allow_failure: bool = False) -> List[Any]:
    """Results by rank. With ``allow_failure`` a rank that died or raised gives
    ``("died", exitcode)`` or ``("error", traceback)`` instead of raising."""
    ctx = rank_context()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_child, args=(r, world, port, out_dir, fn, args, env, cwd), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(timeout)
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            if hung:
                raise TimeoutError(f"ranks {hung} still running after {timeout} s")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for r, p in enumerate(procs):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                if allow_failure:
                    results.append(("died", p.exitcode))
                    continue
                raise RuntimeError(f"rank {r} died with exit code {p.exitcode}")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                if allow_failure:
                    results.append(("error", value))
                    continue
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value if not allow_failure else ("ok", value))
        return results


def fsdp_model(world: int, hidden: int, out: int):
    """A small MLP sharded with FSDP2 (fully_shard) on a CPU mesh, and AdamW."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def full_state(sd: dict) -> dict:
    """Every DTensor gathered into a full tensor (others cloned), for comparisons."""
    from torch.distributed.tensor import DTensor
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone()) for k, v in sd.items()}
