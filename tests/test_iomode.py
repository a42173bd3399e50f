"""The adaptive I/O mode (o_direct="auto"): each read and each write picks
O_DIRECT or buffered from what recent transfers in each mode got, per file
system and direction (a process's first load or save measures both side by
side, the mode not in use is measured again every EXPLORE_S, a mode that
slows is left); a buffered write in this mode is written back before it
counts. True/False force a mode and measure nothing."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import lazyckpt
from lazyckpt.storage import iomode
from test_io_modes import _data_opens

O_DIRECT = getattr(os, "O_DIRECT", 0)
pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
MiB = 1 << 20


@pytest.fixture
def fresh(monkeypatch):
    """Nothing measured yet in this process, and no mode forced by the environment."""
    monkeypatch.delenv("LAZYCKPT_O_DIRECT", raising=False)
    iomode.forget()
    yield
    iomode.forget()


def _state(mib: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(MiB // 4, generator=g) for i in range(mib)}     # 1 MiB each


def test_small_files_teach_nothing_and_leave_nothing(tmp_path, fresh):
    data = tmp_path / "data"
    data.mkdir()
    state = {"w": torch.randn(100_000), "i": torch.arange(10)}
    lazyckpt.save(state, data / "a.lzc")
    lazyckpt.save(state, data / "b.lzc")
    back = lazyckpt.load(data / "a.lzc")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    made = {c["direction"]: c for c in iomode.choices()}
    assert sorted(made) == ["read", "write"]
    for c in made.values():
        # Transfers of 0.4 MB are latency: no mode measured, O_DIRECT (the default) kept.
        assert c["direct_gbps"] is None and c["buffered_gbps"] is None and c["o_direct"] is True, c
    assert sorted(os.listdir(data)) == ["a.lzc", "b.lzc"]      # no probe file, no temporary


def test_a_first_save_writes_in_both_modes_side_by_side_and_keeps_the_faster(tmp_path, fresh, spy_open):
    """A process's first save measures both modes on its first chunks: the file
    is created once (O_TRUNC) and opened a second time, without truncating,
    for the other mode; its bytes are those a forced-mode save writes."""
    state = _state(16)
    path = tmp_path / "w.lzc"
    lazyckpt.save(state, path, chunk_bytes=2 * MiB, writer_threads=4)
    opens = [f for p, f in _data_opens(spy_open) if ".tmp-" in p and f & os.O_ACCMODE == os.O_WRONLY]
    assert sorted(bool(f & O_DIRECT) for f in opens) == [False, True], opens
    assert sum(bool(f & os.O_TRUNC) for f in opens) == 1, opens
    (write,) = [c for c in iomode.choices() if c["direction"] == "write"]
    assert write["direct_gbps"] > 0 and write["buffered_gbps"] > 0, write
    # Buffered is taken only if it ran SWITCH_MARGIN faster than the O_DIRECT transfers beside it.
    assert isinstance(write["o_direct"], bool)
    assert "adaptive" in write["reason"]
    reference = tmp_path / "ref.lzc"
    lazyckpt.save(state, reference, chunk_bytes=2 * MiB, o_direct=False, writer_threads=1)
    assert path.read_bytes() == reference.read_bytes()
    back = lazyckpt.load(path)
    assert all(torch.equal(back[k], v) for k, v in state.items())


def test_a_checkpointer_commit_in_auto_mode_survives_what_each_mode_wrote(tmp_path, fresh):
    """Steps written in both modes (the first save measures both) load whole,
    and an incremental step's references into them resolve."""
    state = _state(12)
    first = state["t0"].clone()
    with lazyckpt.Checkpointer(tmp_path / "run", io=lazyckpt.IO(chunk_bytes=2 * MiB), incremental=True) as ckpt:
        ckpt.save(state, step=1).wait()
        state["t0"] += 1
        ckpt.save(state, step=2).wait()
    for step, t0 in ((1, first), (2, state["t0"])):
        back = lazyckpt.load(tmp_path / "run" / f"step_{step:010d}")
        assert torch.equal(back["t0"], t0)
        assert all(torch.equal(back[k], state[k]) for k in state if k != "t0")


