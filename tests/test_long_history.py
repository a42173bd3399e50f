"""Bookkeeping that does not grow with the run (issue 34): a commit above the
latest step lists nothing, the record stays bounded, the index (the latest
step in a few requests) falls back to the listing whenever it cannot be
trusted -- on a local directory and on an object store. The model-based test
(`burst`) and the crash-point test compare the index with the listing after
every rule and every crash; these are the cases named one by one."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lazyckpt
from lazyckpt import lineage
from lazyckpt.storage.layout import CheckpointDir

STATE = {"w": torch.arange(16, dtype=torch.float32)}


def _values(step):
    return {"w": torch.full((16,), float(step))}


def test_commits_above_the_latest_step_never_list_the_directory(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        for s in range(1, 41):
            ckpt.save(_values(s), step=s).wait()
        ckpt.layout.tidy()                      # waits for the scan opening started
        listed = []
        real = os.listdir

        def counting(path="."):
            if os.path.abspath(os.fspath(path)) == os.path.abspath(run):
                listed.append(path)
            return real(path)
        monkeypatch.setattr(os, "listdir", counting)
        for s in range(41, 61):
            ckpt.save(_values(s), step=s).wait()
        assert ckpt.latest_step() == 60
        torch.testing.assert_close(ckpt.load(), _values(60))
        assert listed == [], f"{len(listed)} listings of the run directory in 20 commits, a latest_step, a load"
        # A rollback lists (once per commit): it supersedes what it finds.
        ckpt.save(_values(99), step=30).wait()
        assert listed, "a rollback must list the steps it supersedes"
        monkeypatch.setattr(os, "listdir", real)
        assert ckpt.steps() == list(range(1, 31))
        torch.testing.assert_close(ckpt.load(), _values(99))


def test_the_record_stays_bounded_and_numbering_survives_it(tmp_path):
    run = str(tmp_path / "run")
    n = lineage.RECENT_EVENTS + 40
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        for s in range(1, n + 1):
            ckpt.save(_values(s), step=s).wait()
    with open(os.path.join(run, lineage.RECORD)) as f:
        doc = json.load(f)
    assert len(doc["events"]) == lineage.RECENT_EVENTS and doc["seq"] == n
    # Reopened: numbering goes on from the record, the line is every step.
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        ckpt.save(_values(0), step=n + 1).wait()
        assert ckpt.steps() == list(range(1, n + 2))
    raw = open(os.path.join(run, f"step_{n + 1:010d}", "manifest.json")).read()
    assert json.loads(raw)["seq"] == n + 1
    # Without the record (deleted by hand) the manifests number it.
    os.unlink(os.path.join(run, lineage.RECORD))
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        ckpt.save(_values(0), step=n + 2).wait()
    assert json.loads(open(os.path.join(run, f"step_{n + 2:010d}", "manifest.json")).read())["seq"] == n + 2


@pytest.mark.parametrize("damage", ["latest-deleted", "latest-older", "newest-pruned", "no-record"])
def test_the_index_falls_back_to_the_listing_when_it_cannot_be_trusted(tmp_path, damage):
    run = str(tmp_path / "run")
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(_values(s), step=s).wait()
    layout = CheckpointDir(run)
    assert layout.tail() == (3, layout.step_path(3))
    expected = 3
    if damage == "latest-deleted":
        os.unlink(os.path.join(run, "latest"))
    elif damage == "latest-older":                  # a crash between the record and `latest`
        with open(os.path.join(run, "latest"), "w") as f:
            f.write("2\n")
    elif damage == "newest-pruned":
        assert layout.delete_step(3)
        expected = 2
    else:
        os.unlink(os.path.join(run, lineage.RECORD))
    assert layout.tail() is None
    assert layout.latest() == expected
    assert layout.locate_step(None) == (expected, layout.step_path(expected))
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        torch.testing.assert_close(ckpt.load(), _values(expected))
        ckpt.save(_values(7), step=expected + 1).wait()     # and the next commit restores the index
    assert layout.tail() == (expected + 1, layout.step_path(expected + 1))


def test_a_commit_without_a_record_removes_latest_first(tmp_path):
    """FORMAT.md §11.3: a commit no record names (a replica restored without a
    seq) must not leave the index naming the step before it."""
    run = str(tmp_path / "run")
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        for s in (1, 2):
            ckpt.save(_values(s), step=s).wait()
        tmp = str(tmp_path / "run" / ".tmp-step_0000000005-000000000000")
        import shutil
        shutil.copytree(ckpt.step_path(2), tmp)
    layout = CheckpointDir(run)
    layout.commit(tmp, 5, keep_superseded=True, event=None)
    assert not os.path.exists(os.path.join(run, "latest"))
    assert layout.tail() is None and layout.latest() == 5


# ----------------------------------------------------------------- an object store


@pytest.fixture
def s3_run(s3_server, s3_bucket):
    opts = {"endpoint_url": s3_server.endpoint, "access_key_id": s3_server.access_key,
            "secret_access_key": s3_server.secret_key, "region": s3_server.region}
    return f"s3://{s3_bucket}/run", opts, s3_server.client(), s3_bucket


def _listings_of(client_store, calls):
    def count(request=None, **_kw):
        url = getattr(request, "url", "")
        if request.method == "GET" and "list-type=" in url:
            calls.append(url)
    client_store.client.meta.events.register("before-send.s3", count)


def test_object_store_commits_and_loads_of_the_latest_do_not_list_the_run(s3_run):
    url, opts, client, bucket = s3_run
    with lazyckpt.Checkpointer(url, keep=None, io=lazyckpt.IO(storage_options=opts)) as ckpt:
        for s in range(1, 6):
            ckpt.save(_values(s), step=s).wait()
        ckpt.layout.tidy()                      # waits for the scan opening started
        calls = []
        _listings_of(ckpt.layout.store, calls)
        ckpt.save(_values(6), step=6).wait()
        assert ckpt.latest_step() == 6
        torch.testing.assert_close(ckpt.load(), _values(6))
        whole = [c for c in calls if "prefix=run%2F&" in c or c.endswith("prefix=run%2F")]
        assert whole == [], f"listings of the whole run prefix: {whole}"
        head = json.loads(client.get_object(Bucket=bucket, Key="run/head.json")["Body"].read())
        assert head["step"] == 6
        # A rollback: listed once, the steps it supersedes go.
        ckpt.save(_values(33), step=3).wait()
        assert ckpt.steps() == [1, 2, 3] and ckpt.latest_step() == 3
        torch.testing.assert_close(ckpt.load(), _values(33))


@pytest.mark.parametrize("damage", ["stale-head", "head-of-a-pruned-step", "no-head", "garbage-head"])
def test_the_object_store_index_is_checked_at_every_use(s3_run, damage):
    """A crash between a commit's event and its head.json leaves the head older
    than the events: the listing from the head's seq finds them. A head whose
    save is gone, none, or an unreadable one: the full listing."""
    from lazyckpt.knobs import resolve
    from lazyckpt.storage.s3layout import ObjectCheckpointDir
    url, opts, client, bucket = s3_run
    with lazyckpt.Checkpointer(url, keep=None, io=lazyckpt.IO(storage_options=opts)) as ckpt:
        for s in (1, 2, 3, 4):
            ckpt.save(_values(s), step=s).wait()
        if damage == "stale-head":
            first = json.loads(client.get_object(Bucket=bucket, Key="run/head.json")["Body"].read())
        ckpt.save(_values(22), step=2).wait()           # a rollback: 3 and 4 abandoned
    layout = ObjectCheckpointDir(url, resolve(storage_options=opts))
    expected = 2
    if damage == "stale-head":
        client.put_object(Bucket=bucket, Key="run/head.json", Body=json.dumps(first).encode())
    elif damage == "head-of-a-pruned-step":
        assert layout.delete_step(2, even_if_read=True)
        expected = 1
    elif damage == "no-head":
        client.delete_object(Bucket=bucket, Key="run/head.json")
    else:
        client.put_object(Bucket=bucket, Key="run/head.json", Body=b"{not json")
    tail = layout.tail()
    assert tail is None or tail.step == expected
    assert layout.latest() == expected
    with lazyckpt.Checkpointer(url, keep=None, io=lazyckpt.IO(storage_options=opts)) as ckpt:
        torch.testing.assert_close(ckpt.load(), _values(22 if expected == 2 else 1))
        assert ckpt.latest_step() == expected and ckpt.steps()[-1] == expected
        ckpt.save(_values(9), step=expected + 1).wait()     # numbered above every event, the head rewritten
        assert ckpt.latest_step() == expected + 1
    assert layout.tail().step == expected + 1


# ----------------------------------------------------------------- a restarting job


def _count_requests(url, opts):
    """Every request of this process's client for ``url``, by kind, the leftover
    scan's thread apart (it runs on the coordinator only, in the background)."""
    import threading
    from lazyckpt.knobs import resolve
    from lazyckpt.storage import s3
    counts = {}

    def count(request=None, **_kw):
        kind = "LIST" if request.method == "GET" and "list-type=" in request.url else request.method
        who = "scan" if threading.current_thread().name == "lazyckpt-leftovers" else "rank"
        counts.setdefault(who, {}).setdefault(kind, 0)
        counts[who][kind] += 1
    store, _ = s3.store_for(url, resolve(storage_options=opts).storage_options)
    store.client.meta.events.register("before-send.s3", count)
    return counts


