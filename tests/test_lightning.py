"""Lightning integration: LazyCheckpointIO (``lightning``) and PLLazyCheckpointIO
(``pytorch_lightning``) with Trainer.fit on CPU, resume bit-exact, the
capture barrier, background errors, the pickle policy, and a 2-process DDP run."""

from __future__ import annotations

import argparse
import os
import time

import pytest
import torch
from lzc_tools import assert_same_model_and_optim

import lazyckpt
from lazyckpt.integrations import lightning as lzl

TREES = {"lightning": "lightning.pytorch", "pytorch_lightning": "pytorch_lightning"}
from _frameworks import require  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=list(TREES))
def tree(request):
    """(Lightning package, plugin class) for one class tree."""
    L = require(TREES[request.param])
    cls = lzl.LazyCheckpointIO if request.param == "lightning" else lzl.PLLazyCheckpointIO
    return L, cls


def _module_class(L):
    class Tiny(L.LightningModule):
        """Linear + BatchNorm (buffers updated in forward) + AdamW + StepLR."""

        def __init__(self, lr=0.05, tag="tiny"):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16),
                                           torch.nn.ReLU(), torch.nn.Linear(16, 1))
            self.losses = []

        def training_step(self, batch, _i):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append((self.global_step, loss.item(), round(x.sum().item(), 3)))  # + which batch
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)}
    return Tiny


def _loader():
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def _snapshot(module, optimizer):
    clone = lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return ({k: clone(v) for k, v in module.state_dict().items()},
            {i: {k: clone(v) for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()})


_assert_equal_states = assert_same_model_and_optim


def _recorder(L, record):
    """Snapshots model + optimizer state after every optimizer step (before
    ModelCheckpoint, which Lightning runs last), and once a resumed fit starts."""
    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, *_):
            record[trainer.global_step] = _snapshot(pl_module, trainer.optimizers[0])

        def on_train_start(self, trainer, pl_module):
            record["start"] = _snapshot(pl_module, trainer.optimizers[0])
    return Recorder()


def _trainer(L, plugin, dirpath, record, **kw):
    ckpt = L.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    kw.setdefault("max_epochs", 3)
    kw.setdefault("devices", 1)
    return L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, plugins=[plugin], callbacks=[ckpt, _recorder(L, record)],
                     num_sanity_val_steps=0, **kw)


# ----------------------------------------------------------------------------- fit and resume


def test_fit_saves_through_plugin_and_resume_is_bit_exact(tree, tmp_path, no_leaked_threads):
    L, cls = tree
    Tiny = _module_class(L)
    dirpath = str(tmp_path / "ckpts")

    torch.manual_seed(0)
    full, rec_full = Tiny(), {}
    plugin = cls(file_format="lazyckpt")                 # raw lazyckpt.load below
    trainer = _trainer(L, plugin, dirpath, rec_full)
    trainer.fit(full, _loader())                         # 3 epochs x 4 steps; a checkpoint every 2 steps
    assert plugin._writer is None                        # teardown drained every save and closed
    names = sorted(os.listdir(dirpath))
    assert names == sorted(f"epoch={(s - 1) // 4}-step={s}.ckpt" for s in range(2, 13, 2)), names
    for name in names:
        assert lzl.is_lazyckpt_file(os.path.join(dirpath, name))

    # The saved state is the state after that optimizer step, bit for bit (raw load,
    # no Lightning involved), although training had moved on while it was written.
    raw = lazyckpt.load(os.path.join(dirpath, "epoch=1-step=6.ckpt"))
    assert raw["global_step"] == 6 and raw["hyper_parameters"] == {"lr": 0.05, "tag": "tiny"}
    model_ref, optim_ref = rec_full[6]
    for k, v in model_ref.items():
        assert torch.equal(raw["state_dict"][k], v), k
    for i, s in optim_ref.items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(raw["optimizer_states"][0]["state"][i][k]),
                               torch.as_tensor(v)), (i, k)

    # Resume in a fresh model and trainer from the checkpoints taken at the last
    # step of epochs 0 and 1. (Lightning restarts a plain DataLoader from the
    # start of the epoch when resuming mid-epoch, so only an epoch boundary can
    # reproduce the uninterrupted run's batches; the restored state is checked
    # mid-epoch above.)
    for resume_step in (4, 8):
        torch.manual_seed(123)                           # different initial weights: they must be replaced
        resumed, rec = Tiny(), {}
        ckpt_path = os.path.join(dirpath, f"epoch={(resume_step - 1) // 4}-step={resume_step}.ckpt")
        trainer2 = _trainer(L, cls(), str(tmp_path / f"resumed-{resume_step}"), rec)
        trainer2.fit(resumed, _loader(), ckpt_path=ckpt_path)
        _assert_equal_states(rec["start"], rec_full[resume_step])
        assert resumed.losses == [x for x in full.losses if x[0] >= resume_step]
        assert len(resumed.losses) == 12 - resume_step
        _assert_equal_states(_snapshot(resumed, trainer2.optimizers[0]), _snapshot(full, trainer.optimizers[0]))
        assert trainer2.lr_scheduler_configs[0].scheduler.state_dict() == \
            trainer.lr_scheduler_configs[0].scheduler.state_dict()


