"""Checkpointer: committed steps, retention, the latest file, leftovers of
interrupted saves (a real SIGKILL mid-write), and not-found errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import lazyckpt
from lzc_tools import assert_same
from _groups import groups

SMALL = dict(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(300, 7, generator=g), "b": torch.arange(7) * step},
            "optim": {"state": {0: {"exp_avg": torch.randn(300, 7, generator=g)}}},
            "np": np.full(5, step, dtype=np.int64), "step": step, "name": f"run-{step}"}


def _listing(directory):
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------- basics


def test_save_wait_steps_and_load(ckpt_dir, no_leaked_threads):
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        assert ckpt.steps() == [] and ckpt.latest_step() is None
        handles = [ckpt.save(state_for(s), step=s) for s in (10, 20)]
        ckpt.wait()
        assert all(h.done() and h.error is None for h in handles)
        h = ckpt.save(state_for(30), step=30)
        assert h.wait() is h
        assert ckpt.steps() == [10, 20, 30] and ckpt.latest_step() == 30
        assert_same(state_for(30), ckpt.load())
        assert_same(state_for(30), ckpt.load(step=None))
        for s in (10, 20, 30):
            assert_same(state_for(s), ckpt.load(step=s))
        assert_same({"model": state_for(20)["model"]}, ckpt.load(step=20, keys=["model"]))
    assert _listing(ckpt_dir) == ["history.json", "latest", "step_0000000010", "step_0000000020", "step_0000000030"]
    # Committed steps are readable without a Checkpointer, too.
    assert_same(state_for(30), lazyckpt.load(ckpt_dir))
    assert_same(state_for(10), lazyckpt.load(os.path.join(ckpt_dir, "step_0000000010")))


def test_latest_file_content(ckpt_dir):
    latest = os.path.join(ckpt_dir, "latest")
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        assert not os.path.exists(latest)
        ckpt.save(state_for(1), step=1).wait()
        assert open(latest, "rb").read() == b"1\n"
        ckpt.save(state_for(12345), step=12345).wait()
        assert open(latest, "rb").read() == b"12345\n"
        # A lower step saved later supersedes the higher one (a rollback): the
        # latest step is always the most recently committed one.
        ckpt.save(state_for(7), step=7).wait()
        assert ckpt.steps() == [1, 7]
        assert open(latest, "rb").read() == b"7\n"
        assert ckpt.load()["step"] == 7


def test_context_manager_drains_and_closes(ckpt_dir, no_leaked_threads):
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        for s in range(3):
            ckpt.save(state_for(s), step=s)          # no wait: exit drains
    with lazyckpt.Checkpointer(ckpt_dir) as reopened:       # (its leftover scan is a thread until closed)
        assert reopened.steps() == [0, 1, 2]
    with pytest.raises(lazyckpt.CheckpointError, match="closed"):
        ckpt.save(state_for(9), step=9)
    with pytest.raises(lazyckpt.CheckpointError, match="closed"):
        ckpt.load()
    ckpt.close()                                      # idempotent


def test_exception_in_context_cancels_and_leaks_nothing(ckpt_dir, no_leaked_threads):
    with pytest.raises(RuntimeError, match="boom"):
        with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
            ckpt.save(state_for(1), step=1).wait()
            ckpt.save(state_for(2), step=2)
            raise RuntimeError("boom")
    with lazyckpt.Checkpointer(ckpt_dir) as reopened:
        steps = reopened.steps()
    assert steps in ([1], [1, 2])
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-")]


def test_saving_a_committed_step_again_supersedes_it(ckpt_dir, no_leaked_threads):
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(1), step=1).wait()
        ckpt.save(state_for(99), step=1).wait()
        assert ckpt.steps() == [1]
        assert_same(state_for(99), ckpt.load(step=1))
        ckpt.save(state_for(2), step=2).wait()        # and the checkpointer goes on
        assert ckpt.steps() == [1, 2]
    # Without retention the superseded step is kept aside, never listed.
    hidden = [n for n in os.listdir(ckpt_dir) if n.startswith(".")]
    assert len(hidden) == 1 and hidden[0].startswith(".abandoned-step_0000000001-")
    with lazyckpt.Checkpointer(ckpt_dir, keep=2, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(3), step=3).wait()        # retention removes abandoned steps too
    assert not [n for n in os.listdir(ckpt_dir) if n.startswith(".")]


def test_bad_arguments(ckpt_dir):
    with pytest.raises(ValueError):
        lazyckpt.Checkpointer(ckpt_dir, keep=0)
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        for bad in (-1, 1.0, "3", True, 10**10):
            with pytest.raises(ValueError):
                ckpt.save({"a": 1}, step=bad)
        with pytest.raises(ValueError):
            ckpt.save({"a": 1}, step=1, metadata={"obj": object()})
        assert ckpt.steps() == []


def _fail_commit_step(monkeypatch, which):
    """Inject an I/O error into one step of the commit protocol (FORMAT.md 11.3)."""
    import errno
    import lazyckpt.storage.layout as cp     # the local store's commit (PendingStepDir.publish)
    enospc = OSError(errno.ENOSPC, "No space left on device")
    if which == "manifest":
        real = cp.write_file_atomic

        def failing(path, data):
            if os.path.basename(path) == "manifest.json":
                raise enospc
            return real(path, data)
        monkeypatch.setattr(cp, "write_file_atomic", failing)
    elif which == "dir-fsync":
        real = cp.fsync_dir

        def failing(path):
            if os.path.basename(path).startswith(".tmp-step_"):
                raise enospc
            return real(path)
        monkeypatch.setattr(cp, "fsync_dir", failing)
    else:
        real = os.rename

        def failing(src, dst):
            if os.path.basename(os.fspath(src)).startswith(".tmp-step_"):
                raise enospc
            return real(src, dst)
        monkeypatch.setattr(cp.os, "rename", failing)


@pytest.mark.parametrize("which", ["manifest", "dir-fsync", "rename"])
def test_failed_commit_removes_the_temporary_directory(ckpt_dir, monkeypatch, which):
    """If writing the manifest, syncing or renaming fails, the save fails, the
    temporary directory is removed and nothing committed changes (FORMAT.md 11.3)."""
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(1), step=1).wait()
        _fail_commit_step(monkeypatch, which)
        with pytest.raises(lazyckpt.CheckpointError, match="No space left"):
            ckpt.save(state_for(2), step=2).wait()
        monkeypatch.undo()
        assert ckpt.steps() == [1]
        # Nothing hidden but the writer lease this open Checkpointer holds.
        assert [n for n in os.listdir(ckpt_dir) if n.startswith(".")] == [".writer"]
        assert open(os.path.join(ckpt_dir, "latest")).read() == "1\n"
        ckpt.save(state_for(2), step=2).wait()
        assert_same(state_for(2), ckpt.load())


# --------------------------------------------------------------------------- retention


class Gate:
    """Pickling this blocks until ``release`` is set: it holds a save in flight."""
    release = threading.Event()
    entered = threading.Event()

    def __reduce__(self):
        Gate.entered.set()
        assert Gate.release.wait(60), "test never released the gate"
        return (int, (0,))


def test_keep_last_deletes_older_steps_only_after_a_newer_commit(ckpt_dir, no_leaked_threads):
    Gate.release.clear()
    Gate.entered.clear()
    with lazyckpt.Checkpointer(ckpt_dir, keep=2, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(1), step=1).wait()
        ckpt.save(state_for(2), step=2).wait()
        assert ckpt.steps() == [1, 2]
        held = ckpt.save(dict(state_for(3), gate=Gate()), step=3)
        try:
            assert Gate.entered.wait(60)
            # Step 3 is being written: nothing may be deleted yet.
            assert ckpt.steps() == [1, 2] and not held.done()
            assert any(n.startswith(".tmp-step_0000000003-") for n in os.listdir(ckpt_dir))
        finally:
            Gate.release.set()
        held.wait()
        assert ckpt.steps() == [2, 3]
        ckpt.save(state_for(4), step=4).wait()
        assert ckpt.steps() == [3, 4]
        assert_same(state_for(4), ckpt.load())
        assert ckpt.load(step=3, allow_pickle=True)["gate"] == 0
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            ckpt.load(step=1)
    assert _listing(ckpt_dir) == ["history.json", "latest", "step_0000000003", "step_0000000004"]
    assert open(os.path.join(ckpt_dir, "latest")).read() == "4\n"


class Unpicklable:
    def __reduce__(self):
        raise TypeError("refuses to be pickled")


def test_failed_save_does_not_trigger_retention(ckpt_dir):
    with lazyckpt.Checkpointer(ckpt_dir, keep=1, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(1), step=1).wait()
        with pytest.raises(lazyckpt.CheckpointError, match="refuses to be pickled"):
            ckpt.save(dict(state_for(2), bad=Unpicklable()), step=2).wait()
        assert ckpt.steps() == [1]
        assert_same(state_for(1), ckpt.load())
    assert _listing(ckpt_dir) == ["history.json", "latest", "step_0000000001"]


# --------------------------------------------------------------------------- listing and leftovers


def test_steps_ignores_everything_but_committed_steps(ckpt_dir):
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(5), step=5).wait()
    os.mkdir(os.path.join(ckpt_dir, "step_0000000009"))                     # no manifest
    os.mkdir(os.path.join(ckpt_dir, "step_9"))                              # wrong name
    os.mkdir(os.path.join(ckpt_dir, "step_00000000009"))                    # 11 digits
    with open(os.path.join(ckpt_dir, "step_0000000008"), "w") as f:         # a file
        f.write("x")
    with open(os.path.join(ckpt_dir, "latest"), "w") as f:                  # a lying latest
        f.write("9\n")
    with lazyckpt.Checkpointer(ckpt_dir) as ckpt:
        assert ckpt.steps() == [5] and ckpt.latest_step() == 5
        assert ckpt.load()["step"] == 5
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            ckpt.load(step=9)
    assert lazyckpt.load(ckpt_dir)["step"] == 5


def test_leftovers_are_cleaned_only_once_provably_dead(ckpt_dir):
    from lazyckpt.storage import locks
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(1), step=1).wait()
    names = {".tmp-step_0000000002-0123abcd4567": False,        # old, unlocked: dead
             ".tmp-step_0000000003-89abcdef0123": True,         # leased (locked) below: live
             ".tmp-step_0000000004-fresh0000000": True,         # unlocked but fresh: may be starting
             ".deleting-step_0000000000-deadbeef": False,
             ".abandoned-step_0000000009-abcdef12": True}       # data, never removed on open
    for name in names:
        os.mkdir(os.path.join(ckpt_dir, name))
        with open(os.path.join(ckpt_dir, name, "rank_00000.lzc"), "wb") as f:
            f.write(b"partial")
    lease = locks.Lease(os.path.join(ckpt_dir, ".tmp-step_0000000003-89abcdef0123", "rank_00000.lzc"))
    old = time.time() - 3600
    with open(os.path.join(ckpt_dir, "latest.tmp-1234"), "w") as f:
        f.write("2\n")
    for name in [n for n in names if "fresh" not in n] + ["latest.tmp-1234"]:
        for root in (os.path.join(ckpt_dir, name),):
            for sub in ([os.path.join(root, "rank_00000.lzc")] if os.path.isdir(root) else []) + [root]:
                os.utime(sub, (old, old))
    try:
        with lazyckpt.Checkpointer(ckpt_dir) as ckpt:
            ckpt.layout.tidy()          # opening scans in the background: tidy() waits for it
            for name, kept in names.items():
                assert os.path.exists(os.path.join(ckpt_dir, name)) == kept, name
            assert not os.path.exists(os.path.join(ckpt_dir, "latest.tmp-1234"))
            assert ckpt.steps() == [1]
    finally:
        lease.release()


CHILD = textwrap.dedent("""
    import sys, threading
    import torch
    import lazyckpt
    from lazyckpt.storage import fileio

    sys.path.insert(0, sys.argv[2])
    from _groups import groups
    from test_checkpointer import SMALL, state_for

    ckpt = lazyckpt.Checkpointer(sys.argv[1], **groups(SMALL))
    ckpt.save(state_for(1), step=1).wait()
    print("COMMITTED", flush=True)

    # Step 2 is large. After a few chunks reached the file, the disk "stalls"
    # (the injected fault) so that the parent can kill us in the middle of it.
    real = fileio.OutputFile.pwrite_all
    writes = []
    stall = threading.Event()

    lock = threading.Lock()

    def stalling_pwrite_all(self, data, offset):
        with lock:
            writes.append(offset)
            first_stall = len(writes) == 4
        if len(writes) > 3:
            if first_stall:            # once: several writer threads stall together
                print("STALLED", flush=True)
            stall.wait()
        return real(self, data, offset)

    fileio.OutputFile.pwrite_all = stalling_pwrite_all
    ckpt.save({"big": torch.randn(4_000_000), "step": 2}, step=2)
    stall.wait()
