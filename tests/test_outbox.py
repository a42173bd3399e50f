"""The persistent tier's durable outbox (issue 33, cases 2-4 and item 3).

A run reaches step 5 (every step persisted), then resumes from step 2 and
commits step 3 again: from then on steps 4, 5 and the first run's step 3 are
abandoned, and a reader of the persistent tier alone must never return them,
whatever was killed or down in between -- it may lag (return step 2) until
the resumed step is uploaded. The store is a real SeaweedFS (``s3_server``),
faults come from the HTTP proxy of tests/_s3proxy.py, kills are SIGKILLs of
a child process at a precise point."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointNotFoundError, CheckpointWriteError

pytestmark = pytest.mark.timeout(600)


# The same run, state and store fixtures as the line-of-history tests.
from test_history import _first_run_to_5, _options, _same, _state, proxy  # noqa: E402,F401

_elsewhere = itertools.count()


def _store_alone_is_on_the_line(tmp_path, url, opts, live):
    """A reader of the persistent tier alone (another machine, an empty local
    directory; and the functional API) returns a step of the live line --
    ``live``: step -> run -- never an abandoned one."""
    where = str(tmp_path / f"elsewhere{next(_elsewhere)}")
    with lazyckpt.Checkpointer(where, persist=lazyckpt.Persist(url, storage_options=opts)) as other:
        got = other.load()
        assert got["run"] == live.get(got["step"]) and _same(got, _state(got["step"], got["run"])), \
            (got["step"], got["run"])
        for step in range(1, 6):
            try:
                got = other.load(step=step)
            except CheckpointNotFoundError:
                continue        # not uploaded yet (lag) or abandoned: never returned
            assert got["run"] == live.get(step), (step, got["run"])
    got = lazyckpt.load(url, storage_options=opts)
    assert got["run"] == live.get(got["step"]), (got["step"], got["run"])


# ---------------------------------------------------------------------- case 2: killed before the store learns

_KILLED_ROLLBACK = """
import json, os, signal, sys, torch, lazyckpt
from lazyckpt.storage import record
from lazyckpt.storage import s3layout
local, url, opts, where = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "after-the-record":          # history.json says step 3 committed; nothing else happened
    add = record.LocalRecord.add
    def add_then_die(self, event, *args, **kwargs):
        add(self, event, *args, **kwargs)
        if event.step == 3:
            die()
    record.LocalRecord.add = add_then_die
