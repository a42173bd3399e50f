"""Lightning with ``ModelCheckpoint(dirpath="s3://...")`` (issue 35, 8): with
``LazyCheckpointIO`` it writes, rotates, resumes and loads as the default
``TorchCheckpointIO`` does through fsspec, against a real SeaweedFS server.
Lightning itself refuses ``save_last="link"`` for a remote dirpath, so only
``save_last=True`` (a copy) is compared."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from _env import child_env
from _frameworks import require

L = require("lightning.pytorch")
require("s3fs")                     # Lightning's ModelCheckpoint lists s3:// through fsspec
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt.integrations import lightning as lzl  # noqa: E402
from test_lightning_contract import HERE, KINDS, UploadingLogger, fit, loader, make_plugin, Tiny  # noqa: E402

pytestmark = pytest.mark.timeout(300)

#: The contract test's configurations that Lightning accepts on a remote dirpath.
CONFIGS = {
    "versions": dict(filename="fixed", save_top_k=-1, every_n_train_steps=1),
    "topk-monitor-last-copy": dict(monitor="score", mode="min", save_top_k=2, every_n_train_steps=1, save_last=True),
    "top1-no-monitor-last": dict(save_top_k=1, every_n_train_steps=3, save_last=True),
    "every-2-steps-versions-last": dict(filename="{epoch}", save_top_k=-1, every_n_train_steps=2, save_last=True),
}


@pytest.fixture
def s3env(s3_server, monkeypatch):
    """The AWS environment pointing at the test server: fsspec (Lightning) and lazyckpt both read it."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


def _objects(server, bucket, prefix):
    out = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        out += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
    return sorted(out)


def _load(server, url):
    """What a user finds at ``url``: torch.load of its bytes (lazyckpt's own format through lazyckpt)."""
    if lzl.is_lazyckpt_file(url):
        return lazyckpt.load(url)
    bucket, key = url[len("s3://"):].split("/", 1)
    raw = server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    return torch.load(io.BytesIO(raw), weights_only=True)


def _outcomes(kind, server, bucket):
    base = f"s3://{bucket}/{kind}"
    checkpoints = {name: ModelCheckpoint(dirpath=f"{base}/{name}", **kw) for name, kw in CONFIGS.items()}
    logger = UploadingLogger()
    _, _, _, model = fit(kind, None, logger=logger, checkpoints=list(checkpoints.values()))
    out = {}
    for name, ckpt in checkpoints.items():
        prefix = f"{kind}/{name}"
        files = _objects(server, bucket, prefix)
        states = {f: _load(server, f"{base}/{name}/{f}") for f in files}
        out[name] = {
            "files": files,
            "best": os.path.basename(ckpt.best_model_path),
            "last": os.path.basename(ckpt.last_model_path),
            "best_k": sorted(os.path.basename(p) for p in ckpt.best_k_models),
            "steps": {f: s["global_step"] for f, s in states.items()},
            # The weights, bit for bit: every file holds what the default's holds.
            "weights": {f: [t.double().sum().item() for t in s["state_dict"].values()] for f, s in states.items()},
            "uploaded": sorted({os.path.basename(p) for p in logger.uploaded if p.startswith(f"{base}/{name}/")}),
        }
    return out


def test_model_checkpoint_on_s3_matches_the_default(s3env, s3_bucket):
    """Names and -vN versions, top-k removal, save_last copies, every_n_train_steps:
    the objects left in the bucket, the callback's paths and every file's step
    and weights are the default plugin's. Before: NotImplementedError."""
    expected = _outcomes("default", s3env, s3_bucket)
    assert all(case["files"] and "last.ckpt" in case["files"] or name == "versions"
               for name, case in expected.items())
    for kind in KINDS[1:]:
        assert _outcomes(kind, s3env, s3_bucket) == expected, kind


@pytest.mark.parametrize("kind", ["lazy-torch", "lazy-lazyckpt"])
def test_resume_from_last_on_s3_and_the_files_are_lightnings(kind, s3env, s3_bucket, tmp_path):
    """fit(ckpt_path="last") on an s3:// dirpath resumes where the run stopped,
    bit-exact against an uninterrupted run; a file_format="torch" checkpoint is
    read by Lightning's own load_from_checkpoint (fsspec), no plugin involved."""
    dirpath = f"s3://{s3_bucket}/run"
    kw = dict(monitor="score", mode="min", save_top_k=2, every_n_train_steps=1, save_last=True)
    trainer, ckpt, _, _ = fit(kind, dirpath, epochs=1, **kw)
    best = ckpt.best_model_path
    assert best.startswith(dirpath + "/")
    resumed, _, _, model = fit(kind, dirpath, epochs=2, ckpt_path="last", **kw)
    assert resumed.global_step == 16                          # 8 restored + 8 more
    straight, _, _, reference = fit("default", tmp_path / "straight", epochs=2, **kw)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    if kind == "lazy-torch":
        loaded = Tiny.load_from_checkpoint(best)
        assert torch.equal(loaded.net[0].weight, _load(s3env, best)["state_dict"]["net.0.weight"])


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {here!r})
    import torch, lightning.pytorch as L
    from test_lightning_contract import Tiny, loader, make_plugin, ModelCheckpoint
    dirpath, kill_batch = sys.argv[1], int(sys.argv[2])
    class Killer(L.Callback):
        def on_train_batch_start(self, trainer, *_):
            if trainer.global_step == kill_batch:
                os.kill(os.getpid(), signal.SIGKILL)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[make_plugin("lazy-torch")],
                        callbacks=[Killer(), ModelCheckpoint(dirpath=dirpath, save_top_k=1, every_n_train_steps=1,
                                                             save_last=True)])
    torch.manual_seed(0)
    trainer.fit(Tiny(width=512), loader())
