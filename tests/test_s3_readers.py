"""Object-store readers and leases, against a real S3 server (SeaweedFS, the
``s3_server`` fixture) and, where a request must be caught mid-flight, the
real HTTP proxy of tests/_s3proxy.py in front of it (issue 22, case 7).

* A reader (another process) holds a reader lease under the step's prefix
  while it loads; retention elsewhere keeps that step until the reader is
  done, and deletes it at a later pass.
* A step deleted under a reader anyway raises CheckpointNotFoundError
  ("deleted while it was being read"), never a corruption error.
* Lease ages use the server's clock only: a cleaner whose local clock is
  skewed neither aborts live saves nor keeps dead ones forever.
* A persist failure is raised once.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import torch

import lazyckpt
import lazyckpt.cli.prune
import lazyckpt.storage.s3layout
import lazyckpt.storage.s3leases
import lazyckpt.loading.verify
from lazyckpt.errors import CheckpointWriteError
from lazyckpt.knobs import resolve as resolve_options

_s3proxy = pytest.importorskip("_s3proxy")


def _options(server, endpoint=None, **extra):
    return {"endpoint_url": endpoint or server.endpoint, "access_key_id": server.access_key,
            "secret_access_key": server.secret_key, "region": server.region, **extra}


def _state(seed, n=200_000):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "step": seed}


@pytest.fixture
def proxy(s3_server):
    if not s3_server.running:
        s3_server.start()
    with _s3proxy.S3FaultProxy(s3_server.endpoint) as p:
        yield p


def _objects(server, bucket, prefix=""):
    out = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _reader(url, opts, step, seed, results):
    """Another process: open the run and load ``step``; report what happened."""
    try:
        with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts)) as ck:
            got = ck.load(step=step)
        ok = torch.equal(got["w"], _state(seed)["w"]) and got["step"] == seed
        results.put(("ok", ok))
    except BaseException as exc:                # reported, asserted by the test
        results.put((type(exc).__name__, str(exc)))


def _start_reader(url, opts, step, seed):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_reader, args=(url, opts, step, seed, results), daemon=True)
    proc.start()
    return proc, results


def _result(proc, results, timeout=120):
    try:
        out = results.get(timeout=timeout)
    finally:
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
    return out


def _data_get(method, path, headers):
    return method == "GET" and "rank_00000.lzc" in path


def test_retention_in_the_writer_keeps_a_step_another_process_is_reading(s3_server, s3_bucket, proxy):
    """Case 7: the reader's data requests are held at the proxy (it is in the
    middle of reading step 1) while the writer commits step 2 with
    keep_last=1. Step 1 stays, the reader gets its exact state, and the next
    retention pass deletes it (and no reader lease is left behind)."""
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, keep=1, io=lazyckpt.IO(storage_options=_options(s3_server))) as ck:
        ck.save(_state(1), 1).wait()
        hold = proxy.hold_matching(_data_get)
        proc, results = _start_reader(url, _options(s3_server, endpoint=proxy.endpoint), 1, 1)
        try:
            assert hold.arrived.wait(120), "the reader never started reading"
            ck.save(_state(2), 2).wait()
            assert ck.steps() == [1, 2]          # retention skipped the step being read
        finally:
            hold.release()
            out = _result(proc, results)
        assert out == ("ok", True)
        ck.save(_state(3), 3).wait()             # the next pass deletes what is no longer read
        assert ck.steps() == [3]
    assert not [k for k in _objects(s3_server, s3_bucket) if "/.readers/" in k]


def test_a_step_deleted_under_a_reader_anyway_is_not_found_not_corrupt(s3_server, s3_bucket, proxy):
    """Another tool (here: the S3 API itself) deletes the step while the
    reader is in the middle of it: CheckpointNotFoundError, saying so."""
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=_options(s3_server))) as ck:
        ck.save(_state(1), 1).wait()
        prefix = lazyckpt.storage.s3layout.store_key(ck.layout.save_url(1, ck.layout.committed()[1]))
    hold = proxy.hold_matching(_data_get)
    proc, results = _start_reader(url, _options(s3_server, endpoint=proxy.endpoint), 1, 1)
    try:
        assert hold.arrived.wait(120)
        client = s3_server.client()
        for key in _objects(s3_server, s3_bucket, prefix + "/"):
            client.delete_object(Bucket=s3_bucket, Key=key)
    finally:
        hold.release()
        name, message = _result(proc, results)
    assert name == "CheckpointNotFoundError", (name, message)
    assert "deleted while it was being read" in message


def test_prune_keeps_a_step_being_read(s3_server, s3_bucket, proxy, monkeypatch):
    """`lazyckpt prune` on an object store respects reader leases too (and
    says why it kept the step)."""
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=_options(s3_server))) as ck:
        for s in (1, 2):
            ck.save(_state(s), s).wait()
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    hold = proxy.hold_matching(_data_get)
    proc, results = _start_reader(url, _options(s3_server, endpoint=proxy.endpoint), 1, 1)
    try:
        assert hold.arrived.wait(120)
        report = lazyckpt.cli.prune.prune(url, keep=1, force=True)
        (action,) = [a for a in report["actions"] if a["what"] == "step"]
        assert action["step"] == 1 and not action["done"] and "being read" in action["error"]
    finally:
        hold.release()
        out = _result(proc, results)
    assert out == ("ok", True)
    report = lazyckpt.cli.prune.prune(url, keep=1)
    assert [a["step"] for a in report["actions"] if a["what"] == "step" and a["done"]] == [1]


def test_a_reader_that_arrives_while_retention_deletes_the_manifest_gets_it_back(s3_server, s3_bucket, proxy):
    """The race the second lease listing closes: retention has checked for
    readers (none) and is about to delete the manifest; a reader then takes
    its lease and reads the manifest. Retention, seeing the lease after its
    delete, puts the manifest back and keeps the step; the reader loads it.
    Two proxies hold each side at that instant (no sleeps)."""
    import threading
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=_options(s3_server))) as ck:
        for s in (1, 2):
            ck.save(_state(s), s).wait()
    with _s3proxy.S3FaultProxy(s3_server.endpoint) as deleter_proxy:
        options = resolve_options(storage_options=_options(s3_server, endpoint=deleter_proxy.endpoint))
        directory = lazyckpt.storage.s3layout.ObjectCheckpointDir(url, options)
        hold_delete = deleter_proxy.hold_matching(lambda m, p, h: m == "POST" and "delete" in p)
        outcome = {}
        deleter = threading.Thread(target=lambda: outcome.update(deleted=directory.apply_retention(1)))
        deleter.start()
        hold_data = proxy.hold_matching(_data_get)
        proc, results = _start_reader(url, _options(s3_server, endpoint=proxy.endpoint), 1, 1)
        try:
            assert hold_delete.arrived.wait(120)
            assert hold_data.arrived.wait(120)        # lease up, manifest read: now reading
            hold_delete.release()
            deleter.join(120)
            assert outcome["deleted"] == [] and directory.steps() == [1, 2]
        finally:
            hold_delete.release()
            hold_data.release()
            out = _result(proc, results)
        assert out == ("ok", True)


# ---------------------------------------------------------------------- lease ages: the server's clock

class _ClockAhead(datetime):
    """This host's clock, one hour ahead of the server's."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) + timedelta(hours=1)


