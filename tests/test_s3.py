"""Object storage and tiers, against a real S3 server (SeaweedFS on loopback,
started by the ``s3_server`` fixture), with faults injected by a real HTTP
proxy in front of it (tests/_s3proxy.py)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch

import lazyckpt
from lazyckpt.errors import (CheckpointError, CheckpointNotFoundError, CheckpointWriteError,
                             CorruptCheckpointError)
from lazyckpt.storage.s3 import StorageConfigError

MiB = 1 << 20


@pytest.fixture
def s3env(s3_server, monkeypatch):
    """The standard AWS environment pointing at the test server."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


def _options(server, endpoint=None, **extra):
    return {"endpoint_url": endpoint or server.endpoint, "access_key_id": server.access_key,
            "secret_access_key": server.secret_key, "region": server.region, **extra}


def _state(seed=0, n=3_000_000):
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.arange(1000, dtype=torch.int64),
                      "h": torch.randn(300, 70, generator=g).to(torch.bfloat16)},
            "step": seed, "name": "run", "lr": [0.1, 0.01]}


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _objects(server, bucket, prefix=""):
    out = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _open_uploads(server, bucket):
    return server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


# ---------------------------------------------------------------------- one object

def test_file_roundtrip_with_parts_assembled_from_several_windows(s3env, s3_bucket):
    """1 MiB cache windows make 5 MiB parts from five writes each, plus the
    header, the tensor/object boundary and the footer: all must land whole."""
    state = _state()
    url = f"s3://{s3_bucket}/ckpt/one.lzc"
    size = lazyckpt.save(state, url, chunk_bytes=MiB, host_cache_bytes=4 * MiB)
    assert size > 2 * 5 * MiB          # three parts, the last one short
    _equal(lazyckpt.load(url), state)
    # keys= reads only what is asked; into= fills in place.
    assert torch.equal(lazyckpt.load(url, keys=[("model", "b")])["model"]["b"], state["model"]["b"])
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    lazyckpt.load(url, keys=["model"], into=into)
    _equal(into["model"], state["model"])
    assert _open_uploads(s3env, s3_bucket) == []


def test_small_file_is_one_put_and_large_windows_upload_zero_copy(s3env, s3_bucket):
    small = {"x": torch.arange(10)}
    lazyckpt.save(small, f"s3://{s3_bucket}/small.lzc")
    assert torch.equal(lazyckpt.load(f"s3://{s3_bucket}/small.lzc")["x"], small["x"])
    big = {"w": torch.randn(4 * MiB)}         # 16 MiB in 8 MiB windows: whole parts from the cache
    lazyckpt.save(big, f"s3://{s3_bucket}/big.lzc", chunk_bytes=8 * MiB, host_cache_bytes=16 * MiB)
    assert torch.equal(lazyckpt.load(f"s3://{s3_bucket}/big.lzc")["w"], big["w"])


@pytest.mark.parametrize("file_format", ["torch", "safetensors"])
def test_foreign_file_formats_are_written_whole_to_the_object_store(s3env, s3_bucket, file_format):
    """file_format="torch" and "safetensors" to s3:// (Lightning's .ckpt on a bucket):
    a 13 MB file in three parts, assembled from 1 MiB windows, read back by the
    formats' own readers. A torch zip's CRC-32s are combined at the end, when its
    parts are uploaded: they go into the central directory (the last part, kept
    in memory until then), which zipfile checks; torch.load checks none."""
    import io
    import zipfile
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(3_000_000, generator=g), "b": torch.arange(1000),
             "h": torch.randn(300, 70, generator=g).to(torch.bfloat16)}
    url = f"s3://{s3_bucket}/ckpt/one.{'pt' if file_format == 'torch' else 'safetensors'}"
    size = lazyckpt.save(state, url, file_format=file_format, chunk_bytes=MiB, host_cache_bytes=4 * MiB)
    assert size > 2 * 5 * MiB
    raw = s3env.client().get_object(Bucket=s3_bucket, Key=url.split("/", 3)[3])["Body"].read()
    assert len(raw) == size
    if file_format == "torch":
        assert zipfile.ZipFile(io.BytesIO(raw)).testzip() is None
        got = torch.load(io.BytesIO(raw), weights_only=True)
    else:
        from safetensors.torch import load as load_safetensors
        got = load_safetensors(raw)
    _equal(got, state)
    assert _open_uploads(s3env, s3_bucket) == []


