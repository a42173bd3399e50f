"""Incremental checkpoints that cannot keep a stale byte (issue 22, cases 1, 2
and the reference half of 6).

``incremental=True`` compares the bytes (content digests), so every writer is
seen: fused optimizers, BatchNorm's running statistics, collectives,
``.data``, numpy views, ``load(into=)`` on DTensors. Each test saves several
steps after such writes and checks that every step loads exactly the state
it had at its save(). The version-counter mode keeps its documented limit,
tested as such. References are checked by save id before they are written.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import lazyckpt
from _dist import run_ranks
from lazyckpt.cli import inspect as lzinspect
from lazyckpt.cli import prune as lzprune
from lazyckpt.loading import resolve as lzresolve
from lazyckpt.loading import verify as lzverify
from lazyckpt.storage.stores import LOCAL
from lzc_tools import assert_same, clone_state
from _groups import groups

pytestmark = pytest.mark.timeout(300)


def _entries(path):
    return lzinspect.describe(str(path))["files"][0]["entries"]


def _each_step_loads_its_own_state(directory, train, state_of, steps=3, **knobs):
    """Train (in place, through the writer under test), save, wait; then every
    step must load exactly what the state held at its save()."""
    expected = {}
    with lazyckpt.Checkpointer(directory, incremental=True, **groups(knobs)) as ckpt:
        for step in range(steps):
            if step:
                train(step)
            state = state_of(step)
            expected[step] = clone_state(state)
            ckpt.save(state, step=step).wait()
        for step in range(steps):
            assert_same(ckpt.load(step=step), expected[step], where=f"step {step}")
    return expected


def test_true_means_content_digests():
    assert lazyckpt.knobs.resolve(incremental=True).incremental == "content"
    assert lazyckpt.knobs.resolve(incremental="version-counters").incremental == "version-counters"
    with pytest.raises(ValueError, match="version-counters"):
        lazyckpt.knobs.resolve(incremental="versions")


# --------------------------------------------------------------------------- case 1: writers that bump no counter


def _fused(kind, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    try:
        opt = getattr(torch.optim, kind)(model.parameters(), lr=0.1, fused=True, **kwargs)
    except (RuntimeError, ValueError, TypeError) as exc:      # not built for this CPU/torch
        pytest.skip(f"{kind}(fused=True) is not available here: {exc}")

    def train(step):
        torch.manual_seed(step)
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    train(0)            # the moments exist from the first save on
    return train, lambda step: {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


@pytest.mark.parametrize("kind,kwargs", [("AdamW", {}), ("Adam", {}), ("SGD", {"momentum": 0.9}),
                                         ("Adagrad", {})])
def test_a_fused_optimizer_step_is_saved(tmp_path, kind, kwargs):
    train, state_of = _fused(kind, **kwargs)
    _each_step_loads_its_own_state(tmp_path, train, state_of)


def test_batchnorm_running_stats_of_a_training_forward_are_saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    model.requires_grad_(False)         # only the running statistics change

    def train(step):
        torch.manual_seed(step)
        model(torch.randn(32, 8))
    _each_step_loads_its_own_state(tmp_path, train, lambda step: {"model": model.state_dict(), "step": step})


def test_writes_through_data_and_a_numpy_view_are_saved(tmp_path):
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000), "frozen": torch.ones(1000)}

    def train(step):
        state["a"].data[step] += 1.0             # .data: a tensor with its own counter
        state["b"].numpy()[step] += 1.0          # a numpy view: no counter at all
    _each_step_loads_its_own_state(tmp_path, train, lambda step: state)
    kinds = {e["name"]: e["kind"] for e in _entries(tmp_path / "step_0000000002")}
    assert kinds == {"a": "data", "b": "data", "frozen": "ref"}      # still incremental


def _collectives(rank, world, directory):
    import torch.distributed as dist
    state = {"reduced": torch.full((256,), float(rank + 1)), "broadcast": torch.full((256,), float(rank)),
             "own": torch.full((256,), float(rank))}

    def train(step):
        dist.all_reduce(state["reduced"])                    # in place, no counter bump
        if rank == 0:
            state["broadcast"].add_(10.0)
        dist.broadcast(state["broadcast"], src=0)            # in place on rank 1, no bump
    expected = _each_step_loads_its_own_state(directory, train, lambda step: state)
    dist.barrier()
    return {step: {k: v[0].item() for k, v in s.items()} for step, s in expected.items()}


def test_all_reduce_and_broadcast_results_are_saved(tmp_path):
    results = run_ranks(2, _collectives, str(tmp_path), timeout=240)
    assert results[1][2] == {"reduced": 6.0, "broadcast": 20.0, "own": 1.0}     # the writes happened


def test_version_counters_mode_misses_a_fused_optimizer_step(tmp_path):
    """The documented limit of ``incremental="version-counters"``: a fused
    optimizer updates weights and moments without bumping their counters, so
    the next step refers to the previous step's bytes and loads stale values."""
    train, state_of = _fused("AdamW")
    with lazyckpt.Checkpointer(tmp_path, incremental="version-counters") as ckpt:
        ckpt.save(state_of(0), step=0).wait()
        before = clone_state(state_of(0))
        train(1)
        ckpt.save(state_of(1), step=1).wait()
        stale = ckpt.load(step=1)
    assert not torch.equal(state_of(1)["model"]["0.weight"], before["model"]["0.weight"])
    assert torch.equal(stale["model"]["0.weight"], before["model"]["0.weight"])           # missed
    assert torch.equal(stale["optim"]["state"][0]["exp_avg"], before["optim"]["state"][0]["exp_avg"])


