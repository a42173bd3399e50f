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


# --------------------------------------------------------------------------- DCP


def _dcp_checkpoint(path):
    import torch.distributed.checkpoint as dcp
    state = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(3)}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def _rewrite_metadata(path, change):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _dcp_load(path):
    import torch.distributed.checkpoint as dcp
    from lazyckpt.interop.dcp_source import LazyStorageReader
    target = {"w": torch.zeros(64), "b": torch.zeros(3)}
    dcp.load(target, storage_reader=LazyStorageReader(str(path)), no_dist=True)
    return target


def _set_span(offset=None, length=None, relative_path=None):
    import dataclasses

    def change(metadata):
        for index, info in list(metadata.storage_data.items()):
            fields = {}
            if offset is not None:
                fields["offset"] = offset
            if length is not None:
                fields["length"] = length
            if relative_path is not None:
                fields["relative_path"] = relative_path
            metadata.storage_data[index] = dataclasses.replace(info, **fields)
    return change


def _dcp_error(path):
    """The exception DCP's load re-raises, unwrapped from its CheckpointException."""
    from lazyckpt.interop.sources import _exception_chain
    try:
        _dcp_load(path)
    except BaseException as exc:        # DCP wraps a rank's error in a CheckpointException
        for inner in _exception_chain(exc):
            if isinstance(inner, CheckpointError):
                return inner
        return exc
    return None


@pytest.mark.parametrize("span", [dict(length=10**12), dict(offset=10**12), dict(offset=-5), dict(length=-1),
                                  dict(offset=2**63, length=2**63), dict(relative_path="missing.distcp"),
                                  dict(length=1.5), dict(offset="0")],
                         ids=["huge-length", "huge-offset", "negative-offset", "negative-length",
                              "overflow", "missing-file", "float-length", "str-offset"])
def test_dcp_spans_beyond_the_file_are_refused_before_reading(tmp_path, span):
    _dcp_checkpoint(tmp_path)
    _rewrite_metadata(str(tmp_path), _set_span(**span))
    error = _dcp_error(tmp_path)
    assert isinstance(error, CheckpointError), repr(error)
    assert str(tmp_path) in str(error)


def test_dcp_convert_of_huge_span_is_the_librarys(tmp_path):
    _dcp_checkpoint(tmp_path / "d")
    _rewrite_metadata(str(tmp_path / "d"), _set_span(length=10**12))
    with pytest.raises(CheckpointError):
        convert(str(tmp_path / "d"), str(tmp_path / "out.lzc"))


# --------------------------------------------------------------------------- step directories


@pytest.fixture
def run_dir(tmp_path):
    directory = tmp_path / "run"
    with lazyckpt.Checkpointer(str(directory)) as ckpt:
        for step in (1, 2):
            ckpt.save({"w": torch.full((4,), float(step))}, step=step).wait(60)
    return directory


@pytest.mark.parametrize("name", ["history.json", "latest"])
@pytest.mark.parametrize("target", ["/dev/zero", "dir"])
def test_step_directory_files_symlinked_to_a_device_or_directory(run_dir, tmp_path, name, target):
    path = run_dir / name
    if not path.exists() and not path.is_symlink():
        pytest.skip(f"this layout writes no {name}")
    if target == "dir":
        target = str(tmp_path / "a_dir")
        os.mkdir(target)
    os.remove(path)
    os.symlink(target, path)
    for call in (lambda: lazyckpt.load(str(run_dir)),
                 lambda: lazyckpt.Checkpointer(str(run_dir)).load(),
                 lambda: lazyckpt.Checkpointer(str(run_dir)).steps()):
        try:
            out = call()
        except CheckpointError as exc:
            assert str(run_dir) in str(exc) or name in str(exc), str(exc)
            continue
        if isinstance(out, dict):
            assert torch.equal(out["w"], torch.full((4,), 2.0))


# --------------------------------------------------------------------------- footers and headers


def _reseal(path, change):
    from lzc_fuzz import footer_of, with_footer
    with open(path, "rb") as f:
        data = f.read()
    doc = json.loads(footer_of(data))
    change(doc)
    with open(path, "wb") as f:
        f.write(with_footer(data, json.dumps(doc).encode()))


def _first_tensor_node(doc):
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("dtype"), str) and "shape" in node:
                return node
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    raise AssertionError("no tensor node")