def test_a_first_load_reads_in_both_modes_side_by_side_and_keeps_the_faster(tmp_path, fresh, spy_open):
    """A process's first load measures both modes on its first large reads
    (each a real read of the file, through its own descriptor); the bytes are
    the same whichever mode read them."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(2 * MiB // 4, generator=g) for i in range(8)}   # 16 MiB, reads of 2-4 MiB
    path = tmp_path / "m.lzc"
    lazyckpt.save(state, path, o_direct=True, chunk_bytes=4 * MiB)
    spy_open.clear()
    back = lazyckpt.load(path, chunk_bytes=4 * MiB)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    reads = [f for p, f in _data_opens(spy_open) if p == str(path)]
    assert sorted(bool(f & O_DIRECT) for f in reads) == [False, True], reads   # one descriptor per mode
    (read,) = [c for c in iomode.choices() if c["direction"] == "read"]
    assert read["direct_gbps"] > 0 and read["buffered_gbps"] > 0, read
    # Buffered is taken only if it ran SWITCH_MARGIN faster than the O_DIRECT transfers beside it.
    assert isinstance(read["o_direct"], bool)
    assert "adaptive" in read["reason"]
    # The next load within EXPLORE_S reads in the mode kept only.
    spy_open.clear()
    back = lazyckpt.load(path, chunk_bytes=4 * MiB)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    reads = [f for p, f in _data_opens(spy_open) if p == str(path)]
    assert [bool(f & O_DIRECT) for f in reads] == [read["o_direct"]], reads


def test_a_buffered_measure_of_bytes_in_the_page_cache_is_not_a_measure_of_the_disk(tmp_path, fresh):
    """A file just written buffered is in the page cache: a buffered read of it
    is a copy from memory. Measured as the disk's buffered speed, judged
    against O_DIRECT reads of the disk, it sent a bench's first repetition
    buffered (BENCHMARKS section 34). Such reads run buffered and teach nothing."""
    state = _state(16)
    path = tmp_path / "cached.lzc"
    lazyckpt.save(state, path, o_direct=False, chunk_bytes=4 * MiB)     # its pages stay cached
    back = lazyckpt.load(path, chunk_bytes=4 * MiB)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    (read,) = [c for c in iomode.choices() if c["direction"] == "read"]
    # (Each read that would have measured ran buffered, from memory, and the
    # next measured instead: a file wholly cached is read from the cache.)
    assert read["buffered_gbps"] is None and read["o_direct"] is True, read


def test_in_page_cache_tells_a_cached_page_from_one_on_disk(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 * MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)      # clean pages: dropped
        if iomode.in_page_cache(fd, 2 * MiB):
            pytest.skip("this file system keeps the pages (tmpfs?)")
        os.pread(fd, 4096, 2 * MiB)
        assert iomode.in_page_cache(fd, 2 * MiB)
    finally:
        os.close(fd)


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _batch(tracker, clock, gbps_of, threads=4, nbytes=32 * MiB):
    """``threads`` transfers side by side, as the reader runs them: each picks
    its mode, then all run over the same interval at the speed of their mode;
    returns the modes picked."""
    picks = [tracker.pick(nbytes) for _ in range(threads)]
    start = clock.now
    for mode, measuring in picks:
        tracker.observe(mode, measuring, nbytes, start, start + nbytes / (gbps_of[mode] * 1e9))
    clock.now += max(nbytes / (gbps_of[m] * 1e9) for m, _ in picks)
    return [m for m, _ in picks]


def test_the_tracker_takes_the_other_mode_only_when_it_ran_faster_beside_the_mode_in_use(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    # The first transfer measures buffered beside three O_DIRECT ones; O_DIRECT is faster: kept.
    assert _batch(tracker, clock, {True: 3.0, False: 1.2}) == [False, True, True, True]
    modes = sum((_batch(tracker, clock, {True: 3.0, False: 1.2}) for _ in range(20)), [])
    assert modes == [True] * 80                     # not measured again within EXPLORE_S
    # Later the disk favours buffered transfers: the next measure finds it, and they are taken.
    clock.now += iomode.EXPLORE_S
    assert _batch(tracker, clock, {True: 0.5, False: 1.8}) == [False, True, True, True]
    assert tracker.as_choice().o_direct is False
    modes = sum((_batch(tracker, clock, {True: 0.5, False: 1.8}) for _ in range(5)), [])
    # One O_DIRECT read confirms the switch after RECENT_FOR_DROP buffered ones; buffered is kept.
    assert modes.count(True) == 1 and modes.index(True) == iomode.RECENT_FOR_DROP, modes
    assert tracker.mode is False
    # A measure only a little faster (under SWITCH_MARGIN) changes nothing: noise does not flip it.
    clock.now += iomode.EXPLORE_S
    _batch(tracker, clock, {True: 1.9, False: 1.8})
    assert tracker.as_choice().o_direct is False


def test_a_measure_is_judged_against_what_ran_beside_it_not_against_averages(monkeypatch):
    """O_DIRECT transfers at a load's end ran alone and slow; a buffered measure
    at the next load's start, beside O_DIRECT transfers as fast as it, must not
    flip the mode (an average of the tail against one lucky start did)."""
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    _batch(tracker, clock, {True: 2.0, False: 1.0})
    for _ in range(6):
        _batch(tracker, clock, {True: 2.0, False: 1.0})
    for _ in range(6):
        _batch(tracker, clock, {True: 0.4, False: 0.4}, threads=1)     # a slow tail, one at a time
    clock.now += iomode.EXPLORE_S
    assert _batch(tracker, clock, {True: 0.9, False: 0.9}) == [False, True, True, True]
    assert tracker.as_choice().o_direct is True


def test_the_tracker_measures_the_other_mode_once_per_period_or_when_the_mode_in_use_slows(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    measured = 0
    for _ in range(int(3 * iomode.EXPLORE_S)):           # a batch a second for three periods
        measured += _batch(tracker, clock, {True: 2.0, False: 1.0}).count(False)
        clock.now += 1
    assert measured == 3                                # the first, then one per period
    # The mode in use slows to a fifth: measured again at once (after DROP_GAP_S), not a period later.
    clock.now += iomode.DROP_GAP_S
    modes = sum((_batch(tracker, clock, {True: 0.4, False: 1.0}) for _ in range(4)), [])
    assert False in modes and tracker.as_choice().o_direct is False
    # Small transfers (latency) neither measure nor teach.
    clock.now += 10 * iomode.EXPLORE_S
    assert tracker.pick(64 * 1024) == (False, False)
    # One measure at a time; a failed one (0 bytes) ends without teaching, the mode
    # unchanged, and the next measure comes a period later.
    assert tracker.pick(32 * MiB) == (True, True)
    assert tracker.pick(32 * MiB) == (False, False)
    tracker.observe(True, True, 0, clock.now, clock.now + 0.01)
    assert tracker.pick(32 * MiB) == (False, False)
    clock.now += iomode.EXPLORE_S + 1
    assert tracker.pick(32 * MiB) == (True, True)


def test_a_file_system_refusing_o_direct_reads_buffered_from_then_on(tmp_path, fresh, monkeypatch):
    """Where O_DIRECT is refused at open (tmpfs before Linux 6.6), the first
    load falls back and every later read is buffered, never tried again."""
    state = {"w": torch.randn(MiB), "v": torch.randn(MiB)}
    path = tmp_path / "s.lzc"
    lazyckpt.save(state, path, o_direct=False, chunk_bytes=MiB)
    real_open, tried = os.open, []

    def refusing_open(p, flags, *args, **kwargs):
        if flags & O_DIRECT:
            tried.append(p)
            raise OSError(errno.EINVAL, "Invalid argument", p)
        return real_open(p, flags, *args, **kwargs)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "open", refusing_open)
    for _ in range(3):
        back = lazyckpt.load(path, chunk_bytes=MiB)
        assert all(torch.equal(back[k], v) for k, v in state.items())
    assert len(tried) == 1, tried
    (read,) = [c for c in iomode.choices() if c["direction"] == "read"]
    assert read["o_direct"] is False and "refuses O_DIRECT" in read["reason"]


def test_forced_modes_measure_nothing(tmp_path, fresh, monkeypatch, spy_open):
    state = _state(8)
    lazyckpt.save(state, tmp_path / "d.lzc", o_direct=True, chunk_bytes=2 * MiB)
    lazyckpt.save(state, tmp_path / "b.lzc", o_direct=False, chunk_bytes=2 * MiB)
    monkeypatch.setenv("LAZYCKPT_O_DIRECT", "0")
    lazyckpt.load(tmp_path / "d.lzc")
    opens = _data_opens(spy_open)
    assert all(f & O_DIRECT for p, f in opens if "d.lzc" in p and ".tmp-" in p)
    assert not any(f & O_DIRECT for p, f in opens if "b.lzc" in p)
    assert not any(f & O_DIRECT for p, f in opens if p.endswith("d.lzc"))     # the load, forced buffered
    assert iomode.choices() == []


def test_bad_knob_values_are_refused():
    with pytest.raises(ValueError, match="o_direct"):
        lazyckpt.Options(o_direct="sometimes")
    assert lazyckpt.Options(o_direct="0").o_direct is False
    assert lazyckpt.Options(o_direct="AUTO").o_direct == "auto"


def test_a_measure_not_of_the_disk_is_taken_again_at_the_next_transfer(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    assert tracker.pick(32 * MiB) == (False, True)
    tracker.not_a_measure()
    tracker.observe(False, False, 32 * MiB, clock.now, clock.now + 0.001)     # ran, from memory
    assert tracker.as_choice().buffered_gbps is None and tracker.mode is True
    assert tracker.pick(32 * MiB) == (False, True)          # the next transfer measures


def test_a_switch_on_a_lucky_measure_is_undone_within_the_drop_gap_not_a_period_later(monkeypatch):
    """A buffered measure ran 2.5x the O_DIRECT reads beside it, then buffered
    reads run at half O_DIRECT's speed: O_DIRECT is measured again once they
    have run under DROP of that measure, and (the bias beside buffered reads
    is against it) taken back at RETURN_MARGIN, not SWITCH_MARGIN."""
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    _batch(tracker, clock, {True: 1.0, False: 2.5})
    assert tracker.mode is False
    switched_at = clock.now
    while not tracker.mode and clock.now - switched_at < iomode.EXPLORE_S:
        _batch(tracker, clock, {True: 1.0, False: 0.5})
        clock.now += 0.25
    assert tracker.mode is True
    assert clock.now - switched_at < iomode.DROP_GAP_S + 2


def test_o_direct_is_taken_back_at_a_smaller_margin_than_buffered_is_taken(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    _batch(tracker, clock, {True: 1.0, False: 1.5})             # buffered 1.5x: under SWITCH_MARGIN
    assert tracker.mode is True
    clock.now += iomode.EXPLORE_S
    _batch(tracker, clock, {True: 0.5, False: 1.5})             # 3x: buffered taken
    assert tracker.mode is False
    clock.now += iomode.EXPLORE_S
    _batch(tracker, clock, {True: 2.0, False: 1.5})             # O_DIRECT 1.33x beside buffered: taken back
    assert tracker.mode is True


def test_a_switch_to_buffered_is_confirmed_by_measuring_o_direct_again_soon(monkeypatch):
    """Buffered reads after the switch do not slow (no DROP) but O_DIRECT now
    runs faster: O_DIRECT is measured after RECENT_FOR_DROP buffered reads,
    not EXPLORE_S later, and taken back; a switch back to O_DIRECT asks no
    such confirmation."""
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker("read", 1, "/disk")
    _batch(tracker, clock, {True: 1.0, False: 2.5})
    assert tracker.mode is False
    modes = sum((_batch(tracker, clock, {True: 3.0, False: 2.0}) for _ in range(3)), [])
    assert modes.count(True) == 1 and tracker.mode is True, modes
    modes = sum((_batch(tracker, clock, {True: 3.0, False: 2.0}) for _ in range(10)), [])
    assert modes == [True] * 40                     # no confirmation of O_DIRECT


def _file_off_the_page_cache(tmp_path, cached: int = 0):
    """A 32 MiB file of random bytes (and the bytes) on disk, none of it in
    the page cache but its first ``cached`` bytes."""
    path = tmp_path / "f"
    data = os.urandom(32 * MiB)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if cached:
            # Those bytes only: without FADV_RANDOM the kernel's readahead sometimes
            # cached the next ones too (a test failed 4 runs in 6).
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, cached, 0)
    finally:
        os.close(fd)
    return path, data


def _reads_of_one_transfer(path, data, monkeypatch) -> list:
    """(O_DIRECT?, offset, length) of each read that one 32 MiB ``read_into``
    of ``path`` made, in this process's first transfer; its bytes checked."""
    from lazyckpt.storage import fileio
    calls = []
    real = fileio.InputFile.read_into

    def recording(self, buf, offset):
        calls.append((self.direct, offset, len(buf)))
        return real(self, buf, offset)
    monkeypatch.setattr(fileio.InputFile, "read_into", recording)
    f = iomode.open_local_input(str(path), lazyckpt.Options())
    try:
        buf = memoryview(fileio.anonymous_buffer(32 * MiB, huge_pages=False))
        assert f.read_into(buf, 0) == 32 * MiB
        assert bytes(buf) == data
    finally:
        f.close()
    return calls


def test_a_measure_moves_only_its_first_bytes_in_the_other_mode(tmp_path, fresh, monkeypatch):
    """A process's first 32 MiB read measures buffered on its first
    MEASURE_BYTES only; the rest is read with O_DIRECT (the mode in use),
    and the bytes are the file's."""
    calls = _reads_of_one_transfer(*_file_off_the_page_cache(tmp_path), monkeypatch)
    m = iomode.MEASURE_BYTES
    assert calls == [(False, 0, m), (True, m, 32 * MiB - m)], calls


def test_a_measure_after_one_served_by_the_page_cache_also_moves_only_its_first_bytes(tmp_path, fresh, monkeypatch):
    """The first 4 MiB of a read are in the page cache: its measure is not
    one, and the next 4 MiB measure instead; the rest is read with O_DIRECT."""
    m = iomode.MEASURE_BYTES
    calls = _reads_of_one_transfer(*_file_off_the_page_cache(tmp_path, cached=m), monkeypatch)
    assert calls == [(False, 0, m), (False, m, m), (True, 2 * m, 32 * MiB - 2 * m)], calls
