"""Disk faults: a disk that fills mid-checkpoint (a real tmpfs and a real
loop-mounted ext4 with O_DIRECT), I/O errors and short writes injected at the
write seam, fsync failures, read-only file systems, missing or mistyped
paths. Every failure must reach the caller as a CheckpointError naming the
step and the cause, leave the previous checkpoints intact and the disk as it
was (no partial data), never hang, never commit, and let training go on.

Mounting needs root: without it (or where the kernel refuses) the mount-based
tests are skipped with the reason; the injection-based ones run everywhere."""

from __future__ import annotations

import errno
import glob
import os
import shutil
import subprocess
import time

import pytest
import torch

import lazyckpt
import lazyckpt.storage.layout
from lazyckpt.storage import fileio
from lzc_tools import assert_same, clone_state
from _groups import groups

pytestmark = pytest.mark.timeout(120)

CKPT_KNOBS = dict(host_cache_bytes=256 << 10, writer_threads=2)
WAIT_S = 60          # every wait is bounded: a hang fails the test instead of blocking CI


# --------------------------------------------------------------------------- mounts


def _try(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _unmount(path) -> None:
    for args in (["umount", str(path)], ["umount", "-l", str(path)]):
        if _try(args).returncode == 0:
            return


def _mount_or_skip(cmd, what):
    if os.geteuid() != 0:
        pytest.skip(f"{what}: mounting needs root (euid {os.geteuid()})")
    if shutil.which("mount") is None:
        pytest.skip(f"{what}: no mount command")
    r = _try(cmd)
    if r.returncode != 0:
        pytest.skip(f"{what}: mount refused ({' '.join(cmd)}): {r.stderr.strip() or r.returncode}")


@pytest.fixture
def tmpfs(tmp_path, request):
    """A fresh 8 MiB tmpfs, unmounted at the end whatever happens."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    _mount_or_skip(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(mnt)], "tmpfs")
    request.addfinalizer(lambda: _unmount(mnt))
    return mnt


@pytest.fixture
def ext4(tmp_path, request):
    """A fresh 32 MiB ext4 image (4 KiB blocks, journal, no reserved blocks) on a
    loop device: a real block file system on which O_DIRECT works."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("ext4: mkfs.ext4 not installed")
    image, mnt = tmp_path / "ext4.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    r = _try(["mkfs.ext4", "-q", "-F", "-b", "4096", "-m", "0", str(image)])
    if r.returncode != 0:
        pytest.skip(f"ext4: mkfs.ext4 failed: {r.stderr.strip()}")
    _mount_or_skip(["mount", "-o", "loop", str(image), str(mnt)], "ext4 on a loop device")
    request.addfinalizer(lambda: _unmount(mnt))
    return mnt


@pytest.fixture(params=["tmpfs", "ext4"])
def small_fs(request):
    return request.getfixturevalue(request.param)


def free_bytes(path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def fill(path, nbytes: int) -> None:
    """Allocate ``nbytes`` of real blocks (not a sparse file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)


def wait_for_free(path, at_least: int, timeout: float = 10.0) -> int:
    """Bounded polling: freed blocks can take a journal commit to show up."""
    deadline = time.monotonic() + timeout
    while True:
        now = free_bytes(path)
        if now >= at_least or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def leftovers(directory) -> list:
    return sorted(n for n in os.listdir(directory)
                  if n.startswith((".tmp-", ".deleting-", "latest.tmp-")) or ".tmp-" in n)


def listing(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n != "lost+found")


def tensor_state(nbytes: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(max(1, nbytes // 4), generator=g), "seed": seed,
            "small": torch.arange(10, dtype=torch.int64) * seed}



def _uses_o_direct(directory) -> bool:
    f = fileio.OutputFile(os.path.join(directory, ".probe"), o_direct=True)
    try:
        direct = f.direct
        f.pwrite_all(memoryview(bytearray(0)), 0)
    finally:
        f.close()
        os.unlink(os.path.join(directory, ".probe"))
    return direct


# --------------------------------------------------------------------------- disk full


def test_disk_full_mid_checkpoint(small_fs):
    """The second checkpoint fills the disk part-way through its data."""
    fs = small_fs
    d = fs / "run"
    free0 = free_bytes(fs)
    fill(fs / "filler", int(0.30 * free0))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    first = tensor_state(int(0.15 * free0), 1)
    big = tensor_state(int(0.60 * free0), 2)
    with lazyckpt.Checkpointer(d, **groups(CKPT_KNOBS)) as ckpt:
        ckpt.attach(opt)
        if fs.name == "ext4":
            assert _uses_o_direct(d), "the ext4 image should take O_DIRECT"
        ckpt.save({"data": first, "model": model.state_dict()}, step=1).wait(WAIT_S)
        ref1 = clone_state({"data": first, "model": model.state_dict()})
        free1 = free_bytes(fs)

        handle = ckpt.save({"data": big, "model": model.state_dict()}, step=2)
        with pytest.raises(lazyckpt.CheckpointError) as info:
            ckpt.wait(WAIT_S)
        err = info.value
        assert isinstance(err, lazyckpt.CheckpointWriteError)
        assert err.step == 2 and "step 2" in str(err)
        assert "No space left" in str(err)
        assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC
        assert handle.done() and handle.error is err

        # Nothing of step 2 is left and its space is back; step 1 is intact.
        assert ckpt.steps() == [1]
        assert leftovers(d) == []
        assert wait_for_free(fs, free1 - (64 << 10)) >= free1 - (64 << 10)
        assert_same(ckpt.load(step=1), ref1)
        assert_same(lazyckpt.load(str(d)), ref1)

        # Training goes on (the attached pre-step hook does not re-raise or hang) ...
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        # ... and a checkpoint that fits commits.
        small = tensor_state(int(0.10 * free0), 3)
        ckpt.save({"data": small, "model": model.state_dict()}, step=3).wait(WAIT_S)
        ref3 = clone_state({"data": small, "model": model.state_dict()})
        assert_same(ckpt.load(step=3), ref3)

        # Once space is freed, the big state saves too.
        os.unlink(fs / "filler")
        ckpt.save({"data": big, "model": model.state_dict()}, step=4).wait(WAIT_S)
        assert_same(ckpt.load(step=4)["data"], big)
        assert ckpt.steps() == [1, 3, 4]
    assert leftovers(d) == []


def test_disk_full_reported_by_the_next_save(small_fs):
    """Without waiting on the handle, the failure surfaces at the next save()."""
    fs = small_fs
    d = fs / "run"
    free0 = free_bytes(fs)
    with lazyckpt.Checkpointer(d, **groups(CKPT_KNOBS)) as ckpt:
        ckpt.save(tensor_state(int(0.2 * free0), 1), step=1).wait(WAIT_S)
        ckpt.save(tensor_state(int(0.9 * free0), 2), step=2)
        deadline = time.monotonic() + WAIT_S
        with pytest.raises(lazyckpt.CheckpointWriteError) as info:
            step = 3
            while time.monotonic() < deadline:
                h = ckpt.save({"n": step}, step=step)      # tiny: fits
                h.wait(WAIT_S)
                step += 1
        assert info.value.step == 2 and "No space left" in str(info.value)
        ckpt.wait(WAIT_S)            # reported once, not again
        assert 2 not in ckpt.steps() and 1 in ckpt.steps()
    assert leftovers(d) == []


def test_functional_save_disk_full_keeps_the_old_file(small_fs):
    fs = small_fs
    path = fs / "model.lzc"
    free0 = free_bytes(fs)
    fill(fs / "filler", int(0.30 * free0))
    old_state = tensor_state(int(0.15 * free0), 1)
    lazyckpt.save(old_state, path, **CKPT_KNOBS)
    old_bytes = path.read_bytes()
    free1 = free_bytes(fs)
    big = tensor_state(int(0.60 * free0), 2)
    with pytest.raises(lazyckpt.CheckpointWriteError) as info:
        lazyckpt.save(big, path, **CKPT_KNOBS)
    assert "No space left" in str(info.value) and str(path) in str(info.value)
    assert path.read_bytes() == old_bytes
    assert listing(fs) == ["filler", "model.lzc"]          # no temporary file left
    assert wait_for_free(fs, free1 - (64 << 10)) >= free1 - (64 << 10)
    assert_same(lazyckpt.load(path), old_state)
    # A new file where there was none: nothing at all is left behind.
    with pytest.raises(lazyckpt.CheckpointWriteError):
        lazyckpt.save(big, fs / "new.lzc", **CKPT_KNOBS)
    assert not (fs / "new.lzc").exists() and listing(fs) == ["filler", "model.lzc"]
    os.unlink(fs / "filler")
    lazyckpt.save(big, path, **CKPT_KNOBS)
    assert_same(lazyckpt.load(path), big)


def _data_file_pages(tmp_path, state, step) -> int:
    """Pages the data file of ``state`` saved at ``step`` takes (dry run elsewhere)."""
    d = tmp_path / f"dry{step}"
    with lazyckpt.Checkpointer(d, **groups(CKPT_KNOBS)) as ckpt:
        ckpt.save(state, step=step).wait(WAIT_S)
    size = os.path.getsize(d / f"step_{step:010d}" / "rank_00000.lzc")
    shutil.rmtree(d)
    return -(-size // 4096)


def test_disk_full_exactly_at_the_manifest(tmpfs, tmp_path):
    """The data file fits to the page and the manifest does not: the failure
    comes from the commit, and the partial step must still be removed at once
    (its data holds the disk's last free pages)."""
    d = tmpfs / "run"
    state = tensor_state(2 << 20, 5)
    pages = _data_file_pages(tmp_path, state, 2)
    with lazyckpt.Checkpointer(d, **groups(CKPT_KNOBS)) as ckpt:
        ckpt.save({"n": 1}, step=1).wait(WAIT_S)
        fill(tmpfs / "filler", free_bytes(tmpfs) - pages * 4096)
        assert free_bytes(tmpfs) == pages * 4096
        with pytest.raises(lazyckpt.CheckpointWriteError) as info:
            ckpt.save(state, step=2).wait(WAIT_S)
        assert info.value.step == 2 and "No space left" in str(info.value)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert ckpt.steps() == [1]
        assert leftovers(d) == [], "the failed step's temporary directory was not removed"
        assert free_bytes(tmpfs) == pages * 4096, "the failed step's data still holds the space"
        os.unlink(tmpfs / "filler")
        ckpt.save(state, step=3).wait(WAIT_S)
        assert ckpt.steps() == [1, 3]


def test_disk_full_exactly_at_latest(tmpfs, tmp_path):
    """Data and manifest fit, the advisory ``latest`` does not. The outcome the
    caller sees must agree with the disk: wait() raises exactly when the step
    is not committed."""
    d = tmpfs / "run"
    state = tensor_state(2 << 20, 6)
    pages = _data_file_pages(tmp_path, state, 2)
    with lazyckpt.Checkpointer(d, **groups(CKPT_KNOBS)) as ckpt:
        ckpt.save({"n": 1}, step=1).wait(WAIT_S)
        fill(tmpfs / "filler", free_bytes(tmpfs) - (pages + 1) * 4096)
        error = None
        try:
            ckpt.save(state, step=2).wait(WAIT_S)
        except lazyckpt.CheckpointError as exc:
            error = exc
        committed = 2 in ckpt.steps()
        assert committed == (error is None), (
            f"step 2 committed={committed} but wait() "
            f"{'raised ' + repr(str(error)) if error else 'returned'}")
        assert leftovers(d) == [] or all(n.startswith("latest.tmp-") for n in leftovers(d))


# --------------------------------------------------------------------------- injected faults


def _count_writes(monkeypatch, state, knobs, path) -> int:
    """How many times one save of ``state`` calls the write seam."""
    calls = []
    real = fileio.OutputFile.pwrite_all

    def counting(self, data, offset):
        calls.append(len(data))
        return real(self, data, offset)
    monkeypatch.setattr(fileio.OutputFile, "pwrite_all", counting)
    lazyckpt.save(state, path, **knobs)
    monkeypatch.setattr(fileio.OutputFile, "pwrite_all", real)
    return len(calls)


def _failing_seam(monkeypatch, fail_at: int, mode: str, err: int = errno.EIO):
    """Replace the single write call: call ``fail_at`` (1-based) fails.

    raise:       raises OSError(err) without writing
    half+raise:  writes the first half, then raises OSError(err)
    """
    real = fileio.OutputFile.pwrite_all
    state = {"n": 0, "failed": 0}

    def seam(self, data, offset):
        state["n"] += 1
        if state["n"] == fail_at:
            state["failed"] += 1
            if mode == "half+raise":
                real(self, data[:len(data) // 2], offset)
            raise OSError(err, os.strerror(err), self.path)
        return real(self, data, offset)
    monkeypatch.setattr(fileio.OutputFile, "pwrite_all", seam)
    return state


INJECT_KNOBS = dict(host_cache_bytes=32 << 10, chunk_bytes=8192, writer_threads=2)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("mode,err", [("raise", errno.EIO), ("half+raise", errno.EIO),
                                      ("raise", errno.ENOSPC)])
def test_write_error_at_the_seam_checkpointer(tmp_path, monkeypatch, where, mode, err):
    state = tensor_state(100_000, 7)
    total = _count_writes(monkeypatch, state, INJECT_KNOBS, tmp_path / "count.lzc")
    assert total >= 4
    fail_at = {"first": 1, "middle": total // 2, "last": total}[where]
    d = tmp_path / "run"
    with lazyckpt.Checkpointer(d, **groups(INJECT_KNOBS)) as ckpt:
        ckpt.save({"before": torch.ones(3)}, step=1).wait(WAIT_S)
        seam = _failing_seam(monkeypatch, fail_at, mode, err)
        handle = ckpt.save(state, step=2)
        with pytest.raises(lazyckpt.CheckpointWriteError) as info:
            handle.wait(WAIT_S)
        monkeypatch.undo()
        assert seam["failed"] == 1
        assert info.value.step == 2 and os.strerror(err) in str(info.value)
        assert ckpt.steps() == [1] and leftovers(d) == []
        ckpt.wait(WAIT_S)                     # already reported through the handle
        ckpt.save(state, step=3).wait(WAIT_S)
        assert_same(ckpt.load(step=3), state)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_write_error_at_the_seam_functional(tmp_path, monkeypatch, where):
    state = tensor_state(100_000, 8)
    total = _count_writes(monkeypatch, state, INJECT_KNOBS, tmp_path / "count.lzc")
    path = tmp_path / "f.lzc"
    old = {"old": torch.arange(5)}
    lazyckpt.save(old, path, **INJECT_KNOBS)
    old_bytes = path.read_bytes()
    _failing_seam(monkeypatch, {"first": 1, "middle": total // 2, "last": total}[where], "half+raise")
    with pytest.raises(lazyckpt.CheckpointWriteError, match="Input/output error"):
        lazyckpt.save(state, path, **INJECT_KNOBS)
    monkeypatch.undo()
    assert path.read_bytes() == old_bytes
    assert sorted(os.listdir(tmp_path)) == ["count.lzc", "f.lzc"]
    assert_same(lazyckpt.load(path), old)


def test_write_error_with_the_smallest_cache_does_not_hang(tmp_path, monkeypatch):
    """Two cache chunks, one writer: the failing writer must not leave capture
    waiting forever for a chunk."""
    knobs = dict(host_cache_bytes=8192, chunk_bytes=4096, writer_threads=1, max_pending_saves=1)
    state = tensor_state(1 << 20, 9)
    with lazyckpt.Checkpointer(tmp_path / "run", **groups(knobs)) as ckpt:
        _failing_seam(monkeypatch, 2, "raise", errno.EIO)
        handles = [ckpt.save(state, step=1)]
        t = time.monotonic()
        with pytest.raises(lazyckpt.CheckpointWriteError):
            handles[0].wait(WAIT_S)
            ckpt.wait_for_snapshot(WAIT_S)
        assert time.monotonic() - t < 30
        monkeypatch.undo()
        ckpt.save(state, step=2).wait(WAIT_S)
        assert ckpt.steps() == [2]


@pytest.fixture
def short_pwrite(monkeypatch):
    """os.pwrite (as fileio calls it) writes at most half of what it is given:
    legal POSIX behaviour that the single write call must loop over."""
    real = os.pwrite
    stats = {"short": 0}

    def pwrite(fd, data, offset):
        n = len(data)
        if n > 1:
            k = n // 2 // 4096 * 4096 if n >= 8192 else n // 2   # keep O_DIRECT alignment when it can
            stats["short"] += 1
            return real(fd, memoryview(data)[:k], offset)
        return real(fd, data, offset)
    monkeypatch.setattr(fileio.os, "pwrite", pwrite)
    return stats


@pytest.mark.parametrize("o_direct", [True, False])
def test_short_writes_are_completed(tmp_path, short_pwrite, o_direct):
    state = tensor_state(300_000, 10)
    knobs = dict(INJECT_KNOBS, o_direct=o_direct)
    with lazyckpt.Checkpointer(tmp_path / "run", **groups(knobs)) as ckpt:
        ckpt.save(state, step=1).wait(WAIT_S)
    path = tmp_path / "f.lzc"
    lazyckpt.save(state, path, **knobs)
    assert short_pwrite["short"] > 10
    assert_same(lazyckpt.load(str(tmp_path / "run")), state)
    assert_same(lazyckpt.load(path), state)


def test_write_returning_zero_is_an_error_not_a_loop(tmp_path, monkeypatch):
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd, data, offset):
        calls["n"] += 1
        return 0 if calls["n"] > 3 else real(fd, data, offset)
    monkeypatch.setattr(fileio.os, "pwrite", pwrite)
    with lazyckpt.Checkpointer(tmp_path / "run", **groups(INJECT_KNOBS)) as ckpt:
        with pytest.raises(lazyckpt.CheckpointWriteError, match="step 1"):
            ckpt.save(tensor_state(100_000, 11), step=1).wait(WAIT_S)
        monkeypatch.undo()
        assert ckpt.steps() == [] and leftovers(tmp_path / "run") == []
    assert calls["n"] < 1000


def test_a_lying_write_is_caught_by_the_checksums(tmp_path, monkeypatch):
    """A lower layer that reports success but drops half the bytes cannot be
    noticed by the writer; the checkpoint commits, but loading it must fail
    loudly (checksums computed from memory, not from disk) and never return
    wrong data."""
    real = fileio.OutputFile.pwrite_all
    state = {"n": 0}

    def lying(self, data, offset):
        state["n"] += 1
        if state["n"] == 3:
            return real(self, data[:len(data) // 2], offset)
        return real(self, data, offset)
    monkeypatch.setattr(fileio.OutputFile, "pwrite_all", lying)
    saved = tensor_state(100_000, 12)
    with lazyckpt.Checkpointer(tmp_path / "run", **groups(INJECT_KNOBS, writer_threads=1)) as ckpt:
        ckpt.save(saved, step=1).wait(WAIT_S)
        monkeypatch.undo()
        with pytest.raises(lazyckpt.CorruptCheckpointError, match="checksum") as info:
            ckpt.load(step=1)
        assert info.value.entry == "w"


def test_fsync_failure_of_the_data_file(tmp_path, monkeypatch):
    def failing_finish(self, size):
        raise OSError(errno.EIO, os.strerror(errno.EIO), self.path)
    with lazyckpt.Checkpointer(tmp_path / "run", **groups(INJECT_KNOBS)) as ckpt:
        ckpt.save({"a": torch.ones(2)}, step=1).wait(WAIT_S)
        monkeypatch.setattr(fileio.OutputFile, "finish", failing_finish)
        with pytest.raises(lazyckpt.CheckpointWriteError, match="Input/output error") as info:
            ckpt.save(tensor_state(50_000, 13), step=2).wait(WAIT_S)
        monkeypatch.undo()
        assert info.value.step == 2
        assert ckpt.steps() == [1] and leftovers(tmp_path / "run") == []


@pytest.mark.parametrize("what", ["manifest", "dir-fsync"])
def test_commit_failure_before_the_rename_removes_the_step(tmp_path, monkeypatch, what):
    """FORMAT.md 11.3: if any of steps 1 to 6 fails, the writer removes the
    temporary directory. (Without this, a disk that fills at the manifest keeps
    the whole data file until another process opens the directory.)"""
    d = tmp_path / "run"
    real_write, real_fsync = lazyckpt.storage.layout.write_file_atomic, lazyckpt.storage.layout.fsync_dir

    def write(path, data):
        if what == "manifest" and os.path.basename(path) == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_write(path, data)

    def fsync(path):
        if what == "dir-fsync" and os.path.basename(path).startswith(".tmp-step_"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        return real_fsync(path)
    with lazyckpt.Checkpointer(d, **groups(INJECT_KNOBS)) as ckpt:
        ckpt.save({"a": torch.ones(2)}, step=1).wait(WAIT_S)
        monkeypatch.setattr(lazyckpt.storage.layout, "write_file_atomic", write)
        monkeypatch.setattr(lazyckpt.storage.layout, "fsync_dir", fsync)
        with pytest.raises(lazyckpt.CheckpointWriteError) as info:
            ckpt.save(tensor_state(50_000, 14), step=2).wait(WAIT_S)
        monkeypatch.undo()
        assert info.value.step == 2
        assert ckpt.steps() == [1]
        assert leftovers(d) == [], f"left behind: {leftovers(d)}"
        ckpt.save(tensor_state(50_000, 14), step=2).wait(WAIT_S)      # the step can be retried
        assert ckpt.steps() == [1, 2]


def test_latest_that_cannot_be_written_does_not_misreport_a_committed_step(tmp_path):
    """``latest`` is advisory (FORMAT.md 11.1). Here it is a directory, so it
    cannot be replaced. wait() must not report a failed checkpoint for a step
    that is committed: the outcome the caller sees must match the disk."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "latest").mkdir()
    with lazyckpt.Checkpointer(d, **groups(INJECT_KNOBS)) as ckpt:
        error = None
        try:
            ckpt.save({"a": torch.ones(2)}, step=1).wait(WAIT_S)
        except lazyckpt.CheckpointError as exc:
            error = exc
        committed = 1 in ckpt.steps()
        assert committed == (error is None), (
            f"step 1 committed={committed} but wait() {'raised ' + repr(str(error)) if error else 'returned'}")


# --------------------------------------------------------------------------- read-only, paths


def test_read_only_file_system(tmpfs):
    d = tmpfs / "run"
    state = tensor_state(100_000, 15)
    with lazyckpt.Checkpointer(d, **groups(CKPT_KNOBS)) as ckpt:
        ckpt.save(state, step=1).wait(WAIT_S)
        lazyckpt.save(state, tmpfs / "f.lzc", **CKPT_KNOBS)
        r = _try(["mount", "-o", "remount,ro", str(tmpfs)])
        if r.returncode != 0:
            pytest.skip(f"remount read-only refused: {r.stderr.strip()}")
        try:
            # An open Checkpointer whose file system turns read-only: the save fails, reported.
            t = time.monotonic()
            with pytest.raises(lazyckpt.CheckpointWriteError, match="Read-only file system") as info:
                ckpt.save(state, step=2).wait(WAIT_S)
            assert info.value.step == 2 and time.monotonic() - t < 30
            assert ckpt.steps() == [1]
            # Opening for writing is refused at once.
            with pytest.raises(lazyckpt.CheckpointError, match="not writable"):
                lazyckpt.Checkpointer(d)
            with pytest.raises(lazyckpt.CheckpointError):
                lazyckpt.Checkpointer(tmpfs / "new-run")
            with pytest.raises(lazyckpt.CheckpointWriteError, match="Read-only file system"):
                lazyckpt.save(state, tmpfs / "f.lzc", **CKPT_KNOBS)
            with pytest.raises(lazyckpt.CheckpointWriteError, match="Read-only file system"):
                lazyckpt.save(state, tmpfs / "g.lzc", **CKPT_KNOBS)
            # Reading still works.
            assert_same(lazyckpt.load(str(d)), state)
            assert_same(lazyckpt.load(tmpfs / "f.lzc"), state)
        finally:
            _try(["mount", "-o", "remount,rw", str(tmpfs)])
        ckpt.save(state, step=3).wait(WAIT_S)
        assert ckpt.steps() == [1, 3] and leftovers(d) == []


def test_missing_parent_directory(tmp_path):
    with pytest.raises(lazyckpt.CheckpointError, match="does not exist"):
        lazyckpt.save({"a": 1}, tmp_path / "missing" / "x.lzc")
    assert not (tmp_path / "missing").exists()
    # A Checkpointer creates its directory, parents included.
    with lazyckpt.Checkpointer(tmp_path / "a" / "b" / "c") as ckpt:
        ckpt.save({"a": 1}, step=1).wait(WAIT_S)
    assert lazyckpt.load(str(tmp_path / "a" / "b" / "c")) == {"a": 1}
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(tmp_path / "missing" / "x.lzc")
    with pytest.raises(lazyckpt.CheckpointNotFoundError):
        lazyckpt.load(str(tmp_path / "missing"))


def test_a_file_where_a_directory_is_expected(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"not a directory")
    with pytest.raises(lazyckpt.CheckpointError):
        lazyckpt.Checkpointer(f)
    with pytest.raises(lazyckpt.CheckpointError):
        lazyckpt.Checkpointer(f / "sub")
    with pytest.raises(lazyckpt.CheckpointError):
        lazyckpt.save({"a": 1}, f / "x.lzc")
    assert f.read_bytes() == b"not a directory"
    # A directory where the checkpoint file should go.
    target = tmp_path / "adir"
    target.mkdir()
    with pytest.raises(lazyckpt.CheckpointError):
        lazyckpt.save({"a": torch.ones(3)}, target)
    assert target.is_dir() and not glob.glob(str(tmp_path / ".adir.tmp-*"))
    # A file squatting on a step directory's name: never listed, never overwritten.
    d = tmp_path / "run"
    with lazyckpt.Checkpointer(d) as ckpt:
        (d / "step_0000000003").write_bytes(b"squatter")
        assert ckpt.steps() == []
        with pytest.raises(lazyckpt.CheckpointError, match="step 3"):
            ckpt.save({"a": 1}, step=3).wait(WAIT_S)
        assert (d / "step_0000000003").read_bytes() == b"squatter"
        ckpt.save({"a": 2}, step=4).wait(WAIT_S)
        assert ckpt.steps() == [4] and leftovers(d) == []