def test_verify_of_a_resealed_footer_with_a_list_dtype(tmp_path):
    path = str(tmp_path / "x.lzc")
    lazyckpt.save({"w": torch.ones(8)}, path)
    _reseal(path, lambda doc: _first_tensor_node(doc).__setitem__("dtype", ["float32"]))
    with pytest.raises(CorruptCheckpointError):
        lazyckpt.load(path)
    from lazyckpt.loading.verify import verify
    from lazyckpt.storage.stores import for_path
    try:
        report = verify(path, store=for_path(path))
    except CheckpointError as exc:
        assert path in str(exc)
    else:
        assert not report.ok


def _safetensors(path, header, data=b""):
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header", [
    {"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
    {"w": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": [1, 2]},
    {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}},
    {"w": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 4]}},
    b"[" * 100000 + b"]" * 100000,
    b'{"w": ' + b'{"a": ' * 50000 + b"1" + b"}" * 50000 + b"}",
], ids=["list-dtype", "dict-dtype", "list-metadata", "bool-shape", "huge-shape", "deep-list", "deep-dict"])
def test_hostile_safetensors_header(tmp_path, header):
    src = str(tmp_path / "x.safetensors")
    _safetensors(src, header, b"\0" * 4)
    for dst in ("out.lzc", "out.safetensors"):
        with pytest.raises(CheckpointError) as info:
            convert(src, str(tmp_path / dst), src_format="safetensors")
        assert src in str(info.value)


def _tensor_meta(metadata, fqn="w"):
    return metadata.state_dict_metadata[fqn]


DCP_METADATA = {
    "size-beyond-chunks": lambda m: object.__setattr__(_tensor_meta(m), "size", torch.Size([100])),
    "chunk-outside": lambda m: object.__setattr__(_tensor_meta(m).chunks[0], "sizes", torch.Size([65])),
    "chunk-dims": lambda m: object.__setattr__(_tensor_meta(m).chunks[0], "offsets", torch.Size([0, 0])),
    "list-offsets": lambda m: object.__setattr__(_tensor_meta(m).chunks[0], "offsets", [[0]]),
    "str-dtype": lambda m: object.__setattr__(_tensor_meta(m).properties, "dtype", "float32"),
    "no-storage": lambda m: m.storage_data.clear(),
    "path-escapes": _set_span(relative_path="../x.distcp"),
}


@pytest.mark.parametrize("change", list(DCP_METADATA.values()), ids=list(DCP_METADATA))
def test_dcp_metadata_refused_by_the_reader_before_dcps_planner(tmp_path, change):
    _dcp_checkpoint(tmp_path)
    _rewrite_metadata(str(tmp_path), change)
    error = _dcp_error(tmp_path)
    assert isinstance(error, CorruptCheckpointError), repr(error)
    assert os.path.join(str(tmp_path), ".metadata") in str(error)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_convert_of_a_fifo_or_device_is_refused_not_read_forever(tmp_path, kind):
    src = str(tmp_path / "src.pt")
    if kind == "fifo":
        os.mkfifo(src)
    else:
        os.symlink("/dev/zero", src)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        convert(src, str(tmp_path / "out.lzc"))


def test_convert_of_a_torch_zip_whose_central_crc_is_zeroed_is_still_checked(tmp_path):
    """A CRC of 0 means "not computed" (torch.serialization.set_crc32_options(False));
    one damaged field must not turn the check off: the data descriptor's CRC still
    holds the real one."""
    src = _torch_zip(str(tmp_path / "src.pt"))
    name, start, size = _record(src, "/data/0")
    _patch(src, start + 8, b"\x01\x02\x03\x04")
    with open(src, "rb") as f:
        raw = bytearray(f.read())
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46:at + 46 + name_len].decode().endswith("/data/0"):
            struct.pack_into("<I", raw, at + 16, 0)
        at = raw.find(b"PK\x01\x02", at + 4)
    with open(src, "wb") as f:
        f.write(raw)
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        convert(src, str(tmp_path / "out.safetensors"))


def test_a_torch_zip_written_without_crcs_still_converts(tmp_path):
    from torch.serialization import get_crc32_options, set_crc32_options
    w = torch.arange(100, dtype=torch.float32)
    old = get_crc32_options()
    set_crc32_options(False)
    try:
        torch.save({"w": w}, str(tmp_path / "src.pt"))
    finally:
        set_crc32_options(old)
    convert(str(tmp_path / "src.pt"), str(tmp_path / "out.lzc"))
    assert torch.equal(lazyckpt.load(str(tmp_path / "out.lzc"))["w"], w)