else:                                    # committed locally; its event never reached the store
    put = s3layout.ObjectCheckpointDir.put_event
    def die_instead(self, event):
        if event.step == 3:
            die()
        return put(self, event)
    s3layout.ObjectCheckpointDir.put_event = die_instead
ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts))
ck.load(step=2)
g = torch.Generator().manual_seed(3 + 1000)
ck.save({"w": torch.randn(200_000, generator=g), "step": 3, "run": "resumed"}, 3).wait()
ck.wait()
sys.exit(3)                              # not killed: the test's premise failed
"""


@pytest.mark.parametrize("where", ["after-the-record", "before-the-event-put"])
def test_a_rollback_killed_before_it_reached_the_store_reaches_it_at_restart(s3_server, s3_bucket, tmp_path,
                                                                            where):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    local = str(tmp_path / "local")
    _first_run_to_5(local, url, opts)
    child = subprocess.run([sys.executable, "-c", _KILLED_ROLLBACK, local, url, json.dumps(opts), where],
                           timeout=300)
    assert child.returncode == -signal.SIGKILL
    live = {1: "first", 2: "first", 3: "resumed"}
    ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts))
    try:
        # Opening published the rollback's event before anything newer: from here on.
        _store_alone_is_on_the_line(tmp_path, url, opts, live)
        ck.wait()
        _store_alone_is_on_the_line(tmp_path, url, opts, live)
        try:
            resumed_here = ck.load(step=3)["run"] == "resumed"
        except CheckpointNotFoundError:        # the record said committed, the renames never ran
            resumed_here = False
        if resumed_here:
            # The resumed step 3 is committed locally: its upload completed on restart.
            assert ck.persistent.dir.steps() == [1, 2, 3]
            got = lazyckpt.load(url, storage_options=opts)
            assert _same(got, _state(3, "resumed"))
        else:
            assert ck.persistent.dir.steps() == [1, 2]
    finally:
        ck.close()


# ---------------------------------------------------------------------- case 3: a rollback while the store is down

def test_a_rollback_saved_while_the_store_is_down_reaches_it_in_order_after_a_restart(s3_server, s3_bucket,
                                                                                    proxy, tmp_path):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    local = str(tmp_path / "local")
    _first_run_to_5(local, url, opts)
    ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(
        url, storage_options=_options(s3_server, proxy.endpoint, max_attempts=1)))
    proxy.fail_matching(lambda method, path, headers: True, status=503)      # the store is down
    try:
        assert _same(ck.load(step=2), _state(2))
        ck.save(_state(3, "resumed"), 3).wait()
        ck.save(_state(4, "resumed"), 4).wait()
    finally:
        with pytest.raises(CheckpointWriteError):
            ck.close()
    proxy.reset()                                                           # back, and a restart
    live = {1: "first", 2: "first", 3: "resumed", 4: "resumed"}
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as ck:
        _store_alone_is_on_the_line(tmp_path, url, opts, live)
        ck.wait()
        assert ck.resumed_drain is not None and ck.resumed_drain.persist_state == "persisted"
        _store_alone_is_on_the_line(tmp_path, url, opts, live)
        assert ck.persistent.dir.steps() == [1, 2, 4]
    assert _same(lazyckpt.load(url, storage_options=opts), _state(4, "resumed"))


def test_events_are_published_in_commit_order_once_the_store_is_back(s3_server, s3_bucket, proxy, tmp_path):
    """Without a restart: an event that failed is published before any newer
    one, so the store never holds a newer event without the older ones."""
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    local = str(tmp_path / "local")
    _first_run_to_5(local, url, opts)
    ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(
        url, storage_options=_options(s3_server, proxy.endpoint, max_attempts=1)))
    try:
        assert _same(ck.load(step=2), _state(2))
        proxy.fail_matching(lambda method, path, headers: True, status=503)
        h3 = ck.save(_state(3, "resumed"), 3)
        h3.wait()
        with pytest.raises(CheckpointWriteError):
            h3.wait(persisted=True)
        proxy.reset()
        # Step 4's event is PUT on the commit's thread: step 3's must be there first.
        h4 = ck.save(_state(4, "resumed"), 4)
        h4.wait()
        h4.wait(persisted=True)
        events = {e.seq for e in ck.persistent.dir.listing()[1]}
        assert {6, 7} <= events, events             # (4 and 5 pruned with their steps)
        # The order they reached the store in: every event PUT that succeeded.
        put = [int(path.split("/history/")[1][:12]) for method, path, status in proxy.requests
               if method == "PUT" and "/history/" in path and status == 200]
        assert put == sorted(put) and put[0] == 6, put
    finally:
        ck.close()
    _store_alone_is_on_the_line(tmp_path, url, opts, {1: "first", 2: "first", 3: "resumed", 4: "resumed"})


# ---------------------------------------------------------------------- case 4: a rollback while step 5 uploads

def test_a_step_superseded_while_it_uploads_is_abandoned_not_failed(s3_server, s3_bucket, proxy, tmp_path):
    url = f"s3://{s3_bucket}/run"
    local = str(tmp_path / "local")
    ck = lazyckpt.Checkpointer(local,
                               persist=lazyckpt.Persist(url, storage_options=_options(s3_server, proxy.endpoint)))
    try:
        for step in range(1, 5):
            ck.save(_state(step), step).wait(persisted=True)
        hold = proxy.hold_matching(lambda method, path, headers: "step_0000000005/" in path
                                   and "rank_00000.lzc" in path)
        h5 = ck.save(_state(5), 5)
        h5.wait()
        assert hold.arrived.wait(60)                    # step 5 is uploading, stalled
        assert _same(ck.load(step=2), _state(2))
        h3 = ck.save(_state(3, "resumed"), 3)
        h3.wait()                                       # step 5 is abandoned, locally and on the store
        hold.release()
        ck.wait()                                       # nothing was lost: nothing raised
        assert h5.persist_state == "abandoned" and h5.persist_error is None
        h5.wait(persisted=True)
        h3.wait(persisted=True)
        assert h3.persist_state == "persisted"
        assert ck.persistent.dir.steps() == [1, 2, 3]
    finally:
        proxy.reset()
        ck.close()
    _store_alone_is_on_the_line(tmp_path, url, _options(s3_server), {1: "first", 2: "first", 3: "resumed"})


# ---------------------------------------------------------------------- case 4 on the replica tier

def _rollback_while_replicating(rank, world, base):
    """Steps 1-4 replicated; step 5's round is held just before it opens its
    file, the node commits a rollback to step 3 (step 5 moved aside), then the
    round goes on."""
    import threading
    from lazyckpt.tiers import replicas
    entered, release = threading.Event(), threading.Event()
    digest = replicas._file_digest

    def held_digest(path):
        name = path if isinstance(path, str) else os.readlink(f"/proc/self/fd/{path}")
        if "step_0000000005" in name:
            entered.set()
            assert release.wait(120)
        return digest(path)
    replicas._file_digest = held_digest
    node = os.path.join(base, f"node{rank // 2}")
    with lazyckpt.Checkpointer(node, replicas=lazyckpt.Replicas(1, node_size=2),
                               distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        for step in range(1, 5):
            ckpt.save(_state(step + 10 * rank), step).wait()
        ckpt.wait()
        h5 = ckpt.save(_state(5 + 10 * rank), 5)
        h5.wait()
        assert entered.wait(120)                    # step 5's round has started here
        h3 = ckpt.save(_state(3 + 10 * rank, "resumed"), 3)
        h3.wait()                                   # step 5 is abandoned on this node
        release.set()
        error = None
        try:
            ckpt.wait()
        except Exception as exc:                    # pragma: no cover - the failure reported
            error = repr(exc)
        return {"h5": h5.replica_state, "h3": h3.replica_state, "error": error,
                "holds": ckpt.replica_stats()["holds"]}


def test_a_step_superseded_while_it_replicates_is_abandoned_and_the_rollback_replicated(tmp_path):
    from _dist import run_ranks
    results = run_ranks(4, _rollback_while_replicating, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert r["error"] is None, (rank, r)
        assert r["h5"] == "abandoned", (rank, r)
        assert r["h3"] == "replicated", (rank, r)    # not dropped with the round of step 5
        assert [h[2] for h in r["holds"]] == [3], (rank, r)


def test_the_outbox_costs_no_listing_per_commit(s3_server, s3_bucket, proxy, tmp_path):
    """Steady state: a commit's event is one PUT; nothing lists the store until
    the upload's own commit (its supersede check), as before the outbox."""
    url = f"s3://{s3_bucket}/run"
    ck = lazyckpt.Checkpointer(str(tmp_path / "local"),
                               persist=lazyckpt.Persist(url, storage_options=_options(s3_server, proxy.endpoint)))
    try:
        ck.save(_state(1), 1).wait(persisted=True)
        hold = proxy.hold_matching(lambda method, path, headers: "step_0000000002/" in path
                                   and "rank_00000.lzc" in path)
        before = len(proxy.requests)
        ck.save(_state(2), 2).wait()
        assert hold.arrived.wait(60)                   # the event is up, the upload has started
        during = proxy.requests[before:]
        assert [m for m, p, s in during if m == "GET" and "list-type=2" in p] == [], during
        assert sum(1 for m, p, s in during if m == "PUT" and "/history/" in p) == 1, during
        hold.release()
        ck.wait()
    finally:
        proxy.reset()
        ck.close()


