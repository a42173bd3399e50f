"""Retention policies (lazyckpt/retention.py): each policy's choice, ``|``, the
one rule storage applies (``retention.plan``), and Checkpointer runs on a
local directory and on ``mem://`` (an object-store layout in this process)
with real saves and metadata. The same on SeaweedFS: tests/test_retention_s3.py."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

import lazyckpt
from lazyckpt import retention
from lazyckpt.formats import manifest as manifests
from lazyckpt.retention import AnyOf, KeepBest, KeepEvery, KeepLast, StepInfo, as_policy, keeps_superseded, plan

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


def infos(steps, metric=None):
    return [StepInfo(s, {} if metric is None else {"loss": metric(s)}) for s in steps]


# ----------------------------------------------------------------- the policies


def test_keep_last_keeps_the_newest_k():
    assert KeepLast(2).select(infos([1, 2, 3, 4])) == {3, 4}
    assert KeepLast(9).select(infos([1, 2])) == {1, 2}
    assert KeepLast(1).select([]) == set()


def test_keep_every_keeps_the_multiples_for_good():
    assert KeepEvery(5).select(infos(range(0, 23))) == {0, 5, 10, 15, 20}
    assert KeepEvery(1).select(infos([3, 7])) == {3, 7}
    assert KeepEvery(100).select(infos([1, 2, 3])) == set()


def test_keep_best_ranks_by_the_metric_and_ignores_what_is_no_number():
    steps = [StepInfo(1, {"loss": 3.0}), StepInfo(2, {"loss": 1}), StepInfo(3, {"loss": "n/a"}),
             StepInfo(4, {}), StepInfo(5, {"loss": True}), StepInfo(6, {"loss": 2.5}), StepInfo(7, {"loss": None})]
    assert KeepBest(2).select(steps) == {2, 6}
    assert KeepBest(2, mode="max").select(steps) == {1, 6}
    assert KeepBest(9).select(steps) == {1, 2, 6}                 # never a step without a number
    acc = [StepInfo(s, {"acc": a}) for s, a in [(1, 0.5), (2, 0.9), (3, 0.7)]]
    assert KeepBest(1, metric="acc", mode="max").select(acc) == {2}
    assert KeepBest(1, metric="acc").select(acc) == {1}


def test_keep_best_prefers_the_newer_step_between_equal_values():
    steps = [StepInfo(s, {"loss": 1.0}) for s in (1, 2, 3)]
    assert KeepBest(2).select(steps) == {2, 3}
    assert KeepBest(1, mode="max").select(steps) == {3}


def test_or_combines_flattens_and_reads_the_union_of_metrics():
    a, b, c = KeepLast(2), KeepEvery(5), KeepBest(1, metric="val")
    combined = a | b | (c | a)
    assert isinstance(combined, AnyOf) and combined.policies == (a, b, c)
    assert combined == AnyOf(a, AnyOf(b, c))
    assert hash(combined) == hash(AnyOf(a, b, c))
    assert combined.metrics() == ["val"]
    assert (KeepBest(1) | KeepBest(2, metric="acc", mode="max") | KeepBest(3)).metrics() == ["loss", "acc"]
    steps = [StepInfo(s, {"val": -s if s == 3 else s}) for s in range(1, 13)]
    assert combined.select(steps) == {11, 12, 5, 10, 3}


def test_policies_are_values_with_a_readable_repr():
    assert repr(KeepLast(2) | KeepEvery(1000) | KeepBest(3, metric="val_loss")) == \
        "KeepLast(2) | KeepEvery(1000) | KeepBest(3, metric='val_loss', mode='min')"
    assert KeepEvery(5) == KeepEvery(5) and len({KeepLast(2), KeepLast(2), KeepEvery(2)}) == 2
    with pytest.raises(Exception):
        KeepLast(2).k = 3                                            # frozen


@pytest.mark.parametrize("make, words", [
    (lambda: KeepLast(0), ["KeepLast", ">= 1", "KeepLast(3)"]),
    (lambda: KeepLast(2.0), ["KeepLast", "int"]),
    (lambda: KeepEvery(0), ["KeepEvery", "KeepEvery(1000)"]),
    (lambda: KeepEvery(True), ["KeepEvery", "int"]),
    (lambda: KeepBest(0), ["KeepBest", "k"]),
    (lambda: KeepBest(2, metric=""), ["metric", "val_loss"]),
    (lambda: KeepBest(2, metric="step"), ["metric", "Checkpointer's own"]),
    (lambda: KeepBest(2, mode="minimum"), ["'min'", "'max'", "'minimum'"]),
    (lambda: AnyOf(), ["AnyOf", "at least one"]),
    (lambda: as_policy(0), ["keep", ">= 1", "KeepLast(2) | KeepEvery(1000)"]),
])
def test_bad_arguments_say_what_to_write(make, words):
    with pytest.raises(ValueError) as info:
        make()
    for word in words:
        assert word in str(info.value)


def test_type_errors_name_the_policies():
    with pytest.raises(TypeError, match=r"KeepLast\(2\) \| KeepLast\(3\)"):
        KeepLast(2) | 3
    with pytest.raises(TypeError, match="AnyOf"):
        AnyOf(KeepLast(1), "KeepEvery(5)")
    with pytest.raises(TypeError, match="KeepBest"):
        as_policy("3")


def test_as_policy_and_the_superseded_rule():
    assert as_policy(None) is None and as_policy(3) == KeepLast(3)
    p = KeepEvery(4)
    assert as_policy(p) is p
    assert keeps_superseded(None)
    assert not any(keeps_superseded(q) for q in (KeepLast(3), KeepEvery(2), KeepBest(1), KeepLast(1) | KeepEvery(2)))


POLICIES = st.one_of(
    st.builds(KeepLast, st.integers(1, 5)),
    st.builds(KeepEvery, st.integers(1, 6)),
    st.builds(KeepBest, st.integers(1, 4), st.just("loss"), st.sampled_from(["min", "max"])))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 60), unique=True).map(sorted), st.lists(POLICIES, min_size=1, max_size=4),
       st.integers(0, 1000))
def test_or_keeps_exactly_what_any_member_keeps(steps, members, seed):
    given_steps = [StepInfo(s, {"loss": (s * 7919 + seed) % 13}) for s in steps]
    combined = members[0]
    for m in members[1:]:
        combined = combined | m
    assert combined.select(given_steps) == set().union(*(m.select(given_steps) for m in members))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 40), unique=True, min_size=1).map(sorted), POLICIES, st.data())
def test_plan_deletes_only_what_nothing_needs_newest_first(steps, policy, data):
    # Random incremental references: each step may refer to some earlier steps (None: unreadable).
    refs = {}
    for i, s in enumerate(steps):
        earlier = steps[:i]
        refs[s] = None if earlier and data.draw(st.integers(0, 9)) == 0 else \
            data.draw(st.lists(st.sampled_from(earlier), unique=True, max_size=3)) if earlier else []
    metadata = {s: {"loss": data.draw(st.integers(0, 5))} for s in steps}
    found = plan(policy, steps, metadata.__getitem__, refs.__getitem__)
    chosen = policy.select([StepInfo(s, metadata[s]) for s in steps])
    assert found.kept == chosen | {steps[-1]}                 # the policy's, and the newest
    assert found.doomed == sorted(found.doomed, reverse=True)
    assert set(found.doomed) == set(steps) - found.needed and found.kept <= found.needed
    for s in found.needed:                                     # nothing kept refers to a deleted step
        needs = [r for r in steps if r < s] if refs[s] is None else refs[s]
        assert not set(needs) & set(found.doomed)
    assert set(found.referred) == found.needed - found.kept
    assert plan(None, steps, metadata.__getitem__, refs.__getitem__).doomed == []


def test_plan_reads_metadata_only_for_a_policy_that_ranks_by_it():
    asked = []

    def metadata(step):
        asked.append(step)
        return {"loss": step}
    assert plan(KeepLast(1) | KeepEvery(2), [1, 2, 3], metadata).doomed == [1]
    assert asked == []
    assert plan(KeepBest(1), [1, 2, 3], metadata).doomed == [2]
    assert asked == [1, 2, 3]


# ----------------------------------------------------------------- Checkpointer runs


STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3)}


def _state(step):
    return {"w": STATE["w"] + step, "b": STATE["b"] * step}


def _save_all(ck, losses, metric="loss"):
    for step, loss in losses.items():
        ck.save(_state(step), step, metadata={} if loss is None else {metric: loss})
    ck.wait()


def _abandoned(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(".abandoned-"))


def test_keep_last_or_keep_every_on_a_local_directory(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=KeepLast(2) | KeepEvery(5)) as ck:
        for step in range(13):
            ck.save(_state(step), step)
        ck.wait()
        assert ck.steps() == [0, 5, 10, 11, 12]
        for step in ck.steps():
            assert torch.equal(ck.load(step)["w"], _state(step)["w"])


def test_keep_best_with_real_saves_and_metadata(tmp_path):
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 1.0, 5: 6.0, 6: 2.0, 7: 7.0, 8: 8.0}
    with lazyckpt.Checkpointer(tmp_path / "min", keep=KeepBest(2, metric="loss")) as ck:
        _save_all(ck, losses)
        assert ck.steps() == [4, 6, 8]            # the two best, and the newest
        assert ck.load(4)["b"][0].item() == 4
    with lazyckpt.Checkpointer(tmp_path / "max", keep=KeepBest(1, metric="acc", mode="max") | KeepLast(2)) as ck:
        _save_all(ck, losses, metric="acc")
        assert ck.steps() == [7, 8]
    # A value that is no number is accepted, and never among the best.
    with lazyckpt.Checkpointer(tmp_path / "odd", keep=KeepBest(1)) as ck:
        _save_all(ck, {1: 3.0, 2: "n/a", 3: 0.5, 4: 9.0})
        assert ck.steps() == [3, 4]


def test_a_save_without_the_metric_is_refused_at_save(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=KeepLast(3) | KeepBest(2, metric="val_loss")) as ck:
        ck.save(_state(1), 1, metadata={"val_loss": 1.0}).wait()
        with pytest.raises(ValueError) as info:
            ck.save(_state(2), 2, metadata={"loss": 1.0})
        message = str(info.value)
        assert "'val_loss'" in message and "KeepBest(2, metric='val_loss', mode='min')" in message
        assert "metadata=" in message
        with pytest.raises(ValueError, match="val_loss"):
            ck.save(_state(2), 2)
        ck.wait()                                 # nothing failed in the background
        assert ck.steps() == [1]
        ck.save(_state(2), 2, metadata={"val_loss": 0.5}).wait()
        assert ck.steps() == [1, 2]


def test_a_rollback_under_a_policy_deletes_the_superseded_steps(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=KeepLast(9) | KeepEvery(2)) as ck:
        _save_all(ck, {s: None for s in range(1, 6)})
        ck.save(_state(30), 3).wait()             # a run resumed from step 2
        assert ck.steps() == [1, 2, 3]
        assert torch.equal(ck.load(3)["w"], _state(30)["w"])
    assert _abandoned(tmp_path) == []


def test_a_rollback_without_a_policy_keeps_the_superseded_steps_aside(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=None) as ck:
        _save_all(ck, {s: None for s in range(1, 6)})
        ck.save(_state(30), 3).wait()
        assert ck.steps() == [1, 2, 3]
    assert [n.split("-")[1] for n in _abandoned(tmp_path)] == ["step_0000000003", "step_0000000004",
                                                               "step_0000000005"]


def test_a_rollback_that_supersedes_the_best_steps(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=KeepBest(2)) as ck:
        _save_all(ck, {1: 1.0, 2: 2.0, 3: 9.0, 4: 9.0, 5: 9.0})
        assert ck.steps() == [1, 2, 5]
        ck.save(_state(2), 2, metadata={"loss": 5.0}).wait()
        assert ck.steps() == [1, 2]
        _save_all(ck, {3: 4.0, 4: 8.0})
        assert ck.steps() == [1, 3, 4]
    assert _abandoned(tmp_path) == []


def test_policies_keep_what_kept_incremental_steps_refer_to(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=KeepLast(1) | KeepEvery(3), incremental=True) as ck:
        big = torch.arange(1 << 16, dtype=torch.float32)
        for step in range(1, 8):
            ck.save({"big": big, "small": torch.full((4,), float(step))}, step)
        ck.wait()
        steps = ck.steps()
        assert {3, 6, 7} <= set(steps) and 1 in steps     # step 1 holds the bytes of "big"
        for step in steps:
            got = ck.load(step)
            assert torch.equal(got["big"], big) and got["small"][0].item() == step


def test_a_retention_pass_parses_each_manifest_once(tmp_path, monkeypatch):
    parsed = []
    real = manifests.parse

    def counting(raw, path):
        parsed.append(str(path))
        return real(raw, path)
    monkeypatch.setattr(manifests, "parse", counting)
    n = 40
    with lazyckpt.Checkpointer(tmp_path, keep=KeepLast(1) | KeepEvery(5) | KeepBest(2)) as ck:
        for step in range(1, n + 1):
            ck.save(_state(step), step, metadata={"loss": float((step * 37) % 11)}).wait()
        mine = [p for p in parsed if p.startswith(str(tmp_path))]
        # One parse per committed step: the kept ones (every 5th, the best) are not read again.
        assert len(mine) <= n, f"{len(mine)} manifest parses for {n} commits"
        present = ck.steps()
        assert len(present) >= n // 5
        assert len(ck.layout._manifests) <= len(present)        # the cache: bounded by the steps present


def test_keep_best_on_the_persistent_tier_and_an_object_store_directory(tmp_path):
    url = f"mem://b{uuid.uuid4().hex[:10]}/run"
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0}
    with lazyckpt.Checkpointer(tmp_path, keep=1, persist=lazyckpt.Persist(url, keep=KeepBest(2))) as ck:
        for step, loss in losses.items():
            ck.save(_state(step), step, metadata={"loss": loss}).wait(persisted=True)
        ck.wait()
        assert ck.steps() == [6]
        assert ck.persistent.dir.steps() == [2, 4, 6]
        with pytest.raises(ValueError, match=r"Persist\(keep\)=KeepBest\(2"):
            ck.save(_state(7), 7)
    on_store = f"mem://b{uuid.uuid4().hex[:10]}/run"
    with lazyckpt.Checkpointer(on_store, keep=KeepBest(1) | KeepEvery(3)) as ck:
        _save_all(ck, losses)
        assert ck.steps() == [2, 3, 6]
        ck.save(_state(20), 2, metadata={"loss": 3.0}).wait()       # a rollback supersedes 2, 3 and 6
        assert ck.steps() == [2]
        assert torch.equal(ck.load(2)["w"], _state(20)["w"])
        assert len(ck.layout._metadata) <= 1


# ----------------------------------------------------------------- freeing off the commit's path


def _trash(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(".deleting-"))


def _hold_release_thread():
    """Occupy the release thread (the real one) until the returned event is set:
    what retention moved aside then stays on disk, observably, until it is."""
    import threading
    from lazyckpt.storage import fileio
    go, started = threading.Event(), threading.Event()

    def busy(_path):
        started.set()
        go.wait(30)
    fileio.free_later(busy, "hold")
    assert started.wait(10)
    return go


def test_wait_returns_before_the_superseded_step_is_freed(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=1) as ck:
        ck.save(_state(1), 1).wait()
        go = _hold_release_thread()
        try:
            ck.save(_state(2), 2).wait()
            # Out of the listing at once; its bytes still on disk, aside.
            assert ck.steps() == [2]
            trash = _trash(tmp_path)
            assert len(trash) == 1 and "step_0000000001" in trash[0]
            assert os.path.isfile(os.path.join(tmp_path, trash[0], "rank_00000.lzc"))
            assert torch.equal(lazyckpt.load(tmp_path)["w"], _state(2)["w"])
        finally:
            go.set()
        ck.wait(freed=True)
        assert _trash(tmp_path) == [] and ck.steps() == [2]


def test_close_waits_for_the_frees(tmp_path):
    ck = lazyckpt.Checkpointer(tmp_path, keep=1)
    ck.save(_state(1), 1).wait()
    go = _hold_release_thread()
    ck.save(_state(2), 2).wait()
    assert len(_trash(tmp_path)) == 1
    import threading
    threading.Timer(0.3, go.set).start()
    ck.close()
    assert _trash(tmp_path) == []


_KILLED_BEFORE_THE_FREE = r"""
import os, sys, torch, lazyckpt
from lazyckpt.storage import fileio
import threading
d = sys.argv[1]
ck = lazyckpt.Checkpointer(d, keep=1)
ck.save({"w": torch.ones(1000)}, 1).wait()
go = threading.Event()
fileio.free_later(lambda _p: go.wait(60), "hold")
ck.save({"w": torch.full((1000,), 2.0)}, 2).wait()
print("trash:", [n for n in os.listdir(d) if n.startswith(".deleting-")], flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_kill_before_the_free_leaves_trash_the_next_open_removes(tmp_path):
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", _KILLED_BEFORE_THE_FREE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == -9, run.stderr
    assert "step_0000000001" in run.stdout
    assert len(_trash(tmp_path)) == 1
    # Never a step, whoever lists: the trash is neither loaded nor counted.
    assert torch.equal(lazyckpt.load(tmp_path)["w"], torch.full((1000,), 2.0))
    with lazyckpt.Checkpointer(tmp_path, keep=1) as ck:
        assert ck.steps() == [2]
        ck.layout.tidy()                # the scan at open
        assert _trash(tmp_path) == []
        assert ck.steps() == [2]
