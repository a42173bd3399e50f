"""Multi-rank checkpoints with real torch.distributed (gloo) processes:
replicated (DDP) state written once, FSDP2 DTensor shards with resharding
loads, two-phase commit, a rank dying mid-save, async saves interleaved
with the training's own collectives."""

from __future__ import annotations

import json
import os

import pytest
import torch

import lazyckpt
from _dist import fsdp_model, full_state, run_ranks

pytestmark = pytest.mark.timeout(600)


# ----------------------------------------------------------------------------- DDP


def _ddp_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    return model, opt


def _ddp_save(rank, world, directory):
    model, opt = _ddp_model()
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(identical_keys=["model", "optim"])) as ckpt:
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(),
                   "rank_state": torch.full((4,), float(rank))}, step=1).wait()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _ddp_load(rank, world, directory):
    with lazyckpt.Checkpointer(directory) as ckpt:
        out = ckpt.load()
        subset = ckpt.load(keys=["rank_state", ("model", "0.weight")])
    assert set(subset) == {"rank_state", "model"} and list(subset["model"]) == ["0.weight"]
    assert torch.equal(subset["model"]["0.weight"], out["model"]["0.weight"])
    return out["model"], out["rank_state"], out["optim"]["state"][0]["exp_avg"]


def test_ddp_replicated_state_is_written_once_and_loads_anywhere(tmp_path):
    ref = run_ranks(2, _ddp_save, str(tmp_path))[0]
    step = tmp_path / "step_0000000001"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["replicated"] == ["model", "optim"]
    model, opt = _ddp_model()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    files = [step / "rank_00000.lzc", step / "rank_00001.lzc"]
    sizes = [f.stat().st_size for f in files]
    # Written once (not twice), and the work is spread over both ranks.
    assert sum(sizes) < 1.2 * state_bytes
    assert min(sizes) > 0.3 * state_bytes
    # Loads on 2 ranks (same), 3 ranks (more) and in one process.
    for world in (2, 3):
        for rank, (m, mine, exp_avg) in enumerate(run_ranks(world, _ddp_load, str(tmp_path))):
            assert all(torch.equal(m[k], ref[k]) for k in ref)
            assert torch.equal(mine, torch.full((4,), float(rank % 2)))
            assert torch.equal(exp_avg, opt.state_dict()["state"][0]["exp_avg"])
    single = lazyckpt.load(str(step))
    assert all(torch.equal(single["model"][k], ref[k]) for k in ref)


def test_single_process_checkpoint_loads_on_two_ranks(tmp_path):
    model, opt = _ddp_model()
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(),
                   "rank_state": torch.zeros(4)}, step=1).wait()
    for m, _mine, _ in run_ranks(2, _ddp_load, str(tmp_path)):
        assert all(torch.equal(m[k], v) for k, v in model.state_dict().items())


def test_replicated_keys_that_differ_between_ranks_are_refused(tmp_path):
    # Each rank's xxh3 of a replicated key covers its structure, sizes and bytes (values:
    # tests/test_replicated_agreement.py): rank 1 holds a different shape.
    results = run_ranks(2, _mismatched_shapes, str(tmp_path))
    assert all("differ" in r and "'model' (rank 0 | rank 1)" in r for r in results), results
    assert lazyckpt.Checkpointer(tmp_path).steps() == []


def _mismatched_shapes(rank, world, directory):
    with lazyckpt.Checkpointer(directory,
                               distributed=lazyckpt.Distributed(identical_keys=["model"], commit_timeout=30)) as ckpt:
        handle = ckpt.save({"model": {"w": torch.zeros(8 + rank)}}, step=1)
        try:
            handle.wait(60)
        except lazyckpt.CheckpointError as exc:
            return str(exc)
    return "committed"


# ----------------------------------------------------------------------------- FSDP2


def _fsdp_build(world):
    return fsdp_model(world, hidden=33, out=7)


_full = full_state


