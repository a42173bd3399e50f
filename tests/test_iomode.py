"""The adaptive I/O mode: o_direct="auto" probes each file system once per
direction, keeps the faster mode, shares the verdict with other processes for
an hour, and leaves nothing behind; True/False force a mode."""

from __future__ import annotations

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


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty verdict cache of our own, and no choice remembered in this process."""
    cache = tmp_path / "cache" / "iomode.json"
    monkeypatch.setenv("LAZYCKPT_IOMODE_CACHE", str(cache))
    monkeypatch.delenv("LAZYCKPT_O_DIRECT", raising=False)
    iomode.forget()
    yield cache
    iomode.forget()


def test_auto_probes_once_per_direction_logs_and_leaves_nothing(tmp_path, fresh, caplog):
    data = tmp_path / "data"
    data.mkdir()
    state = {"w": torch.randn(100_000), "i": torch.arange(10)}
    with caplog.at_level(logging.INFO, logger="lazyckpt"):
        lazyckpt.save(state, data / "a.lzc")
        lazyckpt.save(state, data / "b.lzc")
        back = lazyckpt.load(data / "a.lzc")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    made = iomode.choices()
    assert sorted(c["direction"] for c in made) == ["read", "write"]
    for c in made:
        assert c["reason"].startswith("probed") and c["direct_gbps"] > 0 and c["buffered_gbps"] > 0
        assert c["o_direct"] == (c["direct_gbps"] >= c["buffered_gbps"])
    probes = [r.getMessage() for r in caplog.records if "I/O mode for" in r.getMessage()]
    assert len(probes) == 2, probes                # once per direction, not once per file
    assert sorted(os.listdir(data)) == ["a.lzc", "b.lzc"]      # the probe file never shows
    cached = json.loads(fresh.read_text())
    assert {k.split(":")[1] for k in cached} == {"read", "write"}


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
