"""The crash-point program of DeepSpeed's checkpoint engine
(``lazyckpt.integrations.deepspeed.LazyCheckpointEngine``), for tests/_crashpoints.py
and tests/_crasherrors.py.

The smallest real DeepSpeed save: one rank (a world-size-1 gloo group, made in
each forked child), ``deepspeed.initialize`` of a two-layer model with ZeRO
stage 1 (so a tag has two part files: ``mp_rank_00_model_states.pt`` and
``zero_pp_rank_0_mp_rank_00_optim_states.pt``, each renamed into place and its
directory fsynced, ``TagCommit.part_done``), lazyckpt's engine enabled with the
harness's knobs. Before the operation tag ``step1`` (weights of seed 1) is
saved and committed (``latest`` names it); the operation saves tag ``step2``
(weights of seed 2) with ``engine.save_checkpoint`` and waits for it
(``lazyckpt.integrations.deepspeed.wait``), which raises what the save raised.

After a crash (``_check``, in a fresh process): ``latest`` names ``step1`` or
``step2`` (``step2`` only once the operation returned, the program's one world
then); the tag it names holds DeepSpeed's files, read by ``torch.load`` (the
way DeepSpeed's own engine and ``zero_to_fp32`` read them) with that tag's
module weights bit-exact; ``step1``'s weights are still whole. Then a restart: a
fresh engine (other initial weights) ``load_checkpoint``s the directory and gets
the weights of the tag ``latest`` names, saves tag ``step3`` and waits: ``latest``
names it and it holds those weights.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, List, Optional

from _crashpoints import KNOBS, Ctx, Interceptor, Program, World, differs

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _model(seed: int) -> Any:
    import torch
    with torch.random.fork_rng(devices=[]):          # the caller's generator untouched (the test module's import)
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def values(seed: int) -> Dict[str, Any]:
    """The module weights a tag saved from an engine made with ``seed`` holds."""
    return {k: v.detach().clone() for k, v in _model(seed).state_dict().items()}


def _init() -> None:
    """This child's world-size-1 gloo group (in the child only)."""
    import importlib

    import torch.distributed as dist
    # DeepSpeed's CPU accelerator would JIT-compile a shared-memory all-reduce (minutes): gloo is enough.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def engine(seed: int) -> Any:
    """A DeepSpeed engine (ZeRO 1, AdamW) on the weights of ``seed``, saving through lazyckpt."""
    import deepspeed
    import torch
    import lazyckpt.integrations.deepspeed as lds
    _init()
    model = _model(seed)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "steps_per_print": 10_000}
    ds, *_ = deepspeed.initialize(model=model, config=config,
                                  optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    lds.enable(ds, **KNOBS)
    return ds


def save(ds: Any, directory: str, tag: str) -> None:
    """``save_checkpoint`` of ``tag``, then wait until it is committed (raises its error)."""
    import lazyckpt.integrations.deepspeed as lds
    ds.save_checkpoint(directory, tag=tag)
    lds.wait(ds)


def tag_number(tag: str) -> Optional[int]:
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None


def read_latest(directory: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, "latest")) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def read_tag(directory: str, tag: str) -> Dict[str, Any]:
    """The tag's module weights, read as DeepSpeed's own engine reads its files
    (``torch.load``, weights only, DeepSpeed's few state classes allowed); the
    optimizer's file is read too (it must be a whole file)."""
    import torch
    from lazyckpt.integrations.deepspeed import _deepspeed_safe_globals
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        model = torch.load(os.path.join(directory, tag, MODEL_FILE), weights_only=True)
        torch.load(os.path.join(directory, tag, OPTIM_FILE), weights_only=True)
    return dict(model["module"])


def committed_problems(directory: str, program: Program, when: str) -> List[str]:
    """``latest`` names a tag of one of the program's worlds, and that tag and
    ``step1`` read back with their own weights."""
    problems: List[str] = []
    allowed = {w.latest: w.allowed[w.latest] for w in program.worlds}
    try:
        bad = differs(values(1), read_tag(directory, "step1"))
        if bad:
            problems.append(f"{when}: step1 (committed before the operation) holds other weights: {bad}")
    except Exception as exc:
        problems.append(f"{when}: step1 (committed before the operation): {type(exc).__name__}: {str(exc)[:300]}")
    latest = read_latest(directory)
    n = tag_number(latest or "")
    if n not in allowed:
        return problems + [f"{when}: latest names {latest!r}, not a tag of the worlds {sorted(allowed)}"]
    try:
        bad = differs(allowed[n], read_tag(directory, latest))
        if bad:
            problems.append(f"{when}: latest names {latest!r}, whose files hold other weights: {bad}")
    except Exception as exc:
        problems.append(f"{when}: latest names {latest!r}, whose files do not read: {type(exc).__name__}: "
                        f"{str(exc)[:300]}")
    return problems


def _check(ctx: Ctx, program: Program) -> List[str]:
    directory = os.path.join(ctx.case, "ds")
    problems = committed_problems(directory, program, "after the crash")
    if problems:
        return problems
    latest = read_latest(directory)
    expected = values(tag_number(latest))
    try:
        ds = engine(3)
        path, _ = ds.load_checkpoint(directory)
        if path is None:
            return [f"restart: load_checkpoint found no checkpoint (latest names {latest!r})"]
        bad = differs(expected, ds.module.state_dict())
        if bad:
            problems.append(f"restart: load_checkpoint of {latest!r} gave other weights: {bad}")
        save(ds, directory, "step3")
        if read_latest(directory) != "step3":
            problems.append(f"restart: saved step3, then latest names {read_latest(directory)!r}")
        elif differs(expected, read_tag(directory, "step3")):
            problems.append("restart: step3 holds other weights than the ones loaded")
    except Exception as exc:
        problems.append(f"restart: {type(exc).__name__}: {str(exc)[:500]}")
    return problems


#: The engine the operation saved with, for the error mode's next save in the same process.
LAST: List[Any] = []


def _prepare(ctx: Ctx) -> None:
    save(engine(1), os.path.join(ctx.case, "ds"), "step1")


def _run(ctx: Ctx, icp: Interceptor) -> None:
    ds = engine(2)
    LAST[:] = [ds]
    with icp.operation():
        save(ds, os.path.join(ctx.case, "ds"), "step2")


def _preload() -> None:
    """Imports only, in the fork server: ``deepspeed.initialize`` imports about 1,400 modules
    the first time (torch._dynamo through its optimizer check: 1.8 s a child otherwise)."""
    import importlib
    import deepspeed  # noqa: F401
    import lazyckpt.integrations.deepspeed  # noqa: F401
    for name in ("deepspeed.comm.torch", "torch._dynamo", "deepspeed.runtime.engine", "deepspeed.runtime.zero.utils",
                 "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.stage_1_and_2",
                 "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine"):
        try:
            importlib.import_module(name)
        except ImportError:         # moved in another DeepSpeed release: imported in each child instead
            pass


def deepspeed_program() -> Program:
    """DeepSpeed's ``save_checkpoint`` of tag step2 beside committed step1 through lazyckpt's engine."""
    program = Program("deepspeed-lazyckpt", _prepare, _run, [World("old", 1, {1: values(1)}),
                                                                World("new", 2, {2: values(2)})],
                      kind="deepspeed", preload=_preload)
    program.kwargs = {"check": _check}
    return program