# --------------------------------------------------------------------------- case 2: DTensor + load(into=)


def _dtensor_rollback(rank, world, directory):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)])}
    with lazyckpt.Checkpointer(directory, incremental=True) as ckpt:
        ckpt.save(state, step=1).wait()                      # w = 0
        with torch.no_grad():
            state["w"] += 1.0
        ckpt.save(state, step=2).wait()                      # w = 1
        ckpt.load(step=1, into=state)                        # back to w = 0, through the local tensor
        loaded = state["w"].full_tensor().clone()
        ckpt.save(state, step=3).wait()
        step3 = ckpt.load(step=3, into={"w": distribute_tensor(torch.full((64, 8), 7.0), mesh, [Shard(0)])})
        step2 = ckpt.load(step=2, into={"w": distribute_tensor(torch.full((64, 8), 7.0), mesh, [Shard(0)])})
        result = (loaded.unique().tolist(), step3["w"].full_tensor().unique().tolist(),
                  step2["w"].full_tensor().unique().tolist())
    dist.barrier()
    return result


def test_a_dtensor_filled_by_load_into_is_saved_as_loaded(tmp_path):
    for loaded, step3, step2 in run_ranks(2, _dtensor_rollback, str(tmp_path), timeout=240):
        assert loaded == [0.0] and step3 == [0.0] and step2 == [1.0]


# --------------------------------------------------------------------------- case 6: references checked by save id


def _a_state(step):
    # "frozen" never changes (owned by step 1); "slow" changes at step 2 only
    # (owned by step 2, referred to by step 3); "fast" changes every step.
    return {"frozen": torch.ones(4096), "slow": torch.full((4096,), 2.0 if step >= 2 else 1.0),
            "fast": torch.full((4096,), float(step))}


def _resaved_step_2_by_another_writer_then_saved_3(tmp_path, resave):
    directory = tmp_path / "run"
    with lazyckpt.Checkpointer(directory, incremental="content",
                               distributed=lazyckpt.Distributed(process_group=False)) as a:
        for step in (1, 2):
            a.save(_a_state(step), step=step).wait()
        assert {e["name"]: e["ref"]["step"] for e in _entries(directory / "step_0000000002")
                if e["kind"] == "ref"} == {"frozen": 1}
        resave(directory)
        # A's index holds "slow" at its own step 2, which is now another save.
        a.save(_a_state(3), step=3).wait()
        kinds = {e["name"]: (e["kind"], e.get("ref", {}).get("step")) for e in _entries(directory / "step_0000000003")}
        assert kinds == {"frozen": ("ref", 1), "slow": ("data", None), "fast": ("data", None)}
        assert_same(a.load(step=3), _a_state(3))
    assert lzverify.verify(store=LOCAL, path=str(directory)).ok


def _other_values():
    return {"frozen": torch.full((4096,), 5.0), "slow": torch.full((4096,), 5.0), "fast": torch.full((4096,), 5.0)}


def test_a_reference_to_a_step_replaced_by_another_save_is_written_in_full(tmp_path):
    """Step 2's directory is replaced by another committed save of step 2 (a
    second writer, here without sharing the directory while A writes)."""
    def replace_step_2(directory):
        with lazyckpt.Checkpointer(tmp_path / "other", distributed=lazyckpt.Distributed(process_group=False)) as b:
            b.save(_other_values(), step=2).wait()
        shutil.rmtree(directory / "step_0000000002")
        os.rename(tmp_path / "other" / "step_0000000002", directory / "step_0000000002")
    _resaved_step_2_by_another_writer_then_saved_3(tmp_path, replace_step_2)


def test_a_second_checkpointer_resaving_a_step_never_breaks_the_next_incremental_save(tmp_path):
    """A second Checkpointer on the same directory re-saves step 2 (issue 22
    case 6). Should a writer lease refuse it, nothing was re-saved and the
    test above covers the reference check."""
    def second_writer(directory):
        try:
            with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(process_group=False)) as b:
                b.save(_other_values(), step=2).wait()
        except lazyckpt.CheckpointError:        # refused (a writer lease): step 2 is still A's
            replace = tmp_path / "other"
            with lazyckpt.Checkpointer(replace, distributed=lazyckpt.Distributed(process_group=False)) as b:
                b.save(_other_values(), step=2).wait()
            shutil.rmtree(directory / "step_0000000002")
            os.rename(replace / "step_0000000002", directory / "step_0000000002")
    _resaved_step_2_by_another_writer_then_saved_3(tmp_path, second_writer)
