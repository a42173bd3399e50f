"""Placement-derived shard index (issue 12): 2-D meshes (TP x FSDP),
uneven shards and replicated dimensions, resharded to other shapes, and the
manifest's size independent of the number of ranks."""

from __future__ import annotations

import json

import pytest
import torch

import lazyckpt
from _dist import run_ranks


def _full(name):
    g = torch.Generator().manual_seed(len(name))
    shapes = {"tp_fsdp": (10, 6), "rep_tp": (7, 5), "strided": (13, 4), "plain": (3,)}
    return torch.randn(*shapes[name], generator=g)


def _save_2d(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {"tp_fsdp": distribute_tensor(_full("tp_fsdp"), mesh, [Shard(0), Shard(1)]),
             "rep_tp": distribute_tensor(_full("rep_tp"), mesh, [Replicate(), Shard(0)]),
             "both_on_0": distribute_tensor(_full("strided"), mesh, [Shard(0), Shard(0)]),
             "plain": _full("plain")}
    with lazyckpt.Checkpointer(directory) as ck:
        ck.save(state, 1).wait()
    return rank


def _load_1d(rank, world, directory):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    into = {k: distribute_tensor(torch.zeros_like(_full(n)), mesh, [Shard(0)])
            for k, n in (("tp_fsdp", "tp_fsdp"), ("rep_tp", "rep_tp"), ("both_on_0", "strided"))}
    with lazyckpt.Checkpointer(directory) as ck:
        ck.load(into=into)
    return {("strided" if k == "both_on_0" else k): into[k].full_tensor() for k in ("tp_fsdp", "rep_tp", "both_on_0")}


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("mesh2d"))
    assert run_ranks(4, _save_2d, directory, timeout=240) == [0, 1, 2, 3]
    return directory


def test_2d_mesh_layouts_are_recorded_once_per_tensor(saved_2d):
    with open(f"{saved_2d}/step_0000000001/manifest.json") as f:
        manifest = json.load(f)
    layouts = manifest["layouts"]
    assert set(layouts) == {'["tp_fsdp"]', '["rep_tp"]', '["both_on_0"]'}
    assert layouts['["tp_fsdp"]']["layout"] == {"mesh": {"shape": [2, 2], "start": 0, "strides": [2, 1]},
                                               "placements": [["S", 0], ["S", 1]]}
    assert layouts['["both_on_0"]']["layout"]["placements"] == [["S", 0], ["S", 0]]
    assert layouts['["rep_tp"]']["layout"]["placements"] == [["R"], ["S", 0]]
    assert "shards" not in manifest


@pytest.mark.parametrize("world", [2, 3])
def test_2d_mesh_reshards_to_a_1d_mesh(saved_2d, world):
    for got in run_ranks(world, _load_1d, saved_2d, timeout=240):
        for k, v in got.items():
            assert torch.equal(v, _full(k)), k


def test_2d_mesh_assembles_in_one_process(saved_2d):
    out = lazyckpt.load(saved_2d)
    for k, n in (("tp_fsdp", "tp_fsdp"), ("rep_tp", "rep_tp"), ("both_on_0", "strided"), ("plain", "plain")):
        assert torch.equal(out[k], _full(n)), k


def _save_fsdp(rank, world, directory, tensors):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    state = {f"t{i}": distribute_tensor(torch.full((13, 3), float(i)), mesh, [Shard(0)]) for i in range(tensors)}
    with lazyckpt.Checkpointer(directory) as ck:
        ck.save(state, 1).wait()
    return rank


def test_manifest_bytes_per_added_rank_do_not_depend_on_the_tensors(tmp_path):
    """The manifest grows by the files list only (~70 B per rank), not by a
    piece per tensor per rank (~300 B x tensors before)."""
    sizes = {}
    for world in (2, 4):
        directory = tmp_path / f"w{world}"
        run_ranks(world, _save_fsdp, str(directory), 32, timeout=240)
        sizes[world] = (directory / "step_0000000001" / "manifest.json").stat().st_size
    per_rank = (sizes[4] - sizes[2]) / 2
    assert per_rank < 200, sizes