def test_convert_of_a_dcp_checkpoint_with_a_damaged_record_is_corrupt(tmp_path):
    """convert read DCP's own layout with FileSystemReader, which checks no CRC-32:
    a damaged record converted as other values."""
    _dcp_checkpoint(tmp_path / "d")
    data = [n for n in os.listdir(tmp_path / "d") if n.endswith(".distcp")][0]
    name, start, size = _record(str(tmp_path / "d" / data), "/data/0")
    _patch(str(tmp_path / "d" / data), start + size // 2, b"\xde\xad\xbe\xef")
    with pytest.raises(CorruptCheckpointError, match="CRC"):
        convert(str(tmp_path / "d"), str(tmp_path / "out.lzc"))


def test_convert_of_an_intact_dcp_checkpoint_still_converts(tmp_path):
    state = _dcp_checkpoint(tmp_path / "d")
    convert(str(tmp_path / "d"), str(tmp_path / "out.lzc"))
    out = lazyckpt.load(str(tmp_path / "out.lzc"))
    assert all(torch.equal(out[k], v) for k, v in state.items())


@pytest.mark.timeout(30)
def test_dcp_metadata_putting_at_a_huge_memo_index_is_refused_at_once(tmp_path):
    """The C unpickler sizes its memo to the largest index put: 5 KB asking for
    index 841,250,082 took 30 s and gigabytes before failing."""
    _dcp_checkpoint(tmp_path)
    path = os.path.join(str(tmp_path), ".metadata")
    with open(path, "rb") as f:
        raw = f.read()
    at = raw.index(b"\x94")                                  # the first MEMOIZE
    with open(path, "wb") as f:
        f.write(raw[:at] + b"r" + struct.pack("<I", 841250082) + raw[at + 1:])
    from lazyckpt.interop.dcp_source import LazyStorageReader
    with pytest.raises(CorruptCheckpointError, match="memo index"):
        LazyStorageReader(str(tmp_path)).read_metadata()
    with pytest.raises(CheckpointError):
        convert(str(tmp_path), str(tmp_path.parent / "out.lzc"))


def test_convert_of_a_torch_zip_with_an_int_persistent_id(tmp_path):
    src = str(tmp_path / "p.pt")
    with zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02K\x01Q.")      # BINPERSID of an int: AssertionError
        archive.writestr("archive/version", b"3\n")
    with pytest.raises(CorruptCheckpointError, match="p.pt"):
        convert(src, str(tmp_path / "o.lzc"))


def test_safetensors_dimension_beyond_int64_of_an_empty_tensor(tmp_path):
    src = str(tmp_path / "x.safetensors")
    _safetensors(src, {"e": {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [0, 0]}})
    with pytest.raises(CorruptCheckpointError, match="x.safetensors"):
        convert(src, str(tmp_path / "out.lzc"))


def _set_central_external_attr(path, suffix, value):
    """Set the external attributes of the central entry whose name ends with suffix."""
    with open(path, "rb") as f:
        raw = bytearray(f.read())
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46:at + 46 + name_len].decode().endswith(suffix):
            struct.pack_into("<I", raw, at + 38, value)
        at = raw.find(b"PK\x01\x02", at + 4)
    with open(path, "wb") as f:
        f.write(raw)


@pytest.mark.parametrize("attr", [0x10, 0x93])
def test_a_torch_zip_record_marked_as_a_directory_is_corrupt(tmp_path, attr):
    """Found by the format fuzzer (seed 7, input 73786): one flipped byte set the DOS
    directory bit of a record's external attributes; torch's zip reader (miniz) then
    takes the record for a directory, reads none of its bytes and checks no CRC, and
    the tensor loaded with other values and no error."""
    src = _torch_zip(str(tmp_path / "src.pt"))
    _set_central_external_attr(src, "/data/0", attr)
    with pytest.raises(CorruptCheckpointError, match="directory"):
        convert(src, str(tmp_path / "out.lzc"))


def test_a_dcp_record_marked_as_a_directory_is_corrupt(tmp_path):
    _dcp_checkpoint(tmp_path / "d")
    data = [n for n in os.listdir(tmp_path / "d") if n.endswith(".distcp")][0]
    _set_central_external_attr(str(tmp_path / "d" / data), "/data/0", 0x93)
    with pytest.raises(CorruptCheckpointError, match="directory"):
        convert(str(tmp_path / "d"), str(tmp_path / "out.lzc"))


def test_convert_of_a_tiny_damaged_safetensors_file_is_the_librarys(tmp_path):
    """Found by the format fuzzer (seed 7, input 75276): a safetensors file cut to 7
    bytes is too short to be recognised, goes to torch.load, which hands a
    ``.safetensors`` name to the safetensors package: its SafetensorError escaped."""
    src = tmp_path / "state.safetensors"
    src.write_bytes(bytes.fromhex("80ff00000000f000"[:14]))
    with pytest.raises(CheckpointError):
        convert(str(src), str(tmp_path / "out.lzc"))
