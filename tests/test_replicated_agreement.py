"""replicated= keys must agree across ranks, or the save must say which do not
(issue 22, cases 5 and 9).

* ``replicated="auto"``: a learned key that later differs in size between ranks
  must not change who writes the entries of the keys after it (entry owners
  come from the agreed list, not from each rank's own byte counts); the step
  commits and loads bit-exact on every rank.
* ``replicated=[...]``: keys whose values (or sizes) differ between ranks fail
  the save at commit, naming the keys and the ranks; the previous step stays
  the latest and the next save with agreeing values commits.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import lazyckpt
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)


def _sizes_state(rank, step):
    """``"a"`` precedes ``"b"``. From step 3 on, a["x1"]'s storage is 3x larger on
    rank 0: balancing by each rank's own byte counts then gives b's entry to
    rank 1 on rank 0 and to rank 0 on rank 1 (neither would write it)."""
    g = torch.Generator().manual_seed(step)
    x1 = torch.arange(25, dtype=torch.float32) + step
    if step >= 3 and rank == 0:
        x1 = torch.cat([x1, torch.zeros(50)])
    return {"a": {"x1": x1, "x2": torch.full((25,), float(step))},
            "b": {"y": torch.randn(5000, generator=g)},
            "step": step}


def _equal(got, want):
    return (torch.equal(got["a"]["x1"], want["a"]["x1"]) and torch.equal(got["a"]["x2"], want["a"]["x2"])
            and torch.equal(got["b"]["y"], want["b"]["y"]) and got["step"] == want["step"])


def _auto_sizes(rank, world, directory):
    out = {}
    with lazyckpt.Checkpointer(directory,
                               distributed=lazyckpt.Distributed(identical_keys="auto", commit_timeout=60)) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(_sizes_state(rank, step), step=step).wait()
        out["steps"] = ckpt.steps()
        out["loaded"] = {}
        for step in (1, 2, 3, 4):
            try:
                out["loaded"][step] = _equal(ckpt.load(step=step), _sizes_state(rank, step))
            except lazyckpt.CheckpointError as exc:
                out["loaded"][step] = str(exc)
        with open(os.path.join(ckpt.step_path(3), "manifest.json")) as f:
            out["replicated3"] = json.load(f).get("replicated")
    return out


def test_auto_key_that_changes_size_before_an_identical_key_still_loads(tmp_path):
    results = run_ranks(2, _auto_sizes, str(tmp_path / "run"))
    for rank, r in enumerate(results):
        assert r["steps"] == [1, 2, 3, 4], r
        assert r["loaded"] == {1: True, 2: True, 3: True, 4: True}, (rank, r["loaded"])
    # "a" differs from step 3 on (written per rank); "b" is still written once.
    assert results[0]["replicated3"] == ["b"], results[0]


def _save_two(rank, world, directory, first, second, replicated):
    """Save step 1 (agreeing), then step 2 from ``first(rank)`` and, when that fails,
    step 3 from ``second(rank)``."""
    out = {}
    with lazyckpt.Checkpointer(directory,
                               distributed=lazyckpt.Distributed(identical_keys=replicated, commit_timeout=60)) as ckpt:
        ckpt.save(second(rank), step=1).wait()
        try:
            ckpt.save(first(rank), step=2).wait()
            out["error"] = None
        except lazyckpt.CheckpointError as exc:
            out["error"] = str(exc)
        out["latest_after_failure"] = ckpt.steps()[-1]
        ckpt.save(second(rank), step=3).wait()
        out["steps"] = ckpt.steps()
        got = ckpt.load()
        want = second(rank)
        out["loaded"] = all(torch.equal(got[k][n], want[k][n]) for k in want for n in want[k])
    return out


def _values_differ(rank):
    return {"model": {"w": torch.ones(1000), "v": torch.zeros(10)},
            "buffers": {"running_mean": torch.full((64,), float(rank))},      # a diverged rank
            "extra": {"z": torch.full((8,), float(rank))}}                   # also differs


def _values_agree(rank):
    return {"model": {"w": torch.ones(1000), "v": torch.zeros(10)},
            "buffers": {"running_mean": torch.full((64,), 7.0)},
            "extra": {"z": torch.full((8,), 3.0)}}


def test_named_replicated_keys_whose_values_differ_fail_the_save_naming_keys_and_ranks(tmp_path):
    directory = str(tmp_path / "run")
    results = run_ranks(2, _save_two, directory, _values_differ, _values_agree, ["model", "buffers", "extra"])
    for r in results:
        err = r["error"]
        assert err is not None, r
        assert "'buffers'" in err and "'extra'" in err and "'model'" not in err, err
        assert "rank 0" in err and "rank 1" in err, err
        assert r["latest_after_failure"] == 1, r
        assert r["steps"] == [1, 3] and r["loaded"], r


def _sizes_differ(rank):
    # The same shape on both ranks, but rank 0's tensor is a view of a larger storage:
    # what would be written (the whole storage) differs in size.
    w = torch.zeros(75)[:25] if rank == 0 else torch.zeros(25)
    return {"a": {"w": w}, "b": {"y": torch.ones(5000)}}


def _sizes_agree(rank):
    return {"a": {"w": torch.zeros(25)}, "b": {"y": torch.ones(5000)}}


def test_named_replicated_keys_whose_sizes_differ_fail_the_save_naming_the_key(tmp_path):
    results = run_ranks(2, _save_two, str(tmp_path / "run"), _sizes_differ, _sizes_agree, ["a", "b"])
    for r in results:
        err = r["error"]
        assert err is not None and "'a'" in err and "'b'" not in err, r
        assert r["latest_after_failure"] == 1 and r["steps"] == [1, 3] and r["loaded"], r


def _ddp_bn(rank, world, directory):
    """DDP with broadcast_buffers=False: each rank's BatchNorm running stats follow
    its own batches, so the buffers differ while the parameters agree."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4))
    model = DDP(net, broadcast_buffers=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    with lazyckpt.Checkpointer(directory,
                               distributed=lazyckpt.Distributed(identical_keys=["model", "optim"],
                                                                commit_timeout=60)) as ckpt:
        ckpt.save({"model": net.state_dict(), "optim": opt.state_dict()}, step=1).wait()   # not trained yet
        torch.manual_seed(100 + rank)                   # each rank's own data
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        try:
            ckpt.save({"model": net.state_dict(), "optim": opt.state_dict()}, step=2).wait()
            out["error"] = None
        except lazyckpt.CheckpointError as exc:
            out["error"] = str(exc)
        out["steps"] = ckpt.steps()
    return out


def test_ddp_without_broadcast_buffers_fails_the_save_naming_the_model(tmp_path):
    results = run_ranks(2, _ddp_bn, str(tmp_path / "run"))
    for r in results:
        assert r["error"] is not None and "'model'" in r["error"] and "'optim'" not in r["error"], r
        assert "rank 0" in r["error"] and "rank 1" in r["error"], r
        assert r["steps"] == [1], r


def test_the_ranks_are_named_briefly_even_for_many():
    from lazyckpt.saving.planner import _ranks
    assert _ranks([1]) == "rank 1"
    assert _ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert _ranks(list(range(0, 40, 2))).endswith(", ...")
