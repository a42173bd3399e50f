"""How many read requests a load issues, counted by the kernel
(``/proc/self/io``: read syscalls and bytes) through a real file: adjacent
entries are one request, ``keys=`` reads small gaps through instead of one
request per selected entry, and large gaps are skipped."""

from __future__ import annotations

import os

import pytest
import torch

import lazyckpt

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")]


def _io():
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["syscr"]), int(fields["rchar"])


def _requests(path, keys, **knobs):
    """(read syscalls, bytes read) of a load of ``keys``, less those of a load
    of the first key alone (the footer's reads, and that key's one request)."""
    def count(ks):
        lazyckpt.load(path, keys=ks, o_direct=True, **knobs)       # the footer's reads settle
        r0, b0 = _io()
        out = lazyckpt.load(path, keys=ks, o_direct=True, **knobs)
        r1, b1 = _io()
        return r1 - r0, b1 - b0, out
    base_calls, base_bytes, _ = count(keys[:1])
    calls, nbytes, out = count(keys)
    return calls - base_calls + 1, nbytes - base_bytes, out


def _state(n, numel):
    return {f"t{i:04d}": torch.arange(numel, dtype=torch.float32) + i for i in range(n)}


def test_keys_with_small_gaps_read_as_one_request(tmp_path):
    state = _state(64, 1024)                  # 4 KiB each: gaps of 4 KiB
    path = str(tmp_path / "small.lzc")
    lazyckpt.save(state, path)
    keys = sorted(state)[::2]
    calls, _nbytes, out = _requests(path, keys)
    assert calls == 1, f"{calls} read requests for {len(keys)} keys with 4 KiB gaps"
    assert sorted(out) == keys and all(torch.equal(out[k], state[k]) for k in keys)


def test_read_through_off_reads_each_key_alone(tmp_path):
    state = _state(64, 1024)
    path = str(tmp_path / "small.lzc")
    lazyckpt.save(state, path)
    keys = sorted(state)[::2]
    calls, nbytes, out = _requests(path, keys, read_through_bytes=0)
    assert calls == len(keys)
    assert nbytes <= len(keys) * 4096
    assert all(torch.equal(out[k], state[k]) for k in keys)


def test_adjacent_keys_are_one_request(tmp_path):
    state = _state(64, 1024)
    path = str(tmp_path / "adjacent.lzc")
    lazyckpt.save(state, path)
    keys = sorted(state)[10:40]
    calls, _nbytes, out = _requests(path, keys, read_through_bytes=0)
    assert calls == 1
    assert all(torch.equal(out[k], state[k]) for k in keys)


def test_large_gaps_are_skipped(tmp_path):
    state = _state(8, 1 << 18)                # 1 MiB each: gaps above the read-through size
    path = str(tmp_path / "large.lzc")
    lazyckpt.save(state, path)
    keys = sorted(state)[::2]
    calls, nbytes, out = _requests(path, keys)
    assert calls == len(keys)
    assert nbytes <= (len(keys) - 1) * (1 << 20) + 8192, "a gap of 1 MiB was read"
    assert all(torch.equal(out[k], state[k]) for k in keys)


def test_into_with_small_gaps_reads_only_what_into_names(tmp_path):
    state = _state(64, 1024)
    path = str(tmp_path / "into.lzc")
    lazyckpt.save(state, path)
    keys = sorted(state)[::2]
    into = {k: torch.zeros(1024) for k in keys}
    got = lazyckpt.load(path, into=into, keys=keys, o_direct=True)
    assert got is into and all(torch.equal(into[k], state[k]) for k in keys)
