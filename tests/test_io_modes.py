"""The I/O paths: O_DIRECT or buffered, one or several writer threads, tiny
chunks and caches (entries straddling many chunks, unaligned tails), tmpfs,
O_DIRECT refusals and the LAZYCKPT_* environment variables."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import threading

import numpy as np
import pytest
import torch

import lazyckpt
import lazyckpt.storage.fileio
from lzc_tools import TRAILER, assert_same, assert_same_aliasing, parse
from _groups import groups

O_DIRECT = getattr(os, "O_DIRECT", 0)
pytestmark = pytest.mark.skipif(not O_DIRECT, reason="O_DIRECT is Linux-only")

# Byte sizes around page and chunk boundaries (chunks are 8 KiB in the small knob sets).
ODD_SIZES = [1, 3, 4095, 4096, 4097, 8191, 8192, 8193, 3 * 8192 + 5, 65_537]


def odd_state():
    g = torch.Generator().manual_seed(7)
    state = {f"u8_{n}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in ODD_SIZES}
    big = torch.randn(40_001, generator=g)                       # 160004 bytes
    state.update({
        "big": big, "big_view": big[100:30_000:3], "f16": torch.randn(1001, generator=g).half(),
        "np": np.arange(12_345, dtype=np.int32), "raw": bytes(range(256)) * 77,
        "empty": torch.empty(0), "nested": {"c": torch.randn(3, 5, dtype=torch.complex64, generator=g)},
    })
    return state


def _check_file(path, returned_size):
    p = parse(path)
    size = os.path.getsize(path)
    assert returned_size == size == p.footer_offset + p.footer_length + TRAILER.size
    assert p.footer_offset % 4096 == 0
    assert all(e["offset"] % 4096 == 0 for e in p.doc["entries"])
    return p


def test_round_trip_in_every_io_mode(tmp_path, knobs):
    state = odd_state()
    path = tmp_path / "io.lzc"
    size = lazyckpt.save(state, path, **knobs)
    p = _check_file(path, size)
    out = lazyckpt.load(path, **knobs)
    assert_same(state, out)
    assert_same_aliasing(state, out)
    if "chunk_bytes" in knobs:
        opts = lazyckpt.Options(**knobs)
        from lazyckpt.api import SYNC_HOST_CACHE_BYTES
        assert p.doc["block_bytes"] == opts.chunk_bytes_for(opts.host_cache_bytes or SYNC_HOST_CACHE_BYTES)
    # The same bytes as the simplest path (buffered, one thread) with the same chunking.
    simple = dict(knobs, o_direct=False, writer_threads=1)
    reference = tmp_path / "ref.lzc"
    lazyckpt.save(state, reference, **simple)
    assert path.read_bytes() == reference.read_bytes()


def test_checkpointer_round_trip_in_every_io_mode(tmp_path, knobs, no_leaked_threads):
    state = odd_state()
    with lazyckpt.Checkpointer(tmp_path / "run", **groups(knobs)) as ckpt:
        handle = ckpt.save(state, step=3)
        handle.wait()
        data_file = tmp_path / "run" / "step_0000000003" / "rank_00000.lzc"
        _check_file(data_file, handle.bytes)
        out = ckpt.load(step=3)
    assert_same(state, out)


def _data_opens(calls):
    """Opens of checkpoint data files for bulk I/O (not directories, not
    manifests, not the small buffered header/footer read, which opens the file
    non-blocking to refuse FIFOs, not the save's lease, which opens it
    read-write only to lock it, not the O_PATH hold on a file a save
    replaces, which moves no byte)."""
    return [(p, f) for p, f in calls
            if (p.endswith(".lzc") or ".lzc.tmp-" in p) and not f & os.O_NONBLOCK
            and f & os.O_ACCMODE != os.O_RDWR and not f & getattr(os, "O_PATH", 0)]


def test_o_direct_is_really_used_and_really_avoided(tmp_path, spy_open):
    state = {"w": torch.randn(10_000)}
    lazyckpt.save(state, tmp_path / "d.lzc", o_direct=True)
    lazyckpt.load(tmp_path / "d.lzc", o_direct=True)
    opens = _data_opens(spy_open)
    assert len(opens) >= 2 and all(f & O_DIRECT for _, f in opens), opens
    spy_open.clear()
    lazyckpt.save(state, tmp_path / "b.lzc", o_direct=False)
    lazyckpt.load(tmp_path / "b.lzc", o_direct=False)
    opens = _data_opens(spy_open)
    assert len(opens) >= 2 and not any(f & O_DIRECT for _, f in opens), opens


def test_env_var_o_direct_0_is_honoured(tmp_path, spy_open, monkeypatch):
    monkeypatch.setenv("LAZYCKPT_O_DIRECT", "0")
    assert lazyckpt.Options().o_direct == "auto"               # the dataclass default...
    from lazyckpt.knobs import resolve
    assert resolve().o_direct is False                         # ...is overridden by the environment
    state = {"w": torch.randn(5000)}
    lazyckpt.save(state, tmp_path / "e.lzc")
    assert torch.equal(lazyckpt.load(tmp_path / "e.lzc")["w"], state["w"])
    with lazyckpt.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(state, step=1).wait()
        assert torch.equal(ckpt.load()["w"], state["w"])
    opens = _data_opens(spy_open)
    assert len(opens) >= 4 and not any(f & O_DIRECT for _, f in opens), opens
    # An explicit argument beats the environment.
    spy_open.clear()
    lazyckpt.save(state, tmp_path / "x.lzc", o_direct=True)
    assert all(f & O_DIRECT for _, f in _data_opens(spy_open))


def test_env_vars_for_sizes_are_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYCKPT_CHUNK_BYTES", "8192")
    monkeypatch.setenv("LAZYCKPT_HOST_CACHE_BYTES", "65536")
    monkeypatch.setenv("LAZYCKPT_WRITER_THREADS", "1")
    state = {"w": torch.randn(9000)}
    lazyckpt.save(state, tmp_path / "e.lzc")
    p = parse(tmp_path / "e.lzc")
    assert p.doc["block_bytes"] == 8192
    assert len(p.doc["entries"][0]["checksums"]) == 5            # 36000 bytes from offset 4096
    assert torch.equal(lazyckpt.load(tmp_path / "e.lzc")["w"], state["w"])
    assert parse(tmp_path / "e.lzc").doc["block_bytes"] == 8192
    lazyckpt.save(state, tmp_path / "k.lzc", chunk_bytes=16384)   # argument beats environment
    assert parse(tmp_path / "k.lzc").doc["block_bytes"] == 16384


def test_invalid_knobs_are_rejected(tmp_path):
    for bad in (dict(chunk_bytes=1000), dict(chunk_bytes=0), dict(host_cache_bytes=4096),
                dict(writer_threads=0), dict(queue_policy="drop"), dict(no_such_option=1)):
        with pytest.raises((ValueError, TypeError)):
            lazyckpt.save({"a": 1}, tmp_path / "x.lzc", **bad)
    assert not os.path.exists(tmp_path / "x.lzc")


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    d = tempfile.mkdtemp(prefix="lazyckpt-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("o_direct", [True, False])
def test_tmpfs_save_and_load(shm_dir, o_direct):
    state = odd_state()
    path = os.path.join(shm_dir, "shm.lzc")
    size = lazyckpt.save(state, path, o_direct=o_direct, chunk_bytes=8192, host_cache_bytes=32768)
    _check_file(path, size)
    assert_same(state, lazyckpt.load(path, o_direct=o_direct))
    with lazyckpt.Checkpointer(os.path.join(shm_dir, "run"), io=lazyckpt.IO(o_direct=o_direct)) as ckpt:
        ckpt.save(state, step=1).wait()
        assert_same(state, ckpt.load())


def _is_direct(fd):
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT)


def test_open_refusing_o_direct_falls_back(tmp_path, monkeypatch):
    """File systems that refuse O_DIRECT at open() (tmpfs before Linux 6.6) -> buffered."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "open", refusing_open)
    state = odd_state()
    size = lazyckpt.save(state, tmp_path / "f.lzc", o_direct=True, chunk_bytes=8192, host_cache_bytes=32768)
    _check_file(tmp_path / "f.lzc", size)
    assert_same(state, lazyckpt.load(tmp_path / "f.lzc", o_direct=True))


