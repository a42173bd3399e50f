"""The consistency and no-loss contracts of issue 10 ("One save engine for
every path"), each reproduced first as a failing test on the code before the
one engine landed:

1. ``attach(optimizer)`` alone keeps persistent buffers that the next
   training-mode forward mutates (BatchNorm) at their ``save()`` values.
2. After resuming from an older step, the new save is the latest and is kept.
3. A second process opening the directory never destroys a save in flight.
4. A save refused on one rank fails that step only; the next save commits.
5. ``load(into=...)`` refuses to leave tensors of the target unfilled.

and the contracts that came with them (leases, read-side protection, garbage
collection, interpreter exit). Multi-rank cases use real gloo processes.
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref

import pytest
import torch

import lazyckpt
from _dist import run_ranks
from lzc_tools import assert_same, clone_state
from _groups import groups

pytestmark = pytest.mark.timeout(300)

SLOW_KNOBS = dict(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=1)



# --------------------------------------------------------------------------- 1. buffers


def _bn_model():
    torch.manual_seed(0)
    # 2 x 16 MiB of weights come before the BatchNorm buffers in the state dict, so
    # a capture streaming through an 8 KiB cache is still copying the weights when
    # the next forward runs.
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096, bias=False),
                               torch.nn.Linear(4096, 1024, bias=False), torch.nn.BatchNorm1d(1024))


def test_attach_alone_keeps_batchnorm_buffers_at_their_save_values(tmp_path):
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 1024)
    with lazyckpt.Checkpointer(tmp_path, **groups(SLOW_KNOBS)) as ckpt:
        ckpt.attach(opt)                              # all the README asks for
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict()}
        expected = clone_state(state)
        handle = ckpt.save(state, step=1)
        capturing = not handle.snapshot_done.is_set()
        model(x)                                      # updates running_mean/var in place
        handle.wait()
        assert capturing, "the capture finished before the forward: the race was not exercised"
        loaded = ckpt.load()
    assert_same(loaded, expected)


def test_the_file_writer_of_the_integrations_guards_buffers_too(tmp_path):
    from lazyckpt.integrations._async import AsyncFileWriter
    model = _bn_model()
    x = torch.randn(8, 1024)
    model(x)
    state = {"model": model.state_dict()}
    expected = clone_state(state)
    writer = AsyncFileWriter(**SLOW_KNOBS)
    try:
        pending = writer.save(state, str(tmp_path / "f.lzc"))
        model(x)
        pending.wait()
    finally:
        writer.close()
    assert_same(lazyckpt.load(str(tmp_path / "f.lzc")), expected)


def test_eval_forwards_and_unrelated_modules_do_not_wait(tmp_path):
    """The forward guard waits only for a training-mode module whose persistent
    buffers are part of a pending capture."""
    model = _bn_model()
    other = torch.nn.BatchNorm1d(16)
    with lazyckpt.Checkpointer(tmp_path, **groups(SLOW_KNOBS)) as ckpt:
        handle = ckpt.save({"model": model.state_dict()}, step=1)
        model.eval()
        model(torch.randn(8, 1024))                    # eval: no buffer update, no wait
        other(torch.randn(8, 16))                      # buffers not being saved: no wait
        assert not handle.snapshot_done.is_set()
        handle.wait()


# --------------------------------------------------------------------------- 2. rollback


def _value(step):
    return {"x": torch.full((4,), float(step)), "step": step}


def test_a_save_after_resuming_from_an_older_step_becomes_latest_and_is_kept(tmp_path):
    d = str(tmp_path)
    with lazyckpt.Checkpointer(d, keep=3) as ckpt:
        for step in (200, 300, 301):
            ckpt.save(_value(step), step=step)
    with lazyckpt.Checkpointer(d, keep=2) as ckpt:   # resumed from step 200
        ckpt.save(_value(250), step=250).wait()
        assert ckpt.latest_step() == 250
        assert ckpt.load()["step"] == 250
        # 300 and 301 belong to the abandoned run: never listed, never loaded.
        assert ckpt.steps() == [200, 250]
        ckpt.save(_value(251), step=251).wait()
        assert ckpt.steps() == [250, 251]             # retention in commit order
        # The resumed run reaches the abandoned step numbers again: they commit.
        for step in (300, 301):
            ckpt.save(_value(step) | {"new": True}, step=step).wait()
        assert ckpt.steps() == [300, 301]
    loaded = lazyckpt.load(d)
    assert loaded["step"] == 301 and loaded["new"] is True
    assert open(os.path.join(d, "latest")).read() == "301\n"


def test_abandoned_steps_are_kept_aside_when_retention_is_off(tmp_path):
    d = str(tmp_path)
    with lazyckpt.Checkpointer(d) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(_value(step), step=step)
        ckpt.wait()
        ckpt.save(_value(15), step=15).wait()
        assert ckpt.steps() == [10, 15] and ckpt.latest_step() == 15
    from lazyckpt.cli import inspect as lzinspect
    from lazyckpt.cli import prune as lzprune
    from lazyckpt.loading import resolve as lzresolve
    from lazyckpt.loading import verify as lzverify
    listing = lzinspect.list_directory(d)
    assert [s["step"] for s in listing["steps"]] == [10, 15]
    abandoned = sorted(lo["name"] for lo in listing["leftovers"] if lo["kind"] == "abandoned")
    assert len(abandoned) == 2 and "step_0000000020" in abandoned[0] and "step_0000000030" in abandoned[1]
    # A fresh Checkpointer does not delete them (they are data, not garbage) ...
    fresh = lazyckpt.Checkpointer(d)
    fresh.layout.tidy()                     # its scan at open, waited for (close() cancels it)
    fresh.close()
    assert len([n for n in os.listdir(d) if n.startswith(".abandoned-")]) == 2
    # ... `lazyckpt prune` does.
    report = lzprune.prune(d, keep=10)
    assert not [n for n in os.listdir(d) if n.startswith(".abandoned-")]
    assert report["kept"] == [10, 15]


def test_saving_the_latest_step_again_replaces_it(tmp_path):
    with lazyckpt.Checkpointer(tmp_path, keep=3) as ckpt:
        ckpt.save(_value(1), step=1)
        ckpt.save(_value(2), step=2).wait()
        ckpt.save({"x": torch.zeros(4), "step": 2, "again": True}, step=2).wait()
        assert ckpt.steps() == [1, 2]
        assert ckpt.load()["again"] is True


# --------------------------------------------------------------------------- 3. live saves


def _slow_two_rank_save(rank, world, directory, go_file):
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(commit_timeout=120)) as ckpt:
        ckpt.save({"w": torch.full((1000,), 1.0 + rank)}, step=1).wait()
        if rank == 1:
            # Rank 0 has written its file into the shared temporary directory and
            # waits for rank 1 there; rank 1 waits until the evaluator has run.
            deadline = time.time() + 60
            while not os.path.exists(go_file) and time.time() < deadline:
                time.sleep(0.01)
        ckpt.save({"w": torch.full((1 << 20,), 2.0 + rank)}, step=2).wait()
        return ckpt.steps()


def test_an_evaluation_process_never_destroys_a_multi_rank_save_in_flight(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    go = str(tmp_path / "go")
    results = {}
    t = threading.Thread(target=lambda: results.update(
        r=run_ranks(2, _slow_two_rank_save, str(d), go, allow_failure=True, timeout=240)))
    t.start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not any(n.startswith(".tmp-step_0000000002") for n in os.listdir(d)):
            time.sleep(0.005)
        assert any(n.startswith(".tmp-step_0000000002") for n in os.listdir(d))
        time.sleep(0.2)
        # What an evaluation job does meanwhile (another process, no process group).
        with lazyckpt.Checkpointer(str(d)) as evaluator:
            assert evaluator.load(step=1)["w"][0].item() == 1.0
        from lazyckpt.cli import inspect as lzinspect
        from lazyckpt.cli import prune as lzprune
        from lazyckpt.loading import resolve as lzresolve
        from lazyckpt.loading import verify as lzverify
        lzinspect.list_directory(str(d))
        assert any(n.startswith(".tmp-step_0000000002") for n in os.listdir(d))
    finally:
        open(go, "w").close()
        t.join()
    for status, value in results["r"]:
        assert status == "ok", value
        assert value == [1, 2]
    assert lazyckpt.load(str(d / "step_0000000002"))["w"][0].item() == 2.0


def _lease_holder(directory: str, ready: str) -> None:
    """A process that holds a save's lease and then dies or lingers (used below)."""
    from lazyckpt.storage import locks
    tmp = os.path.join(directory, ".tmp-step_0000000007-x")
    os.makedirs(tmp)
    lease = locks.Lease(os.path.join(tmp, "rank_00000.lzc"), heartbeat_s=0.05)
    open(ready, "w").close()
    time.sleep(60)
    lease.release()