def _fsdp_train_and_save(rank, world, directory):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt = _fsdp_build(world)
    for i in range(2):
        torch.manual_seed(10 + i)
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    from torch.distributed.tensor import Replicate
    replicated = torch.distributed.tensor.DTensor.from_local(
        torch.arange(6.0), model[0].weight.device_mesh, [Replicate()], run_check=False)
    with lazyckpt.Checkpointer(directory) as ckpt:
        ckpt.save({"model": msd, "optim": osd, "rep": replicated}, step=2).wait()
    torch.manual_seed(99)
    loss = model(torch.randn(4, 16)).sum().item()      # the next step's loss, for the resume check
    return _full(msd), {k: _full(v) for k, v in osd["state"].items()}, loss


def _fsdp_load(rank, world, directory):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = _fsdp_build(world)
    msd, osd = get_state_dict(model, opt)
    with lazyckpt.Checkpointer(directory) as ckpt:
        ckpt.load(into={"model": msd, "optim": osd})
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    msd, osd = get_state_dict(model, opt)
    torch.manual_seed(99)
    loss = model(torch.randn(4, 16)).sum().item()
    return _full(msd), {k: _full(v) for k, v in osd["state"].items()}, loss


def _same(ref, got):
    model_ok = all(torch.equal(ref[0][k], got[0][k]) for k in ref[0])
    optim_ok = all(torch.equal(ref[1][p][k], got[1][p][k]) for p in ref[1] for k in ref[1][p])
    return model_ok and optim_ok and ref[2] == got[2]


@pytest.mark.parametrize("saved_world,loaded_worlds", [(2, (2, 3)), (4, (2,))])
def test_fsdp2_sharded_save_and_resharding_load(tmp_path, saved_world, loaded_worlds):
    ref = run_ranks(saved_world, _fsdp_train_and_save, str(tmp_path))[0]
    manifest = json.loads((tmp_path / "step_0000000002" / "manifest.json").read_text())
    # The placement-derived index: one layout per DTensor, no piece per rank.
    assert "shards" not in manifest
    weight = manifest["layouts"]['["model", "0.weight"]']
    assert weight["global_shape"] == [33, 16]
    assert weight["layout"] == {"mesh": {"shape": [saved_world], "start": 0, "strides": [1]},
                                "placements": [["S", 0]]}
    from lazyckpt.formats.placement import pieces
    assert sorted(p["rank"] for p in pieces([33, 16], weight["layout"])) == list(range(saved_world))
    # A replicated DTensor is written once (by the rank at mesh coordinate 0).
    assert [p["rank"] for p in pieces([6], manifest["layouts"]['["rep"]']["layout"])] == [0]
    for world in loaded_worlds:
        for got in run_ranks(world, _fsdp_load, str(tmp_path)):
            assert _same(ref, got), f"{saved_world} -> {world} ranks"
    # Without a sharded target, the full tensors are assembled.
    full = lazyckpt.load(str(tmp_path / "step_0000000002"))
    assert all(torch.equal(full["model"][k], v) for k, v in ref[0].items())
    assert torch.equal(full["rep"], torch.arange(6.0))


# ----------------------------------------------------------------------------- failures


def _die_mid_save(rank, world, directory):
    from lazyckpt.storage import fileio
    # Rank 0 waits out the commit timeout twice for the dead rank 1 (step 2's commit, then
    # its close): short, as the test's time is those waits; long enough for step 1's commit
    # on a loaded machine.
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(commit_timeout=5),
                               host_cache_bytes=1 << 20) as ckpt:
        state = {"w": torch.randn(200_000) + rank}
        ckpt.save(state, step=1).wait()
        if rank == 1:
            real = fileio.OutputFile.pwrite_all

            def die(self, data, offset):
                if "step_0000000002" in self.path:
                    os._exit(17)              # the process dies in the middle of writing
                return real(self, data, offset)
            fileio.OutputFile.pwrite_all = die
        try:
            ckpt.save({"w": state["w"] * 2}, step=2).wait(60)
        except lazyckpt.CheckpointError as exc:
            return ("raised", str(exc), ckpt.steps())
        return ("committed", "", ckpt.steps())


