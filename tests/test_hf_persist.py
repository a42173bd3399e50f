"""The Hugging Face Trainer with a persistent tier (issue 35, 8):
``LazyCheckpointTrainer(..., lazyckpt_persist="s3://...")`` uploads every
committed ``checkpoint-<step>`` (``trainer_state.json`` last: complete there
only then), applies ``save_total_limit`` rotation to the store, and
``train(resume_from_checkpoint=True)`` with ``output_dir`` deleted fetches the
newest complete checkpoint back and resumes bit-exact. Against SeaweedFS."""

from __future__ import annotations

import os
import shutil

import pytest

import lazyckpt

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from _frameworks import require  # noqa: E402

transformers = require("transformers")
require("accelerate")

from test_huggingface import _Data, _Record, _Trainer, _assert_same, _model, _snapshot  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def store(s3_server, s3_bucket):
    options = {"endpoint_url": s3_server.endpoint, "access_key_id": s3_server.access_key,
               "secret_access_key": s3_server.secret_key, "region": s3_server.region}
    return s3_server, s3_bucket, options


class _StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True       # the run "dies" after this step's save


def _train(out, store, seed=0, resume=None, stop_at=None, fmt="hf", persist=True):
    server, bucket, options = store
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=2, save_strategy="steps", save_steps=2, save_total_limit=2,
        logging_steps=1, report_to=[], dataloader_num_workers=0, seed=42, use_cpu=True, disable_tqdm=True)
    record = _Record()
    callbacks = [record] + ([_StopAt(stop_at)] if stop_at else [])
    trainer = _Trainer(model=_model(seed), args=args, train_dataset=_Data(), callbacks=callbacks,
                       lazyckpt_options={"host_cache_bytes": 1 << 20},
                       lazyckpt_checkpoint_format=fmt,
                       lazyckpt_persist=lazyckpt.Persist(f"s3://{bucket}/tier", storage_options=options)
                       if persist else None)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


def _store_files(store, prefix):
    server, bucket, _ = store
    client = server.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(prefix) + 1:]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def _local_files(root):
    out = {}
    for top, _, files in os.walk(root):
        for name in files:
            p = os.path.join(top, name)
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = f.read()
    return out


@pytest.mark.parametrize("fmt", ["hf", "lazyckpt"])
def test_persist_to_mirrors_checkpoints_and_rotation_and_resumes_with_output_dir_gone(fmt, store, tmp_path):
    full, rec_full = _train(tmp_path / "full", store, fmt=fmt, persist=False)

    out = tmp_path / "out"
    stopped, _ = _train(out, store, stop_at=4, fmt=fmt)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-4"]
    # train() returned: every file of every checkpoint is on the store, byte for byte.
    assert _store_files(store, "tier") == _local_files(out)
    assert stopped.lazyckpt_mirror is None or stopped.lazyckpt_mirror.done > 0

    shutil.rmtree(out)                                       # the node is lost
    resumed, rec = _train(out, store, seed=1, resume=True, fmt=fmt)
    _assert_same(rec.at["begin"], rec_full.at[4])            # the store's checkpoint-4, fetched
    assert resumed.losses == full.losses[4:]                 # steps 5..8, bit for bit
    _assert_same(_snapshot(resumed.model, resumed.optimizer), _snapshot(full.model, full.optimizer))
    # Rotation (save_total_limit=2) applied to the store as to the directory.
    assert sorted(os.listdir(out)) == ["checkpoint-6", "checkpoint-8"]
    assert _store_files(store, "tier") == _local_files(out)


def test_persist_to_must_be_an_object_store(tmp_path):
    with pytest.raises(ValueError, match="expected an object store URL"):
        _Trainer(model=_model(0), args=transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                      report_to=[]),
                 lazyckpt_persist=str(tmp_path / "elsewhere"))


def test_every_rank_of_a_node_may_fetch_the_same_checkpoint_at_once(store, tmp_path):
    """With DDP every rank resumes: on one node they fetch the same checkpoint-<step>
    at once. One rename wins; the others drop their copy; no error, no leftover."""
    import threading
    from lazyckpt.knobs import resolve
    from lazyckpt.storage.stores import for_path
    from lazyckpt.tiers.files import FileMirror
    server, bucket, options = store
    src = tmp_path / "src" / "checkpoint-2"
    src.mkdir(parents=True)
    for name, data in {"model.bin": os.urandom(300_000), "sub/extra.json": b"{}", "trainer_state.json": b"{1}"}.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    opts = resolve(storage_options=options)
    up = FileMirror(for_path(f"s3://{bucket}/t"), f"s3://{bucket}/t", str(tmp_path / "src"), opts)
    up.uploaded_dir(str(src), "trainer_state.json")
    up.close()
    up.raise_errors()
    assert up.complete_dirs(str(tmp_path / "src"), "trainer_state.json") == ["checkpoint-2"]

    down = FileMirror(for_path(f"s3://{bucket}/t"), f"s3://{bucket}/t", str(tmp_path / "dst"), opts)
    target, errors = str(tmp_path / "dst" / "checkpoint-2"), []

    def fetch():
        try:
            down.fetch_dir(target)
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert _local_files(target) == _local_files(src)
    assert os.listdir(tmp_path / "dst") == ["checkpoint-2"]        # no hidden copy left behind


def test_after_a_failed_upload_the_tier_deletes_nothing_and_marks_nothing_complete(store, tmp_path):
    """The store refuses an upload (wrong credentials for that one operation): the
    directory it was for is not marked complete there, the removal of the older
    checkpoint that followed is skipped (an older complete checkpoint beats none),
    and the failure is raised (found by review: the marker went up anyway, and
    the older checkpoint was deleted)."""
    import dataclasses
    from lazyckpt.errors import CheckpointError
    from lazyckpt.knobs import resolve
    from lazyckpt.storage.stores import for_path
    from lazyckpt.tiers.files import FileMirror
    server, bucket, options = store
    root = tmp_path / "out"
    for step in (2, 4):
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "model.bin").write_bytes(os.urandom(1000))
        (d / "trainer_state.json").write_bytes(b"{}")
    good = resolve(storage_options=options)
    bad = dataclasses.replace(good, storage_options=resolve(storage_options=dict(options, secret_access_key="wrong"))
                              .storage_options)
    mirror = FileMirror(for_path(f"s3://{bucket}/t"), f"s3://{bucket}/t", str(root), good)
    mirror.uploaded_dir(str(root / "checkpoint-2"), "trainer_state.json")
    mirror.wait()
    mirror.options = bad                                   # the next operation is refused by the store
    mirror.uploaded_dir(str(root / "checkpoint-4"), "trainer_state.json")
    mirror.wait()
    mirror.options = good
    mirror.removed_dir(str(root / "checkpoint-2"), "trainer_state.json")
    mirror.close()
    with pytest.raises(CheckpointError):
        mirror.raise_errors()
    assert mirror.complete_dirs(str(root), "trainer_state.json") == ["checkpoint-2"]
