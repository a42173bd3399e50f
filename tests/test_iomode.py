"""The adaptive I/O mode. With o_direct="auto", writes probe each file system
once, keep the faster mode, share the verdict with other processes for an
hour and leave nothing behind; reads choose per read, from what the reads in
each mode got (a process's first load measures both, the mode not in use is
measured again every EXPLORE_S, a mode that slows is left). True/False force
a mode."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

import lazyckpt
from lazyckpt.storage import iomode
from test_io_modes import _data_opens

O_DIRECT = getattr(os, "O_DIRECT", 0)
pytestmark = pytest.mark.skipif(not O_DIRECT, reason="no O_DIRECT on this platform")
MiB = 1 << 20


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty verdict cache of our own, and no choice remembered in this process."""
    cache = tmp_path / "cache" / "iomode.json"
    monkeypatch.setenv("LAZYCKPT_IOMODE_CACHE", str(cache))
    monkeypatch.delenv("LAZYCKPT_O_DIRECT", raising=False)
    iomode.forget()
    yield cache
    iomode.forget()


def test_auto_probes_writes_once_measures_reads_logs_and_leaves_nothing(tmp_path, fresh, caplog):
    data = tmp_path / "data"
    data.mkdir()
    state = {"w": torch.randn(100_000), "i": torch.arange(10)}
    with caplog.at_level(logging.INFO, logger="lazyckpt"):
        lazyckpt.save(state, data / "a.lzc")
        lazyckpt.save(state, data / "b.lzc")
        back = lazyckpt.load(data / "a.lzc")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    made = {c["direction"]: c for c in iomode.choices()}
    assert sorted(made) == ["read", "write"]
    write = made["write"]
    assert write["reason"].startswith("probed") and write["direct_gbps"] > 0 and write["buffered_gbps"] > 0
    assert write["o_direct"] == (write["direct_gbps"] >= write["buffered_gbps"])
    # Reads of 0.4 MB teach nothing (latency): no mode measured, O_DIRECT (the default) kept.
    assert made["read"]["direct_gbps"] is None and made["read"]["buffered_gbps"] is None
    probes = [r.getMessage() for r in caplog.records if "I/O mode for" in r.getMessage()]
    assert len(probes) == 1, probes                # writes: once per file system, not once per file
    assert sorted(os.listdir(data)) == ["a.lzc", "b.lzc"]      # the probe file never shows
    cached = json.loads(fresh.read_text())
    assert {k.split(":")[1] for k in cached} == {"write"}       # what reads find is not shared


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
    assert read["o_direct"] == (read["direct_gbps"] >= read["buffered_gbps"])
    assert "adaptive" in read["reason"]
    # The next load within EXPLORE_S reads in the mode kept only.
    spy_open.clear()
    back = lazyckpt.load(path, chunk_bytes=4 * MiB)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    reads = [f for p, f in _data_opens(spy_open) if p == str(path)]
    assert [bool(f & O_DIRECT) for f in reads] == [read["o_direct"]], reads


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _read(tracker, gbps_of, nbytes=32 * MiB):
    """One read as the reader does it: pick, then observe what that mode gets."""
    mode, exploring = tracker.pick(nbytes)
    tracker.observe(mode, exploring, nbytes, nbytes / (gbps_of[mode] * 1e9))
    return mode