""")


@pytest.mark.timeout(180)
def test_sigkill_mid_write_leaves_the_last_commit_intact(ckpt_dir, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYCKPT_")}
    proc = subprocess.Popen([sys.executable, str(script), ckpt_dir, os.path.dirname(__file__)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "COMMITTED", proc.stderr.read()
        assert proc.stdout.readline().strip() == "STALLED", proc.stderr.read()
        tmp_dirs = [n for n in os.listdir(ckpt_dir) if n.startswith(".tmp-step_0000000002-")]
        assert len(tmp_dirs) == 1
        data_file = os.path.join(ckpt_dir, tmp_dirs[0], "rank_00000.lzc")
        assert os.path.getsize(data_file) > 0
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    # Readers ignore the leftover, even before any cleanup.
    assert os.path.isdir(os.path.join(ckpt_dir, tmp_dirs[0]))
    assert_same(state_for(1), lazyckpt.load(ckpt_dir))
    # A fresh Checkpointer lists only step 1, loads it bit-exactly and removes the
    # leftover once its lease has expired (the dead process no longer holds its lock
    # nor refreshes its heartbeat).
    time.sleep(0.6)
    with lazyckpt.Checkpointer(ckpt_dir, **groups(SMALL, lease_expiry=0.5)) as ckpt:
        assert ckpt.steps() == [1] and ckpt.latest_step() == 1
        assert_same(state_for(1), ckpt.load())
        ckpt.layout.tidy()      # the leftover scan opening starts runs in the background: wait for it
        assert _listing(ckpt_dir) == ["history.json", "latest", "step_0000000001"]
        assert open(os.path.join(ckpt_dir, "latest")).read() == "1\n"
        ckpt.save(state_for(2), step=2).wait()
        assert ckpt.steps() == [1, 2]
        assert_same(state_for(2), ckpt.load())
        assert_same(state_for(1), ckpt.load(step=1))


# --------------------------------------------------------------------------- not found


def test_functional_load_of_missing_things(tmp_path):
    with pytest.raises(lazyckpt.CheckpointNotFoundError) as info:
        lazyckpt.load(tmp_path / "missing.lzc")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, lazyckpt.CheckpointError)
    assert "missing.lzc" in str(info.value)
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(tmp_path / "no" / "such" / "dir")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(empty)                            # a directory without committed steps
    (empty / "step_0000000001").mkdir()
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(empty / "step_0000000001")        # a step directory without manifest


def test_functional_save_into_missing_directory(tmp_path):
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.save({"a": 1}, tmp_path / "nope" / "x.lzc")
    assert not (tmp_path / "nope").exists()


def test_checkpointer_load_without_checkpoints(ckpt_dir, no_leaked_threads):
    with lazyckpt.Checkpointer(ckpt_dir) as ckpt:
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            ckpt.load()
        with pytest.raises(lazyckpt.CheckpointNotFoundError):
            ckpt.load(step=3)


def test_checkpointer_creates_missing_directories(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    with lazyckpt.Checkpointer(target, **groups(SMALL)) as ckpt:
        ckpt.save({"x": 1}, step=1).wait()
    assert lazyckpt.load(target) == {"x": 1}


def test_checkpointer_on_an_unusable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(lazyckpt.CheckpointError):
        lazyckpt.Checkpointer(blocker / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    with lazyckpt.Checkpointer(d, **groups(SMALL)) as ckpt:
        ckpt.save(state_for(1), step=1).wait()
    os.chmod(d, 0o500)
    try:
        with pytest.raises(lazyckpt.CheckpointError):
            lazyckpt.Checkpointer(d)
        assert_same(state_for(1), lazyckpt.load(d))     # reading needs no write access
    finally:
        os.chmod(d, 0o700)
