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


def _engine(stage, seed, file_format="torch"):
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
    lds.enable(engine, host_cache_bytes=1 << 20, file_format=file_format)
    return engine


def _step(engine, i, rank):
    import torch
    torch.manual_seed(1000 + 10 * i + rank)
    loss = engine(torch.randn(2, 16)).square().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


def _save_then_resume(rank, world, directory, stage, file_format):
    import logging

    import deepspeed
    import torch
    import lazyckpt.integrations.deepspeed as lds
    from lazyckpt.integrations.deepspeed import LazyCheckpointEngine
    deepspeed.utils.logger.setLevel(logging.WARNING)
    engine = _engine(stage, seed=0, file_format=file_format)
    assert isinstance(engine.checkpoint_engine, LazyCheckpointEngine)
    for i in range(3):
        _step(engine, i, rank)
    engine.save_checkpoint(directory, tag="step3")        # returns before the data is durable
    snapshot = {k: v.clone() for k, v in engine.module.state_dict().items()} if stage < 3 else None
    reference = [_step(engine, i, rank) for i in range(3, 6)]   # uninterrupted run
    lds.wait(engine)
    latest = open(os.path.join(directory, "latest")).read()

    fresh = _engine(stage, seed=123, file_format=file_format)   # different initial weights
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


@pytest.mark.parametrize("world,stage,file_format", [
    (world, stage, "torch") for world in (1, 2) for stage in (1, 2, 3)] + [
    (2, 2, "lazyckpt"), (1, 3, "lazyckpt")])
def test_zero_save_load_resumes_bit_exact(tmp_path, stage, world, file_format):
    for rank, (reference, resumed, restored, latest, magic, path) in enumerate(
            run_ranks(world, _save_then_resume, str(tmp_path), stage, file_format, timeout=600)):
        assert latest == "step3"
        # DeepSpeed's file names; torch.save's zip by default, lazyckpt's format as an option.
        if file_format == "torch":
            assert magic[:4] == b"PK\x03\x04"
        else:
            assert magic == b"LAZYCKPT"
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



# --------------------------------------------------------------------------- no lock-in
# DeepSpeed's own tools torch.load the files (zero_to_fp32, ds_to_universal,
# DeepSpeed's default engine): what lazyckpt writes by default is what they read.

def _zero_to_fp32_reads(rank, world, directory, stage):
    import torch
    # Bound before enable(), as DeepSpeed's own tests import it.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    engine = _engine(stage, seed=0)
    for i in range(2):
        _step(engine, i, rank)
    engine.save_checkpoint(directory, tag="t")
    # No wait: in the process that saved, DeepSpeed's reader sees the pending save.
    fp32 = get_fp32_state_dict_from_zero_checkpoint(directory, tag="t")
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        expected = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}   # buffers too
    if sorted(fp32) != sorted(expected):
        return f"names {sorted(fp32)} != {sorted(expected)}"
    return [k for k, v in expected.items() if not torch.equal(fp32[k], v)] or True


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32_reads_a_lazyckpt_written_checkpoint_right_after_save(tmp_path, stage):
    [same] = run_ranks(1, _zero_to_fp32_reads, str(tmp_path), stage, timeout=300)
    assert same is True, f"zero_to_fp32 did not rebuild the trained fp32 weights: {same}"


# --------------------------------------------------------------------------- a failed save

def _failed_save_is_not_committed(rank, world, directory):
    import torch
    import lazyckpt.integrations.deepspeed as lds
    engine = _engine(1, seed=0)
    _step(engine, 0, rank)
    engine.save_checkpoint(directory, tag="good")
    lds.wait(engine)
    # Fault injection: DeepSpeed fails after the model states file was handed over,
    # before the ZeRO optimizer states (as a full disk or a bad client_state would).
    real = engine._save_zero_checkpoint

    def fails(*args, **kwargs):
        raise RuntimeError("injected: optimizer states could not be gathered")

    engine._save_zero_checkpoint = fails
    try:
        engine.save_checkpoint(directory, tag="bad")
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    engine._save_zero_checkpoint = real
    _step(engine, 1, rank)                       # the step barrier used to commit the open tag
    lds.wait(engine)
    latest_after_failure = open(os.path.join(directory, "latest")).read()
    engine.save_checkpoint(directory, tag="next")
    lds.wait(engine)
    latest_after_next = open(os.path.join(directory, "latest")).read()
    fresh = _engine(1, seed=123)
    path, _ = fresh.load_checkpoint(directory)
    return raised, latest_after_failure, latest_after_next, os.path.basename(os.path.dirname(path))


def test_a_failed_save_checkpoint_is_never_committed_nor_named_by_latest(tmp_path):
    [(raised, after_failure, after_next, loaded)] = run_ranks(1, _failed_save_is_not_committed, str(tmp_path),
                                                              timeout=300)
    assert raised and "injected" in raised            # the caller got DeepSpeed's error, once
    assert after_failure == "good", "`latest` names the tag whose save_checkpoint failed"
    assert after_next == "next" and loaded == "next"


def test_torch_format_file_is_what_deepspeeds_clone_then_torch_save_writes(tmp_path):
    """Views of a larger buffer (ZeRO's flat groups) hold just their elements,
    Parameters load as plain tensors, and torch.load reads it with weights_only."""
    import torch
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from lazyckpt.integrations._async import AsyncFileWriter
    from lazyckpt.integrations.deepspeed_files import ClonedTorchZipLayout
    flat = torch.arange(1000, dtype=torch.float32)
    weight = torch.nn.Parameter(flat[100:120].view(4, 5))
    state = {"module": {"w": weight, "tied": weight, "b": flat[500:503]},
             "half": torch.ones(7, dtype=torch.bfloat16), "transposed": torch.arange(12.).view(3, 4).t(),
             "empty": torch.empty(0), "steps": 3}
    expected = clone_tensors_for_torch_save(state)
    writer = AsyncFileWriter(host_cache_bytes=1 << 16)
    path = str(tmp_path / "mp_rank_00_model_states.pt")
    writer._submit(path, ClonedTorchZipLayout(state).part(), None, None).wait()
    writer.close()
    got = torch.load(path, weights_only=True)
    assert got["steps"] == 3
    for key, value in [("w", expected["module"]["w"]), ("tied", expected["module"]["tied"]),
                       ("b", expected["module"]["b"])]:
        assert type(got["module"][key]) is torch.Tensor and not got["module"][key].requires_grad
        assert torch.equal(got["module"][key], value)
        assert got["module"][key].untyped_storage().nbytes() == value.untyped_storage().nbytes()
    for key in ("half", "transposed", "empty"):
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key])
        assert got[key].stride() == expected[key].stride()