def test_the_tracker_follows_a_disk_whose_faster_mode_changes(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker(1, "/disk")
    speeds = {True: 3.0, False: 1.2}
    # Nothing known: the first two reads measure one mode each.
    assert [tracker.pick(32 * MiB)[0], tracker.pick(32 * MiB)[0]] == [True, False]
    tracker.observe(True, True, 32 * MiB, 32 * MiB / 3.0e9)
    tracker.observe(False, True, 32 * MiB, 32 * MiB / 1.2e9)
    modes = [_read(tracker, speeds) for _ in range(50)]
    assert modes == [True] * 50                     # the faster kept; the other not measured again yet
    # Later (both measures old) the disk favours buffered reads: measured again, found.
    clock.now += iomode.EXPLORE_S + 1
    speeds = {True: 0.5, False: 1.8}
    modes = [_read(tracker, speeds) for _ in range(20)]
    assert modes[:2] == [True, False] and modes[2:] == [False] * 18, modes
    assert tracker.as_choice().o_direct is False
    # The mode in use slows below the other's last measure: left at once.
    speeds = {True: 0.5, False: 0.2}
    clock.now += 1
    modes = [_read(tracker, speeds) for _ in range(10)]
    assert modes[-5:] == [True] * 5, modes


def test_the_tracker_measures_the_mode_not_in_use_once_per_explore_period(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(iomode.time, "monotonic", clock)
    tracker = iomode.ModeTracker(1, "/disk")
    speeds = {True: 2.0, False: 1.0}
    modes = []
    for _ in range(int(3 * iomode.EXPLORE_S)):       # a read a second for three periods
        modes.append(_read(tracker, speeds))
        clock.now += 1
    assert modes.count(False) == 3, modes.count(False)   # the first, then one per period
    # Small reads (latency) neither explore nor teach.
    clock.now += 10 * iomode.EXPLORE_S
    assert tracker.pick(64 * 1024) == (True, False)
    # Reads in flight count: a second read while the first measure runs does not measure again.
    first = tracker.pick(32 * MiB)
    assert first == (True, True) and tracker.pick(32 * MiB) == (False, True)
    assert tracker.pick(32 * MiB) == (True, False)
    # A failed read (0 bytes) ends its measure without teaching.
    tracker.observe(True, True, 0, 0.01)
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


def test_a_recorded_verdict_is_used_by_the_next_process_without_probing(tmp_path, fresh):
    data = tmp_path / "data"
    data.mkdir()
    device = os.stat(data).st_dev
    record = {"direction": "write", "device": device, "where": str(data), "o_direct": False,
              "direct_gbps": 0.1, "buffered_gbps": 0.9, "reason": "probed 64 MiB", "at": time.time()}
    fresh.parent.mkdir(parents=True)
    fresh.write_text(json.dumps({f"{device}:write": record}))
    code = (
        "import os, sys, torch, lazyckpt\n"
        "from lazyckpt.storage import iomode\n"
        "def no(*a): raise AssertionError('probed although a fresh verdict exists')\n"
        "iomode._probe = no\n"
        "opened = []\n"
        "real = os.open\n"
        "lazyckpt.storage.fileio.os.open = lambda p, f, *a: (opened.append((str(p), f)), real(p, f, *a))[1]\n"
        "lazyckpt.save({'w': torch.ones(1000)}, sys.argv[1])\n"
        "bulk = [f for p, f in opened if '.lzc.tmp-' in p and f & os.O_ACCMODE != os.O_RDWR]\n"
        "assert bulk and not any(f & os.O_DIRECT for f in bulk), bulk\n"
        "print('ok', iomode.choices()[0]['o_direct'])\n")
    out = subprocess.run([sys.executable, "-c", code, str(data / "x.lzc")], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "False"]


def test_an_expired_verdict_is_measured_again(tmp_path, fresh):
    device = os.stat(tmp_path).st_dev
    old = {"direction": "write", "device": device, "where": str(tmp_path), "o_direct": False,
           "direct_gbps": 0.1, "buffered_gbps": 0.9, "reason": "probed 64 MiB",
           "at": time.time() - iomode.CACHE_TTL_S - 1}
    fresh.parent.mkdir(parents=True)
    fresh.write_text(json.dumps({f"{device}:write": old}))
    iomode.use_o_direct(str(tmp_path / "f.lzc"), "write", "auto")
    now = json.loads(fresh.read_text())[f"{device}:write"]
    assert now["at"] > old["at"] + iomode.CACHE_TTL_S and now["direct_gbps"] != 0.1


def test_forced_modes_never_probe(tmp_path, fresh, monkeypatch, spy_open):
    def no(*a):
        raise AssertionError("probed although the mode is forced")
    monkeypatch.setattr(iomode, "_probe", no)
    state = {"w": torch.randn(10_000)}
    lazyckpt.save(state, tmp_path / "d.lzc", o_direct=True)
    lazyckpt.save(state, tmp_path / "b.lzc", o_direct=False)
    monkeypatch.setenv("LAZYCKPT_O_DIRECT", "0")
    lazyckpt.load(tmp_path / "d.lzc")
    opens = _data_opens(spy_open)
    assert any(f & O_DIRECT for p, f in opens if "d.lzc" in p and ".tmp-" in p)
    assert not any(f & O_DIRECT for p, f in opens if "b.lzc" in p)
    assert not any(f & O_DIRECT for p, f in opens if p.endswith("d.lzc"))     # the load, forced buffered
    assert iomode.choices() == [] and not fresh.exists()


def test_bad_knob_values_are_refused():
    with pytest.raises(ValueError, match="o_direct"):
        lazyckpt.Options(o_direct="sometimes")
    assert lazyckpt.Options(o_direct="0").o_direct is False
    assert lazyckpt.Options(o_direct="AUTO").o_direct == "auto"