def _job_saves(rank, world, url, opts, steps):
    with lazyckpt.Checkpointer(url, keep=None, distributed=lazyckpt.Distributed(commit_timeout=60),
                               io=lazyckpt.IO(storage_options=opts)) as ckpt:
        for s in steps:
            ckpt.save({"w": torch.full((16,), float(100 * s + rank))}, step=s).wait()


def _job_restarts(rank, world, url, opts, between):
    import torch.distributed as dist
    counts = _count_requests(url, opts)
    with lazyckpt.Checkpointer(url, keep=None, distributed=lazyckpt.Distributed(commit_timeout=60),
                               io=lazyckpt.IO(storage_options=opts)) as ckpt:
        opened = {k: dict(v) for k, v in counts.items()}
        if rank == 0 and between == "another-writer-commits":
            with lazyckpt.Checkpointer(url, distributed=lazyckpt.Distributed(process_group=False),
                                       io=lazyckpt.IO(storage_options=opts)) as other:
                other.save({"w": torch.full((16,), 500.0)}, step=5).wait()
        elif rank == 0 and between == "the-latest-step-is-pruned":
            from lazyckpt.knobs import resolve
            from lazyckpt.storage.s3layout import ObjectCheckpointDir
            assert ObjectCheckpointDir(url, resolve(storage_options=opts)).delete_step(4, even_if_read=True)
        dist.barrier()
        got = float(ckpt.load()["w"][0])
        return got, ckpt.loaded_from["step"], opened.get("rank", {}), counts.get("rank", {})


