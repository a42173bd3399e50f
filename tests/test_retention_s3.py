"""Retention policies against a real S3 server (SeaweedFS, the ``s3_server``
fixture): an ``s3://`` directory and the persistent tier keep what their
policy keeps (tests/test_retention.py has the policies themselves)."""

from __future__ import annotations

import pytest
import torch

import lazyckpt
from lazyckpt.formats import manifest as manifests
from lazyckpt.retention import KeepBest, KeepEvery, KeepLast


@pytest.fixture
def s3env(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


def _state(step):
    return {"w": torch.arange(256, dtype=torch.float32) + step, "n": step}


def _keys(server, bucket, prefix):
    out = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def test_policies_on_an_s3_directory(s3env, s3_bucket, monkeypatch):
    parsed = []
    real = manifests.parse
    monkeypatch.setattr(manifests, "parse", lambda raw, path: (parsed.append(str(path)), real(raw, path))[1])
    url = f"s3://{s3_bucket}/run"
    losses = {s: float((s * 37) % 11) for s in range(1, 13)}
    with lazyckpt.Checkpointer(url, keep=KeepLast(2) | KeepEvery(5) | KeepBest(1)) as ck:
        for step, loss in losses.items():
            ck.save(_state(step), step, metadata={"loss": loss}).wait()
        best = min(losses, key=lambda s: (losses[s], -s))
        assert ck.steps() == sorted({5, 10, 11, 12, best})
        for step in ck.steps():
            assert torch.equal(ck.load(step)["w"], _state(step)["w"])
        # Each save's metadata read once (kept steps are not read again every pass).
        assert len([p for p in parsed if p.startswith(url)]) <= len(losses) + len(ck.steps())
        # A rollback: the superseded steps go, whatever the policy would keep.
        ck.save(_state(60), 6, metadata={"loss": 99.0}).wait()
        assert ck.steps() == sorted({5, 6} | ({best} if best < 6 else set()))
        with pytest.raises(ValueError, match="'loss'"):
            ck.save(_state(7), 7, metadata={"acc": 1.0})
    keys = _keys(s3env, s3_bucket, "run/")
    assert not any("step_0000000012" in k or "step_0000000001/" in k for k in keys)


def test_policies_on_the_persistent_tier(s3env, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/tiered"
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0, 7: 3.0}
    persist = lazyckpt.Persist(url, keep=KeepBest(2, metric="loss") | KeepEvery(3))
    with lazyckpt.Checkpointer(tmp_path, keep=KeepLast(1), persist=persist) as ck:
        for step, loss in losses.items():
            ck.save(_state(step), step, metadata={"loss": loss}).wait(persisted=True)
        ck.wait()
        assert ck.steps() == [7]
        assert ck.persistent.dir.steps() == [2, 3, 4, 6, 7]
        with pytest.raises(ValueError, match=r"Persist\(keep\)"):
            ck.save(_state(8), 8)
        # A rollback to step 3: the local tier and the store drop 4, 6 and 7.
        ck.save(_state(40), 4, metadata={"loss": 9.0}).wait(persisted=True)
        ck.wait()
        assert ck.steps() == [4]
        assert ck.persistent.dir.steps() == [2, 3, 4]
    # A new node reads the best steps back from the store.
    with lazyckpt.Checkpointer(tmp_path / "new", persist=url) as ck:
        assert ck.load(2)["n"] == 2 and ck.loaded_from["tier"] == "persistent"