# ----------------------------------------------------------------------------- barrier


def test_capture_is_consistent_when_buffers_and_weights_change_right_after_save(tmp_path):
    """A deliberately slow capture (8 KiB cache, one writer): BatchNorm's
    running statistics change in the very next forward and the weights in the
    next optimizer step; the file still holds the values of save() time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.BatchNorm1d(1024),
                                torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    import torch.optim.optimizer as optimizer_module
    global_hooks = (torch.nn.modules.module._global_forward_pre_hooks, optimizer_module._global_optimizer_pre_hooks)
    before = [len(h) for h in global_hooks]
    writer = lzl.AsyncFileWriter(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=1)
    try:
        expected = []
        for i in range(3):
            state = {"model": model.state_dict(), "i": i}
            expected.append({k: v.clone() for k, v in model.state_dict().items()})
            t0 = time.perf_counter()
            writer.save(state, str(tmp_path / f"s{i}.lzc"))
            assert time.perf_counter() - t0 < 0.5
            loss = model(torch.randn(8, 512)).square().mean()    # BatchNorm updates its buffers here
            loss.backward()
            opt.step()
            opt.zero_grad()
        writer.wait()
        for i, ref in enumerate(expected):
            got = writer.load(str(tmp_path / f"s{i}.lzc"))
            assert got["i"] == i
            for k, v in ref.items():
                assert torch.equal(got["model"][k], v), (i, k)
    finally:
        writer.close()
    assert [len(h) for h in global_hooks] == before                       # hooks removed


# ----------------------------------------------------------------------------- plugin semantics


def test_background_error_surfaces_at_next_save_and_teardown(tree, tmp_path):
    _, cls = tree
    (tmp_path / "a_file").write_text("x")
    bad = str(tmp_path / "a_file" / "sub" / "x.ckpt")       # its directory cannot be created
    state = {"state_dict": {"w": torch.ones(3)}, "epoch": 0}

    plugin = cls()
    plugin.save_checkpoint(state, bad)                       # returns; fails in the background
    plugin.writer.wait(raise_errors=False)
    with pytest.raises(lazyckpt.CheckpointWriteError, match="x.ckpt"):
        plugin.save_checkpoint(state, str(tmp_path / "ok.ckpt"))
    plugin.save_checkpoint(state, str(tmp_path / "ok.ckpt"))  # raised once; later saves work
    plugin.teardown()
    assert torch.equal(plugin.load_checkpoint(str(tmp_path / "ok.ckpt"))["state_dict"]["w"], torch.ones(3))

    plugin.save_checkpoint(state, bad)
    with pytest.raises(lazyckpt.CheckpointWriteError):
        plugin.teardown()
    assert not os.path.exists(bad)
    plugin.teardown()


def test_remove_and_load_wait_for_the_pending_save(tree, tmp_path):
    _, cls = tree
    plugin = cls(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=1)   # slow on purpose
    big = {"state_dict": {"w": torch.randn(1 << 20)}}
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    plugin.save_checkpoint(big, a)
    plugin.save_checkpoint(big, b)
    plugin.remove_checkpoint(a)                              # waits for a, then removes it
    assert torch.equal(plugin.load_checkpoint(b)["state_dict"]["w"], big["state_dict"]["w"])
    plugin.teardown()
    assert not os.path.exists(a) and os.path.exists(b)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []     # no temporaries left


def test_pickle_policy_and_torch_checkpoint_fallback(tree, tmp_path):
    _, cls = tree
    path = str(tmp_path / "p.ckpt")
    state = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"args": argparse.Namespace(a=1)}}
    plugin = cls(file_format="lazyckpt")
    plugin.save_checkpoint(state, path)
    plugin.teardown()

    with pytest.raises(lazyckpt.UnsafeObjectError, match="hyper_parameters"):
        plugin.load_checkpoint(path)                                     # default: refused
    with pytest.raises(lazyckpt.UnsafeObjectError):
        plugin.load_checkpoint(path, weights_only=True)
    assert plugin.load_checkpoint(path, weights_only=False)["hyper_parameters"]["args"].a == 1
    trusting = cls(allow_pickle=True)
    assert trusting.load_checkpoint(path)["hyper_parameters"]["args"].a == 1
    with pytest.raises(lazyckpt.UnsafeObjectError):
        trusting.load_checkpoint(path, weights_only=True)                # the caller's refusal wins
    with pytest.raises(lazyckpt.UnsafeObjectError):
        cls(allow_pickle=False).load_checkpoint(path, weights_only=False)

    legacy = str(tmp_path / "legacy.ckpt")                              # a torch.save checkpoint
    torch.save({"state_dict": {"w": torch.arange(3.0)}, "epoch": 1}, legacy)
    assert torch.equal(plugin.load_checkpoint(legacy)["state_dict"]["w"], torch.arange(3.0))
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(str(tmp_path / "missing.ckpt"))

    # torch format: torch.load's own weights_only contract
    import pickle
    torch_plugin = cls(file_format="torch")
    torch_plugin.save_checkpoint(state, path)
    torch_plugin.teardown()
    assert not lzl.is_lazyckpt_file(path)
    with pytest.raises(pickle.UnpicklingError):
        torch_plugin.load_checkpoint(path)
    assert torch_plugin.load_checkpoint(path, weights_only=False)["hyper_parameters"]["args"].a == 1


def test_plugin_pickles_without_its_runtime_state(tree, tmp_path):
    """ddp_spawn pickles the Trainer, plugin included: threads and caches stay behind."""
    import pickle
    _, cls = tree
    plugin = cls(allow_pickle=True, writer_threads=2)
    plugin.save_checkpoint({"w": torch.ones(2)}, str(tmp_path / "a.ckpt"))
    clone = pickle.loads(pickle.dumps(plugin))
    assert type(clone) is cls and clone._writer is None
    assert clone.allow_pickle is True and clone.knobs == {"writer_threads": 2}
    plugin.teardown()
    assert torch.equal(clone.load_checkpoint(str(tmp_path / "a.ckpt"))["w"], torch.ones(2))
    clone.teardown()
    with pytest.raises(TypeError, match="unknown options"):
        cls(no_such_knob=1)


# ----------------------------------------------------------------------------- DDP


def _ddp_fit_and_resume(rank, world, dirpath):
    """One rank of a 2-process DDP job (launched outside Lightning, as torchrun would)."""
    import lightning.pytorch as L
    import torch.distributed as dist
    Tiny = _module_class(L)

    def fit(ckpt_path=None, seed=0):
        torch.manual_seed(seed)
        model, rec = Tiny(), {}
        trainer = _trainer(L, lzl.LazyCheckpointIO(), dirpath if ckpt_path is None else dirpath + "-2", rec,
                           strategy="ddp", devices=world, max_epochs=2)
        trainer.fit(model, _loader(), ckpt_path=ckpt_path)
        return model, rec, _snapshot(model, trainer.optimizers[0])

    full, rec_full, end_full = fit()
    dist.barrier()
    names = sorted(os.listdir(dirpath))
    resumed, rec, end = fit(os.path.join(dirpath, "epoch=0-step=2.ckpt"), seed=7)
    if rank == 0:
        _assert_equal_states(rec["start"], rec_full[2])
    else:
        # Rank 1 restores rank 0's BatchNorm statistics (the checkpoint's; DDP
        # broadcasts rank 0's buffers at every forward anyway); the rest is identical.
        (m_start, o_start), (m_ref, o_ref) = rec["start"], rec_full[2]
        _assert_equal_states(({k: v for k, v in m_start.items() if "running" not in k}, o_start),
                             ({k: v for k, v in m_ref.items() if "running" not in k}, o_ref))
    _assert_equal_states(end, end_full)
    assert resumed.losses == [x for x in full.losses if x[0] >= 2]
    return names, resumed.losses


def test_ddp_two_processes_save_on_rank_zero_and_resume(tmp_path):
    require("lightning.pytorch")
    from _dist import run_ranks
    dirpath = str(tmp_path / "ddp")
    results = run_ranks(2, _ddp_fit_and_resume, dirpath, timeout=240)
    (names0, losses0), (names1, losses1) = results
    # 2 epochs x 2 steps per rank (32 samples, batch 8, 2 ranks); a checkpoint every 2 steps.
    assert names0 == names1 == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    assert len(losses0) == len(losses1) == 2
    assert losses0 != losses1                                            # each rank saw its own shard
