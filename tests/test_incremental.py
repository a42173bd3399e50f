"""Incremental checkpoints (issue 14): unchanged tensor storages are neither
copied nor written; the step refers to an earlier step's bytes (format v2
"ref" entries). Version and content modes, full_every, retention that keeps
referred-to steps, damaged or missing referred-to files, rollback, the CLI,
several ranks with resharding loads."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lazyckpt
from _dist import run_ranks
from lazyckpt.cli import inspect as lzinspect
from lazyckpt.cli import prune as lzprune
from lazyckpt.loading import resolve as lzresolve
from lazyckpt.loading import verify as lzverify
from lazyckpt.storage.stores import LOCAL
from lzc_tools import assert_same, clone_state, flip_byte

pytestmark = pytest.mark.timeout(300)


def _model(frozen=True):
    torch.manual_seed(0)
    backbone = torch.nn.Linear(256, 1024)           # 1 MiB of weights, frozen
    head = torch.nn.Linear(1024, 8)
    if frozen:
        backbone.requires_grad_(False)
    model = torch.nn.Sequential(backbone, torch.nn.ReLU(), head)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _train(model, opt, step):
    torch.manual_seed(100 + step)
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt, step):
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def _manifest(directory, step):
    with open(os.path.join(directory, f"step_{step:010d}", "manifest.json")) as f:
        return json.load(f)


def _entries(path):
    return lzinspect.describe(str(path))["files"][0]["entries"]


def test_unchanged_storages_are_referred_to_not_written(tmp_path):
    model, opt = _model()
    refs, sizes = {}, {}
    with lazyckpt.Checkpointer(tmp_path, keep=None, incremental=True) as ckpt:
        ckpt.attach(opt)
        for step in range(4):
            _train(model, opt, step)
            state = _state(model, opt, step)
            refs[step] = clone_state(state)
            sizes[step] = ckpt.save(state, step=step).wait().bytes
        for step in range(4):
            assert_same(ckpt.load(step=step), refs[step])
    backbone = 1024 * 256 * 4 + 1024 * 4
    assert sizes[0] > backbone
    for step in (1, 2, 3):
        assert sizes[step] < sizes[0] - backbone + 64 * 1024          # the frozen bytes are not in it
        manifest = _manifest(tmp_path, step)
        assert manifest["references"] == [0] and manifest["format_version"] == 2
    assert _manifest(tmp_path, 0)["format_version"] == 1              # a full save stays version 1
    kinds = {e["name"]: e["kind"] for e in _entries(tmp_path / "step_0000000003")}
    assert kinds["model/0.weight"] == kinds["model/0.bias"] == "ref"
    assert kinds["model/2.weight"] == kinds["optim/state/0/exp_avg"] == "data"
    ref = next(e["ref"] for e in _entries(tmp_path / "step_0000000003") if e["name"] == "model/0.weight")
    assert ref["step"] == 0 and ref["rank"] == 0                      # always the owner, never a chain


def test_keys_into_and_map_location_work_across_references(tmp_path):
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, incremental=True) as ckpt:
        for step in range(2):
            _train(model, opt, step)
            ckpt.save(_state(model, opt, step), step=step).wait()
        part = ckpt.load(keys=[("model", "0.weight")])
        assert torch.equal(part["model"]["0.weight"], model[0].weight)
        target = _state(*_model(frozen=True), 0)
        with torch.no_grad():
            for t in target["model"].values():
                t.zero_()
        out = ckpt.load(into=target, map_location="cpu")
        assert out is target and torch.equal(target["model"]["0.weight"], model[0].weight)
    # A data file loaded by itself resolves its references in its directory.
    alone = lazyckpt.load(str(tmp_path / "step_0000000001" / "rank_00000.lzc"))
    assert torch.equal(alone["model"]["0.weight"], model[0].weight)


def test_a_load_opens_only_the_files_holding_what_it_reads(tmp_path):
    state = {"a": torch.ones(1000), "b": torch.zeros(1000)}
    with lazyckpt.Checkpointer(tmp_path, incremental=True) as ckpt:
        ckpt.save(state, step=0).wait()
        state["b"].add_(1.0)
        ckpt.save(state, step=1).wait()                  # b owned by 1, a referred to 0
        ckpt.save(state, step=2).wait()                  # a -> 0, b -> 1: never 2 -> 1 -> 0
    refs = {e["name"]: e["ref"]["step"] for e in _entries(tmp_path / "step_0000000002") if e["kind"] == "ref"}
    assert refs == {"a": 0, "b": 1}
    assert _manifest(tmp_path, 2)["references"] == [0, 1]
    gone = tmp_path / "step_0000000001" / "rank_00000.lzc"
    os.rename(gone, gone.with_suffix(".moved"))
    assert torch.equal(lazyckpt.load(str(tmp_path), keys=["a"])["a"], state["a"])    # step 1 not needed
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="step 1"):
        lazyckpt.load(str(tmp_path), keys=["b"])


def test_an_in_place_change_is_written_again(tmp_path):
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, incremental=True) as ckpt:
        ckpt.save(_state(model, opt, 0), step=0).wait()
        with torch.no_grad():
            model[0].weight[0, 0] += 1.0             # bumps the version counter
        ckpt.save(_state(model, opt, 1), step=1).wait()
        kinds = {e["name"]: e["kind"] for e in _entries(tmp_path / "step_0000000001")}
        assert kinds["model/0.weight"] == "data" and kinds["model/0.bias"] == "ref"
        assert torch.equal(ckpt.load()["model"]["0.weight"], model[0].weight)


def test_content_mode_catches_writes_that_bypass_the_version_counter(tmp_path):
    # True is "content" (issue 22); "version" is the old name of "version-counters".
    for mode, expect_kind in (("version-counters", "ref"), ("version", "ref"), (True, "data"), ("content", "data")):
        model, opt = _model()
        d = tmp_path / str(mode)
        with lazyckpt.Checkpointer(d, incremental=mode) as ckpt:
            ckpt.save(_state(model, opt, 0), step=0).wait()
            model[0].weight.data[0, 0] += 1.0            # .data: no version bump
            model[0].bias.numpy()[0] += 1.0              # a numpy view: no version bump either
            ckpt.save(_state(model, opt, 1), step=1).wait()
            kinds = {e["name"]: e["kind"] for e in _entries(d / "step_0000000001")}
            assert kinds["model/0.weight"] == kinds["model/0.bias"] == expect_kind, mode
            loaded = ckpt.load()["model"]["0.weight"]
        # The documented limit of the version mode: the stale bytes are referred to.
        assert torch.equal(loaded, model[0].weight) == (expect_kind == "data")
    # Content mode still refers to what really did not change.
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path / "c2", incremental="content") as ckpt:
        ckpt.save(_state(model, opt, 0), step=0).wait()
        _train(model, opt, 1)
        ckpt.save(_state(model, opt, 1), step=1).wait()
        kinds = {e["name"]: e["kind"] for e in _entries(tmp_path / "c2" / "step_0000000001")}
        assert kinds["model/0.weight"] == "ref" and kinds["model/2.weight"] == "data"


def test_full_every_bounds_the_reach_of_references(tmp_path):
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, keep=2, incremental=lazyckpt.Incremental(full_every=3)) as ckpt:
        for step in range(7):
            _train(model, opt, step)
            ckpt.save(_state(model, opt, step), step=step).wait()
            refs = _manifest(tmp_path, step).get("references", [])
            assert refs == ([] if step % 3 == 0 else [step - step % 3])
        # Kept: 5, 6 and the step they refer to (6 is full, 5 refers to 3).
        assert ckpt.steps() == [3, 5, 6]
        ckpt.save(_state(model, opt, 7), step=7).wait()       # refers to 6: 3 can go now
        assert ckpt.steps() == [6, 7]
        assert lzverify.verify(store=LOCAL, path=str(tmp_path)).ok


def test_retention_never_leaves_a_dangling_reference(tmp_path):
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, keep=1, incremental=True) as ckpt:
        for step in range(5):
            _train(model, opt, step)
            ckpt.save(_state(model, opt, step), step=step).wait()
            for s in ckpt.steps():
                assert lzverify.verify(store=LOCAL, path=str(tmp_path / f"step_{s:010d}")).ok, s
        assert ckpt.steps() == [0, 4]                  # 0 owns the frozen bytes 4 refers to
    layout = lazyckpt.storage.layout.CheckpointDir(str(tmp_path))
    # A new Checkpointer (a restarted run) writes its first save in full: 5 owns
    # the frozen bytes from then on.
    with lazyckpt.Checkpointer(tmp_path, keep=None, incremental=True) as ckpt:
        for step in range(5, 9):
            ckpt.save(_state(model, opt, step), step=step).wait()
    # Deleting newest first: a crash between two deletes never strands a reference.
    doomed, referred = layout.retention_plan(1)
    assert doomed == [7, 6, 4, 0] and referred == [5]
    report = lzprune.prune(str(tmp_path), keep=1)
    assert report["kept"] == [5, 8] and report["kept_for_references"] == [5]
    assert lzverify.verify(store=LOCAL, path=str(tmp_path)).ok


def test_a_missing_or_damaged_referred_to_file_names_both_steps(tmp_path):
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, incremental=True) as ckpt:
        ckpt.save(_state(model, opt, 0), step=0).wait()
        _train(model, opt, 1)
        ckpt.save(_state(model, opt, 1), step=1).wait()
    owner = tmp_path / "step_0000000000" / "rank_00000.lzc"
    offset = next(e["offset"] for e in _entries(tmp_path / "step_0000000000") if e["name"] == "model/0.weight")
    flip_byte(owner, offset + 100)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="checksum"):
        lazyckpt.load(str(tmp_path), keys=["model"])
    report = lzverify.verify(store=LOCAL, path=str(tmp_path / "step_0000000001"))
    assert not report.ok and any("referred to by step 1" in p.message for p in report.problems)
    flip_byte(owner, offset + 100)                     # repaired
    assert lzverify.verify(store=LOCAL, path=str(tmp_path / "step_0000000001")).ok
    os.rename(owner, owner.with_suffix(".gone"))
    with pytest.raises(lazyckpt.CorruptCheckpointError) as info:
        lazyckpt.load(str(tmp_path))
    assert "step 1" in str(info.value) and "step 0" in str(info.value) and "missing" in str(info.value)
    # A file of another save put in its place is refused too (its save_id differs).
    with lazyckpt.Checkpointer(tmp_path / "other") as other:
        other.save(_state(model, opt, 0), step=0).wait()
    os.replace(tmp_path / "other" / "step_0000000000" / "rank_00000.lzc", owner)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="does not hold those bytes"):
        lazyckpt.load(str(tmp_path))


def test_a_rollback_never_refers_to_a_superseded_step(tmp_path):
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, keep=3, incremental=True) as ckpt:
        for step in (10, 11):
            ckpt.save(_state(model, opt, step), step=step).wait()
        assert _manifest(tmp_path, 11)["references"] == [10]
        ckpt.save(_state(model, opt, 5), step=5).wait()          # supersedes 10 and 11
        assert ckpt.steps() == [5] and "references" not in _manifest(tmp_path, 5)
        ckpt.save(_state(model, opt, 6), step=6).wait()
        assert _manifest(tmp_path, 6)["references"] == [5]
        assert_same(ckpt.load()["model"], model.state_dict())


def test_a_state_that_all_changes_refers_to_nothing(tmp_path):
    """Full training: every tensor changes, nothing is referred to, and the
    files are version 1 like without incremental (the content check's cost
    there: bench_incremental_modes.py)."""
    model, opt = _model(frozen=False)
    with lazyckpt.Checkpointer(tmp_path, incremental=True) as ckpt:
        for step in range(3):
            _train(model, opt, step)
            ckpt.save(_state(model, opt, step), step=step).wait()
            assert "references" not in _manifest(tmp_path, step)
            assert _manifest(tmp_path, step)["format_version"] == 1


def test_cli_shows_references_and_prunes_around_them(tmp_path):
    from lazyckpt import cli
    model, opt = _model()
    with lazyckpt.Checkpointer(tmp_path, incremental=True) as ckpt:
        for step in range(3):
            _train(model, opt, step)
            ckpt.save(_state(model, opt, step), step=step).wait()
    listing = lzinspect.list_directory(str(tmp_path))
    assert [r.get("references") for r in listing["steps"]] == [[], [0], [0]]
    doc = lzinspect.describe(str(tmp_path))
    f = doc["files"][0]
    assert doc["references"] == [0] and f["references"] == [0]
    assert f["referenced_bytes"] >= 1024 * 256 * 4 and f["owned_bytes"] < f["referenced_bytes"]
    assert cli.main(["prune", str(tmp_path), "--keep", "1"]) == 0
    assert lazyckpt.Checkpointer(tmp_path).steps() == [0, 2]


# --------------------------------------------------------------------------- several ranks


def _fsdp_incremental(rank, world, directory, loaded_world):
    import torch.distributed as dist
    from _dist import fsdp_model, full_state
    model, opt = fsdp_model(world, 64, 8)
    model[0].requires_grad_(False)                     # a frozen, sharded layer
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with lazyckpt.Checkpointer(directory, incremental=True, keep=1) as ckpt:
        for step in range(3):
            torch.manual_seed(step)
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save({"model": model.state_dict(), "rank_bias": torch.full((3,), float(rank))},
                      step=step).wait()
        reference = full_state(model.state_dict())
        steps = ckpt.steps()
    dist.barrier()
    return steps, {k: v for k, v in reference.items()}


def _load_resharded(rank, world, directory):
    from _dist import fsdp_model, full_state
    model, _ = fsdp_model(world, 64, 8)
    with lazyckpt.Checkpointer(directory) as ckpt:
        state = {"model": model.state_dict(), "rank_bias": torch.zeros(3)}
        ckpt.load(into=state)
        return full_state(state["model"]), state["rank_bias"][0].item()


def test_several_ranks_refer_to_their_own_files_and_reshard(tmp_path):
    results = run_ranks(2, _fsdp_incremental, str(tmp_path), 1, timeout=240)
    steps, reference = results[0]
    assert steps == [0, 2]                              # 2 is kept, 0 holds its frozen shards
    manifest = _manifest(tmp_path, 2)
    assert manifest["references"] == [0] and manifest["world_size"] == 2
    for rank in (0, 1):
        entries = _entries(tmp_path / "step_0000000002" / f"rank_{rank:05d}.lzc")
        refs = [e["ref"] for e in entries if e["kind"] == "ref"]
        assert refs and all(r["rank"] == rank and r["step"] == 0 for r in refs)
    for loaded_world in (1, 3):
        for rank, (model_state, bias) in enumerate(run_ranks(loaded_world, _load_resharded, str(tmp_path),
                                                             timeout=240)):
            assert_same(model_state, reference)
            assert bias == float(rank % 2)
