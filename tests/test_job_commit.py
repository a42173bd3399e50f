"""One decision for the whole job with replicas= (lazyckpt/saving/jobcommit.py):
a rollback commits on no node before every node has it prepared, a crash in
between is decided when the job opens again (the enumeration of every crash
point is tests/test_crash_points.py ``replicas-rollback``). Here: the marker,
the round's refusals and a damaged marker, on real gloo ranks."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import lazyckpt
from _dist import run_ranks
from lazyckpt.distributed import RankInfo
from lazyckpt.errors import CorruptCheckpointError
from lazyckpt.lineage import Event
from lazyckpt.saving.jobcommit import JobCommit, is_job_wide
from lazyckpt.storage.layout import CheckpointDir

pytestmark = pytest.mark.timeout(300)


# ----------------------------------------------------------------------------- the marker (no processes)

def _prepared_tmp(tmp_path, step=3):
    layout = CheckpointDir(str(tmp_path))
    tmp = layout.temp_path(step, "r1-c4")
    os.makedirs(tmp)
    with open(os.path.join(tmp, "rank_00000.lzc"), "wb") as f:
        f.write(b"x" * 100)
    old = time.time() - 3600            # its lease long expired: cleanup would take it
    os.utime(os.path.join(tmp, "rank_00000.lzc"), (old, old))
    os.utime(tmp, (old, old))
    return layout, tmp


def test_a_prepared_save_is_never_a_removable_leftover(tmp_path):
    layout, tmp = _prepared_tmp(tmp_path)
    assert [x.kind for x in layout.leftovers()] == ["interrupted-save"]
    layout.prepare(tmp, Event(3, "job-abc-c4", 7), keep_superseded=False)
    found, keep = layout.prepared()
    assert found.event == Event(3, "job-abc-c4", 7) and found.tmp == os.path.basename(tmp) and keep is False
    (leftover,) = layout.leftovers()
    assert leftover.kind == "prepared" and not leftover.removable and "job" in leftover.describe()
    assert layout.clean_leftovers() == [] and os.path.isdir(tmp)
    layout.discard_prepared(tmp)
    assert layout.prepared() is None and not os.path.exists(tmp)


def test_a_damaged_marker_is_corrupt_and_keeps_every_temporary_directory(tmp_path):
    layout, tmp = _prepared_tmp(tmp_path)
    with open(os.path.join(str(tmp_path), "prepared.json"), "w") as f:
        json.dump({"prepared": [3, "job-abc-c4", 10 ** 13, os.path.basename(tmp)], "keep_superseded": False}, f)
    with pytest.raises(CorruptCheckpointError, match="prepared save"):
        layout.prepared()
    # Which save it named is unknown: no temporary directory is removed.
    assert [x.kind for x in layout.leftovers()] == ["prepared"]
    assert layout.clean_leftovers() == [] and os.path.isdir(tmp)


def test_only_a_save_at_or_below_the_highest_step_takes_the_round():
    job = JobCommit(RankInfo(run_id="abc"), nodes=2, node=0)
    job.high = 5                        # the highest step any node had at open
    assert [job.needs_round(s) for s in (6, 7, 3, 4, 8, 8)] == [False, False, True, True, False, True]
    assert job.save_id(3) == "job-abc-c3" and is_job_wide(job.save_id(3))
    assert not is_job_wide("0123abcd") and not is_job_wide(None)


# ----------------------------------------------------------------------------- two nodes of one rank

def _state(rank, step):
    return {"w": torch.full((1000,), float(step * 10 + rank)), "step": step}


def _dir(base, rank):
    return os.path.join(base, f"node{rank}")


def _line(rank, world, base, steps):
    with lazyckpt.Checkpointer(_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=1),
                               distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        for step in range(1, steps + 1):
            ckpt.save(_state(rank, step), step=step).wait()
        ckpt.wait()


def _save_id(base, rank, step):
    with open(os.path.join(_dir(base, rank), f"step_{step:010d}", "manifest.json")) as f:
        return json.load(f)["save_id"]


def _rollback_refused_on_rank_1(rank, world, base):
    with lazyckpt.Checkpointer(_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=1),
                               distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        ckpt.load(step=2)
        t0 = time.monotonic()
        # Refused on rank 1 only (metadata that is not JSON): node 0 must not commit it.
        metadata = {"bad": object()} if rank == 1 else {"ok": 1}
        try:
            ckpt.save(_state(rank, 100), step=3, metadata=metadata).wait()
            outcome = "committed"
        except Exception as exc:
            outcome = type(exc).__name__
        return {"outcome": outcome, "seconds": time.monotonic() - t0, "steps": ckpt.steps()}


def test_a_rollback_refused_on_one_node_commits_on_none_at_once(tmp_path):
    base = str(tmp_path)
    run_ranks(2, _line, base, 4, timeout=200)
    before = [_save_id(base, r, 3) for r in (0, 1)]
    # Job-wide save ids: the same save is the same id on every node.
    assert before[0] == before[1] and is_job_wide(before[0])
    results = run_ranks(2, _rollback_refused_on_rank_1, base, timeout=200)
    assert results[1]["outcome"] != "committed", results
    assert results[0]["outcome"] == "CheckpointWriteError", results
    assert results[0]["seconds"] < 30, results      # told by node 1's refusal, not at the deadline
    for r in (0, 1):
        assert results[r]["steps"] == [1, 2, 3, 4], results
        assert _save_id(base, r, 3) == before[r]    # the line before the rollback stands
        assert not os.path.exists(os.path.join(_dir(base, r), "prepared.json"))


def _rollback(rank, world, base):
    with lazyckpt.Checkpointer(_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=1),
                               distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        ckpt.load(step=2)
        ckpt.save(_state(rank, 100), step=3).wait()
        ckpt.wait()
        return ckpt.steps()


def _open(rank, world, base):
    try:
        lazyckpt.Checkpointer(_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=1),
                              distributed=lazyckpt.Distributed(commit_timeout=60)).close()
        return "opened"
    except CorruptCheckpointError as exc:
        return f"corrupt: {exc}"


def test_a_rollback_commits_the_same_save_on_every_node_and_a_damaged_marker_stops_every_rank(tmp_path):
    base = str(tmp_path)
    run_ranks(2, _line, base, 4, timeout=200)
    assert run_ranks(2, _rollback, base, timeout=200) == [[1, 2, 3], [1, 2, 3]]
    ids = [_save_id(base, r, 3) for r in (0, 1)]
    assert ids[0] == ids[1] and is_job_wide(ids[0])
    with open(os.path.join(_dir(base, 1), "prepared.json"), "w") as f:
        f.write("{not json")
    # Every rank raises (none waits for the others in a round that never comes).
    results = run_ranks(2, _open, base, timeout=200)
    assert all(r.startswith("corrupt:") and "prepared.json" in r for r in results), results


def _rollback_failing_after_the_round_on_rank_0(rank, world, base):
    import errno
    from lazyckpt.storage import layout as layout_module
    if rank == 0:
        # The disk fails node 0's record write, after every node voted yes.
        def commit(self, tmp, step, keep_superseded, event=None):
            raise OSError(errno.EIO, "injected: the record cannot be written")
        layout_module.CheckpointDir.commit = commit
    # Node 1's replica round with the failed node 0 ends at this deadline (most of the test's
    # time): short, yet ample for the two ranks to meet in the round on a loaded machine.
    with lazyckpt.Checkpointer(_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=1),
                               distributed=lazyckpt.Distributed(commit_timeout=6)) as ckpt:
        ckpt.load(step=2)
        try:
            ckpt.save(_state(rank, 100), step=3).wait()
            return "committed"
        except Exception as exc:
            return type(exc).__name__


def _load(rank, world, base, step):
    with lazyckpt.Checkpointer(_dir(base, rank), replicas=lazyckpt.Replicas(1, node_size=1),
                               distributed=lazyckpt.Distributed(commit_timeout=60)) as ckpt:
        try:
            return ckpt.load(step=step)["w"][0].item(), ckpt.loaded_from["step"]
        except lazyckpt.CheckpointError as exc:
            return type(exc).__name__, str(exc)


def test_two_saves_of_one_step_number_are_never_restored_as_one_step(tmp_path):
    """An I/O error on one node after the round: node 0 keeps the old step 3,
    node 1 commits the new one. Save ids are job-wide, so the restore sees two
    saves and never loads the mix. (Node 0 keeps its agreed save prepared, and
    the next open finishes it -- the next test; here its record is gone, as
    after a crash that lost it.)"""
    base = str(tmp_path)
    run_ranks(2, _line, base, 5, timeout=200)
    assert run_ranks(2, _rollback_failing_after_the_round_on_rank_0, base, timeout=200) == \
        ["CheckpointWriteError", "committed"]
    assert _save_id(base, 0, 3) != _save_id(base, 1, 3)
    os.unlink(os.path.join(_dir(base, 0), "prepared.json"))
    # The newest step both nodes have as one save: 2 (3 differs, 4-5 are gone on node 1).
    assert run_ranks(2, _load, base, None, timeout=200) == [(20.0, 2), (21.0, 2)]
    refused = run_ranks(2, _load, base, 3, timeout=200)
    assert all(r[0] == "CheckpointError" and "cannot be restored on every node" in r[1] for r in refused), refused


def test_a_save_every_node_agreed_on_is_finished_at_the_next_open_where_its_commit_failed(tmp_path):
    """The same I/O error on node 0 after every node voted for the rollback's
    step 3: node 0 keeps its prepared save (its error says the job committed
    it) instead of discarding it, and reopening the job's Checkpointers rolls it
    forward: step 3, the new save, on both nodes, as rank 1 was told."""
    base = str(tmp_path)
    run_ranks(2, _line, base, 5, timeout=200)
    assert run_ranks(2, _rollback_failing_after_the_round_on_rank_0, base, timeout=200) == \
        ["CheckpointWriteError", "committed"]
    assert os.path.exists(os.path.join(_dir(base, 0), "prepared.json"))
    assert run_ranks(2, _load, base, None, timeout=200) == [(1000.0, 3), (1001.0, 3)]
    assert _save_id(base, 0, 3) == _save_id(base, 1, 3)