@pytest.mark.parametrize("writer_threads", [1, 4])
def test_write_refusing_o_direct_falls_back(tmp_path, monkeypatch, writer_threads):
    """File systems that accept O_DIRECT at open() but fail the first direct write with EINVAL."""
    real_pwrite = os.pwrite
    refused = []

    def refusing_pwrite(fd, data, offset):
        if _is_direct(fd):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "pwrite", refusing_pwrite)
    state = odd_state()
    path = tmp_path / "w.lzc"
    size = lazyckpt.save(state, path, o_direct=True, writer_threads=writer_threads, chunk_bytes=8192,
                         host_cache_bytes=32768)
    assert refused
    _check_file(path, size)
    monkeypatch.undo()
    assert_same(state, lazyckpt.load(path))


def test_concurrent_writers_all_fall_back_when_direct_writes_are_refused(tmp_path, monkeypatch):
    """Two writer threads both hold the O_DIRECT descriptor when the file system
    refuses direct writes. The first one falls back to buffered I/O; the
    second one's EINVAL (on the old descriptor) must be retried too, not raised.
    The injected fault orders the threads so this interleaving always happens."""
    real_pwrite = os.pwrite
    lock = threading.Lock()
    direct_calls = []
    second_arrived, buffered_done = threading.Event(), threading.Event()

    def choreographed_pwrite(fd, data, offset):
        if offset == 0:
            # The header, written first by the capture thread alone: let it through
            # so that the refusals meet the writer threads.
            return real_pwrite(fd, data, offset)
        if not _is_direct(fd):
            result = real_pwrite(fd, data, offset)
            buffered_done.set()
            return result
        with lock:
            direct_calls.append(offset)
            n = len(direct_calls)
        if n == 1:
            second_arrived.wait(5)          # let a second writer pick up the direct descriptor
        elif n == 2:
            second_arrived.set()
            buffered_done.wait(5)           # fail only after the first writer has fallen back
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(lazyckpt.storage.fileio.os, "pwrite", choreographed_pwrite)
    state = odd_state()
    path = tmp_path / "c.lzc"
    size = lazyckpt.save(state, path, o_direct=True, writer_threads=4, chunk_bytes=8192, host_cache_bytes=65536)
    assert len(direct_calls) >= 2 and second_arrived.is_set() and buffered_done.is_set()
    _check_file(path, size)
    monkeypatch.undo()
    assert_same(state, lazyckpt.load(path))