@pytest.mark.parametrize("between", ["nothing", "another-writer-commits", "the-latest-step-is-pruned"])
def test_a_restarting_job_looks_up_the_latest_step_once(s3_run, between):
    """Issue 34: a job restarting from an object store finds the latest step
    once, on the coordinator as it opens; the other ranks send no LIST request
    and check the lookup with one GET of head.json. A commit or a prune between
    open and load (another process) makes them look again, never load a step
    that is no longer the latest."""
    from _dist import run_ranks
    url, opts, _client, _bucket = s3_run
    run_ranks(3, _job_saves, url, opts, [1, 2, 3, 4], timeout=180)
    results = run_ranks(3, _job_restarts, url, opts, between, timeout=180)
    step, value = {"nothing": (4, 400.0), "another-writer-commits": (5, 500.0),
                   "the-latest-step-is-pruned": (3, 300.0)}[between]
    for rank, (got, loaded, opened, total) in enumerate(results):
        assert loaded == step, (rank, between, loaded)
        # Step 5 was saved by one rank: every rank reads its file.
        assert got == (value if between == "another-writer-commits" else value + rank), (rank, got)
        if rank == 0:
            assert opened.get("LIST", 0) == 2, opened        # the index: the events after head.json, the fences
        else:
            assert opened.get("LIST", 0) == 0 and opened.get("GET", 0) == 0, opened
    if between == "nothing":
        # One lookup for the job; every other rank: head.json checked (1 GET), its manifest
        # (1 GET), its reader lease, its file (a HEAD, 4 GETs). No LIST.
        assert [r[3].get("LIST", 0) for r in results] == [2, 0, 0], results
        assert [r[3].get("GET", 0) for r in results[1:]] == [6, 6], results


