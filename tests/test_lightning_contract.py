"""ModelCheckpoint's contract with the default CheckpointIO and with lazyckpt's
(issue 27): each case runs with both, and what holds for the default holds for
lazyckpt. The lazyckpt plugin is made slow on purpose (8 KiB host cache, one
writer) so that saves are still pending when ModelCheckpoint names, removes,
links and notifies: the cases that failed before the commit ordering."""

from __future__ import annotations

import os
import threading
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from _env import child_env
from _frameworks import require

L = require("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.loggers.utilities import _scan_checkpoints  # noqa: E402

from lazyckpt import keptpools  # noqa: E402
from lazyckpt.integrations import lightning as lzl  # noqa: E402

pytestmark = pytest.mark.timeout(300)
SLOW_KNOBS = dict(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=1)
HERE = os.path.dirname(os.path.abspath(__file__))


def make_plugin(kind):
    if not isinstance(kind, str):
        return kind                         # a plugin made by the test itself
    if kind == "default":
        return None
    return lzl.LazyCheckpointIO(file_format=kind.split("-")[1], **SLOW_KNOBS)


KINDS = ["default", "lazy-torch", "lazy-lazyckpt"]


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


class Tiny(L.LightningModule):
    """~100k parameters (a few hundred KiB per checkpoint), a metric that goes
    down, up, down (so top-k replaces and keeps files), AdamW."""

    def __init__(self, width=128, mutate_after_save=False, manual=False):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 32))
        self.automatic_optimization = not manual

    def training_step(self, batch, i):
        (x,) = batch
        loss = (self.net(x) - x).square().mean()
        self.log("score", float([5, 3, 4, 1, 2, 6, 0.5, 7][self.global_step % 8]) + self.global_step / 100)
        if not self.automatic_optimization:
            opt = self.optimizers()
            with torch.no_grad():                       # an in-place change before the step (manual)
                self.net[0].bias.add_(0.25)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def on_train_batch_end(self, *args):
        if self.hparams.mutate_after_save:               # runs after ModelCheckpoint's hook
            with torch.no_grad():
                self.net[0].weight.mul_(0.5)

    def validation_step(self, batch, i):
        (x,) = batch
        self.log("val", (self.net(x) - x).square().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader(n=64):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(n, 32, generator=g)),
                                       batch_size=8)


class Observer(L.Callback):
    """Reads best/last_model_path the way a user callback does, and records the
    weights after each optimizer step (before ModelCheckpoint, which runs last)."""

    def __init__(self):
        self.reads = []
        self.weights = {}

    def _read(self, trainer):
        for cb in trainer.checkpoint_callbacks:
            for path in (cb.best_model_path, cb.last_model_path):
                if path:
                    self.reads.append(os.path.exists(path))

    def on_train_batch_start(self, trainer, *_):
        self._read(trainer)

    def on_train_batch_end(self, trainer, pl_module, *_):
        self._read(trainer)
        self.weights[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}


class UploadingLogger(Logger):
    """MLflow's / W&B's log_model='all' logic: scan and 'upload' on every save."""

    def __init__(self):
        super().__init__()
        self.logged_model_time = {}
        self.uploaded = []

    name, version = "uploader", 0

    @property
    def experiment(self):
        return None

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def after_save_checkpoint(self, checkpoint_callback):
        for t, p, _s, _tag in _scan_checkpoints(checkpoint_callback, self.logged_model_time):
            with open(p, "rb") as f:                     # the upload reads the file
                f.read()
            self.logged_model_time[p] = t
            self.uploaded.append(os.path.abspath(p))


def fit(kind, dirpath, epochs=2, ckpt_path=None, logger=None, model=None, checkpoints=None, **ckpt_kw):
    """``checkpoints``: several ModelCheckpoint callbacks in one Trainer (each
    its own dirpath and state key), instead of one built from ``ckpt_kw``."""
    plugin = make_plugin(kind)
    checkpoints = checkpoints or [ModelCheckpoint(dirpath=str(dirpath), **ckpt_kw)]
    ckpt = checkpoints[0]
    observer = Observer()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=logger or False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                        plugins=[plugin] if plugin else None, callbacks=[observer, *checkpoints])
    torch.manual_seed(0)
    model = model or Tiny()
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    if plugin is not None and any(c.save_top_k != 0 for c in checkpoints):
        assert plugin.saves > 0                          # the swap took effect
    return trainer, ckpt, observer, model