class _ClockBehind(datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) - timedelta(hours=1)


def _skew_local_clock(monkeypatch, clock):
    """Skew the clock the cleaner's code could read (the server stays real)."""
    for module in (lazyckpt.storage.s3layout, lazyckpt.storage.s3leases):
        monkeypatch.setattr(module, "datetime", clock, raising=False)
    real = time.time
    offset = (clock.now(timezone.utc) - datetime.now(timezone.utc)).total_seconds()
    monkeypatch.setattr(time, "time", lambda: real() + offset)     # every module's time.time()


def test_a_cleaner_whose_clock_runs_ahead_keeps_live_saves(s3_server, s3_bucket, monkeypatch):
    """A save in progress (its heartbeat seconds old by the server's clock)
    must survive clean_leftovers on a host whose clock is an hour ahead."""
    options = resolve_options(storage_options=_options(s3_server), lease_expiry_s=60)
    directory = lazyckpt.storage.s3layout.ObjectCheckpointDir(f"s3://{s3_bucket}/run", options)
    prefix = directory._key("step_0000000001", uuid.uuid4().hex)
    directory.store.put(f"{prefix}/rank_00000.lzc", b"x" * 100)
    lease = lazyckpt.storage.s3leases.ObjectLease(directory.store, f"{prefix}/{lazyckpt.storage.s3leases.LEASE_PREFIX}00000", 5)
    try:
        _skew_local_clock(monkeypatch, _ClockAhead)
        assert directory.leftovers() == []
        assert directory.clean_leftovers() == []
        assert f"{prefix}/rank_00000.lzc" in _objects(s3_server, s3_bucket)
    finally:
        monkeypatch.undo()
        lease.release()


