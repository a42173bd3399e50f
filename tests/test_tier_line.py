"""Which copy to load, decided by the tiers without a Checkpointer (issue 36):
``lazyckpt.tiers.line.Line.candidates`` over a local directory and a
persistent tier on ``mem://`` (an object store in memory: no server).

The directories are made by real saves; the choice is then asked of the
tier object alone, as the Checkpointer asks it."""

from __future__ import annotations

import json
import os
import shutil
import uuid

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointNotFoundError
from lazyckpt.knobs import resolve
from lazyckpt.storage.layout import CheckpointDir
from lazyckpt.storage.s3layout import ObjectCheckpointDir
from lazyckpt.tiers.line import Line


def _state(step: int):
    return {"w": torch.full((100,), float(step)), "step": step}


def _run(tmp_path, steps=(1, 2, 3)):
    local, url = str(tmp_path / "run"), f"mem://line{uuid.uuid4().hex[:8]}/run"
    with lazyckpt.Checkpointer(local, keep=None, persist=url) as ckpt:
        for step in steps:
            ckpt.save(_state(step), step=step).wait()
        ckpt.wait()                         # every step on both tiers
    return local, url


def _history(local, url):
    return Line(CheckpointDir(local), ObjectCheckpointDir(url, resolve()))


def _tiers(candidates):
    return [(step, tier) for step, tier, _ in candidates]


def test_the_newest_save_first_local_before_persistent_then_the_line(tmp_path):
    local, url = _run(tmp_path)
    got = list(_history(local, url).candidates(None))
    assert _tiers(got) == [(3, "local"), (3, "persistent"), (2, "local"), (2, "persistent"),
                           (1, "local"), (1, "persistent")]
    assert got[0][2] == CheckpointDir(local).step_path(3)
    assert got[1][2].startswith(url + "/step_0000000003/")
    assert _tiers(_history(local, url).candidates(2)) == [(2, "local"), (2, "persistent")]


def test_a_step_lost_locally_is_offered_from_the_store_alone(tmp_path):
    local, url = _run(tmp_path)
    shutil.rmtree(CheckpointDir(local).step_path(3))
    assert _tiers(_history(local, url).candidates(None))[:2] == [(3, "persistent"), (2, "local")]
    shutil.rmtree(local)                    # a replaced node: an empty local directory
    os.makedirs(local)
    assert _tiers(_history(local, url).candidates(None)) == [(3, "persistent"), (2, "persistent"),
                                                            (1, "persistent")]


def test_a_rollback_not_yet_persisted_abandons_the_store_s_newer_steps(tmp_path):
    local, url = _run(tmp_path)
    # The run resumes from step 1 and saves step 2 again, locally only (its upload
    # has not happened): the store still holds the abandoned run's steps 2 and 3.
    with lazyckpt.Checkpointer(local, keep=None) as ckpt:
        ckpt.save(_state(20), step=2).wait()
    history = _history(local, url)
    got = list(history.candidates(None))
    assert _tiers(got) == [(2, "local"), (1, "local"), (1, "persistent")]
    assert lazyckpt.load(got[0][2])["step"] == 20
    with pytest.raises(CheckpointNotFoundError, match="step 3 was abandoned"):
        list(history.candidates(3))
    # Step 2 is offered only as the resumed run's save: the store's is another save.
    assert _tiers(history.candidates(2)) == [(2, "local")]


def test_the_line_is_built_only_when_the_newest_copies_are_not_enough(tmp_path):
    local, url = _run(tmp_path)
    history = _history(local, url)
    built = []
    real = history.line_and_listing
    history.line_and_listing = lambda: built.append(1) or real()
    got = history.candidates(None)
    assert [next(got)[0], next(got)[0]] == [3, 3] and not built      # the indexes alone
    assert next(got)[0] == 2 and built == [1]                        # then the line, once