def listing(dirpath):
    return sorted(n for n in os.listdir(dirpath) if not n.startswith("."))


def load(path):
    """What the default CheckpointIO reads (torch.load); lazyckpt's own format through lazyckpt."""
    if lzl.is_lazyckpt_file(path):
        import lazyckpt
        return lazyckpt.load(path)
    return torch.load(path, weights_only=True)


# ----------------------------------------------------------------------------- naming, top-k, last, frequency

CONFIGS = {
    # name: ModelCheckpoint kwargs. All run in one Trainer, so their state keys
    # (monitor, mode, every_n_*) differ.
    "versions": dict(filename="fixed", save_top_k=-1, every_n_train_steps=1),
    "topk-monitor-last-copy": dict(monitor="score", mode="min", save_top_k=2, every_n_train_steps=1, save_last=True),
    "topk-monitor-max-last-link": dict(monitor="score", mode="max", save_top_k=2, every_n_train_steps=1,
                                       save_last="link"),
    "top1-no-monitor-link": dict(save_top_k=1, every_n_train_steps=3, save_last="link"),
    "every-n-epochs": dict(save_top_k=-1, every_n_epochs=1),
    "every-2-steps-versions-last": dict(filename="{epoch}", save_top_k=-1, every_n_train_steps=2, save_last=True),
}


def _outcomes(kind, tmp_path):
    """One fit holding a ModelCheckpoint per CONFIGS entry: what each leaves."""
    base = tmp_path / kind
    checkpoints = {name: ModelCheckpoint(dirpath=str(base / name), **kw) for name, kw in CONFIGS.items()}
    logger = UploadingLogger()
    _, _, observer, _ = fit(kind, None, logger=logger, checkpoints=list(checkpoints.values()))
    out = {"reads_found": bool(observer.reads) and all(observer.reads)}
    for name, ckpt in checkpoints.items():
        dirpath = str(base / name)
        files = listing(dirpath)
        last = os.path.join(dirpath, "last.ckpt")
        out[name] = {
            "files": files,
            "best": os.path.basename(ckpt.best_model_path),
            "last": os.path.basename(ckpt.last_model_path),
            "best_k": sorted(os.path.basename(p) for p in ckpt.best_k_models),
            "last_is_link": os.path.islink(last),
            "last_target_step": load(last)["global_step"] if os.path.exists(last) else None,
            "uploaded": sorted({os.path.basename(p) for p in logger.uploaded
                                if os.path.dirname(p) == os.path.abspath(dirpath)}),
            "all_loadable": all(isinstance(load(os.path.join(dirpath, f))["global_step"], int) for f in files),
        }
    return out


def test_model_checkpoint_outcome_matches_the_default(tmp_path):
    """Names and -vN versions, top-k removal (min and max), save_last copy and
    link, every_n_train_steps / every_n_epochs; best/last paths read during
    training exist; log_model='all' uploads every checkpoint the default uploads."""
    expected = _outcomes("default", tmp_path)
    assert expected["reads_found"]
    assert all(case["all_loadable"] and case["files"] for name, case in expected.items() if name != "reads_found")
    for kind in KINDS[1:]:
        assert _outcomes(kind, tmp_path) == expected, kind


# ----------------------------------------------------------------------------- resume, load, interop


