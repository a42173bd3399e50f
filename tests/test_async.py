"""Asynchronous Checkpointer: lazy capture consistency, back-pressure,
queueing, background errors, close() and thread hygiene."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import lazyckpt
from lzc_tools import clone_state
from lazyckpt import keptpools
from lazyckpt.storage import fileio


def _lazy_threads():
    """lazyckpt's threads, less those of the pools kept for the process."""
    return {t for t in threading.enumerate() if t.name.startswith("lazyckpt-")} - keptpools.threads()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32),
                               torch.nn.LayerNorm(32))



def _assert_same(a, b, where=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"tensor differs at {where}"
    else:
        assert a == b, where


@pytest.mark.parametrize("cache_bytes", [16 << 10, 8 << 20])
def test_capture_is_consistent_under_in_place_mutation(tmp_path, cache_bytes):
    """Every committed checkpoint equals a copy taken at its save(), although
    the optimizer (AdamW, attached) and the loop mutate every tensor in place
    as soon as wait_for_snapshot() allows."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    refs = {}
    with lazyckpt.Checkpointer(tmp_path, host_cache_bytes=cache_bytes, io=lazyckpt.IO(max_pending_saves=3)) as ckpt:
        ckpt.attach(opt)
        for step in range(8):
            loss = model(torch.randn(16, 64)).pow(2).mean()
            loss.backward()
            opt.step()                     # waits for the previous captures first
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            refs[step] = clone_state(state)
            ckpt.save(state, step=step)
            # Mutate everything in place the moment the capture allows it.
            ckpt.wait_for_snapshot()
            with torch.no_grad():
                for t in list(model.state_dict().values()):
                    t.add_(1.0)
                for s in opt.state.values():
                    s["exp_avg"].mul_(3.0)
        ckpt.wait()
        assert ckpt.steps() == list(range(8))
        for step, ref in refs.items():
            _assert_same(ckpt.load(step=step), ref, f"step {step}")


def test_tensor_larger_than_cache_streams_through(tmp_path):
    big = torch.randn(300_000)                     # 1.2 MB through a 16 KiB cache
    with lazyckpt.Checkpointer(tmp_path, host_cache_bytes=16 << 10) as ckpt:
        h = ckpt.save({"big": big, "small": torch.arange(3)}, step=1)
        h.wait()
        assert h.bytes > big.numel() * 4
        out = ckpt.load()
    assert torch.equal(out["big"], big) and torch.equal(out["small"], torch.arange(3))


def test_many_saves_queue_and_all_commit(tmp_path):
    state = {"w": torch.randn(50_000)}
    with lazyckpt.Checkpointer(tmp_path, host_cache_bytes=64 << 10, io=lazyckpt.IO(max_pending_saves=2)) as ckpt:
        handles = [ckpt.save({"w": state["w"] + i, "i": i}, step=i) for i in range(12)]
        ckpt.wait()
        assert all(h.done() and h.error is None for h in handles)
        assert ckpt.steps() == list(range(12))
        for i in (0, 5, 11):
            out = ckpt.load(step=i)
            assert out["i"] == i and torch.equal(out["w"], state["w"] + i)


def test_skip_policy_skips_with_a_warning(tmp_path):
    gate = threading.Event()
    real = fileio.OutputFile.pwrite_all

    def slow_write(self, data, offset):
        gate.wait(10)
        return real(self, data, offset)

    fileio.OutputFile.pwrite_all = slow_write
    try:
        with lazyckpt.Checkpointer(tmp_path, io=lazyckpt.IO(max_pending_saves=1, when_full="skip")) as ckpt:
            first = ckpt.save({"w": torch.ones(10)}, step=1)      # in flight (held at its write)
            second = ckpt.save({"w": torch.ones(10)}, step=2)     # waits behind it
            with pytest.warns(RuntimeWarning, match="step 3 skipped"):
                third = ckpt.save({"w": torch.ones(10)}, step=3)
            assert third.skipped and third.done() and not second.skipped
            gate.set()
            first.wait(30)
            second.wait(30)
            assert ckpt.steps() == [1, 2]
    finally:
        fileio.OutputFile.pwrite_all = real
        gate.set()


def _failing_writes(after: int, err=errno.ENOSPC):
    """A fault injected at the write call: the first ``after`` writes pass."""
    real = fileio.OutputFile.pwrite_all
    calls = {"n": 0}

    def write(self, data, offset):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(err, os.strerror(err), self.path)
        return real(self, data, offset)
    return real, write


def test_background_write_error_surfaces_at_next_call(tmp_path):
    state = {"w": torch.randn(100_000)}
    with lazyckpt.Checkpointer(tmp_path, host_cache_bytes=64 << 10) as ckpt:
        ckpt.save(state, step=1).wait()
        real, failing = _failing_writes(after=3)
        fileio.OutputFile.pwrite_all = failing
        try:
            handle = ckpt.save(state, step=2)
            with pytest.raises(lazyckpt.CheckpointError) as info:
                for _ in range(200):       # the next save() or wait() reports it
                    ckpt.wait()
                    ckpt.save(state, step=3)
            assert info.value.step == 2 and "No space left" in str(info.value) and "step 2" in str(info.value)
            assert handle.done() and handle.error is not None
        finally:
            fileio.OutputFile.pwrite_all = real
        ckpt.wait()
        # The previous checkpoint is intact; nothing of step 2 remains; saving works again.
        assert 2 not in ckpt.steps()
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-step_0000000002")]
        assert torch.equal(ckpt.load(step=1)["w"], state["w"])
        ckpt.save(state, step=4).wait()
        assert torch.equal(ckpt.load(step=4)["w"], state["w"])


def test_handle_wait_reports_error_once(tmp_path):
    real, failing = _failing_writes(after=0, err=errno.EIO)
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        fileio.OutputFile.pwrite_all = failing
        try:
            h = ckpt.save({"w": torch.ones(1000)}, step=1)
            with pytest.raises(lazyckpt.CheckpointWriteError, match="Input/output error"):
                h.wait(30)
        finally:
            fileio.OutputFile.pwrite_all = real
        ckpt.wait()                      # already reported through the handle
        ckpt.save({"w": torch.ones(3)}, step=2).wait()
        assert ckpt.steps() == [2]


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot serialize this")


def test_serialization_failure_is_raised_with_step(tmp_path):
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        h = ckpt.save({"w": torch.ones(10), "obj": _Unpicklable()}, step=7)
        with pytest.raises(lazyckpt.CheckpointError, match="step 7.*cannot serialize this"):
            h.wait(30)
        assert ckpt.steps() == []


def test_close_drains_saves_in_flight(tmp_path):
    before = _lazy_threads()
    ckpt = lazyckpt.Checkpointer(tmp_path, host_cache_bytes=32 << 10)
    for i in range(4):
        ckpt.save({"w": torch.randn(20_000)}, step=i)
    ckpt.close()
    with lazyckpt.Checkpointer(tmp_path) as reopened:       # (its leftover scan is a thread until closed)
        assert reopened.steps() == [0, 1, 2, 3]
    assert _lazy_threads() <= before


def test_close_cancel_commits_nothing_pending_and_leaks_nothing(tmp_path):
    before = _lazy_threads()
    gate = threading.Event()
    real = fileio.OutputFile.pwrite_all

    def slow_write(self, data, offset):
        gate.wait(0.05)
        return real(self, data, offset)

    fileio.OutputFile.pwrite_all = slow_write
    try:
        ckpt = lazyckpt.Checkpointer(tmp_path, host_cache_bytes=16 << 10, io=lazyckpt.IO(max_pending_saves=4))
        handles = [ckpt.save({"w": torch.randn(50_000)}, step=i) for i in range(4)]
        ckpt.close(cancel=True)
    finally:
        fileio.OutputFile.pwrite_all = real
    assert all(h.done() for h in handles)
    with lazyckpt.Checkpointer(tmp_path) as reopened:
        committed = reopened.steps()
    assert all(h.cancelled for h in handles if h.step not in committed)
    assert any(h.cancelled for h in handles)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert _lazy_threads() <= before


def test_attach_several_optimizers_and_detach_on_close(tmp_path):
    a, b = _model(1), _model(2)
    opt_a = torch.optim.AdamW(a.parameters())
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    ckpt = lazyckpt.Checkpointer(tmp_path)
    ckpt.attach(opt_a)
    ckpt.attach(opt_b)
    assert len(opt_a._optimizer_step_pre_hooks) == 1 and len(opt_b._optimizer_step_pre_hooks) == 1
    for step, (opt, model) in enumerate(((opt_a, a), (opt_b, b))):
        model(torch.randn(2, 64)).sum().backward()
        ckpt.save({"m": model.state_dict()}, step=step)
        opt.step()
    ckpt.close()
    assert len(opt_a._optimizer_step_pre_hooks) == 0 and len(opt_b._optimizer_step_pre_hooks) == 0


def test_handle_statistics(tmp_path, caplog):
    caplog.set_level("INFO", logger="lazyckpt")
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        h = ckpt.save({"w": torch.randn(100_000)}, step=3).wait()
    s = h.stats()
    assert s["step"] == 3 and s["bytes"] >= 400_000
    assert 0 < s["blocking_s"] and 0 < s["capture_s"] <= s["flush_s"] and s["gbps"] > 0
    assert any("step 3 committed" in r.getMessage() for r in caplog.records)


def test_errors_for_bad_arguments(tmp_path):
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError):
            ckpt.save({}, step=-1)
        with pytest.raises(ValueError):
            ckpt.save({}, step=1, metadata={"step": 3})      # reserved key
        ckpt.save({"a": 1}, step=1).wait()
    with pytest.raises(lazyckpt.CheckpointError, match="closed"):
        ckpt.save({"a": 3}, step=2)


def test_barrier_raises_a_capture_failure_instead_of_passing(tmp_path):
    """wait_for_snapshot() guards the optimizer step: after a failed capture it
    must raise that failure, not return as if the snapshot were taken."""
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(4), "obj": _Unpicklable()}, step=2)
        with pytest.raises(lazyckpt.CheckpointError, match="step 2"):
            ckpt.wait_for_snapshot()
        ckpt.wait()                                   # reported once, not again
        ckpt.save({"w": torch.ones(4)}, step=3).wait()
        assert ckpt.steps() == [3]


def test_async_file_writer_reports_each_failure_once(tmp_path):
    from lazyckpt.integrations._async import AsyncFileWriter
    writer = AsyncFileWriter(host_cache_bytes=1 << 20, chunk_bytes=4096)
    try:
        failed = writer.save({"obj": _Unpicklable()}, str(tmp_path / "a.ckpt"))
        with pytest.raises(lazyckpt.CheckpointWriteError):
            failed.wait(30)
        writer.save({"w": torch.ones(2)}, str(tmp_path / "b.ckpt")).wait(30)   # not raised again
        writer.wait()
    finally:
        writer.close()
    assert torch.equal(lazyckpt.load(str(tmp_path / "b.ckpt"))["w"], torch.ones(2))