""")


@pytest.mark.parametrize("kill_batch", [2, 3])
def test_a_kill_on_s3_leaves_last_naming_a_committed_checkpoint(kill_batch, s3env, s3_bucket, tmp_path):
    """SIGKILL at the start of a batch, saves still uploading (one slow writer):
    every object in the bucket is a whole checkpoint (an upload is visible only
    once complete), last.ckpt exists once one is committed and names one of
    them or the newest, and fit(ckpt_path="last") resumes from it."""
    dirpath = f"s3://{s3_bucket}/run"
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(here=HERE))
    env = child_env(PYTHONPATH=os.pathsep.join([HERE, os.path.join(os.path.dirname(HERE), "src")]))
    proc = subprocess.run([sys.executable, str(script), dirpath, str(kill_batch)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    names = _objects(s3env, s3_bucket, "run")
    steps = {n: _load(s3env, f"{dirpath}/{n}")["global_step"] for n in names}     # every object loads whole
    committed = {n: s for n, s in steps.items() if n != "last.ckpt"}
    assert committed, names
    assert "last.ckpt" in steps, names
    # A server-side copy follows each top-k object's completion: a kill in between leaves
    # last.ckpt on the one before, complete (the stand_in docstring); never an older one.
    assert steps["last.ckpt"] >= max(committed.values()) - 1, steps
    resumed_from = steps["last.ckpt"]
    trainer, _, _, _ = fit("lazy-torch", dirpath, epochs=3, ckpt_path="last", save_top_k=1,
                           every_n_train_steps=1, save_last=True, model=Tiny(width=512))
    assert trainer.global_step == 24 and resumed_from > 0
    assert {"epoch=2-step=24.ckpt", "last.ckpt"} <= set(_objects(s3env, s3_bucket, "run"))
    open_uploads = s3env.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert len(open_uploads) <= 1           # at most the killed run's upload, which prune's cleanup aborts


# ----------------------------------------------------------------------------- persist_to (issue 35, 8)


def _persisting(tmp_path, s3_bucket, **kw):
    return lzl.LazyCheckpointIO(persist=f"s3://{s3_bucket}/tier", local_root=str(tmp_path), **kw)


@pytest.mark.parametrize("save_last", [True, "link"])
def test_persist_to_mirrors_rotation_and_resumes_bit_exact_with_the_local_directory_gone(
        save_last, s3env, s3_bucket, tmp_path, monkeypatch):
    """Files committed locally are uploaded, top-k removals and last.ckpt follow on
    the store; after fit the store holds what the directory holds (last.ckpt a
    whole file there, whichever save_last). With the local directory deleted,
    fit(ckpt_path="last") fetches last.ckpt from the store and resumes bit-exact
    against the same resume from the kept directory with the default plugin.
    Before: persist_to refused."""
    monkeypatch.chdir(tmp_path)
    dirpath = tmp_path / "ck"
    kw = dict(monitor="score", mode="min", save_top_k=2, every_n_train_steps=1, save_last=save_last)
    plugin = _persisting(tmp_path, s3_bucket)
    trainer, ckpt, _, _ = fit(plugin, dirpath, epochs=1, **kw)
    local = sorted(os.listdir(dirpath))
    assert _objects(s3env, s3_bucket, "tier/ck") == local and "last.ckpt" in local
    for name in local:             # each object is the local file's checkpoint, bit for bit
        a, b = _load(s3env, f"s3://{s3_bucket}/tier/ck/{name}"), torch.load(dirpath / name, weights_only=True)
        assert a["global_step"] == b["global_step"] and all(
            torch.equal(x, y) for x, y in zip(a["state_dict"].values(), b["state_dict"].values())), name
    assert plugin.mirror.done >= len(local)

    import shutil
    shutil.rmtree(dirpath)                                   # the node is lost
    resumed, _, _, model = fit(_persisting(tmp_path, s3_bucket), dirpath, epochs=2, ckpt_path="last", **kw)
    assert resumed.global_step == 16                         # 8 restored from the store + 8 more
    # The oracle: the same two runs with the default plugin and the directory kept.
    fit("default", tmp_path / "ref", epochs=1, **kw)
    _, straight, _, reference = fit("default", tmp_path / "ref", epochs=2, ckpt_path="last", **kw)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    # The rotation went on from the callback's restored state: the store holds the files
    # the default leaves (a top-k file of the first run included, which only the store
    # has now), and best_model_path loads from it although it is not local.
    assert _objects(s3env, s3_bucket, "tier/ck") == sorted(os.listdir(tmp_path / "ref"))
    assert set(os.listdir(dirpath)) <= set(_objects(s3env, s3_bucket, "tier/ck"))
    best = resumed.checkpoint_callback.best_model_path
    assert os.path.basename(best) == os.path.basename(straight.best_model_path)
    got = resumed.strategy.checkpoint_io.load_checkpoint(best)
    assert got["global_step"] == torch.load(straight.best_model_path, weights_only=True)["global_step"]


def test_persist_to_refusals_say_why(s3env, s3_bucket, tmp_path):
    with pytest.raises(ValueError, match="expected an object store URL"):
        lzl.LazyCheckpointIO(persist=str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="local_root= names what persist= mirrors"):
        lzl.LazyCheckpointIO(local_root=str(tmp_path))
    plugin = _persisting(tmp_path / "root", s3_bucket)
    with pytest.raises(ValueError, match="outside local_root"):
        plugin.save_checkpoint({"x": torch.zeros(2)}, str(tmp_path / "other" / "a.ckpt"))
    with pytest.raises(ValueError, match="already on an object store"):
        plugin.save_checkpoint({"x": torch.zeros(2)}, f"s3://{s3_bucket}/direct/a.ckpt")
    plugin.teardown()