def test_resume_last_and_best_load_from_checkpoint_and_save_after_fit(kind, tmp_path):
    """Resume with ckpt_path="last" / "best"; load_from_checkpoint and the
    default CheckpointIO read the plugin's files; trainer.save_checkpoint()
    after fit is on disk and complete when it returns (not at exit)."""
    dirpath = tmp_path / "ck"
    kw = dict(monitor="score", mode="min", save_top_k=2, every_n_train_steps=1, save_last="link")
    trainer, ckpt, _, _ = fit(kind, dirpath, epochs=1, **kw)
    best = ckpt.best_model_path
    trainer.validate(trainer.lightning_module, loader(16), ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == best
    resumed, _, _, _ = fit(kind, dirpath, epochs=2, ckpt_path="last", **kw)
    assert resumed.global_step == 16                         # 8 restored + 8 more, not 16 from scratch
    after = str(tmp_path / "after.ckpt")
    resumed.save_checkpoint(after)
    assert load(after)["global_step"] == 16
    if kind not in ("default", "lazy-lazyckpt"):             # lazyckpt's own format: read through the plugin
        model = Tiny.load_from_checkpoint(best)              # no plugin involved at all
        assert torch.equal(model.net[0].weight, load(best)["state_dict"]["net.0.weight"])
        plain, _, _, _ = fit("default", tmp_path / "plain", epochs=2, ckpt_path=best)
        assert plain.global_step == 16


def test_fitted_trainer_pickles_and_a_save_outside_a_run_leaves_no_thread(tmp_path, no_leaked_threads):
    """Lightning's test_model_torch_save (torch.save of a fitted Trainer: its
    ModelCheckpoint held a weakref to the plugin) and
    test_save_last_saves_correct_last_model_path (a save outside a run is
    durable on return and nothing calls teardown() afterwards: the writer
    thread must not outlive it)."""
    import pickle
    trainer, _, _, _ = fit("lazy-torch", tmp_path / "ck", epochs=1, save_top_k=1)
    trainer.callbacks = [cb for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]  # Observer: local state
    clone = pickle.loads(pickle.dumps(trainer))
    assert clone.checkpoint_callback.best_model_path == trainer.checkpoint_callback.best_model_path
    trainer.save_checkpoint(str(tmp_path / "after.ckpt"))
    assert load(str(tmp_path / "after.ckpt"))["global_step"] == 8


def test_a_load_outside_a_run_leaves_no_thread(tmp_path):
    """Lightning's test_model_torch_save_ddp_cpu with file_format="lazyckpt": after
    ddp_spawn the launcher loads the workers' weights through the plugin in the
    main process, outside any run, and nothing calls teardown() afterwards: the
    reader threads the load started must not outlive it."""
    writer = lzl.LazyCheckpointIO(file_format="lazyckpt")
    writer.save_checkpoint({"w": torch.arange(4.0).repeat(1 << 20)}, str(tmp_path / "w.ckpt"))
    writer.teardown()
    before = set(threading.enumerate())
    reader = lzl.LazyCheckpointIO(file_format="lazyckpt")          # kept, as Lightning's strategy keeps it
    loaded = reader.load_checkpoint(str(tmp_path / "w.ckpt"))
    assert torch.equal(loaded["w"], torch.arange(4.0).repeat(1 << 20))
    kept = keptpools.threads()                                    # the process's, started as work needs them
    started = [t.name for t in threading.enumerate()
               if t not in before and t not in kept and t.name.startswith("lazyckpt-")]
    assert not started, started


# ----------------------------------------------------------------------------- in-place changes after a save


@pytest.mark.parametrize("kind", [pytest.param("default", marks=pytest.mark.slow), "lazy-torch", "lazy-lazyckpt"])
def test_in_place_changes_after_a_save_are_not_in_it(kind, tmp_path):
    """The module's on_train_batch_end (after ModelCheckpoint's) halves a
    weight, and (manual optimization) training_step shifts a bias before the
    step. Each checkpoint holds the state at its save."""
    model = Tiny(width=512, mutate_after_save=True, manual=True)
    _, _, observer, _ = fit(kind, tmp_path / "ck", epochs=1, model=model, save_top_k=-1, every_n_train_steps=1)
    for step in range(1, 9):
        name = os.path.join(tmp_path, "ck", f"epoch=0-step={step}.ckpt")
        saved = load(name)["state_dict"]
        for key, value in observer.weights[step].items():
            assert torch.equal(saved[key], value), (step, key)


def test_direct_save_then_in_place_change_is_not_in_the_checkpoint(tmp_path):
    """Lightning's AsyncCheckpointIO contract for a direct call: nothing guards
    the caller's next line, so save_checkpoint returns once captured."""
    plugin = lzl.LazyCheckpointIO(**SLOW_KNOBS)
    t = torch.zeros(1 << 18)
    plugin.save_checkpoint({"x": t}, str(tmp_path / "a.ckpt"))
    t.add_(1.0)
    plugin.teardown()
    assert load(str(tmp_path / "a.ckpt"))["x"].sum().item() == 0.0


# ----------------------------------------------------------------------------- kills and ENOSPC

CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import torch, lightning.pytorch as L
    from test_lightning_contract import Tiny, loader, make_plugin, ModelCheckpoint
    kind, dirpath, kill_at = sys.argv[1], sys.argv[2], sys.argv[3]
    what, nth, when = kill_at.split(":")
    calls = [0]
    def killing(fn):
        def wrapper(*a, **k):
            calls[0] += 1
            if calls[0] == int(nth) and when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            out = fn(*a, **k)
            if calls[0] == int(nth) and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        return wrapper
    from lazyckpt.integrations import lightning as lzl
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.callbacks import model_checkpoint as mc
    from lazyckpt.storage import localstore
    if what == "remove":
        lzl._LazyCheckpointIOImpl._remove = killing(lzl._LazyCheckpointIOImpl._remove)
        TorchCheckpointIO.remove_checkpoint = killing(TorchCheckpointIO.remove_checkpoint)
    elif what == "link":
        # Every link the plugin makes: last.ckpt's symlink, and the stand-in's hard link
        # (at publication, or through the store's copy_file once the file is visible).
        lzl._replace_with_link = killing(lzl._replace_with_link)
        localstore.replace_with_link = killing(localstore.replace_with_link)
        mc.ModelCheckpoint._link_checkpoint = staticmethod(killing(mc.ModelCheckpoint._link_checkpoint))
    plugin = make_plugin(kind)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[plugin] if plugin else None,
                        callbacks=[ModelCheckpoint(dirpath=dirpath, monitor="score", save_top_k=1,
                                                   every_n_train_steps=1, save_last="link")])
    torch.manual_seed(0)
    trainer.fit(Tiny(), loader())
    print("finished")