def test_a_dcp_file_whose_indexes_sit_in_the_middle_of_the_object_is_written_whole(s3env, s3_bucket):
    """LazyStorageWriter(file_format="dcp") on s3://: every tensor is a zip of its
    own, its index (and CRC-32) after its bytes, so parts in the middle of the
    object are rewritten at the end. Before, such a part was uploaded again from
    a buffer holding only the patched 4 KiB: the save committed an object whose
    tensors read "File is not a zip file". The reader checks every CRC-32."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(900_000, generator=g) for i in range(5)}      # 18 MB: four parts
    url = f"s3://{s3_bucket}/run/step1"
    dcp.save(state, storage_writer=LazyStorageWriter(url, file_format="dcp", chunk_bytes=MiB,
                                                     host_cache_bytes=4 * MiB), no_dist=True)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(into, storage_reader=LazyStorageReader(url), no_dist=True)
    _equal(into, state)
    assert _open_uploads(s3env, s3_bucket) == []


def test_storage_options_override_the_environment(s3_server, s3_bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    state = {"x": torch.arange(100)}
    with pytest.raises(CheckpointError):
        lazyckpt.save(state, f"s3://{s3_bucket}/o.lzc")
    lazyckpt.save(state, f"s3://{s3_bucket}/o.lzc", storage_options=_options(s3_server))
    out = lazyckpt.load(f"s3://{s3_bucket}/o.lzc", storage_options=_options(s3_server))
    assert torch.equal(out["x"], state["x"])


def test_ranged_reads_go_from_the_socket_into_the_buffer_and_keep_their_connection(s3_server, s3_bucket, caplog):
    """Ranged GETs land in the caller's buffer without urllib3's bytes copy, and
    the connection goes back to the pool (closing the body would otherwise close
    it: a new connection per GET). The end of the object: a short read."""
    import logging
    import random
    from lazyckpt.storage import s3
    store, key = s3.store_for(f"s3://{s3_bucket}/ranged.bin", tuple(sorted(_options(s3_server).items())))
    data = random.Random(5).randbytes(3 * MiB + 123)
    store.put(key, data)
    body = store.client.get_object(Bucket=s3_bucket, Key=key, Range="bytes=0-9")["Body"]
    assert s3._socket_reader(body._raw_stream) is not None      # the direct path applies here
    body.close()
    store.read_into(key, memoryview(bytearray(10)), 0)          # one connection in the pool
    caplog.set_level(logging.DEBUG, logger="urllib3.connectionpool")
    rng = random.Random(7)
    for _ in range(20):
        offset, n = rng.randrange(len(data)), rng.randrange(1, MiB)
        buf = bytearray(n)
        got = store.read_into(key, memoryview(buf), offset)
        assert got == min(n, len(data) - offset) and bytes(buf[:got]) == data[offset:offset + got]
    opened = [r for r in caplog.records if "Starting new" in r.getMessage()]
    assert opened == [], [r.getMessage() for r in opened]


def test_load_of_a_missing_object_is_not_found(s3env, s3_bucket):
    with pytest.raises(CheckpointNotFoundError):
        lazyckpt.load(f"s3://{s3_bucket}/nothing-here")


# ---------------------------------------------------------------------- a directory on the store

def test_checkpointer_on_the_object_store(s3env, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    states = []
    with lazyckpt.Checkpointer(url, keep=2, io=lazyckpt.IO(chunk_bytes=MiB)) as ck:
        for step in range(4):
            states.append(_state(step, 200_000))
            h = ck.save(states[-1], step)
            h.wait(persisted=True)          # the commit is on persistent storage
        assert ck.steps() == [2, 3]
        _equal(ck.load(), states[3])
        _equal(ck.load(2), states[2])
        assert ck.loaded_from["step"] == 2
    keys = _objects(s3env, s3_bucket, "run/")
    assert "run/latest" in keys
    assert not any("step_0000000000" in k or "step_0000000001" in k for k in keys)
    _equal(lazyckpt.load(url), states[3])       # the latest step, by URL


def test_object_store_saves_supersede_and_ignore_uncommitted_prefixes(s3env, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    client = s3env.client()
    # An interrupted save: data, no manifest. Invisible.
    client.put_object(Bucket=s3_bucket, Key="run/step_0000000009/deadbeef/rank_00000.lzc", Body=b"x" * 100)
    with lazyckpt.Checkpointer(url) as ck:
        for step in (1, 2, 3):
            ck.save(_state(step, 1000), step).wait()
        assert ck.steps() == [1, 2, 3]
        ck.save(_state(10, 1000), 2).wait()      # resumed from step 1: steps >= 2 are abandoned
        assert ck.steps() == [1, 2]
        _equal(ck.load(), _state(10, 1000))
        # Young leftovers may be a save in progress: kept; old ones are cleaned.
        assert any("deadbeef" in k for k in _objects(s3env, s3_bucket))
        # A dead writer's open multipart upload is aborted too.
        client.create_multipart_upload(Bucket=s3_bucket, Key="run/step_0000000011/cafe/rank_00000.lzc")
        assert ck.layout.clean_leftovers(expiry_s=0)
        assert not any("deadbeef" in k for k in _objects(s3env, s3_bucket))
        assert _open_uploads(s3env, s3_bucket) == []


def test_failed_object_store_save_leaves_nothing_and_keeps_the_previous(s3env, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(chunk_bytes=MiB)) as ck:
        ck.save(_state(1, 100_000), 1).wait()
        bad = _state(2, 100_000)
        bad["obj"] = lambda: None           # cannot be serialized: fails after data was uploaded
        with pytest.raises(CheckpointError):
            ck.save(bad, 2).wait()
        assert ck.steps() == [1]
        _equal(ck.load(), _state(1, 100_000))
    assert not any("step_0000000002" in k for k in _objects(s3env, s3_bucket))
    assert _open_uploads(s3env, s3_bucket) == []


# ---------------------------------------------------------------------- tiers

def test_tiered_commit_local_then_persist(s3env, s3_bucket, tmp_path):
    local = tmp_path / "local"
    url = f"s3://{s3_bucket}/tiered"
    state = _state(0)
    with lazyckpt.Checkpointer(local, keep=1, persist=lazyckpt.Persist(url, keep=2),
                               io=lazyckpt.IO(chunk_bytes=MiB)) as ck:
        handles = []
        for step in range(3):
            state["model"]["w"].add_(1)
            h = ck.save(state, step)
            h.wait(persisted=True)
            handles.append(h)
            assert h.persist_state == "persisted"
            stats = h.stats()
            assert stats["tiers"]["local"] <= stats["tiers"]["persistent"]
        ck.wait()
        assert ck.steps() == [2]                    # local keep_last, once drained
        assert ck.persistent.dir.steps() == [1, 2]  # persist_keep_last
        _equal(ck.load(), state)
        assert ck.loaded_from["tier"] == "local"
    # A replaced node: the local tier is empty; the newest step comes from the store.
    shutil.rmtree(local)
    with lazyckpt.Checkpointer(local, persist=url) as ck:
        _equal(ck.load(), state)
        assert ck.loaded_from == {"step": 2, "tier": "persistent", "path": ck.persistent.dir.step_path(2)}
    _equal(lazyckpt.load(url), state)


def test_load_falls_back_to_the_persistent_tier_when_the_local_copy_is_damaged(s3env, s3_bucket, tmp_path):
    url = f"s3://{s3_bucket}/tiered"
    state = _state(3)
    with lazyckpt.Checkpointer(tmp_path, persist=url) as ck:
        ck.save(state, 7).wait(persisted=True)
        data = os.path.join(ck.step_path(7), "rank_00000.lzc")
        with open(data, "r+b") as f:
            f.seek(4096 + 100)
            f.write(b"\xff" * 8)
        _equal(ck.load(), state)
        assert ck.loaded_from["tier"] == "persistent"
        os.truncate(data, 5000)
        _equal(ck.load(), state)
        assert ck.loaded_from["tier"] == "persistent"
        # Damage on the persistent tier too: the error, not a wrong state.
        client = s3env.client()
        key = ck.persistent.dir.step_path(7)[len(f"s3://{s3_bucket}/"):] + "/rank_00000.lzc"
        body = bytearray(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
        body[4096 + 200] ^= 0xFF
        client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
        with pytest.raises(CorruptCheckpointError):
            ck.load()


def test_corrupt_or_truncated_object_is_refused(s3env, s3_bucket):
    url = f"s3://{s3_bucket}/x.lzc"
    state = _state(5, 300_000)
    lazyckpt.save(state, url)
    client = s3env.client()
    body = client.get_object(Bucket=s3_bucket, Key="x.lzc")["Body"].read()
    flipped = bytearray(body)
    flipped[4096 + 10] ^= 0x01
    client.put_object(Bucket=s3_bucket, Key="x.lzc", Body=bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        lazyckpt.load(url)
    client.put_object(Bucket=s3_bucket, Key="x.lzc", Body=body[:len(body) // 2])
    with pytest.raises(CorruptCheckpointError):
        lazyckpt.load(url)


def test_drain_takes_the_newest_step_and_skips_the_backlog(s3env, s3_bucket, tmp_path):
    """A bandwidth cap makes the drain slower than the saves: waiting steps are
    superseded by newer ones, save() never blocks on the upload."""
    url = f"s3://{s3_bucket}/slow"
    state = _state(0, 1_000_000)                   # 4 MB
    with lazyckpt.Checkpointer(tmp_path, persist=lazyckpt.Persist(url, bandwidth=4e6)) as ck:
        handles = []
        for step in range(5):
            t0 = time.perf_counter()
            handles.append(ck.save(state, step))
            handles[-1].wait()
            assert time.perf_counter() - t0 < 5
        ck.wait()
        states = [h.persist_state for h in handles]
        assert states[0] == "persisted" and states[-1] == "persisted"
        assert any(s.startswith("superseded by step") for s in states), states
        for h in handles:
            h.wait(persisted=True)                 # a superseded step: the newer one is persisted
        assert ck.persistent.dir.steps()[-1] == 4
        assert ck.persistent.dir.steps() == [handles.index(h) for h in handles if h.persist_state == "persisted"]


def test_bandwidth_cap_bounds_the_upload_rate(s3env, s3_bucket, tmp_path):
    state = {"w": torch.randn(2_500_000)}          # 10 MB at 5 MB/s: at least ~2 s
    with lazyckpt.Checkpointer(tmp_path, persist=lazyckpt.Persist(f"s3://{s3_bucket}/cap", bandwidth=5e6)) as ck:
        h = ck.save(state, 0)
        h.wait()
        h.wait(persisted=True)
        assert h.stats()["tiers"]["persistent"] - h.stats()["tiers"]["local"] >= 1.5


def test_wait_persisted_without_a_persistent_tier_is_an_error(tmp_path):
    with lazyckpt.Checkpointer(tmp_path) as ck:
        h = ck.save({"x": torch.arange(3)}, 0)
        with pytest.raises(CheckpointError, match="no persistent tier"):
            h.wait(persisted=True)


# ---------------------------------------------------------------------- faults

def test_wrong_credentials_fail_once_and_clearly(s3_server, s3_bucket, tmp_path):
    bad = _options(s3_server, secret_access_key="not-the-secret")
    t0 = time.perf_counter()
    with pytest.raises(StorageConfigError, match="credentials"):
        lazyckpt.Checkpointer(tmp_path, persist=lazyckpt.Persist(f"s3://{s3_bucket}/x", storage_options=bad))
    with pytest.raises(StorageConfigError, match="credentials"):
        lazyckpt.Checkpointer(f"s3://{s3_bucket}/x", io=lazyckpt.IO(storage_options=bad))
    assert time.perf_counter() - t0 < 10           # not a stack of retries


def test_missing_bucket_fails_once_and_clearly(s3_server, tmp_path):
    opts = _options(s3_server)
    with pytest.raises(StorageConfigError, match="no such bucket"):
        lazyckpt.Checkpointer(tmp_path, persist=lazyckpt.Persist("s3://no-such-bucket-here/x", storage_options=opts))
    with pytest.raises(StorageConfigError, match="no such bucket"):
        lazyckpt.save({"x": torch.arange(3)}, "s3://no-such-bucket-here/x.lzc", storage_options=opts)
    with pytest.raises(StorageConfigError):
        lazyckpt.Checkpointer("s3://ab/x", io=lazyckpt.IO(storage_options=opts))       # not even a bucket name


@pytest.fixture
def proxy(s3_server):
    from _s3proxy import S3FaultProxy
    with S3FaultProxy(s3_server.endpoint) as p:
        yield p


def test_transient_errors_are_retried(s3_server, s3_bucket, proxy):
    opts = _options(s3_server, endpoint=proxy.endpoint, max_attempts=5)
    state = _state(1, 2_000_000)
    proxy.fail_matching(lambda method, path, headers: "partNumber=" in path, status=503, count=3)
    url = f"s3://{s3_bucket}/retry.lzc"
    lazyckpt.save(state, url, storage_options=opts, chunk_bytes=MiB)
    assert sum(1 for m, p, s in proxy.requests if s == 503) == 3
    _equal(lazyckpt.load(url, storage_options=opts), state)


def test_persistent_server_errors_fail_the_save_and_abort_the_upload(s3_server, s3_bucket, proxy):
    opts = _options(s3_server, endpoint=proxy.endpoint, max_attempts=2)
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(chunk_bytes=MiB, storage_options=opts)) as ck:
        ck.save(_state(1, 100_000), 1).wait()
        proxy.fail_matching(lambda method, path, headers: "partNumber=" in path, status=500)
        with pytest.raises(CheckpointWriteError, match="500|InternalError|part"):
            ck.save(_state(2, 2_000_000), 2).wait()
        proxy.reset()
        assert ck.steps() == [1]
        _equal(ck.load(), _state(1, 100_000))
        assert _open_uploads(s3_server, s3_bucket) == []
        ck.save(_state(3, 100_000), 3).wait()      # the next one commits
        assert ck.steps() == [1, 3]


def test_timeouts_become_a_clear_error(s3_server, s3_bucket, proxy):
    opts = _options(s3_server, endpoint=proxy.endpoint, max_attempts=2, read_timeout=1, connect_timeout=1)
    lazyckpt.save({"x": torch.arange(10)}, f"s3://{s3_bucket}/t.lzc", storage_options=opts)
    proxy.delay(3)
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="t.lzc"):
        lazyckpt.load(f"s3://{s3_bucket}/t.lzc", storage_options=opts)
    assert time.perf_counter() - t0 < 30


def test_server_killed_mid_drain(s3_server, s3_bucket, tmp_path):
    """The persistent step is absent, the local commit intact, and after a
    restart the next drain succeeds."""
    opts = _options(s3_server, max_attempts=2, connect_timeout=1, read_timeout=2)
    url = f"s3://{s3_bucket}/killed"
    state = _state(4, 3_000_000)
    ck = lazyckpt.Checkpointer(tmp_path, persist=lazyckpt.Persist(url, bandwidth=6e6, storage_options=opts),
                               io=lazyckpt.IO(chunk_bytes=MiB))
    try:
        h = ck.save(state, 1)
        h.wait()
        time.sleep(0.5)                 # the drain is uploading (12 MB at 6 MB/s)
        s3_server.kill()
        with pytest.raises(CheckpointWriteError):
            h.wait(persisted=True)
        assert h.persist_state == "failed"
        ck.wait()                        # raised once: by the handle, not again by the checkpointer
        _equal(ck.load(), state)         # the local commit is intact
        assert ck.loaded_from["tier"] == "local"
        s3_server.restart()
        assert ck.persistent.dir.steps() == []     # no manifest: step 1 is not on the store
        state["model"]["w"].add_(1)
        ck.save(state, 2).wait(persisted=True)
        assert ck.persistent.dir.steps() == [2]
    finally:
        if not s3_server.running:
            s3_server.restart()
        ck.close()
    _equal(lazyckpt.load(url, storage_options=opts), state)


# ---------------------------------------------------------------------- several ranks

def _rank_state(rank, step):
    return {"w": torch.full((300_000,), float(rank * 100 + step)), "rank": rank, "step": step}


def _two_ranks_persist(rank, world, local, url, opts):
    with lazyckpt.Checkpointer(local, keep=1, persist=lazyckpt.Persist(url, storage_options=opts),
                               distributed=lazyckpt.Distributed(commit_timeout=60)) as ck:
        for step in range(3):
            ck.save(_rank_state(rank, step), step)
        ck.wait()
        return ck.persistent.dir.steps()


def _two_ranks_load(rank, world, local, url, opts):
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as ck:
        out = ck.load()
        return ck.loaded_from["tier"], out["rank"], out["step"], float(out["w"][0])


def test_two_ranks_each_upload_their_file_and_the_coordinator_commits(s3_server, s3_bucket, tmp_path):
    from _dist import run_ranks
    url = f"s3://{s3_bucket}/dist"
    opts = _options(s3_server)
    local = str(tmp_path / "local")
    results = run_ranks(2, _two_ranks_persist, local, url, opts, timeout=180)
    assert results[0][-1] == 2 and results[1][-1] == 2        # the newest step reached the store
    keys = _objects(s3_server, s3_bucket, "dist/step_0000000002/")
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == ["manifest.json", "rank_00000.lzc", "rank_00001.lzc"]
    shutil.rmtree(local)                       # every node replaced
    loaded = run_ranks(2, _two_ranks_load, local, url, opts, timeout=180)
    assert loaded == [("persistent", 0, 2, 2.0), ("persistent", 1, 2, 102.0)]


def _rank_dies_mid_drain(rank, world, local, url, opts):
    # Rank 1 uploads slowly and dies during its upload.
    ck = lazyckpt.Checkpointer(local,
                               persist=lazyckpt.Persist(url, bandwidth=2e6 if rank == 1 else 0, storage_options=opts),
                               distributed=lazyckpt.Distributed(commit_timeout=8))
    h = ck.save(_rank_state(rank, 5), 5)
    h.wait()
    if rank == 1:
        time.sleep(0.5)
        os._exit(3)
    try:
        h.wait(persisted=True)
        return "persisted"
    except CheckpointError as exc:
        return f"failed: {exc}"
    finally:
        ck.close(cancel=True)


def test_a_rank_dying_mid_drain_leaves_no_persistent_step_and_the_local_commit(s3_server, s3_bucket, tmp_path):
    from _dist import run_ranks
    url = f"s3://{s3_bucket}/dies"
    local = str(tmp_path / "local")
    results = run_ranks(2, _rank_dies_mid_drain, local, url, _options(s3_server), timeout=120,
                        allow_failure=True)
    assert results[1] == ("died", 3)
    status, message = results[0]
    assert status == "ok" and message.startswith("failed:") and "timed out" in message, message
    assert lazyckpt.storage.s3layout.ObjectCheckpointDir(url, lazyckpt.knobs.resolve(
        storage_options=_options(s3_server))).steps() == []
    assert sorted(os.listdir(os.path.join(local, "step_0000000005"))) == \
        ["manifest.json", "rank_00000.lzc", "rank_00001.lzc"]
    out = lazyckpt.load(os.path.join(local, "step_0000000005"))     # rank 0's state, committed locally
    assert out["rank"] == 0 and out["step"] == 5


def test_a_live_save_is_never_a_leftover(s3env, s3_bucket):
    """A save whose first object is older than the lease expiry but whose
    heartbeat is young (a long upload elsewhere in it) is kept; once its
    heartbeat stops, it is a leftover, its open uploads aborted too."""
    from lazyckpt.storage.s3layout import ObjectCheckpointDir
    from lazyckpt.storage.s3leases import LEASE_PREFIX, ObjectLease
    opts = lazyckpt.knobs.resolve()
    d = ObjectCheckpointDir(f"s3://{s3_bucket}/run", opts)
    client = s3env.client()
    client.put_object(Bucket=s3_bucket, Key="run/step_0000000012/live/rank_00000.lzc", Body=b"x" * 10)
    client.create_multipart_upload(Bucket=s3_bucket, Key="run/step_0000000012/live/rank_00001.lzc")
    lease = ObjectLease(d.store, f"run/step_0000000012/live/{LEASE_PREFIX}00000", heartbeat_s=0.3)
    try:
        time.sleep(2.5)
        assert d.clean_leftovers(expiry_s=2) == []
        assert any("rank_00000" in k for k in _objects(s3env, s3_bucket))
    finally:
        lease.release()
    time.sleep(2.5)
    assert d.clean_leftovers(expiry_s=2) == [f"s3://{s3_bucket}/run/step_0000000012/live/"]
    assert _objects(s3env, s3_bucket, "run/") == []
    assert _open_uploads(s3env, s3_bucket) == []


def test_fsdp2_state_on_the_object_store_reshards_on_load(s3env, s3_bucket):
    """2 FSDP2 ranks save straight to the store; 3 ranks load it back (each
    reading only the byte ranges of its own rows), and one process assembles
    the full tensors."""
    from _dist import run_ranks
    from test_multirank import _fsdp_load, _fsdp_train_and_save, _same
    url = f"s3://{s3_bucket}/fsdp"
    ref = run_ranks(2, _fsdp_train_and_save, url, timeout=240)[0]
    for got in run_ranks(3, _fsdp_load, url, timeout=240):
        assert _same(ref, got)
    full = lazyckpt.load(url)
    assert all(torch.equal(full["model"][k], v) for k, v in ref[0].items())
    assert torch.equal(full["rep"], torch.arange(6.0))


@pytest.mark.parametrize("file_format", ["lazyckpt", "safetensors", "torch"])
def test_a_file_ending_in_the_last_page_of_a_part_is_not_padded_on_the_store(s3env, s3_bucket, tmp_path,
                                                                             file_format):
    """The writer padded its last write to a whole 4 KiB page (what O_DIRECT needs):
    a file ending in the last page of a 5 MiB part made that part look complete,
    it was uploaded with the padding, and the object came out longer than the
    file (its footer no longer at the end; safetensors: "incomplete metadata")."""
    import io
    knobs = dict(chunk_bytes=MiB, host_cache_bytes=4 * MiB, file_format=file_format)
    target = 10 * MiB - 1000                           # 2 parts of 5 MiB; the file ends in the last page
    n = target - 20_000 if file_format != "lazyckpt" else 10 * MiB - 8192 - 100    # its footer: the last page
    for _ in range(4):                                  # the metadata's size moves a little with n
        state = {"w": torch.arange(n, dtype=torch.uint8)}
        size = lazyckpt.save(state, str(tmp_path / "probe"), **knobs)
        if 10 * MiB - 4096 < size < 10 * MiB:
            break
        n += target - size
    assert 10 * MiB - 4096 < size < 10 * MiB, size
    url = f"s3://{s3_bucket}/edge.{file_format}"
    assert lazyckpt.save(state, url, **knobs) == size
    raw = s3env.client().get_object(Bucket=s3_bucket, Key=url.split("/", 3)[3])["Body"].read()
    assert len(raw) == size
    if file_format == "lazyckpt":
        got = lazyckpt.load(url)
    elif file_format == "torch":
        got = torch.load(io.BytesIO(raw), weights_only=True)
    else:
        from safetensors.torch import load as load_safetensors
        got = load_safetensors(raw)
    assert torch.equal(got["w"], state["w"])
