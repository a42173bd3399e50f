"""Megatron-Core's dist_checkpointing with lazyckpt's save strategy
(lazyckpt.integrations.megatron): 2 gloo ranks, a tiny GPTModel under tensor
parallel 2, Megatron's own save/load/AsyncCallsQueue unmocked. What lazyckpt
writes loads with plain Megatron bit-exact, and Megatron's own checkpoints load
through lazyckpt's reader. The CPU shims are in tests/_megatron.py."""

from __future__ import annotations

import os
import signal

import pytest

from _dist import run_ranks
from _frameworks import require
from _megatron import (allow_typing_override, cpu_shims, init_tp, make_dir, same, stub_triton_kernels, tensors,
                       tiny_gpt)

stub_triton_kernels()
require("megatron.core.dist_checkpointing")


def _sgd_step(model) -> None:
    """An optimizer step that changes every parameter (lazyckpt's global step
    pre-hook makes it wait for a pending capture first)."""
    import torch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()


def _roundtrips(rank, world, root):
    cpu_shims()
    init_tp(2)
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from lazyckpt.errors import CheckpointWriteError
    from lazyckpt.integrations.megatron import LazyLoadStrategy, LazySaveStrategy
    out = {}
    model = tiny_gpt()
    before = tensors(model)
    strategy = LazySaveStrategy()

    # Async through lazyckpt, Megatron's queue; an optimizer step before the finalize.
    lazy = f"{root}/lazy"
    make_dir(lazy)
    queue = AsyncCallsQueue()
    request = dist_checkpointing.save(model.sharded_state_dict(), lazy, strategy, async_sharded_save=True,
                                      async_strategy="mcore")
    out["uncommitted"] = sorted(os.listdir(lazy))      # before the finalize: no .metadata yet
    queue.schedule_async_request(request)
    _sgd_step(model)
    after = tensors(model)
    queue.maybe_finalize_async_calls(blocking=True)
    out["committed"] = sorted(os.listdir(lazy))
    fresh = tiny_gpt(seed=1)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), lazy))      # plain Megatron
    out["lazy_read_by_megatron"] = same(tensors(fresh), before)
    out["the_step_changed_the_model"] = not same(after, before)

    # The reverse: Megatron's own (sync) save, read through lazyckpt's reader.
    plain = f"{root}/megatron"
    make_dir(plain)
    dist_checkpointing.save(model.sharded_state_dict(), plain)
    fresh = tiny_gpt(seed=1)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), plain, LazyLoadStrategy()))
    out["megatron_read_by_lazy"] = same(tensors(fresh), after)

    # A rank's write fails: every rank's finalize raises lazyckpt's error and nothing commits.
    broken = f"{root}/broken"
    make_dir(broken)
    if rank == 1:       # a non-empty directory where rank 1's file goes
        os.makedirs(f"{broken}/__1_0.distcp/x")
    torch.distributed.barrier()
    try:
        dist_checkpointing.save(model.sharded_state_dict(), broken, strategy)
        out["error"] = None
    except CheckpointWriteError as exc:
        out["error"] = str(exc)
    out["broken"] = sorted(os.listdir(broken))

    # The strategy goes on: a sync save (Megatron's save() -> execute_sync) after the failure.
    again = f"{root}/again"
    make_dir(again)
    dist_checkpointing.save(model.sharded_state_dict(), again, strategy)
    fresh = tiny_gpt(seed=1)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), again))
    out["sync_after_failure"] = same(tensors(fresh), after)
    strategy.close()
    return out


def test_saved_through_lazyckpt_loads_with_plain_megatron_and_back(tmp_path):
    results = run_ranks(2, _roundtrips, str(tmp_path), timeout=240)
    for out in results:
        assert ".metadata" not in out["uncommitted"] and "metadata.json" not in out["uncommitted"]
        assert out["committed"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
        assert out["the_step_changed_the_model"]
        assert out["lazy_read_by_megatron"], "the checkpoint must hold the values at async_save"
        assert out["megatron_read_by_lazy"]
        assert out["error"] is not None and "not committed" in out["error"] and "intact" in out["error"]
        assert ".metadata" not in out["broken"] and "metadata.json" not in out["broken"]
        assert out["sync_after_failure"]
    # Tensor parallel 2: the two ranks hold different halves, and each round-trips its own.
    assert os.path.getsize(tmp_path / "lazy" / "__0_0.distcp") > 0


# --------------------------------------------------------------------------- a kill mid-save


def _save(model, strategy, queue, root, iteration, rank):
    """megatron.training's order: save, then the tracker file in a finalize after the commit."""
    import torch
    from megatron.core import dist_checkpointing
    path = f"{root}/iter_{iteration:07d}"
    make_dir(path)
    request = dist_checkpointing.save(model.sharded_state_dict(), path, strategy, async_sharded_save=True,
                                      async_strategy="mcore")

    def tracker() -> None:
        if rank == 0:
            with open(f"{root}/latest.tmp", "w") as f:
                f.write(str(iteration))
            os.replace(f"{root}/latest.tmp", f"{root}/latest_checkpointed_iteration.txt")
        torch.distributed.barrier()
    request.add_finalize_fn(tracker)
    queue.schedule_async_request(request)


def _train_then_killed(rank, world, root):
    cpu_shims()
    init_tp(2)
    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from lazyckpt.integrations.megatron import LazySaveStrategy
    model = tiny_gpt()
    strategy, queue = LazySaveStrategy(), AsyncCallsQueue()
    _save(model, strategy, queue, root, 1, rank)
    queue.maybe_finalize_async_calls(blocking=True)
    torch.save(tensors(model), f"{root}/expected_{rank}.pt")
    _sgd_step(model)
    _save(model, strategy, queue, root, 2, rank)
    os.kill(os.getpid(), signal.SIGKILL)        # while iteration 2's save is in flight


def _resume(rank, world, root):
    cpu_shims()
    init_tp(2)
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    with open(f"{root}/latest_checkpointed_iteration.txt") as f:
        iteration = int(f.read())
    model = tiny_gpt(seed=1)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), f"{root}/iter_{iteration:07d}"))
    expected = torch.load(f"{root}/expected_{rank}.pt")
    try:
        dist_checkpointing.load(tiny_gpt(seed=1).sharded_state_dict(), f"{root}/iter_0000002")
        killed_loads = True
    except CheckpointingException:
        killed_loads = False
    return iteration, same(tensors(model), expected), killed_loads