""")


def _child(kind, dirpath, kill_at, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(here=HERE))
    env = child_env(PYTHONPATH=os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "src")]))
    return subprocess.run([sys.executable, str(script), kind, str(dirpath), kill_at], env=env,
                          capture_output=True, text=True, timeout=240)


def _resumable(kind, dirpath, tmp_path):
    """last.ckpt resolves to a complete checkpoint and fit(ckpt_path='last') continues from it."""
    last = os.path.join(dirpath, "last.ckpt")
    if kind == "default" and not os.path.exists(last):
        pytest.xfail("Lightning's own order: the old top-k file is removed before last.ckpt is re-linked; "
                     "a kill in between leaves it dangling with the default CheckpointIO")
    if not os.path.lexists(last) and not listing(dirpath):
        return                              # killed before the first commit: nothing to resume from
    assert os.path.exists(last), listing(dirpath)            # not a dangling link
    saved = load(last)
    if kind != "default":                   # issue 35 (1): and it names the newest committed checkpoint
        # (or a newer one: it names the new file's durable bytes just before their rename publishes them)
        assert saved["global_step"] >= max(_committed_steps(dirpath).values(), default=0), listing(dirpath)
    assert saved["global_step"] > 0
    epochs = saved["epoch"] + 2                              # the rest of its epoch and one more
    trainer, _, _, _ = fit(kind, dirpath, epochs=epochs, ckpt_path="last", monitor="score", save_top_k=1,
                           every_n_train_steps=1, save_last="link")
    assert trainer.global_step == 8 * epochs


# The default plugin's outcome (a dangling last.ckpt: xfail) is shown by the slow test below.
# Fast: one instant per format (each case is a child process, ~40 s on a loaded 2-core machine).
@pytest.mark.parametrize("kind, kill_at", [
    ("lazy-torch", "link:4:before"), ("lazy-lazyckpt", "remove:1:after"),
    pytest.param("lazy-torch", "remove:3:after", marks=pytest.mark.slow),
    pytest.param("lazy-lazyckpt", "link:4:before", marks=pytest.mark.slow)])
def test_sigkill_around_topk_removal_and_last_link_leaves_a_resumable_checkpoint(kind, kill_at, tmp_path):
    dirpath = tmp_path / "ck"
    proc = _child(kind, dirpath, kill_at, tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    _resumable(kind, dirpath, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [f"{w}:{n}:{t}" for w in ("remove", "link") for n in (1, 2, 5, 9)
                                     for t in ("before", "after")])
def test_sigkill_at_every_instant_around_removal_and_link(kind, kill_at, tmp_path):
    dirpath = tmp_path / "ck"
    proc = _child(kind, dirpath, kill_at, tmp_path)
    if proc.returncode == 0 and "finished" in proc.stdout:
        pytest.skip(f"{kill_at}: {kind} makes fewer such calls in this run; no instant to kill at")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    _resumable(kind, dirpath, tmp_path)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1.5 MiB tmpfs: room for two checkpoints of Tiny(width=512) plus a bit, not three."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {proc.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_enospc_on_a_new_checkpoint_keeps_the_previous_one(kind, small_tmpfs, tmp_path):
    """save_top_k=1 + last link on a file system that fills up: the failed save
    raises (from fit) and the previous checkpoint and last.ckpt stay loadable."""
    dirpath = small_tmpfs / "ck"
    with pytest.raises(Exception) as info:
        fit(kind, dirpath, epochs=3, model=Tiny(width=1024), monitor="score", save_top_k=1,
            every_n_train_steps=1, save_last="link")
    assert "No space left" in repr(info.value) + repr(info.value.__cause__) + str(info.getrepr()), info.value
    last = os.path.join(dirpath, "last.ckpt")
    assert os.path.exists(last), listing(dirpath)
    assert load(last)["global_step"] > 0                   # the previous checkpoint, through the link


# ----------------------------------------------------------------------------- issue 35 (1, 2): last.ckpt

CHILD_AT_BATCH = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import torch, lightning.pytorch as L
    from test_lightning_contract import Tiny, loader, make_plugin, ModelCheckpoint
    kind, dirpath, save_last, kill_batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    class Killer(L.Callback):
        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == kill_batch:
                os.kill(os.getpid(), signal.SIGKILL)
    plugin = make_plugin(kind)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[plugin] if plugin else None,
                        callbacks=[Killer(), ModelCheckpoint(dirpath=dirpath, save_top_k=1, every_n_train_steps=1,
                                                             save_last="link" if save_last == "link" else True)])
    torch.manual_seed(0)
    trainer.fit(Tiny(width=512), loader())
    print("finished")
""")