def _open_and_tidy(d, expiry):
    """Open a Checkpointer and wait for the leftover scan it starts (close() cancels it)."""
    ck = lazyckpt.Checkpointer(str(d), io=lazyckpt.IO(lease_expiry=expiry))
    try:
        ck.layout.tidy()
    finally:
        ck.close()


def test_leftovers_are_removed_only_once_their_lease_has_expired(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    ready = str(tmp_path / "ready")
    script = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_contracts import _lease_holder
        _lease_holder({str(d)!r}, {ready!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while not os.path.exists(ready) and time.time() < deadline:
            time.sleep(0.01)
        assert os.path.exists(ready)
        time.sleep(0.3)
        # Live (locked and heartbeating): kept, even with a tiny expiry.
        _open_and_tidy(d, 0.2)
        assert os.path.isdir(d / ".tmp-step_0000000007-x")
        proc.kill()
        proc.wait()
        # Dead but the heartbeat is fresh: kept until the expiry has passed.
        _open_and_tidy(d, 30)
        assert os.path.isdir(d / ".tmp-step_0000000007-x")
        time.sleep(0.5)
        _open_and_tidy(d, 0.2)
        assert not os.path.exists(d / ".tmp-step_0000000007-x")
    finally:
        proc.kill()
        proc.wait()


def test_inspection_tools_never_delete_or_rename(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    with lazyckpt.Checkpointer(d) as ckpt:
        ckpt.save(_value(1), step=1).wait()
    (d / ".tmp-step_0000000002-deadbeef").mkdir()      # no lease at all, very old
    os.utime(d / ".tmp-step_0000000002-deadbeef", (0, 0))
    (d / ".deleting-step_0000000000-abcd1234").mkdir()
    before = sorted(os.listdir(d))
    from lazyckpt import cli
    for argv in (["ls", str(d)], ["inspect", str(d)], ["verify", str(d)]):
        assert cli.main(argv) == 0
    lazyckpt.load(str(d))
    assert sorted(os.listdir(d)) == before


# --------------------------------------------------------------------------- 4. refused saves


def _refused_on_one_rank(rank, world, directory):
    out = {}
    with lazyckpt.Checkpointer(directory, distributed=lazyckpt.Distributed(commit_timeout=30)) as ckpt:
        ckpt.save({"w": torch.full((10,), 1.0 + rank)}, step=1).wait()
        t0 = time.time()
        try:
            handle = ckpt.save({"w": torch.full((10,), 2.0)}, step=2,
                               metadata={"bad": object()} if rank == 1 else None)
            handle.wait()
            out["step2"] = "committed"
        except (ValueError, lazyckpt.CheckpointError) as exc:
            out["step2"] = f"{type(exc).__name__}: {exc}"
        try:
            ckpt.save({"w": torch.full((10,), 3.0 + rank)}, step=3).wait()
            out["step3"] = "committed"
        except lazyckpt.CheckpointError as exc:
            out["step3"] = f"{type(exc).__name__}: {exc}"
        out["elapsed"] = time.time() - t0
        out["steps"] = ckpt.steps()
    return out


def test_a_save_refused_on_one_rank_fails_that_step_only(tmp_path):
    results = run_ranks(2, _refused_on_one_rank, str(tmp_path), timeout=200)
    r0, r1 = results
    assert r1["step2"].startswith("ValueError"), r1
    assert r0["step2"].startswith("CheckpointWriteError") and "rank 1" in r0["step2"], r0
    assert r0["step3"] == r1["step3"] == "committed", results
    assert r0["elapsed"] < 20 and r1["elapsed"] < 20, results      # no commit timeout waited
    assert r0["steps"] == r1["steps"] == [1, 3]
    from lazyckpt.cli import inspect as lzinspect
    from lazyckpt.cli import prune as lzprune
    from lazyckpt.loading import resolve as lzresolve
    from lazyckpt.loading import verify as lzverify
    from lazyckpt.storage.stores import LOCAL
    assert lzverify.verify(store=LOCAL, path=str(tmp_path / "step_0000000003")).ok
    assert lazyckpt.load(str(tmp_path / "step_0000000003"))["w"][0].item() == 3.0


# --------------------------------------------------------------------------- 5. strict into=


def test_load_into_is_strict_by_default(tmp_path):
    path = str(tmp_path / "f.lzc")
    lazyckpt.save({"model": {"a": torch.ones(3)}, "step": 7}, path)
    target = {"model": {"a": torch.zeros(3), "b": torch.zeros(2)}, "extra": {"c": torch.zeros(1)}}
    with pytest.raises(lazyckpt.MissingKeyError) as info:
        lazyckpt.load(path, into=target)
    message = str(info.value)
    assert "model/b" in message and "extra/c" in message and "model/a" not in message
    assert info.value.missing == ["extra/c", "model/b"]
    assert torch.equal(target["model"]["a"], torch.zeros(3))      # nothing was filled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lazyckpt.load(path, into=target, strict=False)
    assert out is target and torch.equal(target["model"]["a"], torch.ones(3))
    assert any("model/b" in str(w.message) for w in caught)
    # keys= narrows what must be filled to the selected part.
    lazyckpt.load(path, keys=[("model", "a")], into={"model": {"a": torch.zeros(3)}})


def test_checkpointer_load_into_is_strict_too(tmp_path):
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save({"a": torch.ones(2)}, step=1).wait()
        with pytest.raises(lazyckpt.MissingKeyError):
            ckpt.load(into={"a": torch.zeros(2), "b": torch.zeros(2)})
        assert torch.equal(ckpt.load(into={"a": torch.zeros(2), "b": torch.zeros(2)}, strict=False)["a"],
                           torch.ones(2))


# --------------------------------------------------------------------------- read side


def test_retention_does_not_delete_a_step_while_another_process_reads_it(tmp_path):
    from lazyckpt.storage import locks
    with lazyckpt.Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(_value(1), step=1).wait()
        with locks.StepDir(ckpt.step_path(1)).reading():     # what load() holds while it reads
            ckpt.save(_value(2), step=2).wait()
            assert ckpt.steps() == [1, 2]                    # step 1 kept while it is read
        ckpt.save(_value(3), step=3).wait()
        assert ckpt.steps() == [3]                           # ... and deleted afterwards


def test_a_step_deleted_under_a_reader_is_reported_as_deleted(tmp_path, monkeypatch):
    from lazyckpt.storage import locks
    from lazyckpt.loading import reader
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(_value(1), step=1).wait()
    step = tmp_path / "step_0000000001"
    real = reader.CheckpointFile.__init__

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")      # e.g. Lustre without -o flock

    def delete_then_open(self, path, options, *rest, **kw):
        # What a `prune` in another process does between the manifest read and the
        # data file's open, where the file system gives the reader no lock.
        if os.path.isdir(step):
            os.rename(step, tmp_path / ".deleting-step_0000000001-00000000")
        real(self, path, options, *rest, **kw)
    monkeypatch.setattr(locks, "_flock", no_locks)
    monkeypatch.setattr(reader.CheckpointFile, "__init__", delete_then_open)
    with pytest.raises(lazyckpt.CheckpointNotFoundError, match="deleted while it was being read"):
        lazyckpt.load(str(tmp_path))


def test_io_errors_during_a_load_are_library_errors_with_the_path(tmp_path, monkeypatch):
    from lazyckpt.storage import fileio, localstore
    path = str(tmp_path / "f.lzc")
    lazyckpt.save({"a": torch.ones(1000)}, path)

    def failing(*_args, **_kwargs):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(fileio.os, "preadv", failing)
    with pytest.raises(lazyckpt.CheckpointReadError) as info:
        lazyckpt.load(path)
    assert info.value.path == path and "Input/output error" in str(info.value)
    monkeypatch.undo()
    for err in (errno.ESTALE, errno.EIO):
        def stale(*_args, _err=err, **_kwargs):
            raise OSError(_err, os.strerror(_err))
        monkeypatch.setattr(localstore, "open_regular", stale)
        with pytest.raises(lazyckpt.CheckpointReadError):
            lazyckpt.load(path)
        monkeypatch.undo()


# --------------------------------------------------------------------------- lifetime


def test_an_unreferenced_checkpointer_is_collected_and_frees_its_cache(tmp_path):
    ckpt = lazyckpt.Checkpointer(tmp_path, host_cache_bytes=1 << 20)
    ckpt.attach(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    ckpt.save(_value(1), step=1).wait()
    cache = ckpt._engine.resources.cache
    assert cache is not None and not cache.closed
    ref = weakref.ref(ckpt)
    del ckpt
    gc.collect()
    assert ref() is None
    deadline = time.time() + 10
    while not cache.closed and time.time() < deadline:
        time.sleep(0.01)
    assert cache.closed
    assert not [t for t in threading.enumerate() if t.name == "lazyckpt-capture"]


EXIT_SCRIPT = """
import sys, torch, lazyckpt
ckpt = lazyckpt.Checkpointer(sys.argv[1], host_cache_bytes=8192,
                             io=lazyckpt.IO(chunk_bytes=4096, writer_threads=1, at_exit=sys.argv[2]))
ckpt.save({"w": torch.ones(1 << 20)}, step=1)
ckpt.save({"w": torch.full((1 << 20,), 2.0)}, step=2)
print("exiting", flush=True)
"""


def test_pending_saves_are_drained_at_interpreter_exit(tmp_path):
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), "drain"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert lazyckpt.Checkpointer(tmp_path).steps() == [1, 2]
    assert lazyckpt.load(str(tmp_path))["w"][0].item() == 2.0


def test_exit_policy_warn_names_the_lost_steps(tmp_path):
    r = subprocess.run([sys.executable, "-W", "always", "-c", EXIT_SCRIPT, str(tmp_path), "warn"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "step" in r.stderr and "lost" in r.stderr
    steps = lazyckpt.Checkpointer(tmp_path).steps()
    assert 2 not in steps
    for step in (1, 2):
        if step not in steps:
            assert f"{step}" in r.stderr


# --------------------------------------------------------------------------- DCP staging


def test_dcp_staging_buffers_are_not_reused_before_their_write_is_durable(tmp_path):
    """Three async saves in a row through one writer, the write of each slow:
    every checkpoint must hold exactly the state of its own save (the third
    must not overwrite the buffer the first is still writing), and staging
    stays within host_cache_bytes."""
    import torch.distributed.checkpoint as dcp
    from lazyckpt.integrations.dcp import LazyStorageReader, LazyStorageWriter
    state = {"w": torch.zeros(1 << 20), "v": torch.zeros(1 << 18)}
    budget = 16 << 20
    writer = LazyStorageWriter(str(tmp_path / "c0"), host_cache_bytes=budget, chunk_bytes=4096, writer_threads=1)
    expected, responses = [], []
    try:
        for i in range(3):
            with torch.no_grad():
                state["w"].fill_(float(i + 1))
                state["v"].fill_(float(-i - 1))
            expected.append(clone_state(state))
            responses.append(dcp.async_save(state, checkpoint_id=str(tmp_path / f"c{i}"), storage_writer=writer,
                                            no_dist=True))
            writer.wait_for_staging()           # the state may be modified from here on
        for r in responses:
            r.upload_completion.result(timeout=120)
        assert 0 < writer.peak_staging_bytes <= budget
    finally:
        writer.close()
    for i in range(3):
        out = {"w": torch.empty(1 << 20), "v": torch.empty(1 << 18)}
        dcp.load(out, storage_reader=LazyStorageReader(str(tmp_path / f"c{i}")), no_dist=True)
        assert_same(out, expected[i])