def _cut_newest_upload(url):
    """The store as a process that died uploading its newest step leaves it: that
    commit's event is there (it goes first), the step's objects are not, and
    ``head.json`` names the step before it."""
    remote = ObjectCheckpointDir(url, resolve())
    newest = remote.tail()
    before = max((e for e in remote.listing()[1] if e.seq < newest.seq), key=lambda e: e.seq)
    prefix = f"{remote.prefix}/step_{newest.step:010d}/{newest.save_id}/"
    remote.store.delete([o["Key"] for o in remote.store.list(prefix)])
    remote.store.put(f"{remote.prefix}/head.json", json.dumps(
        {"step": before.step, "save_id": before.save_id, "seq": before.seq}).encode())
    assert remote.tail() is None            # the store's index alone cannot name its newest save
    return newest


def test_an_upload_cut_after_its_event_offers_the_local_copy_from_the_indexes(tmp_path):
    """A restart after the newest step's upload was cut: the store holds that
    commit's event and not its data. The newest save is still named by the
    two indexes (the local tail is the store's newest event), so the local
    copy is offered without listing either tier; the line comes after."""
    local, url = _run(tmp_path)
    newest = _cut_newest_upload(url)
    history = _history(local, url)
    built = []
    real = history.line_and_listing
    history.line_and_listing = lambda: built.append(1) or real()
    got = iter(history.candidates(None))
    assert next(got)[:2] == (3, "local") and built == [], "the line was built for the newest save"
    assert newest.step == 3
    assert _tiers(got) == [(2, "local"), (2, "persistent"), (1, "local"), (1, "persistent")] and built == [1]


def test_an_open_after_a_cut_upload_sends_the_newest_step_again_without_the_line(tmp_path, monkeypatch):
    """The open's retried upload of that step (the store lacks it) comes from the
    two indexes too; the load reads the local copy, and once the upload is
    done the store's index names the step again."""
    local, url = _run(tmp_path)
    newest = _cut_newest_upload(url)
    built = []
    real = Line.line_and_listing
    monkeypatch.setattr(Line, "line_and_listing", lambda self: built.append(1) or real(self))
    with lazyckpt.Checkpointer(local, keep=None, persist=url) as ckpt:
        assert ckpt.resumed_drain is not None and ckpt.resumed_drain.step == 3
        assert ckpt.load()["step"] == 3 and ckpt.loaded_from["tier"] == "local"
        ckpt.wait()
        assert built == [], "the line was built"
    assert ObjectCheckpointDir(url, resolve()).tail() == newest


# ------------------------------------------------------------ a held replica's deletion (finding 22)

class _Cut(BaseException):
    """A kill in the middle of a deletion (not an Exception: nothing catches it)."""


@pytest.mark.parametrize("cut_at", range(1, 6))
def test_a_replica_deletion_cut_short_never_leaves_a_marked_replica_without_its_data(tmp_path, monkeypatch, cut_at):
    """``remove_replica`` takes ``COMPLETE`` away first: whichever unlink a kill
    interrupts, the directory is either still whole and marked, or unmarked (no
    restore trusts it). A marked directory without its data file is what a
    restore chooses and then refuses for every rank ("the replicas of node(s)
    [0] do not match their manifest": tests/test_replicas.py shows that state
    gives that error), which finding 22 saw once; plain ``shutil.rmtree``, as
    before, deletes in directory order, the marker possibly last."""
    from lazyckpt.tiers.replicas import COMPLETE, held_replicas, remove_replica
    root = tmp_path / ".replicas"
    step = root / "node_00000" / "rank_00000" / "step_0000000002"
    step.mkdir(parents=True)
    for name in ("manifest.json", "rank_00000.lzc", COMPLETE):
        (step / name).write_bytes(b"x")
    assert held_replicas(str(root)) == [(0, 0, 2)]
    real, calls = os.unlink, []

    def unlink(path, *a, **k):
        calls.append(path)
        if len(calls) == cut_at:
            raise _Cut()
        return real(path, *a, **k)
    monkeypatch.setattr(os, "unlink", unlink)
    try:
        remove_replica(str(step))
    except _Cut:
        pass
    monkeypatch.setattr(os, "unlink", real)
    listed = held_replicas(str(root))
    whole = step.is_dir() and {"manifest.json", "rank_00000.lzc"} <= set(os.listdir(step))
    assert not listed or whole, (cut_at, sorted(os.listdir(step)) if step.is_dir() else None)
    if cut_at == 1:
        assert listed == [(0, 0, 2)]        # cut before anything went: still a whole replica
    if cut_at > 3:
        assert not step.exists()            # not cut: all gone
