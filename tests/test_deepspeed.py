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


# --------------------------------------------------------------------------- what a save hands over
# Found by running DeepSpeed's own tests/unit/checkpoint with lazyckpt swapped in
# (benchmarks/ds_suite/run_deepspeed_suite.py): their load goes through a fresh
# engine in the same process right after save_checkpoint, with no step between.

def _save_paths_without_a_step(rank, world, directory):
    """One process for three observations (each DeepSpeed start costs seconds)."""
    import time

    import torch
    engine = _engine(1, seed=0)
    for i in range(2):
        _step(engine, i, rank)
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    out = {}

    # 1. A fresh engine in the same process loads what was just saved (tag from `latest`).
    engine.save_checkpoint(os.path.join(directory, "a"))     # returns before the files are in place
    fresh = _engine(1, seed=123)
    path, _ = fresh.load_checkpoint(os.path.join(directory, "a"))
    state = fresh.module.state_dict()
    out["fresh_load"] = (path is not None, all(torch.equal(state[k], v) for k, v in saved.items()),
                         fresh.global_steps)

    # 2. No step, no wait: the tag still commits (DeepSpeed has no end-of-save call
    # for a decoupled engine; the job used to stay open until the next step).
    engine.save_checkpoint(os.path.join(directory, "b"))
    latest = os.path.join(directory, "b", "latest")
    deadline = time.monotonic() + 60
    while not os.path.exists(latest) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["committed"] = os.path.exists(latest)

    # 3. The consolidated export, read as from_pretrained and every other tool does.
    expected = {k: v.clone() for k, v in engine.module_state_dict().items()}
    engine.save_16bit_model(os.path.join(directory, "c"), "pytorch_model.bin")
    try:
        export = torch.load(os.path.join(directory, "c", "pytorch_model.bin"), weights_only=True)
        out["export"] = sorted(export) == sorted(expected) and all(
            torch.equal(export[k], v) for k, v in expected.items())
    except Exception as exc:                      # reported by the test, not raised in the child
        out["export"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


@pytest.fixture(scope="module")
def save_paths(tmp_path_factory):
    [out] = run_ranks(1, _save_paths_without_a_step, str(tmp_path_factory.mktemp("ds_save_paths")),
                      timeout=300)
    return out


def test_fresh_engine_in_the_same_process_loads_a_save_still_in_flight(save_paths):
    found, same, steps = save_paths["fresh_load"]
    assert found, "load_checkpoint found no `latest`: it did not wait for the pending save"
    assert same and steps == 2


def test_checkpoint_commits_when_save_checkpoint_returns_without_another_step(save_paths):
    assert save_paths["committed"], "`latest` was not written: the tag stayed open until a next step or wait()"


def test_save_16bit_model_writes_a_file_torch_load_reads(save_paths):
    assert save_paths["export"] is True, save_paths["export"]


def _eval_time_swap_waits_for_capture(rank, world, directory):
    import importlib

    import deepspeed
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    import lazyckpt.integrations.deepspeed as lds

    class SwapOnEval(DeepSpeedEngine):
        """Changes the weights in place in eval(), as DeepSpeed's hybrid engine
        does (LoRA fusion; its inference kernels need CUDA, so not usable here)."""

        def eval(self):
            super().eval()
            with torch.no_grad():
                for p in self.module.parameters():
                    p.mul_(-1.0)

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    torch.manual_seed(0)
    # Large enough that the capture is still running when eval() is called.
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
              "steps_per_print": 10_000}
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    engine.__class__ = SwapOnEval              # before enable(): it hooks what the class overrides
    lds.enable(engine, host_cache_bytes=1 << 22)
    loss = engine(torch.randn(2, 512)).square().mean()
    engine.backward(loss)
    engine.step()
    saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.save_checkpoint(directory, tag="t")
    engine.eval()                              # swaps in place right after the save returns
    lds.wait(engine)
    state = lds.enable(engine).load(os.path.join(directory, "t", "mp_rank_00_model_states.pt"))["module"]
    return all(torch.equal(state[k], v) for k, v in saved.items())


def test_an_engine_eval_that_changes_weights_in_place_waits_for_the_capture(tmp_path):
    [same] = run_ranks(1, _eval_time_swap_waits_for_capture, str(tmp_path), timeout=300)
    assert same, "the checkpoint holds weights changed by eval() after save_checkpoint returned"

