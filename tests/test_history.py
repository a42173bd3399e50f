"""One line of history on every tier (issue 22, cases 3 and 4).

A run reaches step 5, then resumes from step 2 and commits step 3: from then
on step 5 (and the first run's steps 3 and 4) are abandoned on *every* tier.
The persistent tier is a real SeaweedFS (``s3_server``), its faults come from
a real HTTP proxy (tests/_s3proxy.py); replicas run on 4 gloo ranks as 2
"nodes" of 2, each with its own directory (as tests/test_replicas.py)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lazyckpt
from lazyckpt.errors import CheckpointNotFoundError, CheckpointWriteError, CorruptCheckpointError
from lazyckpt.lineage import Event, abandoned, line, prunable

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- the pure function


def _oracle(steps):
    """What a local directory holds after committing ``steps`` in order: the line."""
    live = []
    for i, s in enumerate(steps):
        live = [x for x in live if x[0] < s] + [(s, f"id{i}")]
    return live


def _events(steps):
    return [Event(s, f"id{i}", i + 1) for i, s in enumerate(steps)]


def test_a_rollback_supersedes_every_newer_step():
    events = _events([1, 2, 3, 4, 5, 3])
    assert line(events) == [(1, "id0"), (2, "id1"), (3, "id5")]
    assert abandoned(events) == {(3, "id2"), (4, "id3"), (5, "id4")}


def test_saves_without_seq_come_first_ordered_by_step():
    # Manifests written before seq existed: their directory was already one line.
    legacy = [Event(1, "a", None), Event(2, "b", None), Event(5, "c", None)]
    assert line(legacy) == [(1, "a"), (2, "b"), (5, "c")]
    # A numbered commit of step 3 (a resumed run) abandons the legacy step 5.
    assert line(legacy + [Event(3, "d", 1)]) == [(1, "a"), (2, "b"), (3, "d")]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=30), st.randoms(use_true_random=False),
       st.integers(1, 3))
def test_line_is_the_local_rule_whatever_order_and_copies_the_events_come_in(steps, rnd, copies):
    events = _events(steps) * copies            # the same save seen on several tiers
    rnd.shuffle(events)
    assert line(events) == _oracle(steps)
    assert abandoned(events) == {(e.step, e.save_id) for e in _events(steps)} - set(_oracle(steps))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=30), st.data())
def test_pruned_events_never_change_which_present_saves_are_live(steps, data):
    events = _events(steps)
    saves = sorted({(e.step, e.save_id) for e in events})
    # What a tier holds: at most one save per step (a commit replaces its step).
    chosen = data.draw(st.lists(st.sampled_from(saves), unique_by=lambda x: x[0])) if saves else []
    present = dict(chosen)
    live = set(line(events))
    kept = [e for e in events if e not in prunable(events, present)]
    assert max(e.seq for e in kept) == max(e.seq for e in events)      # numbering survives
    assert {p for p in present.items() if p in live} == {p for p in present.items() if p in set(line(kept))}


def _prunable_by_definition(events, present):
    """``prunable`` as its docstring states it, one scan of the present saves
    per event (what it was before the bisect; the oracle for it)."""
    top = max(e.seq for e in events)
    present_seq = {(e.step, e.save_id): e.seq for e in events}
    return [e for e in events
            if e.seq != top and present.get(e.step) != e.save_id
            and not any(s >= e.step and (present_seq.get((s, sid)) is None or present_seq[(s, sid)] < e.seq)
                        for s, sid in present.items())]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 8), min_size=1, max_size=30), st.data())
def test_prunable_is_its_definition_with_legacy_and_foreign_saves_present(steps, data):
    events = _events(steps)
    saves = sorted({(e.step, e.save_id) for e in events})
    # Present saves: some with an event, some without (a legacy manifest or a
    # save whose event was pruned: no seq).
    chosen = data.draw(st.lists(st.one_of(st.sampled_from(saves),
                                          st.tuples(st.integers(0, 9), st.just("legacy"))),
                                unique_by=lambda x: x[0]))
    present = dict(chosen)
    assert prunable(events, present) == _prunable_by_definition(events, present)


def test_line_and_prunable_of_a_long_run_cost_what_the_run_costs():
    # 200,000 events with rollbacks every 1,000 steps: quadratic work (a filter of
    # the line per event, a scan of the present steps per event) would not
    # finish in this test's time; the answer is checked against the rule.
    steps = [s for block in range(200) for s in range(block * 900, block * 900 + 1000)]
    events = _events(steps)
    live = line(events)
    assert [s for s, _ in live] == list(range(199 * 900 + 1000))
    assert live[-1] == (199 * 900 + 999, f"id{len(steps) - 1}")
    present = dict(live)
    doomed = prunable(events, present)
    assert {(e.step, e.save_id) for e in doomed}.isdisjoint(live)
    assert len(doomed) == len(events) - len(live)


# ---------------------------------------------------------------------- case 3: persist_to + rollback

MiB = 1 << 20


def _options(server, endpoint=None, **extra):
    return {"endpoint_url": endpoint or server.endpoint, "access_key_id": server.access_key,
            "secret_access_key": server.secret_key, "region": server.region, **extra}


def _state(step, run="first"):
    g = torch.Generator().manual_seed(step + (0 if run == "first" else 1000))
    return {"w": torch.randn(200_000, generator=g), "step": step, "run": run}


def _same(a, b):
    return a["step"] == b["step"] and a["run"] == b["run"] and torch.equal(a["w"], b["w"])


@pytest.fixture
def proxy(s3_server):
    from _s3proxy import S3FaultProxy
    with S3FaultProxy(s3_server.endpoint) as p:
        yield p


def _first_run_to_5(local, url, opts):
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as ck:
        for step in range(1, 6):
            ck.save(_state(step), step).wait(persisted=True)
        assert ck.persistent.dir.steps() == [1, 2, 3, 4, 5]


def _step3_upload(step=3):
    return lambda method, path, headers: f"step_{step:010d}/" in path and "rank_00000.lzc" in path


def _resume_from_2(ck):
    assert _same(ck.load(step=2), _state(2))
    return ck.save(_state(3, run="resumed"), 3)


def test_while_the_resumed_step_uploads_load_never_returns_the_abandoned_step(s3_server, s3_bucket, proxy,
                                                                              tmp_path):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    local = str(tmp_path / "local")
    _first_run_to_5(local, url, opts)
    hold = proxy.hold_matching(_step3_upload())
    ck = lazyckpt.Checkpointer(local,
                               persist=lazyckpt.Persist(url, storage_options=_options(s3_server, proxy.endpoint)))
    try:
        h = _resume_from_2(ck)
        h.wait()                                        # committed locally
        assert hold.arrived.wait(60)                    # its upload has started and is stalled
        assert _same(ck.load(), _state(3, run="resumed")) and ck.loaded_from["tier"] == "local"
        # The local tier lost (another machine): the persistent tier alone already
        # knows that step 3 superseded 5; its step 3 is the first run's, so step 2.
        with lazyckpt.Checkpointer(str(tmp_path / "elsewhere"),
                                   persist=lazyckpt.Persist(url, storage_options=opts)) as other:
            assert _same(other.load(), _state(2)) and other.loaded_from["tier"] == "persistent"
            with pytest.raises(CheckpointNotFoundError, match="abandoned"):
                other.load(step=5)
            with pytest.raises(CheckpointNotFoundError):
                other.load(step=3)                      # only the abandoned run's step 3 is there
        # So does the functional API on the prefix, and the listing.
        assert _same(lazyckpt.load(url, storage_options=opts), _state(2))
        assert ck.persistent.dir.steps() == [1, 2]
        assert h.persist_state == "pending"             # all of it while the upload was stalled
        hold.release()
        h.wait(persisted=True)
        assert ck.persistent.dir.steps() == [1, 2, 3]
    finally:
        hold.release()
        ck.close()
    with lazyckpt.Checkpointer(str(tmp_path / "elsewhere2"),
                               persist=lazyckpt.Persist(url, storage_options=opts)) as other:
        assert _same(other.load(), _state(3, run="resumed"))


def _fail_step3_upload(s3_server, s3_bucket, proxy, tmp_path):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    local = str(tmp_path / "local")
    _first_run_to_5(local, url, opts)
    proxy.fail_matching(_step3_upload(), status=500)
    ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(
        url, storage_options=_options(s3_server, proxy.endpoint, max_attempts=1)))
    h = _resume_from_2(ck)
    with pytest.raises(CheckpointWriteError):
        h.wait(persisted=True)
    try:
        ck.close()
    except CheckpointWriteError:
        pass                                            # the failure, reported again
    proxy.reset()
    return local, url, opts


def test_a_failed_upload_of_the_resumed_step_is_retried_after_a_restart(s3_server, s3_bucket, proxy, tmp_path):
    local, url, opts = _fail_step3_upload(s3_server, s3_bucket, proxy, tmp_path)
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as ck:
        assert _same(ck.load(), _state(3, run="resumed")), ck.loaded_from
        assert ck.resumed_drain is not None and ck.resumed_drain.step == 3
        ck.wait()
        assert ck.resumed_drain.persist_state == "persisted"
        assert ck.persistent.dir.steps() == [1, 2, 3]
    with lazyckpt.Checkpointer(str(tmp_path / "elsewhere"),
                               persist=lazyckpt.Persist(url, storage_options=opts)) as other:
        assert _same(other.load(), _state(3, run="resumed")) and other.loaded_from["tier"] == "persistent"


def _damage(step_dir):
    path = os.path.join(step_dir, "rank_00000.lzc")
    with open(path, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_resumed_step_never_falls_back_to_the_abandoned_runs_step(s3_server, s3_bucket, proxy,
                                                                             tmp_path):
    local, url, opts = _fail_step3_upload(s3_server, s3_bucket, proxy, tmp_path)
    _damage(os.path.join(local, "step_0000000003"))
    with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=opts)) as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.load(step=3)
        # The latest loadable step of the line: 2 (never the first run's 3 or 5).
        assert _same(ck.load(), _state(2))
        assert ck.resumed_drain is None                 # a damaged copy is never uploaded
    # The first run's steps 3-5 are still on the persistent tier, untouched, and abandoned.
    assert sorted(ck.persistent.dir.listing()[0]) == [1, 2, 3, 4, 5]
    assert ck.persistent.dir.steps() == [1, 2]


def test_two_manifests_of_one_step_are_told_apart_by_seq_not_by_the_clock(s3_server, s3_bucket):
    from lazyckpt.lineage import event_key
    from lazyckpt.formats.names import MANIFEST, step_dirname
    url, opts = f"s3://{s3_bucket}/objs", _options(s3_server)
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts)) as ck:
        ck.save(_state(1), 1).wait()
        ck.save(_state(2), 2).wait()
        first = ck.layout.committed()[2]
        ck.save(_state(2, run="resumed"), 2).wait()     # supersedes the first step 2
        second = ck.layout.committed()[2]
        # A crash inside the supersede leaves both manifests; make the old one the newest object.
        store, prefix = ck.layout.store, ck.layout.prefix
        raw = store.get(f"{prefix}/{step_dirname(2)}/{second}/{MANIFEST}")
        store.put(f"{prefix}/{step_dirname(2)}/{first}/{MANIFEST}", raw)
        store.put(f"{prefix}/{event_key(Event(2, first, 2))}", b"")
        assert ck.layout.committed()[2] == second


# ---------------------------------------------------------------------- case 4: replicas + rollback + crash

NODE = 2


def _rstate(rank, step, run="first"):
    g = torch.Generator().manual_seed(rank * 1000 + step + (0 if run == "first" else 500))
    return {"w": torch.randn(300, 40, generator=g), "rank": rank, "step": step, "run": run}


def _rsame(a, b):
    return all(a[k] == b[k] for k in ("rank", "step", "run")) and torch.equal(a["w"], b["w"])


def _node_dir(base, rank):
    return os.path.join(base, f"node{rank // NODE}")


def _ckpt(base, rank, bandwidth=0):
    return lazyckpt.Checkpointer(_node_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=NODE,
                                                                                   bandwidth=bandwidth),
                                 distributed=lazyckpt.Distributed(commit_timeout=60))


def _first_run(rank, world, base):
    with _ckpt(base, rank) as ck:
        for step in range(1, 6):
            ck.save(_rstate(rank, step), step).wait()
        ck.wait()
        return ck.replica_stats()["holds"]


def _rollback_then_die(rank, world, base):
    # Slow replicas: step 3 is committed on every node, never replicated.
    ck = _ckpt(base, rank, bandwidth=1000)
    assert _rsame(ck.load(step=2), _rstate(rank, 2))
    ck.save(_rstate(rank, 3, run="resumed"), 3).wait()
    torch.distributed.barrier()
    os._exit(0)                                         # the job dies: nothing closed


def _resume(rank, world, base):
    with _ckpt(base, rank) as ck:
        state = ck.load()
        return {"state": state, "from": ck.loaded_from, "steps": ck.steps()}


def test_a_crash_before_the_resumed_step_is_replicated_never_restores_the_abandoned_step(tmp_path):
    from _dist import run_ranks
    base = str(tmp_path)
    holds = run_ranks(4, _first_run, base, timeout=300)
    assert all(h[0][2] == 5 for h in holds), holds      # the partners hold the first run's step 5
    died = run_ranks(4, _rollback_then_die, base, timeout=300, allow_failure=True)
    assert all(kind == "died" for kind, _ in died), died
    resumed = run_ranks(4, _resume, base, timeout=300)
    for rank, r in enumerate(resumed):
        assert _rsame(r["state"], _rstate(rank, 3, run="resumed")), (rank, r["from"], r["state"]["step"])
        assert r["from"]["tier"] == "local"
        # Step 5 was not re-committed above the resumed step 3.
        assert r["steps"] == [1, 2, 3], r["steps"]
