"""torchtitan's CheckpointManager with lazyckpt's writer (lazyckpt.integrations.torchtitan):
2 gloo ranks, FSDP2, torchtitan's own save/purge/load code unmocked. What it writes is
DCP's layout, loaded by torchtitan's unchanged dcp.load, bit-exact, in every async mode."""

from __future__ import annotations

import os

import pytest
import torch

torchtitan = pytest.importorskip("torchtitan", reason="torchtitan is not installed (the torchtitan extra)")

from _dist import fsdp_model, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(600)


class _Optimizers:
    """What torchtitan's OptimizersContainer gives the checkpointer: a Stateful over
    DCP's optimizer state dict (FQN-keyed, sharded)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.opt)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.opt, optim_state_dict=sd)


class _Nothing:
    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def _manager(model, opt, folder, async_mode, keep=2):
    from lazyckpt.integrations.torchtitan import LazyCheckpointManager
    config = LazyCheckpointManager.Config(enable=True, async_mode=async_mode, folder="checkpoint", interval=1,
                                          keep_latest_k=keep, lazyckpt={"host_cache_bytes": 8 << 20})
    return config.build(dataloader=None, model_parts=[model], optimizers=_Optimizers(model, opt),
                        lr_schedulers=_Nothing(), states={}, sd_adapter=None, base_folder=folder)


def _step(model, opt, manager, i):
    """torchtitan's train_step order: forward/backward, wait for staging, optimizer step."""
    torch.manual_seed(100 + i)
    loss = model(torch.randn(4, 16)).square().mean()
    loss.backward()
    manager.maybe_wait_for_staging()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train_and_save(rank, world, folder, async_mode):
    from lazyckpt.integrations.torchtitan import LazyCheckpointManager
    model, opt = fsdp_model(world, hidden=37, out=5)
    manager = _manager(model, opt, folder, async_mode)
    assert type(manager) is LazyCheckpointManager
    for step in range(1, 5):
        _step(model, opt, manager, step)
        manager.save(curr_step=step)                  # torchtitan's own save: staging, write, purge
    manager.maybe_wait_for_saving()
    after = [_step(model, opt, manager, step) for step in range(5, 8)]
    manager.close()
    return after


def _resume(rank, world, folder, async_mode):
    model, opt = fsdp_model(world, hidden=37, out=5)
    manager = _manager(model, opt, folder, async_mode)
    assert manager.load(step=-1)                       # torchtitan's own load: the latest step, dcp.load
    resumed = [_step(model, opt, manager, step) for step in range(5, 8)]
    manager.close()
    return resumed


@pytest.mark.parametrize("async_mode", ["async_with_pinned_mem", "async", "disabled"])
def test_torchtitan_checkpoints_through_lazyckpt_resume_bit_exact(tmp_path, async_mode):
    after = run_ranks(2, _train_and_save, str(tmp_path), async_mode)
    folder = tmp_path / "checkpoint"
    # torchtitan's keep_latest_k=2 purges what it lists right after queueing a save: an async
    # save's directory may not exist yet then, so one older step may stay (as with DCP's writer).
    kept = sorted(os.listdir(folder))
    assert kept == ["step-3", "step-4"] or (async_mode != "disabled" and kept == ["step-2", "step-3", "step-4"])
    for step in kept:
        assert sorted(os.listdir(folder / step)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    resumed = run_ranks(2, _resume, str(tmp_path), async_mode)
    assert resumed == after                            # the losses of steps 5-7, bit for bit


def test_the_override_builds_a_lazy_manager_from_any_checkpoint_config():
    """``--override.imports lazyckpt.integrations.torchtitan.lazy_checkpoint``: the run's
    config, every field kept, becomes a LazyCheckpointManager.Config."""
    from torchtitan.components.checkpointer import CheckpointManager
    from lazyckpt.integrations.torchtitan import LazyCheckpointManager, lazy_checkpoint
    cfg = CheckpointManager.Config(enable=True, async_mode="async", interval=7, keep_latest_k=3, folder="ck")
    got = lazy_checkpoint(cfg)
    assert isinstance(got, LazyCheckpointManager.Config)
    assert (got.enable, got.async_mode, got.interval, got.keep_latest_k, got.folder) == (True, "async", 7, 3, "ck")