def _committed_steps(dirpath):
    """global_step of every committed checkpoint file (a visible .ckpt) but last.ckpt."""
    out = {}
    for name in listing(dirpath):
        if name.endswith(".ckpt") and not name.startswith("last"):
            out[name] = load(os.path.join(dirpath, name))["global_step"]
    return out


def _batch_kills():
    # CI: batches 2 and 3, each with one of the two last.ckpt kinds (a Trainer and its
    # resume each, 5-12 s); the other kind at each, and batches 5 and 9, are slow.
    for kill_batch in (2, 3, 5, 9):
        for save_last in ("link", "copy"):
            ci = (kill_batch, save_last) in ((2, "link"), (3, "copy"))
            yield pytest.param(save_last, kill_batch, marks=[] if ci else [pytest.mark.slow],
                               id=f"{kill_batch}-{save_last}")


@pytest.mark.parametrize("save_last,kill_batch", list(_batch_kills()))
def test_a_kill_at_any_batch_leaves_last_naming_the_newest_committed_checkpoint(save_last, kill_batch, tmp_path):
    """Issue 35 (1): a 512-wide model written by one slow writer thread (its
    commit takes longer than a step), killed at the start of a batch: once any
    checkpoint is committed, last.ckpt exists and names the newest of them (on
    main: no last.ckpt and the resume trained from scratch), and
    ``fit(ckpt_path="last")`` resumes from it. (2): the resumed run leaves
    neither the killed save's hidden temporary nor an untracked top-k file."""
    dirpath = tmp_path / "ck"
    script = tmp_path / "child.py"
    script.write_text(CHILD_AT_BATCH.format(here=HERE))
    env = child_env(PYTHONPATH=os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "src")]))
    proc = subprocess.run([sys.executable, str(script), "lazy-torch", str(dirpath),
                           "link" if save_last == "link" else "true", str(kill_batch)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    committed = _committed_steps(dirpath)
    assert committed, os.listdir(dirpath)                     # the first commit happened before the kill
    last = os.path.join(dirpath, "last.ckpt")
    assert os.path.exists(last), os.listdir(dirpath)
    # The newest committed one (or newer: last.ckpt names a file's durable bytes just before its rename).
    assert load(last)["global_step"] >= max(committed.values()), (committed, os.listdir(dirpath))
    if save_last == "copy":
        assert not os.path.islink(last)                       # save_last=True: a file of its own, as by default

    resumed_from = load(last)["global_step"]
    trainer, _, _, _ = fit("lazy-torch", dirpath, epochs=3, ckpt_path="last", save_top_k=1,
                           every_n_train_steps=1, save_last="link" if save_last == "link" else True,
                           model=Tiny(width=512))
    assert trainer.global_step == 24 and resumed_from > 0
    names = sorted(os.listdir(dirpath))
    assert not [n for n in names if n.startswith(".")], names      # no temporary of the killed run is left
    assert {"epoch=2-step=24.ckpt", "last.ckpt"} <= set(names), names