def test_a_kill_during_an_async_save_leaves_the_previous_iteration_loading(tmp_path):
    died = run_ranks(2, _train_then_killed, str(tmp_path), timeout=240, allow_failure=True)
    assert all(r[0] == "died" for r in died), died
    killed = sorted(os.listdir(tmp_path / "iter_0000002"))
    assert ".metadata" not in killed and "metadata.json" not in killed
    for iteration, loaded_exact, killed_loads in run_ranks(2, _resume, str(tmp_path), timeout=240):
        assert iteration == 1
        assert loaded_exact
        assert not killed_loads, "plain Megatron must refuse the uncommitted iteration"


# --------------------------------------------------------------------------- megatron.training


def test_install_swaps_the_strategy_megatron_training_builds():
    """``install()`` changes the name megatron.training's save_checkpoint builds its
    strategy from; ``uninstall()`` gives it back."""
    allow_typing_override()
    checkpointing = pytest.importorskip("megatron.training.checkpointing")
    from lazyckpt.integrations.megatron import LazySaveStrategy, install, uninstall
    own = checkpointing.TorchDistSaveShardedStrategy
    install(writer_threads=2)
    try:
        built = checkpointing.TorchDistSaveShardedStrategy(cpu_shm_mode=False)   # as save_checkpoint does
        assert isinstance(built, LazySaveStrategy) and isinstance(built, own)
        assert built.lazyckpt_knobs == {"writer_threads": 2}
        install()
        assert issubclass(checkpointing.TorchDistSaveShardedStrategy, LazySaveStrategy)
    finally:
        uninstall()
    assert checkpointing.TorchDistSaveShardedStrategy is own


def _megatron_lm_saves(rank, world, root):
    """megatron.training's own save_checkpoint with --async-save, set up as Megatron's own
    tests set it up (parse_args, then the attributes a run would have; get_args patched
    where checkpointing reads it)."""
    cpu_shims()
    allow_typing_override()
    init_tp(2)
    import sys
    from unittest import mock

    import torch
    sys.argv = sys.argv[:1]
    import megatron.training.async_utils as async_utils
    import megatron.training.checkpointing as checkpointing
    from megatron.core import dist_checkpointing
    from megatron.training.arguments import parse_args

    import lazyckpt.integrations.megatron as lazy_megatron
    if not torch.cuda.is_available():       # get_rng_state saves the CUDA generator's state too
        torch.cuda.get_rng_state = lambda *args, **kwargs: torch.zeros(16, dtype=torch.uint8)
    args = parse_args(ignore_unknown_args=True)
    for name, value in dict(save=root, load=root, use_dist_ckpt=True, ckpt_format="torch_dist", async_save=True,
                            async_strategy="mcore", no_save_optim=True, no_save_rng=False,
                            ckpt_fully_parallel_save=True, ckpt_assume_constant_structure=False,
                            non_persistent_ckpt_type=None, non_persistent_global_ckpt_dir=None,
                            data_parallel_random_init=False, log_progress=False, consumed_train_samples=0,
                            skipped_train_samples=0, consumed_valid_samples=0, tensor_model_parallel_size=2,
                            pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                            use_distributed_optimizer=False, fp16=False, bf16=False).items():
        setattr(args, name, value)
    model = tiny_gpt()
    lazy_megatron.install(writer_threads=2)
    tracker = checkpointing.get_checkpoint_tracker_filename(root)
    context = {}
    try:
        with mock.patch.object(checkpointing, "get_args", new=lambda: args), \
                mock.patch.object(async_utils, "get_args", new=lambda: args):
            checkpointing.save_checkpoint(5, [model], None, None, 0, checkpointing_context=context)
            strategy = context["save_strategy"]
            before_finalize = os.path.exists(tracker)
            async_utils.maybe_finalize_async_save(blocking=True, terminate=True)
    finally:
        lazy_megatron.uninstall()
    with open(tracker) as f:
        latest = f.read().strip()
    base = getattr(strategy, "base_strategy", strategy)     # inside FullyParallelSaveStrategyWrapper
    path = checkpointing.get_checkpoint_name(root, 5, return_base_dir=True)
    fresh = tiny_gpt(seed=1)
    loaded = dist_checkpointing.load({"model": fresh.sharded_state_dict()}, path, strict="assume_ok_unexpected")
    fresh.load_state_dict(loaded["model"])
    return (type(base).__name__, before_finalize, latest, same(tensors(fresh), tensors(model)))


def test_megatron_lm_save_checkpoint_through_install(tmp_path):
    """The one line for Megatron-LM: its save_checkpoint (--ckpt-format torch_dist,
    --ckpt-fully-parallel-save, --async-save) builds LazySaveStrategy; the tracker file
    appears only with the finalize, and plain Megatron loads the model bit-exact."""
    allow_typing_override()
    pytest.importorskip("megatron.training.checkpointing")
    for name, before_finalize, latest, exact in run_ranks(2, _megatron_lm_saves, str(tmp_path), timeout=240):
        assert name == "LazySaveStrategy"
        assert not before_finalize
        assert latest == "5"
        assert exact