def test_read_refusing_o_direct_falls_back(tmp_path, monkeypatch):
    """The reader must cope with the same file systems as the writer: a direct
    read failing with EINVAL is retried buffered, not raised as a raw OSError."""
    state = odd_state()
    path = tmp_path / "r.lzc"
    lazyckpt.save(state, path, chunk_bytes=8192, host_cache_bytes=32768)
    real_preadv = os.preadv

    def refusing_preadv(fd, buffers, offset, *args):
        if _is_direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "preadv", refusing_preadv)
    assert_same(state, lazyckpt.load(path, o_direct=True))


def test_many_saves_reuse_the_host_cache(tmp_path):
    """Saving repeatedly through a tiny cache never corrupts earlier chunks."""
    g = torch.Generator().manual_seed(3)
    for i in range(5):
        state = {"x": torch.randn(5_000 + i * 1_001, generator=g), "i": i}
        lazyckpt.save(state, tmp_path / f"s{i}.lzc", chunk_bytes=8192, host_cache_bytes=16384, writer_threads=4)
        assert_same(state, lazyckpt.load(tmp_path / f"s{i}.lzc"))


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    """lazyckpt.save replaces the file atomically: a failed save leaves the old
    content and no temporary file (FORMAT.md 11.8)."""
    path = tmp_path / "keep.lzc"
    old = {"w": torch.arange(10_000)}
    lazyckpt.save(old, path, chunk_bytes=8192, host_cache_bytes=32768)
    before = path.read_bytes()
    real_pwrite = os.pwrite
    calls = []

    def failing_pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "pwrite", failing_pwrite)
    with pytest.raises(lazyckpt.CheckpointWriteError, match="No space left"):
        lazyckpt.save({"w": torch.randn(50_000)}, path, chunk_bytes=8192, host_cache_bytes=32768)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["keep.lzc"]
    assert torch.equal(lazyckpt.load(path)["w"], old["w"])


def test_functional_api_is_thread_safe_across_options(tmp_path):
    """lazyckpt.save/load share process-wide pools that are rebuilt when the
    options change; a load running in another thread must not be broken by a
    save (or load) that uses different options."""
    path = tmp_path / "shared.lzc"
    state = {"w": torch.randn(200_000)}
    lazyckpt.save(state, path)
    errors, done = [], threading.Event()

    def loader():
        while not done.is_set():
            try:
                assert torch.equal(lazyckpt.load(path)["w"], state["w"])
            except BaseException as e:          # noqa: BLE001 - collected and reported below
                errors.append(e)
                return

    thread = threading.Thread(target=loader)
    thread.start()
    try:
        for i in range(40):
            lazyckpt.save({"x": torch.ones(10)}, tmp_path / "other.lzc", chunk_bytes=8192 * (1 + i % 2))
            if errors:
                break
    finally:
        done.set()
        thread.join(60)
    assert not errors, f"concurrent load failed: {type(errors[0]).__name__}: {errors[0]!r}"


