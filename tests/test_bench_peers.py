"""The benchmark harness (lazyckpt/cli/bench.py): torch-checkpointing as a peer,
the raw methods and the choice of the best one as the ceiling."""

from __future__ import annotations

import os

import pytest
import torch

from lazyckpt.cli import bench as _bench
from lazyckpt.knobs import Options

from _frameworks import require


def _bench_on(tmp_path, state):
    return _bench.Bench(state, _bench.state_bytes(state), str(tmp_path), Options(), "no")


def _tiny_state():
    return _bench.make_state(64 << 10, 5, _bench.parse_dtypes("fp32,bf16,fp16,int8,int64"), seed=3)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_torch_checkpointing_roundtrip_bit_exact(tmp_path, asynchronous):
    require("torch_checkpointing")
    state = _tiny_state()
    b = _bench_on(tmp_path, state)
    m = _bench.TorchCheckpointing(asynchronous)
    assert m.unavailable() is None
    m.setup(b)
    try:
        path = os.path.join(b.workdir, "ckpt")
        times = m.save(b, path)
        assert 0 <= times.blocking <= times.durable
        if asynchronous:
            assert 0 <= times.extra["capture_s"] <= times.durable
        assert os.path.isdir(path) and not m.self_durable      # an fsync was added to its save
        loaded = m.load(b, path)
        _bench.touch(loaded)
        assert set(loaded) == set(state)
        for key, t in state.items():
            got = loaded[key]
            assert got.dtype == t.dtype and got.shape == t.shape, key
            assert _bits(got) == _bits(t), key
    finally:
        m.teardown(b)
    assert m.note                       # which storage mode, what was set up untimed


def test_best_raw_picks_the_fastest():
    assert _bench.best_raw({"O_DIRECT": 0.9, "buffered": 1.3, "mmap": 1.1}) == ("buffered", 1.3)
    assert _bench.best_raw({"O_DIRECT": 2.1, "buffered": 1.6}) == ("O_DIRECT", 2.1)
    # Figures that are missing or meaningless are not candidates.
    assert _bench.best_raw({"O_DIRECT": None, "buffered": 0.0, "mmap": float("nan"), "x": 0.5}) == ("x", 0.5)
    with pytest.raises(ValueError):
        _bench.best_raw({"O_DIRECT": None})


def test_ceiling_rows_and_fractions():
    ok = lambda key, save, load: {"key": key, "status": "ok", "save_gbps": save, "load_gbps": load}  # noqa: E731
    rows = {"raw": ok("raw", 2.0, 0.8), "raw_buffered": ok("raw_buffered", 1.6, 1.3),
            "raw_mmap": ok("raw_mmap", None, 1.1), "lazyckpt": ok("lazyckpt", 1.8, 1.2)}
    ceiling = _bench.ceiling_of(rows)
    assert ceiling["write"]["best"] == "O_DIRECT" and ceiling["write"]["gbps"] == 2.0
    assert ceiling["read"]["best"] == "buffered" and ceiling["read"]["gbps"] == 1.3
    assert set(ceiling["read"]["methods"]) == {"O_DIRECT", "buffered", "mmap"}
    assert set(ceiling["write"]["methods"]) == {"O_DIRECT", "buffered"}      # mmap is a read method
    line = _bench.fraction_line("lazyckpt", 1.8, 1.2, ceiling["write"]["methods"], ceiling["read"]["methods"])
    assert "90% of the best raw (O_DIRECT" in line and "92% of the best raw (buffered" in line


def test_raw_methods_read_what_was_written(tmp_path):
    n = (3 << 20) + 123                             # not a multiple of a page
    for write in (lambda p: _bench.raw_write(p, n, 2)[0], lambda p: _bench.raw_write_buffered(p, n)):
        path = str(tmp_path / "raw.bin")
        assert write(path) > 0
        assert os.path.getsize(path) == n
        assert _bench.raw_read(path, n, 2) > 0
        assert _bench.raw_read_buffered(path, n) > 0
        assert _bench.raw_read_mmap(path, n) > 0
        os.unlink(path)


# --------------------------------------------------------------------------- order, spread, ranking

def test_rep_order_is_a_new_seeded_shuffle_every_repetition():
    keys = list(_bench.METHOD_KEYS)
    orders = [_bench.rep_order(keys, rep) for rep in range(_bench.DEFAULT_REPS)]
    assert all(sorted(o) == sorted(keys) for o in orders)
    assert len({tuple(o) for o in orders}) == len(orders)          # every repetition its own order
    assert orders == [_bench.rep_order(keys, rep) for rep in range(_bench.DEFAULT_REPS)]   # seeded
    assert orders != [_bench.rep_order(keys, rep, seed=1) for rep in range(_bench.DEFAULT_REPS)]


def test_median_interval_is_min_max_up_to_8_repetitions_then_narrower():
    assert _bench.median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0, pytest.approx(0.75))
    assert _bench.median_interval([float(i) for i in range(7)]) == (0.0, 6.0, pytest.approx(1 - 2 / 128))
    lo, hi, coverage = _bench.median_interval([float(i) for i in range(9)])
    assert (lo, hi) == (1.0, 7.0) and coverage == pytest.approx(1 - 20 / 512) and coverage >= 0.95
    assert _bench.range_misses_median(_bench.DEFAULT_REPS) < 0.02 < _bench.range_misses_median(5)


