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
