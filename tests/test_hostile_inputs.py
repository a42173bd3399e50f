"""Hostile and damaged inputs to every reader: torch zips through convert (their
records' CRC-32s and lengths), DCP metadata claiming spans beyond its files,
step-directory files that are symlinks to devices or directories, resealed
footers and safetensors headers with a list for a dtype or deep nesting.

The property everywhere: the right values, or an error of lazyckpt's family
(CheckpointError) naming the file; never another exception type."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError, CorruptCheckpointError
from lazyckpt.interop.convert import convert

pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------- torch zips


def _torch_zip(path, **tensors):
    torch.save(tensors or {"w": torch.arange(4096, dtype=torch.float32)}, path)
    return path


def _record(path, suffix):
    """(name, data offset, size) of the zip record whose name ends with suffix."""
    with open(path, "rb") as f:
        raw = f.read()
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.filename.endswith(suffix):
                name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
                return info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size
    raise AssertionError(f"no record ending in {suffix}")


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("dst_ext", [".safetensors", ".lzc", ".pt"])
def test_convert_of_a_torch_zip_with_flipped_data_bytes_is_corrupt(tmp_path, dst_ext):
    src = _torch_zip(str(tmp_path / "src.pt"))
    name, start, size = _record(src, "/data/0")
    _patch(src, start + size // 2, b"\xde\xad\xbe\xef")
    with pytest.raises(CorruptCheckpointError) as info:
        convert(src, str(tmp_path / f"out{dst_ext}"))
    assert src in str(info.value) and name in str(info.value) and "CRC" in str(info.value)
    assert not os.path.exists(tmp_path / f"out{dst_ext}")


def test_convert_of_a_torch_zip_with_a_flipped_pickle_is_corrupt(tmp_path):
    src = _torch_zip(str(tmp_path / "src.pt"))
    name, start, size = _record(src, "/data.pkl")
    _patch(src, start + size - 3, b"\x00")
    with pytest.raises(CorruptCheckpointError, match="data.pkl"):
        convert(src, str(tmp_path / "out.safetensors"))


def test_convert_of_a_torch_zip_whose_record_claims_more_than_the_file(tmp_path):
    src = _torch_zip(str(tmp_path / "src.pt"))
    with open(src, "rb") as f:
        raw = bytearray(f.read())
    at = raw.rfind(b"PK\x01\x02")               # the last central entry: its sizes
    struct.pack_into("<II", raw, at + 20, 0xFFFFFFF0, 0xFFFFFFF0)
    with open(src, "wb") as f:
        f.write(raw)
    with pytest.raises(CorruptCheckpointError, match="src.pt"):
        convert(src, str(tmp_path / "out.safetensors"))


def test_convert_of_an_intact_torch_zip_still_converts(tmp_path):
    w = torch.arange(4096, dtype=torch.float32)
    src = _torch_zip(str(tmp_path / "src.pt"), w=w)
    convert(src, str(tmp_path / "out.lzc"))
    assert torch.equal(lazyckpt.load(str(tmp_path / "out.lzc"))["w"], w)


def test_convert_of_a_torch_zip_unpickler_errors_are_the_librarys(tmp_path):
    """A data.pkl whose opcodes the unpickler rejects with IndexError or
    TypeError (valid CRCs, so the bytes reach it)."""
    import zlib
    outcomes = []
    for payload in (b"\x80\x02}q\x00(X\x01\x00\x00\x00wq\x01h\x05u.",    # memo index missing: IndexError/KeyError
                    b"\x80\x02K\x01K\x02s."):                           # setitem on an int: TypeError
        src = str(tmp_path / f"p{len(outcomes)}.pt")
        with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as archive:
            archive.writestr("archive/data.pkl", payload)
            archive.writestr("archive/version", b"3\n")
        assert zlib.crc32(payload)
        with pytest.raises(CheckpointError) as info:
            convert(src, str(tmp_path / f"o{len(outcomes)}.safetensors"))
        assert src in str(info.value)
        outcomes.append(type(info.value).__name__)