def test_a_rank_dying_mid_save_commits_nothing_and_the_others_raise(tmp_path):
    results = run_ranks(2, _die_mid_save, str(tmp_path), allow_failure=True, timeout=120)
    assert results[1] == ("died", 17)
    status, (outcome, message, steps) = results[0]
    assert status == "ok" and outcome == "raised", results[0]
    assert "timed out" in message and "step 2" in message
    assert steps == [1]
    ckpt = lazyckpt.Checkpointer(tmp_path)       # a fresh process would see the same
    assert ckpt.steps() == [1]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]   # cleaned on open
    out = lazyckpt.load(str(tmp_path / "step_0000000001"), keys=["w"])
    assert out["w"].shape == (200_000,)


def _train_with_collectives(rank, world, directory):
    import torch.distributed as dist
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refs = {}
    with lazyckpt.Checkpointer(directory, keep=None,
                               distributed=lazyckpt.Distributed(identical_keys=["model", "optim"], commit_timeout=60),
                               host_cache_bytes=256 << 10) as ckpt:
        ckpt.attach(opt)
        for step in range(6):
            torch.manual_seed(100 * step + rank)
            model(torch.randn(8, 64)).square().mean().backward()
            for p in model.parameters():                 # DDP-style gradient all-reduce
                dist.all_reduce(p.grad)
                p.grad /= world
            opt.step()                                   # barrier: waits for the last capture
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            refs[step] = {k: v.clone() for k, v in model.state_dict().items()}
            ckpt.save(state, step=step)
            dist.barrier()                               # more collectives while saves run
        ckpt.wait()
        ok = all(all(torch.equal(ckpt.load(step=s)["model"][k], v) for k, v in ref.items())
                 for s, ref in refs.items())
        return ok, ckpt.steps()


def test_async_saves_interleaved_with_training_collectives(tmp_path):
    for ok, steps in run_ranks(2, _train_with_collectives, str(tmp_path)):
        assert ok and steps == list(range(6))


# ----------------------------------------------------------------------------- the last use of the store


def _a_rank_slow_to_read_the_outcome(rank, world, directory, persist_to):
    """Rank 1 is descheduled (a sleep) just before it reads the outcome of the
    coordinator's commit; rank 0 closes and its process exits at once. The
    store lives in rank 0's process (init_method tcp://, as with env://)."""
    import time
    from lazyckpt.distributed import RankInfo
    if rank == 1:
        wait_for = RankInfo.wait_for

        def descheduled(self, keys, what, step):
            # The local commit's outcome, or with persist_to the drain's (the last agree of a close).
            if any(k.endswith("/outcome") and (persist_to is None) != k.startswith("persist") for k in keys):
                time.sleep(1.5)
            return wait_for(self, keys, what, step)
        RankInfo.wait_for = descheduled
    t0 = time.monotonic()
    with lazyckpt.Checkpointer(directory, persist=persist_to,
                               distributed=lazyckpt.Distributed(commit_timeout=8)) as ckpt:
        ckpt.save({"x": torch.full((4,), float(rank))}, step=1).wait()
    return time.monotonic() - t0


@pytest.mark.parametrize("tier", ["local", "persist_to"])
def test_the_coordinator_closes_only_after_every_rank_is_done_with_the_store(tmp_path, tier, request,
                                                                             monkeypatch):
    """A rank that read the commit's outcome after the coordinator's process had
    exited waited for the dead store until its deadline, then reported a
    committed step as failed. The coordinator's close now waits until every
    rank's close is done with the store."""
    persist_to = None
    if tier == "persist_to":                  # the drain's commit: the last agree of a close
        server = request.getfixturevalue("s3_server")
        for k, v in server.env().items():
            monkeypatch.setenv(k, v)
        persist_to = f"s3://{request.getfixturevalue('s3_bucket')}/run"
    took = run_ranks(2, _a_rank_slow_to_read_the_outcome, str(tmp_path / "run"), persist_to, timeout=120)
    assert took[0] >= 1.0, took        # rank 0 waited for rank 1
    with lazyckpt.Checkpointer(str(tmp_path / "run")) as ckpt:
        assert ckpt.steps() == [1]