# -- a save over the last one: the old file's blocks freed off the save's path ----------

def _holders_of(inode: int, dev: int) -> list:
    """This process's descriptors on the file (device, inode)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.fstat(int(name))
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (dev, inode):
            out.append(int(name))
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "O_PATH"), reason="needs Linux")
def test_a_save_over_the_last_one_frees_the_old_file_on_the_release_thread(tmp_path, no_leaked_threads):
    """Replacing a file frees its blocks inside the rename: a synchronous TRIM
    on a file system mounted with ``discard`` (0.36 s for 0.8 GB on this
    machine's ext4). The save holds the old file across the rename and the
    release thread's close frees it: with that thread busy, the save still
    returns, the old file is an orphan this process holds, the new one loads;
    once the thread runs, nothing holds the old file."""
    path = tmp_path / "model.lzc"
    lazyckpt.save({"w": torch.zeros(1 << 16)}, path)
    old = os.stat(path)
    gate = threading.Event()
    busy = lazyckpt.storage.fileio._releaser.get().submit(gate.wait, 30)
    try:
        lazyckpt.save({"w": torch.ones(1 << 16)}, path)
        held = _holders_of(old.st_ino, old.st_dev)
        assert len(held) == 1 and os.fstat(held[0]).st_nlink == 0       # an orphan, held
        assert os.stat(path).st_ino != old.st_ino
        assert torch.equal(lazyckpt.load(path)["w"], torch.ones(1 << 16))
    finally:
        gate.set()
        busy.result(timeout=30)
    lazyckpt.storage.fileio.wait_for_releases(timeout=30)
    assert _holders_of(old.st_ino, old.st_dev) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "O_PATH"), reason="needs Linux")
def test_a_replace_that_fails_holds_nothing_and_leaves_both_names(tmp_path):
    """The rename refused (a directory in the way): the error is the caller's,
    the descriptor taken on the old name is closed, nothing is moved."""
    src, dst = tmp_path / "new", tmp_path / "dir"
    src.write_bytes(b"new")
    dst.mkdir()
    (dst / "inside").write_bytes(b"x")
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        lazyckpt.storage.fileio.replace_releasing_later(str(src), str(dst))
    lazyckpt.storage.fileio.wait_for_releases(timeout=30)
    assert sorted(os.listdir("/proc/self/fd")) == before
    assert src.read_bytes() == b"new" and (dst / "inside").read_bytes() == b"x"


def test_a_save_over_a_symlink_replaces_the_link_and_never_touches_its_target(tmp_path):
    """The descriptor held across the rename is on the link itself (O_NOFOLLOW):
    the file it pointed at is neither replaced nor held."""
    target = tmp_path / "elsewhere.lzc"
    lazyckpt.save({"w": torch.zeros(8)}, target)
    link = tmp_path / "model.lzc"
    link.symlink_to(target)
    lazyckpt.save({"w": torch.ones(8)}, link)
    lazyckpt.storage.fileio.wait_for_releases(timeout=30)
    assert not link.is_symlink()
    assert torch.equal(lazyckpt.load(link)["w"], torch.ones(8))
    assert torch.equal(lazyckpt.load(target)["w"], torch.zeros(8))
    st = os.stat(target)
    assert _holders_of(st.st_ino, st.st_dev) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd") or not hasattr(os, "O_PATH"), reason="needs Linux")
def test_a_removed_checkpoint_file_is_freed_on_the_release_thread(tmp_path):
    """The same cause, elsewhere: a store's ``delete_file`` (Lightning's top-k
    removal, on the training thread) drops the name at once and leaves the
    freeing of the blocks to the release thread."""
    from lazyckpt.storage.stores import for_path
    path = str(tmp_path / "epoch=1.ckpt")
    lazyckpt.save({"w": torch.zeros(1 << 16)}, path)
    old = os.stat(path)
    gate = threading.Event()
    busy = lazyckpt.storage.fileio._releaser.get().submit(gate.wait, 30)
    try:
        for_path(path).delete_file(path, lazyckpt.Options())
        assert not os.path.lexists(path)
        held = _holders_of(old.st_ino, old.st_dev)
        assert len(held) == 1 and os.fstat(held[0]).st_nlink == 0
    finally:
        gate.set()
        busy.result(timeout=30)
    lazyckpt.storage.fileio.wait_for_releases(timeout=30)
    assert _holders_of(old.st_ino, old.st_dev) == []