def test_close_that_raises_a_persist_failure_still_releases_the_writer_lease(s3_server, s3_bucket, proxy,
                                                                               tmp_path):
    """Found by the model-based test's outage rule (issue 33 item 5: outage, save,
    restart): close() raised the persistent tier's failure from inside its
    ``finally`` before releasing the writer lease, so every later Checkpointer of
    the same process on that directory was refused ("another Checkpointer on this
    directory is still open; close() it") although the first one was closed."""
    url = f"s3://{s3_bucket}/lease-after-failed-close"
    opts = _options(s3_server, proxy.endpoint, max_attempts=1)
    local = str(tmp_path / "run")
    ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts))
    ck.save(_state(1), 1).wait(persisted=True)
    proxy.fail_matching(lambda *a: True)
    ck.save(_state(2), 2).wait()                    # committed locally; its upload fails
    with pytest.raises(CheckpointWriteError):
        ck.close()                                  # the persist failure is reported ...
    proxy.reset()
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as again:
        again.save(_state(3), 3).wait(persisted=True)   # ... and the directory is free again
        assert again.steps()[-1] == 3


def test_a_checkpointer_opens_on_its_local_tier_while_the_store_is_down(s3_server, s3_bucket, proxy, tmp_path):
    """A process restarted during a store outage resumes from its local tier (found by
    the model's outage rule: PersistentTier's bucket check and leftover cleanup at open
    raised CheckpointReadError on a 503). A transient error is logged there now; wrong
    credentials or a missing bucket still fail at once (test_s3.py)."""
    url = f"s3://{s3_bucket}/open-during-outage"
    opts = _options(s3_server, proxy.endpoint, max_attempts=2)
    local = str(tmp_path / "run")
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as ck:
        ck.save(_state(1), 1).wait(persisted=True)
    # During the outage each request fails at its first attempt (as in the tests above): the
    # library sees the same 503 and takes the same path, without the client's retry backoff
    # (1-2 s a request, eight requests in a row: most of the test's time).
    down = dict(opts, max_attempts=1)
    code = (f"import lazyckpt, torch\n"
            f"ck = lazyckpt.Checkpointer({local!r}, persist=lazyckpt.Persist({url!r}, storage_options={down!r}))\n"
            f"assert ck.load()['step'] == 1\n"
            f"ck.save({{'w': torch.ones(3), 'step': 2, 'run': 'first'}}, 2).wait()\n"
            f"print('resumed')\n")
    proxy.fail_matching(lambda *a: True)      # a new process (its bucket check not cached) during the outage
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    proxy.reset()
    assert "resumed" in proc.stdout, proc.stderr[-1500:]
