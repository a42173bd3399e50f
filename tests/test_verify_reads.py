"""``verify`` over many small entries: adjacent block pieces are read in one
request (counted by the kernel, ``/proc/self/io``), and damage inside such a
request is still reported for exactly the entries it touches, at their
offsets."""

from __future__ import annotations

import os

import pytest
import torch

import lazyckpt
from lazyckpt.loading.reader import CheckpointFile
from lazyckpt.loading.verify import verify
from lazyckpt.storage.stores import LOCAL

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io (Linux)")]


def _syscalls() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["syscr"])


def _saved(tmp_path, n):
    # 4 KiB tensors, a 4-byte scalar between them: entries padded to 4 KiB each.
    state = {}
    for i in range(n):
        state[f"t{i:04d}"] = torch.arange(1024, dtype=torch.float32) + i
        state[f"s{i:04d}"] = torch.tensor(float(i))
    path = str(tmp_path / f"n{n}.lzc")
    lazyckpt.save(state, path)
    return path


def _verify_reads(path):
    verify(path, store=LOCAL)                       # the footer's reads and the pool settle
    before = _syscalls()
    report = verify(path, store=LOCAL)
    return _syscalls() - before, report


def test_adjacent_entries_are_one_read(tmp_path):
    one, many = _saved(tmp_path, 1), _saved(tmp_path, 200)
    calls_one, report_one = _verify_reads(one)
    calls_many, report_many = _verify_reads(many)
    assert report_one.ok and report_many.ok
    assert report_many.entries == 400 and report_many.blocks_checked == 400
    # The footer's reads are the same for both files; 400 entries add no request.
    assert calls_many <= calls_one + 1, f"{calls_many} read syscalls for 400 entries, {calls_one} for 2"


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_damage_inside_one_read_names_only_its_entry(tmp_path):
    path = _saved(tmp_path, 50)
    entries = {e.name: e for e in CheckpointFile(path, lazyckpt.Options(), store=LOCAL).entries}
    _flip(path, entries["t0020"].offset + 100)
    _flip(path, entries["s0031"].offset)
    report = verify(path, store=LOCAL)
    assert sorted(p.entry for p in report.problems) == ["s0031", "t0020"]
    by_entry = {p.entry: p for p in report.problems}
    assert by_entry["t0020"].offsets == [entries["t0020"].offset]
    assert "checksum mismatch in 1 of 1 block(s)" in by_entry["s0031"].message
    assert report.blocks_checked == 100


def test_damage_at_both_ends_of_a_read(tmp_path):
    path = _saved(tmp_path, 50)
    entries = sorted(CheckpointFile(path, lazyckpt.Options(), store=LOCAL).entries, key=lambda e: e.offset)
    first, last = entries[0], entries[-1]
    _flip(path, first.offset)
    _flip(path, last.offset + last.length - 1)
    report = verify(path, store=LOCAL)
    assert sorted(p.entry for p in report.problems) == sorted([first.name, last.name])
    assert all(p.offsets == [e.offset] for p, e in zip(sorted(report.problems, key=lambda p: p.offsets[0]),
                                                        (first, last)))


# --------------------------------------------------------------------------- loads


def _odd_state():
    # Sizes that are not multiples of a page; the large ones cross several
    # checksum blocks.
    g = torch.Generator().manual_seed(3)
    return {f"t{i:02d}": torch.randn(n, generator=g) for i, n in enumerate([3, 10_001, 70_000, 1, 40_000, 5_000])}


def test_spans_across_blocks_load_verified(tmp_path):
    state = _odd_state()
    path = str(tmp_path / "odd.lzc")
    lazyckpt.save(state, path, chunk_bytes=64 << 10)
    f = CheckpointFile(path, lazyckpt.Options(), store=LOCAL)
    assert f.footer.block_bytes == 64 << 10
    assert any(e.length > 64 << 10 for e in f.entries)         # spans cut at block boundaries
    for knobs in ({}, {"o_direct": True}, {"o_direct": False}, {"verify_checksums": False}):
        out = lazyckpt.load(path, **knobs)
        assert all(torch.equal(out[k], state[k]) for k in state), knobs


@pytest.mark.parametrize("where", [0, 65_535, 65_536, 100_000, -1])
def test_damage_anywhere_in_an_entry_across_blocks_fails_the_load(tmp_path, where):
    state = _odd_state()
    path = str(tmp_path / "odd.lzc")
    lazyckpt.save(state, path, chunk_bytes=64 << 10)
    e = entry_by_offset(path, "t02")                # 280,000 bytes: 5 blocks
    _flip(path, e.offset + (where if where >= 0 else e.length + where))
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="checksum mismatch in entry 't02'"):
        lazyckpt.load(path)
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="t02"):
        lazyckpt.load(path, keys=["t02"])
    # Unverified, the damaged bytes load (nothing else checks them).
    assert not torch.equal(lazyckpt.load(path, verify_checksums=False)["t02"], state["t02"])


def entry_by_offset(path, name):
    return {e.name: e for e in CheckpointFile(path, lazyckpt.Options(), store=LOCAL).entries}[name]


def test_into_never_holds_unverified_bytes(tmp_path):
    """A damaged entry fails the load before its bytes reach its tensor of
    into=: every tensor holds its old value or the saved one."""
    state = _odd_state()
    path = str(tmp_path / "odd.lzc")
    lazyckpt.save(state, path, chunk_bytes=64 << 10)
    e = entry_by_offset(path, "t04")
    _flip(path, e.offset + e.length - 5)
    into = {k: torch.full_like(v, -7.0) for k, v in state.items()}
    with pytest.raises(lazyckpt.CorruptCheckpointError, match="t04"):
        lazyckpt.load(path, into=into)
    assert torch.equal(into["t04"], torch.full_like(state["t04"], -7.0))
    for k in state:
        assert torch.equal(into[k], state[k]) or torch.equal(into[k], torch.full_like(state[k], -7.0)), k