def test_a_cleaner_whose_clock_runs_behind_still_removes_dead_saves(s3_server, s3_bucket, monkeypatch):
    """The other direction: a dead save (no heartbeat for longer than the
    expiry, by the server's clock) is removed even if this host's clock
    says it is an hour younger. Polls the server (1 s timestamps), no sleep."""
    options = resolve_options(storage_options=_options(s3_server), lease_expiry_s=1)
    directory = lazyckpt.storage.s3layout.ObjectCheckpointDir(f"s3://{s3_bucket}/run", options)
    prefix = directory._key("step_0000000001", uuid.uuid4().hex)
    directory.store.put(f"{prefix}/rank_00000.lzc", b"x" * 100)
    _skew_local_clock(monkeypatch, _ClockBehind)
    deadline = time.monotonic() + 20
    removed = []
    while not removed and time.monotonic() < deadline:
        removed = directory.clean_leftovers()
    assert removed == [directory.store.url(prefix + "/")]
    assert _objects(s3_server, s3_bucket, prefix) == []


def test_retention_with_a_clock_ahead_keeps_a_step_being_read(s3_server, s3_bucket, proxy, monkeypatch):
    """Reader leases are aged by the server's clock too."""
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=_options(s3_server))) as ck:
        for s in (1, 2):
            ck.save(_state(s), s).wait()
        hold = proxy.hold_matching(_data_get)
        proc, results = _start_reader(url, _options(s3_server, endpoint=proxy.endpoint), 1, 1)
        try:
            assert hold.arrived.wait(120)
            _skew_local_clock(monkeypatch, _ClockAhead)
            assert ck.layout.apply_retention(1) == []
            assert ck.steps() == [1, 2]
        finally:
            monkeypatch.undo()
            hold.release()
            out = _result(proc, results)
        assert out == ("ok", True)


# ---------------------------------------------------------------------- persist failures: raised once

def test_a_persist_failure_is_raised_once(s3_server, s3_bucket, proxy, tmp_path):
    """handle.wait(persisted=True) raises the failed upload; ckpt.wait() and
    close() do not raise it a second time."""
    opts = _options(s3_server, endpoint=proxy.endpoint, max_attempts=1)
    ck = lazyckpt.Checkpointer(tmp_path, persist=lazyckpt.Persist(f"s3://{s3_bucket}/p", storage_options=opts))
    try:
        proxy.fail_matching(lambda m, p, h: m in ("PUT", "POST") and "rank_00000.lzc" in p, status=403)
        h = ck.save(_state(1), 1)
        with pytest.raises(CheckpointWriteError):
            h.wait(persisted=True)
        assert h.persist_state == "failed"
        ck.wait()                       # already raised, by the handle
    finally:
        proxy.reset()
        ck.close()                      # nor here