# ----------------------------------------------------------------- two tiers (persist_to)


def _whole_run_listings(calls, prefix):
    return [c for c in calls if f"prefix={prefix}%2F&" in c or c.endswith(f"prefix={prefix}%2F")]


@pytest.mark.parametrize("case", ["both-tiers", "local-lost", "store-behind"])
def test_persist_to_finds_the_newest_save_from_the_two_indexes(s3_run, tmp_path, monkeypatch, case):
    """Issue 34 with persist_to: opening and loading the latest step read the
    newest manifest and the store's index, not every local manifest nor a
    listing of the store -- while the two indexes agree on where the newest
    save is (both tiers, or the store alone after the node lost its disk). A
    store behind the local tier (an upload not done) takes the whole line."""
    import shutil
    import threading
    url, opts, client, bucket = s3_run
    local = str(tmp_path / "local")
    with lazyckpt.Checkpointer(local, keep=None, persist=lazyckpt.Persist(url, storage_options=opts)) as ckpt:
        for s in range(1, 31):
            ckpt.save(_values(s), step=s)
        ckpt.wait()
        ckpt.save(_values(120), step=12).wait()         # a rollback: 13..30 abandoned on both tiers
        ckpt.wait()
    expected = 12
    if case == "local-lost":
        shutil.rmtree(local)
    elif case == "store-behind":
        with lazyckpt.Checkpointer(local, keep=None) as ckpt:    # saved without persist_to
            ckpt.save(_values(13), step=13).wait()
        expected = 13
    read = []
    original = CheckpointDir.step_paths
    monkeypatch.setattr(CheckpointDir, "step_paths", lambda self: read.append(1) or original(self))
    calls = []
    from lazyckpt.knobs import resolve
    from lazyckpt.storage import s3
    store, _ = s3.store_for(url, resolve(storage_options=opts).storage_options)

    def count(request=None, **_kw):
        if request.method == "GET" and "list-type=" in request.url and \
                threading.current_thread().name != "lazyckpt-leftovers":
            calls.append(request.url)
    store.client.meta.events.register("before-send.s3", count)
    with lazyckpt.Checkpointer(local, keep=None, persist=lazyckpt.Persist(url, storage_options=opts)) as ckpt:
        out = ckpt.load()
        torch.testing.assert_close(out, _values(120 if expected == 12 else 13))
        assert ckpt.loaded_from["step"] == expected
        assert ckpt.loaded_from["tier"] == ("persistent" if case == "local-lost" else "local")
        whole = _whole_run_listings(calls, "run")
        if case == "store-behind":
            assert whole, "the whole line was expected here"
        else:
            assert whole == [], whole
            if case == "both-tiers":
                assert read == [], "the local directory was listed"
        ckpt.save(_values(expected + 1), step=expected + 1)
        ckpt.wait()
        assert ckpt.persistent.dir.latest() == expected + 1


def test_study_of_a_range_of_steps_does_not_list_the_run(tmp_path, monkeypatch):
    """Issue 34: ``trajectory(steps=...)`` and ``diff("RUN@A", "RUN@B")`` on a
    local run look up the steps they name (a few stat calls each), not the
    whole run; a step that is not there is still a clear not-found."""
    run = str(tmp_path / "run")
    with lazyckpt.Checkpointer(run, keep=None) as ckpt:
        for s in range(1, 41):
            ckpt.save(_values(s), step=s).wait()

    def no_listing(self):
        raise AssertionError("the whole run was listed")
    monkeypatch.setattr(CheckpointDir, "step_paths", no_listing)
    table = lazyckpt.trajectory(run, fn="max", steps=[7, 31]).table()
    assert table == {"w": {7: 7.0, 31: 31.0}}
    report = lazyckpt.diff(f"{run}@7", f"{run}@31")
    assert [row.key for row in report.rows] == ["w"]
    monkeypatch.undo()
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.trajectory(run, steps=[7, 99])
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.diff(f"{run}@7", f"{run}@99")
