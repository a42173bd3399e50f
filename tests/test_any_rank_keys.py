"""Any key from any rank: state split by pipeline stage (each rank owns
different keys, plain tensors) loads after the stages are re-partitioned or
the pipeline degree changes -- DeepSpeed's "universal checkpoint" case,
without an offline conversion."""

from __future__ import annotations

import json

import pytest
import torch

import lazyckpt
from _dist import run_ranks

LAYERS = 8


def _layer(i):
    g = torch.Generator().manual_seed(100 + i)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def _stage_state(stage, stages):
    per = LAYERS // stages
    return {"model": {f"layer{i}": _layer(i) for i in range(stage * per, (stage + 1) * per)},
            "optim": {f"layer{i}": {"exp_avg": _layer(i)["w"] * 0.5} for i in range(stage * per, (stage + 1) * per)},
            "stage": stage}


def _save_stages(rank, world, directory):
    with lazyckpt.Checkpointer(directory) as ck:
        ck.save(_stage_state(rank, world), 3).wait()
    return rank


def _empty(stage, stages):
    ref = _stage_state(stage, stages)
    return {"model": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in ref["model"].items()},
            "optim": {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in ref["optim"].items()}}


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return torch.equal(a, b) and a.dtype == b.dtype


def _load_stages(rank, world, directory):
    into = _empty(rank, world)
    with lazyckpt.Checkpointer(directory) as ck:
        ck.load(into=into)
    ref = _stage_state(rank, world)
    return _same(into["model"], ref["model"]) and _same(into["optim"], ref["optim"])


@pytest.fixture(scope="module")
def four_stages(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pp4"))
    assert run_ranks(4, _save_stages, directory) == [0, 1, 2, 3]
    return directory


def test_the_manifest_groups_ranks_by_the_keys_they_hold(four_stages):
    with open(f"{four_stages}/step_0000000003/manifest.json") as f:
        manifest = json.load(f)
    assert sorted(r for g in manifest["keysets"] for run in g["ranks"] for r in range(run[0], run[1] + 1)) \
        == [0, 1, 2, 3]
    assert len(manifest["keysets"]) == 4


def test_four_stages_load_on_two_ranks_with_another_split(four_stages):
    assert run_ranks(2, _load_stages, four_stages) == [True, True]


def test_four_stages_load_in_one_process(four_stages):
    into = _empty(0, 1)
    out = lazyckpt.load(four_stages, into=into)
    ref = _stage_state(0, 1)
    assert out is into and _same(into["model"], ref["model"]) and _same(into["optim"], ref["optim"])
    # keys= finds a key another rank saved, and reads only it.
    got = lazyckpt.load(four_stages, keys=[("model", "layer7")])
    assert _same(got["model"]["layer7"], _layer(7))
    # A key no rank holds is still an error naming it.
    with pytest.raises(lazyckpt.MissingKeyError):
        lazyckpt.load(four_stages, into={"model": {"layer9": {"w": torch.zeros(64, 32)}}})


def test_a_plain_load_still_returns_this_ranks_own_state(four_stages):
    out = lazyckpt.load(four_stages)
    assert out["stage"] == 0 and sorted(out["model"]) == ["layer0", "layer1"]


def test_ranks_that_hold_the_same_keys_make_one_keyset(tmp_path):
    run_ranks(2, _same_keys_save, str(tmp_path))
    with open(tmp_path / "step_0000000001" / "manifest.json") as f:
        assert "keysets" not in json.load(f)


def _same_keys_save(rank, world, directory):
    with lazyckpt.Checkpointer(directory) as ck:
        ck.save({"w": torch.full((10,), float(rank))}, 1).wait()