# A load's time per repetition here is bimodal (the run: torch.load 0.79/0.77/0.22 s,
# lazyckpt 0.29/0.81/0.78 s); seven repetitions of that shape.
BIMODAL = {"torch": [0.79, 0.77, 0.22, 0.80, 0.24, 0.78, 0.23],
           "lazyckpt": [0.29, 0.81, 0.78, 0.27, 0.30, 0.79, 0.28],
           "safetensors": [0.61, 0.60, 0.62, 0.59, 0.63, 0.60, 0.61]}
TIGHT = {"torch": [0.79, 0.80, 0.78, 0.81, 0.79, 0.80, 0.79],
         "lazyckpt": [0.29, 0.30, 0.29, 0.31, 0.30, 0.29, 0.30],
         "safetensors": [0.61, 0.60, 0.62, 0.59, 0.63, 0.60, 0.61]}


def test_spread_too_wide_to_rank_on_bimodal_timings():
    verdict = _bench.rank_verdict(BIMODAL)
    assert verdict["rankable"] is False
    pairs = {(u["faster"], u["slower"]) for u in verdict["unresolved"]}
    assert ("lazyckpt", "torch") in pairs and ("lazyckpt", "safetensors") in pairs
    assert all(u["gap"] > _bench.TIE for u in verdict["unresolved"])


def test_tight_timings_are_ranked():
    verdict = _bench.rank_verdict(TIGHT)
    assert verdict["rankable"] is True
    assert verdict["order"] == ["lazyckpt", "safetensors", "torch"]
    assert verdict["unresolved"] == [] and verdict["ties"] == []


def test_overlapping_but_close_medians_are_a_tie_not_a_failure_to_rank():
    verdict = _bench.rank_verdict({"dcp1": [0.50, 0.52, 0.55, 0.51, 0.53, 0.54, 0.50],
                                   "dcp2": [0.52, 0.53, 0.56, 0.50, 0.55, 0.54, 0.52],
                                   "lazyckpt": [0.20, 0.21, 0.20, 0.22, 0.21, 0.20, 0.21]})
    assert verdict["rankable"] is True and verdict["ties"] == [["dcp1", "dcp2"]]


def _result_of(samples):
    """A result as bench.run returns it, from per-repetition load times alone."""
    rows = []
    for key, values in samples.items():
        summary = _bench._summary(values)
        rows.append({"key": key, "method": key, "status": "ok", "load_s": summary,
                     "load_gbps": 1.0 / summary["median"]})
    return {"config": {"reps": len(next(iter(samples.values())))}, "rows": rows,
            "ranking": {"load_s": _bench.rank_verdict(samples)}}


def test_the_report_says_when_the_spread_is_too_wide_and_when_it_is_not():
    wide = "\n".join(_bench.ranking_lines(_result_of(BIMODAL)) + _bench.summary_lines(_result_of(BIMODAL)))
    assert "load: SPREAD TOO WIDE TO RANK" in wide and "lazyckpt 0.300 (0.270-0.810)" in wide
    assert "fastest peer, load: safetensors" in wide and "lazyckpt 2.03x (ranges overlap: not resolved)" in wide
    tight = "\n".join(_bench.ranking_lines(_result_of(TIGHT)) + _bench.summary_lines(_result_of(TIGHT)))
    assert "TOO WIDE" not in tight and "load: ranked" in tight
    assert "lazyckpt 2.03x" in tight and "not resolved" not in tight
    assert "min-max ranges do not overlap" in tight
    few = _bench.ranking_lines(_result_of({k: v[:3] for k, v in TIGHT.items()}))
    assert any("with 3 repetitions" in line and "25%" in line for line in few)


def test_a_tiny_real_run_shuffles_and_shows_the_spread(tmp_path):
    result = _bench.run(256 << 10, 3, reps=3, methods=["torch", "lazyckpt"], directory=str(tmp_path), seed=5)
    cfg = result["config"]
    assert cfg["seed"] == 5 and len(cfg["orders"]) == 3
    shared = {"raw", "raw_buffered", "raw_mmap", "torch", "lazyckpt"}
    assert all(set(order) == shared for order in cfg["orders"])
    in_table = [r["key"] for r in result["rows"]]
    assert cfg["orders"] == [_bench.rep_order(in_table, rep, 5) for rep in range(3)]
    assert len({tuple(o) for o in cfg["orders"]}) > 1
    rows = {r["key"]: r for r in result["rows"]}
    for key in shared:
        s = rows[key]["load_s"]
        assert rows[key]["status"] == "ok" and len(s["values"]) == 3 and s["min"] <= s["median"] <= s["max"]
    assert set(result["ranking"]) == {"durable_s", "load_s"}
    assert set(result["ranking"]["load_s"]["order"]) == shared
    table = _bench.format_table(result)
    lo, hi = rows["lazyckpt"]["load_s"]["min"], rows["lazyckpt"]["load_s"]["max"]
    assert f"({lo:.4f}-{hi:.4f})" in table or f"({lo:.3f}-{hi:.3f})" in table
    assert "3 repetitions, the methods in a new order in each (seed 5)" in table
    assert "load: ranked" in table or "load: SPREAD TOO WIDE TO RANK" in table
    import importlib.util
    if importlib.util.find_spec("matplotlib") is not None:
        _bench.plot(result, str(tmp_path / "bench.png"))
        assert (tmp_path / "bench.png").stat().st_size > 0
