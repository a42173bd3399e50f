"""DeepSpeed (CPU accelerator, gloo) with lazyckpt's checkpoint engine:
ZeRO stages 1, 2 and 3 in 1 and 2 processes. Save with lazyckpt; a fresh
engine's load_checkpoint resumes bit-exact and training continues with the
same losses as an uninterrupted run."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")      # inherited by the spawned ranks
from _frameworks import require  # noqa: E402

require("deepspeed")

from _dist import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _engine(stage, seed):
    import deepspeed
    import importlib
    import torch
    # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op on first
    # use (minutes on 2 cores); gloo alone is what we test with, so skip building it.
    # `import deepspeed.comm.torch as m` would bind the real torch (deepspeed.comm imports it).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(seed)
    # BatchNorm: its running statistics (buffers) must come back bit-exact too.
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.AdamW(model.parameters(), lr=0.01))
    import lazyckpt.integrations.deepspeed as lds
    lds.enable(engine, host_cache_bytes=1 << 20)
    return engine


def _step(engine, i, rank):
    import torch
    torch.manual_seed(1000 + 10 * i + rank)
    loss = engine(torch.randn(2, 16)).square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_then_resume(rank, world, directory, stage):
    import logging

    import deepspeed
    import torch
    import lazyckpt.integrations.deepspeed as lds
    from lazyckpt.integrations.deepspeed import LazyCheckpointEngine
    deepspeed.utils.logger.setLevel(logging.WARNING)
    engine = _engine(stage, seed=0)
    assert isinstance(engine.checkpoint_engine, LazyCheckpointEngine)
    for i in range(3):
        _step(engine, i, rank)
    engine.save_checkpoint(directory, tag="step3")        # returns before the data is durable
    snapshot = {k: v.clone() for k, v in engine.module.state_dict().items()} if stage < 3 else None
    reference = [_step(engine, i, rank) for i in range(3, 6)]   # uninterrupted run
    lds.wait(engine)
    latest = open(os.path.join(directory, "latest")).read()

    fresh = _engine(stage, seed=123)                      # different initial weights
    path, _ = fresh.load_checkpoint(directory)
    restored = None
    if snapshot is not None:
        state = fresh.module.state_dict()
        # DeepSpeed saves the module (BatchNorm buffers included) from rank 0 only:
        # another rank's running statistics, from its own batches, are not restored.
        restored = all(torch.equal(state[k], v) for k, v in snapshot.items()
                       if rank == 0 or not k.split(".")[-1].startswith(("running_", "num_batches")))
    resumed = [_step(fresh, i, rank) for i in range(3, 6)]
    lds.wait(fresh)
    with open(os.path.join(directory, "step3", sorted(os.listdir(os.path.join(directory, "step3")))[0]),
              "rb") as f:
        magic = f.read(8)
    return reference, resumed, restored, latest, magic, path


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_save_load_resumes_bit_exact(tmp_path, stage, world):
    for rank, (reference, resumed, restored, latest, magic, path) in enumerate(
            run_ranks(world, _save_then_resume, str(tmp_path), stage, timeout=600)):
        assert latest == "step3"
        assert magic == b"LAZYCKPT"                      # DeepSpeed's files hold lazyckpt's format
        assert path is not None
        assert restored in (True, None), f"rank {rank}: restored weights differ"
        assert resumed == reference, f"rank {rank}: losses after resume differ"
