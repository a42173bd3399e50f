"""The crash-point program of Megatron-Core's save strategy
(``lazyckpt.integrations.megatron.LazySaveStrategy``), for tests/_crashpoints.py.

One rank (a world-size-1 gloo group, initialized in each forked child), not the
2-rank tensor-parallel GPTModel of tests/test_megatron.py: a GPTModel and a
2-rank job per crash point and per check would cost seconds each. The state is
a small sharded state dict of ``ShardedTensor`` objects, as Megatron's own
dist_checkpointing tests build it, saved with Megatron's
``dist_checkpointing.save`` through ``LazySaveStrategy`` with
``async_sharded_save=True``; the returned ``AsyncRequest`` runs and finalizes
(``execute_sync``: its wait, then the finalize that commits ``.metadata``,
then Megatron's ``metadata.json``).

Before the operation ``iter1`` is saved and committed; the operation saves
``iter2``. After a crash (``_check``): ``iter1`` loads with plain Megatron
(its own ``TorchDistLoadShardedStrategy``, no lazyckpt) bit-exact; ``iter2``
either loads bit-exact with its own values or plain Megatron refuses it as no
checkpoint (the directory absent, or without ``metadata.json``: before the
finalize it holds no ``.metadata`` either; between the ``.metadata`` rename
and Megatron's ``metadata.json`` it holds ``.metadata`` only, and Megatron
refuses it too); any other error is a violation. Once the finalize returned,
``iter2`` must load. Then saving ``iter2`` again works.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List

from _crashpoints import KNOBS, Ctx, Interceptor, Program, World, differs

SHAPES = {"embedding.weight": (8, 16), "layer.weight": (16, 16), "layer.bias": (16,), "head.weight": (4, 16)}


def values(seed: int) -> Dict[str, Any]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*shape, generator=g) for k, shape in SHAPES.items()}


def sharded(tensors: Dict[str, Any]) -> Dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedTensor
    return {k: ShardedTensor.from_rank_offsets(k, v, replica_id=0) for k, v in tensors.items()}


def _init() -> None:
    """This child's world-size-1 gloo group and the CPU shims (in the child only)."""
    import torch.distributed as dist
    from _megatron import cpu_shims
    cpu_shims()
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _save(path: str, tensors: Dict[str, Any]) -> None:
    from megatron.core import dist_checkpointing
    from lazyckpt.integrations.megatron import LazySaveStrategy
    os.makedirs(path, exist_ok=True)
    strategy = LazySaveStrategy(lazyckpt={k: KNOBS[k] for k in ("writer_threads", "o_direct", "chunk_bytes")})
    try:
        request = dist_checkpointing.save(sharded(tensors), path, strategy, async_sharded_save=True,
                                          async_strategy="mcore")
        request.execute_sync()
    finally:
        strategy.close()


def _load(path: str) -> Dict[str, Any]:
    """Plain Megatron's load (its own ``TorchDistLoadShardedStrategy``, no lazyckpt)."""
    import torch
    from megatron.core import dist_checkpointing
    return dist_checkpointing.load(sharded({k: torch.zeros(s) for k, s in SHAPES.items()}), path)


def refused_as_no_checkpoint(exc: BaseException) -> bool:
    """Whether plain Megatron's load refused a directory as no checkpoint (absent,
    or without ``metadata.json``)."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    return isinstance(exc, CheckpointingException) and (
        "is not a distributed checkpoint" in str(exc) or "does not exist" in str(exc))


#: For the error mode (tests/_crasherrors.py): the same save and plain load.
save, load = _save, _load


def _check(ctx: Ctx, program: Program) -> List[str]:
    _init()
    problems: List[str] = []
    # The last world's iter2: the operation's save, or (error mode) the next save after it.
    old, new = values(1), program.worlds[-1].allowed[2]
    try:
        bad = differs(old, _load(os.path.join(ctx.case, "iter1")))
        if bad:
            problems.append(f"iter1 (committed before the operation) loads other values: {bad}")
    except Exception as exc:
        problems.append(f"iter1: plain Megatron's load: {type(exc).__name__}: {exc}")
    iter2 = os.path.join(ctx.case, "iter2")
    try:
        bad = differs(new, _load(iter2))
        if bad:
            problems.append(f"iter2 loads with plain Megatron, but other values: {bad}")
    except Exception as exc:
        refused = refused_as_no_checkpoint(exc)
        if len(program.worlds) == 1:            # the finalize returned: it must be there
            problems.append(f"iter2: the finalize returned, then it is gone: {type(exc).__name__}: {exc}")
        elif not refused:
            problems.append(f"iter2: neither loaded whole nor refused as no checkpoint: {type(exc).__name__}: {exc}")
        elif os.path.exists(os.path.join(iter2, "metadata.json")):
            problems.append(f"iter2 holds metadata.json, yet plain Megatron refuses it: {exc}")
    try:
        values_again = values(999)
        _save(iter2, values_again)
        bad = differs(values_again, _load(iter2))
        if bad:
            problems.append(f"restart: saving iter2 again, then loading it, differs: {bad}")
    except Exception as exc:
        problems.append(f"restart: {type(exc).__name__}: {exc}")
    return problems


def _prepare(ctx: Ctx) -> None:
    _init()
    _save(os.path.join(ctx.case, "iter1"), values(1))


def _run(ctx: Ctx, icp: Interceptor) -> None:
    _init()
    tensors = values(2)
    with icp.operation():
        _save(os.path.join(ctx.case, "iter2"), tensors)


def _preload() -> None:
    from _megatron import allow_typing_override, stub_triton_kernels
    stub_triton_kernels()
    allow_typing_override()
    import megatron.core.dist_checkpointing  # noqa: F401
    from megatron.core.dist_checkpointing.strategies import torch as _strategies  # noqa: F401
    import lazyckpt.integrations.megatron  # noqa: F401


def megatron_program() -> Program:
    """Megatron's ``dist_checkpointing.save`` through ``LazySaveStrategy``, async, then finalized."""
    old, new = values(1), values(2)
    program = Program("megatron-lazyckpt", _prepare, _run, [World("old", 1, {1: old}), World("new", 2, {2: new})],
                      kind="megatron", preload=_preload)
    program.kwargs = {"check": _check}
    return program
