"""replicated="auto" and the hint (issue 12): DDP state that is identical on every
rank is written once without naming it; state that differs, or stops agreeing,
is written by each rank and loads back per rank."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import lazyckpt
from _dist import run_ranks

pytestmark = pytest.mark.timeout(300)

MODEL_NUMEL = 200_000           # 800 KB of fp32: what deduplication is about


def _state(rank, step):
    g = torch.Generator().manual_seed(step)           # the same on every rank (DDP)
    return {
        "model": {"w": torch.randn(MODEL_NUMEL, generator=g), "b": torch.full((16,), float(step))},
        "optim": {"state": {0: {"exp_avg": torch.randn(1000, generator=g)}}, "param_groups": [{"lr": 0.1}]},
        "rng": torch.full((64,), float(rank * 100 + step)),                  # per rank
        # identical until step 3, then a per-rank value (a key that stops agreeing)
        "counter": torch.full((8,), float(step if step < 3 else step + rank)),
        "step": step,
    }


def _files(step_dir):
    return {f: os.path.getsize(os.path.join(step_dir, f)) for f in os.listdir(step_dir) if f.endswith(".lzc")}


def _same(a, b):
    return (torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["model"]["b"], b["model"]["b"])
            and torch.equal(a["optim"]["state"][0]["exp_avg"], b["optim"]["state"][0]["exp_avg"])
            and torch.equal(a["rng"], b["rng"]) and torch.equal(a["counter"], b["counter"])
            and a["step"] == b["step"] and a["optim"]["param_groups"] == b["optim"]["param_groups"])


def _auto(rank, world, directory):
    out = {"sizes": {}, "replicated": {}, "loaded": {}}
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(identical_keys="auto")) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(rank, step), step=step).wait()
            path = ckpt.step_path(step)
            out["sizes"][step] = _files(path)
            with open(os.path.join(path, "manifest.json")) as f:
                out["replicated"][step] = json.load(f).get("replicated", [])
        for step in (1, 2, 3):
            out["loaded"][step] = _same(ckpt.load(step=step), _state(rank, step))
    return out


def test_auto_writes_identical_keys_once_and_keys_that_differ_per_rank(tmp_path):
    directory = str(tmp_path / "run")
    results = run_ranks(2, _auto, directory)
    r = results[0]
    model_bytes = MODEL_NUMEL * 4
    # Step 1 learns (every rank writes everything): two full copies of the model.
    assert r["replicated"][1] == []
    assert all(size > model_bytes for size in r["sizes"][1].values()), r["sizes"][1]
    # Step 2: model, optim and counter agree on both ranks: written once (spread over the
    # ranks), rng stays per rank.
    assert sorted(r["replicated"][2]) == ["counter", "model", "optim"], r["replicated"][2]
    assert sum(r["sizes"][2].values()) < 1.2 * model_bytes + 64 * 1024, r["sizes"][2]
    # Step 3: counter now differs: checked before writing, written by each rank.
    assert sorted(r["replicated"][3]) == ["model", "optim"], r["replicated"][3]
    for rank, res in enumerate(results):
        assert res["loaded"] == {1: True, 2: True, 3: True}, (rank, res["loaded"])


def _auto_load_elsewhere(rank, world, directory):
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(identical_keys="auto")) as ckpt:
        state = ckpt.load(step=3)
    return _same(state, _state(rank, 3))


def test_an_auto_step_loads_on_another_world_size(tmp_path):
    directory = str(tmp_path / "run")
    run_ranks(2, _auto, directory)
    # One process reads rank 0's tree; the entries written by rank 1 come from rank 1's file.
    state = lazyckpt.load(os.path.join(directory, "step_0000000003"))
    assert _same(state, _state(0, 3))
    assert run_ranks(2, _auto_load_elsewhere, directory) == [True, True]


def _hint(rank, world, directory):
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    handler = Keep(level=logging.WARNING)
    logging.getLogger("lazyckpt").addHandler(handler)
    try:
        with lazyckpt.Checkpointer(directory) as ckpt:
            for step in (1, 2):
                ckpt.save(_state(rank, step), step=step).wait()
            sizes = _files(ckpt.step_path(2))
    finally:
        logging.getLogger("lazyckpt").removeHandler(handler)
    return {"warnings": [m for m in records if "identical on all" in m], "sizes": sizes}


def test_the_default_warns_once_with_the_bytes_replicated_would_save(tmp_path):
    results = run_ranks(2, _hint, str(tmp_path / "run"))
    (warning,) = results[0]["warnings"]                      # the coordinator, once
    assert "['counter', 'model', 'optim']" in warning and "replicated='auto'" in warning, warning
    saved_mb = float(warning.split("would write ")[1].split(" MB")[0])
    expected = (MODEL_NUMEL * 4 + 16 * 4 + 1000 * 4 + 8 * 4) / 1e6
    assert abs(saved_mb - expected) < 0.05, (saved_mb, expected)
    assert results[1]["warnings"] == []
    # Nothing changed in what is written: both ranks still write everything.
    assert all(size > MODEL_NUMEL * 4 for size in results[0]["sizes"].values())


def test_replicated_must_be_keys_or_auto(tmp_path):
    with pytest.raises(ValueError, match="'auto'"):
        lazyckpt.Checkpointer(str(tmp_path), distributed=lazyckpt.Distributed(identical_keys="yes"))


def _auto_refused(rank, world, directory):
    import time
    out = {}
    with lazyckpt.Checkpointer(directory,
                               distributed=lazyckpt.Distributed(identical_keys="auto", commit_timeout=60)) as ckpt:
        for step in (1, 2, 3, 4):
            t0 = time.monotonic()
            bad = step == 3 and rank == 1
            try:
                ckpt.save(_state(rank, step), step=step, metadata={"x": object()} if bad else None).wait()
                out[step] = "ok"
            except (ValueError, lazyckpt.CheckpointError) as exc:
                out[step] = type(exc).__name__
            out[f"t{step}"] = time.monotonic() - t0
        out["loaded"] = _same(ckpt.load(step=4), _state(rank, 4))
        out["steps"] = ckpt.steps()
    return out


def test_a_call_refused_on_one_rank_fails_its_check_round_at_once(tmp_path):
    results = run_ranks(2, _auto_refused, str(tmp_path / "run"))
    assert results[1][3] == "ValueError" and results[0][3] == "CheckpointWriteError", results
    for r in results:
        assert r[1] == r[2] == r[4] == "ok" and r["loaded"] and r["steps"] == [1, 2, 4], r
        assert r["t3"] < 20, r              # not the 60 s deadline


def _auto_incremental(rank, world, directory):
    frozen = torch.arange(50_000, dtype=torch.float32)          # the same storage every save
    out = {}
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(identical_keys="auto"),
                               incremental=True) as ckpt:
        for step in (1, 2, 3):
            state = _state(rank, step)
            state["model"]["frozen"] = frozen
            ckpt.save(state, step=step).wait()
        for step in (1, 2, 3):
            got = ckpt.load(step=step)
            want = _state(rank, step)
            out[step] = _same(got, want) and torch.equal(got["model"]["frozen"], frozen)
    return out


def test_auto_with_incremental_checkpoints_loads_bit_exact(tmp_path):
    results = run_ranks(2, _auto_incremental, str(tmp_path / "run"))
    assert results == [{1: True, 2: True, 3: True}] * 2, results
