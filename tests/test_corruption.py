"""Damaged and hostile files: every problem is a lazyckpt.CheckpointError
(mostly CorruptCheckpointError), never a raw Python exception, a huge
allocation or code execution."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pickle
import shutil
import time
import tracemalloc

import numpy as np
import pytest
import torch

import lazyckpt
from lzc_tools import FOOTER_MAGIC, TRAILER, entry_by_name, flip_byte, parse, write_with_footer

SMALL_CHUNKS = dict(chunk_bytes=8192, host_cache_bytes=32768)


def multi_entry_state():
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"weight": torch.randn(64, 100, generator=g),           # 25600 bytes: 4 blocks of 8 KiB
                  "bias": torch.randn(100, generator=g)},
        "emb": torch.randint(0, 1000, (3001,), generator=g, dtype=torch.int16),   # odd length
        "arr": np.arange(2500, dtype=np.float64),
        "blob": bytes(range(256)) * 20,
        "step": 12,
    }


@pytest.fixture
def multi_file(tmp_path):
    path = tmp_path / "multi.lzc"
    lazyckpt.save(multi_entry_state(), path, **SMALL_CHUNKS)
    return path


def _copy(src, tmp_path, name="copy.lzc"):
    dst = tmp_path / name
    shutil.copyfile(src, dst)
    return dst


def _load_fails_cleanly(path, exc=lazyckpt.CorruptCheckpointError, **kwargs):
    try:
        lazyckpt.load(path, **kwargs)
    except exc as e:
        return e
    except lazyckpt.CheckpointError as e:
        pytest.fail(f"expected {exc.__name__}, got {type(e).__name__}: {e}")
    except BaseException as e:      # noqa: BLE001 - the point of the test
        pytest.fail(f"raw {type(e).__name__} escaped: {e}")
    pytest.fail("damaged file loaded without error")


# --------------------------------------------------------------------------- truncation


def test_truncation_at_every_page_and_odd_offsets(multi_file, tmp_path):
    data = multi_file.read_bytes()
    size = len(data)
    footer_offset = TRAILER.unpack(data[-32:])[0]
    cuts = set(range(0, size, 4096))
    cuts |= {1, 7, 8, 15, 16, 4095, 4097, 4127, 4128, 4129, 5000, footer_offset - 1, footer_offset + 1,
             size - 33, size - 32, size - 31, size - 9, size - 8, size - 1}
    cut_path = tmp_path / "cut.lzc"
    for cut in sorted(c for c in cuts if 0 <= c < size):
        cut_path.write_bytes(data[:cut])
        err = _load_fails_cleanly(cut_path)
        assert str(cut_path) in str(err), cut


def test_empty_file_and_appended_garbage(multi_file, tmp_path):
    empty = tmp_path / "empty.lzc"
    empty.write_bytes(b"")
    _load_fails_cleanly(empty)
    longer = _copy(multi_file, tmp_path)
    with open(longer, "ab") as f:
        f.write(b"\0" * 4096)
    _load_fails_cleanly(longer)
    not_ours = tmp_path / "other.bin"
    not_ours.write_bytes(os.urandom(20000))
    _load_fails_cleanly(not_ours)


# --------------------------------------------------------------------------- bit flips


def _flip_points(e, block):
    """First, last and middle byte of the entry, and the first byte of each later block."""
    start, end = e["offset"], e["offset"] + e["length"]
    points = {start, end - 1, (start + end) // 2}
    points |= set(range((start // block + 1) * block, end, block))
    return sorted(points)


@pytest.mark.parametrize("name", ["model/weight", "model/bias", "emb", "arr", "blob"])
def test_flipped_data_byte_names_the_entry(multi_file, tmp_path, name):
    doc = parse(multi_file).doc
    e = entry_by_name(doc, name)
    for point in _flip_points(e, doc["block_bytes"]):
        damaged = _copy(multi_file, tmp_path)
        flip_byte(damaged, point)
        err = _load_fails_cleanly(damaged)
        assert err.entry == name
        assert name in str(err) and "checksum" in str(err)
        # The other entries are still readable, selecting around the damage.
        if name != "blob":
            assert lazyckpt.load(damaged, keys=["blob"])["blob"] == multi_entry_state()["blob"]


def test_verify_checksums_false_loads_flipped_data(multi_file, tmp_path):
    e = entry_by_name(parse(multi_file).doc, "model/bias")
    damaged = _copy(multi_file, tmp_path)
    flip_byte(damaged, e["offset"] + 5, mask=0x80)
    out = lazyckpt.load(damaged, verify_checksums=False)
    want = multi_entry_state()
    got_bytes = out["model"]["bias"].view(torch.uint8)
    want_bytes = want["model"]["bias"].view(torch.uint8)
    assert (got_bytes != want_bytes).sum().item() == 1 and got_bytes[5] == want_bytes[5] ^ 0x80
    assert torch.equal(out["model"]["weight"], want["model"]["weight"])
    _load_fails_cleanly(damaged, verify_checksums=True)


def test_verification_of_untouched_padding_is_not_required(multi_file, tmp_path):
    """Padding between entries is not covered by checksums (FORMAT.md section 5)."""
    e = entry_by_name(parse(multi_file).doc, "model/bias")
    damaged = _copy(multi_file, tmp_path)
    flip_byte(damaged, e["offset"] + e["length"] + 10)
    assert torch.equal(lazyckpt.load(damaged)["model"]["bias"], multi_entry_state()["model"]["bias"])


def test_flipped_footer_bytes(multi_file, tmp_path):
    p = parse(multi_file)
    for point in (p.footer_offset, p.footer_offset + 1, p.footer_offset + p.footer_length // 2,
                  p.footer_offset + p.footer_length - 1):
        damaged = _copy(multi_file, tmp_path)
        flip_byte(damaged, point)
        err = _load_fails_cleanly(damaged)
        assert "footer" in str(err)


@pytest.mark.parametrize("field_offset", [0, 3, 8, 12, 16, 23, 24, 31])
def test_flipped_trailer_bytes(multi_file, tmp_path, field_offset):
    damaged = _copy(multi_file, tmp_path)
    flip_byte(damaged, damaged.stat().st_size - 32 + field_offset)
    _load_fails_cleanly(damaged)


@pytest.mark.parametrize("offset", [0, 7, 12, 13, 15])
def test_flipped_header_bytes(multi_file, tmp_path, offset):
    """Magic and header size are checked; (version flips are UnsupportedVersionError,
    tested in test_format.py)."""
    damaged = _copy(multi_file, tmp_path)
    flip_byte(damaged, offset)
    _load_fails_cleanly(damaged)


# --------------------------------------------------------------------------- hostile footers


def _rewrite_trailer(src, dst, *, offset=None, length=None, digest=None, magic=FOOTER_MAGIC):
    data = src.read_bytes()
    o, ln, d, _ = TRAILER.unpack(data[-32:])
    dst.write_bytes(data[:-32] + TRAILER.pack(o if offset is None else offset, ln if length is None else length,
                                              d if digest is None else digest, magic))


def _fails_fast_without_allocating(path, **kwargs):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        err = _load_fails_cleanly(path, **kwargs)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 5.0
    assert peak < 16 << 20, f"peak Python allocation {peak} bytes while rejecting a hostile file"
    return err


@pytest.mark.parametrize("length", [2**63, 2**64 - 1, 255 << 20, 2**40])
def test_trailer_claiming_a_huge_footer(multi_file, tmp_path, length):
    dst = tmp_path / "huge.lzc"
    _rewrite_trailer(multi_file, dst, length=length)
    _fails_fast_without_allocating(dst)


@pytest.mark.parametrize("offset", [0, 4095, 2**63, 2**64 - 4096])
def test_trailer_with_impossible_footer_offset(multi_file, tmp_path, offset):
    dst = tmp_path / "off.lzc"
    _rewrite_trailer(multi_file, dst, offset=offset)
    _fails_fast_without_allocating(dst)


def test_footer_over_max_footer_bytes_is_refused_before_reading(multi_file, tmp_path):
    p = parse(multi_file)
    err = _fails_fast_without_allocating(multi_file, max_footer_bytes=p.footer_length - 1)
    assert "max_footer_bytes" in str(err)
    assert lazyckpt.load(multi_file, max_footer_bytes=p.footer_length)["step"] == 12


def _footer_variant(src, tmp_path, mutate):
    doc = copy.deepcopy(parse(src).doc)
    mutate(doc)
    dst = tmp_path / "variant.lzc"
    write_with_footer(src, dst, doc)
    return dst


def _entry(doc, name):
    return entry_by_name(doc, name)


HUGE_FOOTER_CASES = {
    "entry-length-2**60": lambda d: _entry(d, "model/weight").update(length=2**60),
    "entry-length-past-footer": lambda d: _entry(d, "blob").update(length=10**6),
    "entry-offset-2**62": lambda d: _entry(d, "model/weight").update(offset=2**62),
    "entry-offset-unaligned": lambda d: _entry(d, "emb").update(offset=_entry(d, "emb")["offset"] + 8),
    "entry-offset-in-header": lambda d: _entry(d, "emb").update(offset=0),
    "entry-negative-length": lambda d: _entry(d, "emb").update(length=-1),
    "entry-length-float": lambda d: _entry(d, "emb").update(length=6002.0),
    "entry-length-bool": lambda d: _entry(d, "blob").update(length=True),
    "too-many-checksums": lambda d: _entry(d, "emb")["checksums"].extend([1] * 100000),
    "checksum-2**64": lambda d: _entry(d, "emb").update(checksums=[2**64]),
    "checksum-negative": lambda d: _entry(d, "emb").update(checksums=[-1]),
    "checksum-string": lambda d: _entry(d, "emb").update(checksums=["1"]),
    "block-bytes-0": lambda d: d.update(block_bytes=0),
    "block-bytes-unaligned": lambda d: d.update(block_bytes=5000),
    "block-bytes-bool": lambda d: d.update(block_bytes=True),
    "entries-not-list": lambda d: d.update(entries={"0": 1}),
    "entry-not-object": lambda d: d["entries"].__setitem__(0, [1, 2]),
    "entry-kind-unknown": lambda d: _entry(d, "emb").update(kind="mmap"),
    "entry-name-not-string": lambda d: _entry(d, "emb").update(name=5),
    "no-tree": lambda d: d.pop("tree"),
    "metadata-not-object": lambda d: d.update(metadata=[1]),
    "byteorder-big": lambda d: d.update(byteorder="big"),
    "alignment-512": lambda d: d.update(alignment=512),
    "checksum-algorithm": lambda d: d.update(checksum="crc32"),
    "tensor-geometry-2**40-squared": lambda d: d["tree"]["v"][0]["v"][0].update(shape=[2**40, 2**40],
                                                                                  stride=[2**40, 1]),
    "numpy-shape-huge": lambda d: d["tree"]["v"][2].update(shape=[2**31, 2**31]),
}


@pytest.mark.parametrize("mutate", list(HUGE_FOOTER_CASES.values()), ids=list(HUGE_FOOTER_CASES))
def test_inconsistent_footer_is_corrupt(multi_file, tmp_path, mutate):
    dst = _footer_variant(multi_file, tmp_path, mutate)
    _fails_fast_without_allocating(dst)


@pytest.mark.parametrize("raw", [b"", b"[1, 2]", b"{", b"\xff\xfe{}", b'{"format_version": NaN}',
                                 b"null", b'"x"', b"{" * 100000, b"[" * 5000 + b"]" * 5000])
def test_footer_that_is_not_a_json_object(multi_file, tmp_path, raw):
    dst = tmp_path / "raw.lzc"
    write_with_footer(multi_file, dst, raw=raw)
    _fails_fast_without_allocating(dst)


def test_footer_checksum_mismatch(multi_file, tmp_path):
    dst = tmp_path / "sum.lzc"
    doc = parse(multi_file).doc
    write_with_footer(multi_file, dst, doc, digest=12345)
    assert "footer" in str(_load_fails_cleanly(dst))


# --------------------------------------------------------------------------- hostile trees



def _tensor_node(doc):
    return doc["tree"]["v"][0]["v"][0]          # model/weight: shape [64, 100], 25600 bytes


GEOMETRY_CASES = {
    "shape-too-big": dict(shape=[65, 100]),
    "one-element-past-the-end": dict(shape=[6400], stride=[1], offset=1),
    "stride-too-big": dict(stride=[101, 1]),
    "offset-too-big": dict(offset=6400),
    "offset-huge": dict(offset=2**62),
    "shape-2**63": dict(shape=[2**63, 1]),
    "negative-shape": dict(shape=[-1, 100]),
    "negative-stride": dict(stride=[-100, 1]),
    "negative-offset": dict(offset=-1),
    "rank-mismatch": dict(stride=[100]),
    "shape-not-ints": dict(shape=[64.0, 100]),
    "shape-bools": dict(shape=[True, True], stride=[1, 1]),
    "shape-not-list": dict(shape="64,100"),
    "offset-string": dict(offset="0"),
    "dtype-wider-than-storage": dict(dtype="float64"),
    "dtype-complex128": dict(dtype="complex128", shape=[64, 50], stride=[50, 1]),
}


@pytest.mark.parametrize("change", list(GEOMETRY_CASES.values()), ids=list(GEOMETRY_CASES))
def test_tensor_geometry_outside_its_storage(multi_file, tmp_path, change):
    dst = _footer_variant(multi_file, tmp_path, lambda d: _tensor_node(d).update(change))
    err = _fails_fast_without_allocating(dst)
    assert "model/weight" in str(err)


def test_tensor_geometry_exactly_filling_its_storage_is_fine(multi_file, tmp_path):
    dst = _footer_variant(multi_file, tmp_path,
                          lambda d: _tensor_node(d).update(shape=[6399], stride=[1], offset=1))
    out = lazyckpt.load(dst)
    assert torch.equal(out["model"]["weight"], multi_entry_state()["model"]["weight"].reshape(-1)[1:])


def _replace_value(doc, key, node):
    tree = doc["tree"]
    tree["v"][tree["k"].index(key)] = node


U, R = "update", "replace"       # update members of the key's node / replace the node
UNKNOWN_CASES = {
    "unknown-tag": ("step", R, {"$": "evil", "v": 1}),
    "tag-not-string": ("step", R, {"$": 5}),
    "object-without-tag": ("step", R, {"v": 1}),
    "bare-json-array": ("step", R, [1, 2]),
    "tensor-unknown-dtype": ("emb", U, {"dtype": "float99"}),
    "tensor-quantized-dtype": ("emb", U, {"dtype": "qint8"}),
    "tensor-dtype-not-a-dtype": ("emb", U, {"dtype": "Tensor"}),
    "tensor-dtype-dunder": ("emb", U, {"dtype": "__class__"}),
    "tensor-dtype-dotted": ("emb", U, {"dtype": "nn.Module"}),
    "tensor-dtype-int": ("emb", U, {"dtype": 5}),
    "tensor-bad-device": ("emb", U, {"device": "nonsense:7"}),
    "tensor-int-param-requires-grad": ("emb", U, {"param": True, "requires_grad": True}),
    "tensor-int-requires-grad": ("emb", U, {"requires_grad": True}),
    "tensor-entry-bool": ("emb", U, {"e": True}),
    "tensor-entry-out-of-range": ("emb", U, {"e": 99}),
    "tensor-entry-negative": ("emb", U, {"e": -1}),
    "tensor-entry-string": ("emb", U, {"e": "1"}),
    "numpy-object-dtype": ("arr", U, {"dtype": "|O"}),
    "numpy-void-dtype": ("arr", U, {"dtype": "|V8"}),
    "numpy-structured-dtype": ("arr", U, {"dtype": [["a", "<f8"]]}),
    "numpy-unparsable-dtype": ("arr", U, {"dtype": "garbage"}),
    "numpy-unknown-kind": ("arr", U, {"t": "matrix"}),
    "numpy-wrong-length": ("arr", U, {"shape": [2499]}),
    "seq-unknown-type": ("step", R, {"$": "seq", "t": "deque", "v": []}),
    "seq-items-not-list": ("step", R, {"$": "seq", "t": "list", "v": 5}),
    "set-of-unhashables": ("step", R, {"$": "seq", "t": "set", "v": [{"$": "seq", "t": "list", "v": []}]}),
    "dict-lengths-differ": ("step", R, {"$": "dict", "k": ["a", "b"], "v": [1]}),
    "dict-unhashable-key": ("step", R, {"$": "dict", "k": [{"$": "seq", "t": "list", "v": []}], "v": [1]}),
    "float-node-finite": ("step", R, {"$": "float", "v": "1.5"}),
    "float-node-number": ("step", R, {"$": "float", "v": 1.5}),
    "complex-bad": ("step", R, {"$": "complex", "v": ["x", "1"]}),
    "complex-arity": ("step", R, {"$": "complex", "v": ["1.0"]}),
    "torch-unknown-kind": ("step", R, {"$": "torch", "t": "module", "v": "x"}),
    "torch-dtype-unknown": ("step", R, {"$": "torch", "t": "dtype", "v": "float99"}),
    "torch-device-bad": ("step", R, {"$": "torch", "t": "device", "v": "nope:x"}),
    "torch-size-not-ints": ("step", R, {"$": "torch", "t": "size", "v": ["a"]}),
    "numpy-scalar-wrong-size": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<f8", "v": "00"}),
    "numpy-scalar-not-hex": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<i4", "v": "zzzzzzzz"}),
    "numpy-str-len-past-width": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<U1", "v": "00000000",
                                             "len": 2}),
    "numpy-str-len-negative": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<U1", "v": "00000000",
                                           "len": -1}),
    "numpy-str-len-not-int": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<U1", "v": "00000000",
                                          "len": True}),
    "numpy-str-len-cuts-chars": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<U2", "v": "6100000062000000",
                                             "len": 1}),
    "numpy-str-bad-code-point": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<U1", "v": "ffffffff",
                                             "len": 1}),
    "numpy-bytes-len-cuts-bytes": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "|S2", "v": "6162", "len": 1}),
    "numpy-len-on-a-number": ("step", R, {"$": "numpy", "t": "scalar", "dtype": "<i4", "v": "00000000", "len": 4}),
    "bytes-entry-missing": ("step", R, {"$": "bytes", "e": 1000}),
}


@pytest.mark.parametrize("case", list(UNKNOWN_CASES.values()), ids=list(UNKNOWN_CASES))
def test_unknown_or_invalid_nodes_are_corrupt(multi_file, tmp_path, case):
    key, how, change = case

    def mutate(doc):
        if how == U:
            doc["tree"]["v"][doc["tree"]["k"].index(key)].update(change)
        else:
            _replace_value(doc, key, change)
    dst = _footer_variant(multi_file, tmp_path, mutate)
    err = _fails_fast_without_allocating(dst)
    assert key in str(err)
    # Loading only another key does not touch the bad node.
    assert lazyckpt.load(dst, keys=["blob"])["blob"] == multi_entry_state()["blob"]


def test_deeply_nested_tree_is_corrupt_not_recursion_error(multi_file, tmp_path):
    doc = parse(multi_file).doc
    for depth in (400, 900, 3000):
        doc["tree"] = "PLACEHOLDER"
        raw = json.dumps(doc, separators=(",", ":")).replace(
            '"PLACEHOLDER"', '{"$":"seq","t":"list","v":[' * depth + "1" + "]}" * depth).encode()
        dst = tmp_path / f"deep{depth}.lzc"
        write_with_footer(multi_file, dst, raw=raw)
        _fails_fast_without_allocating(dst)


def test_entry_kind_must_match_the_node(tmp_path):
    """A pickle node must not read a data entry, and a data node must not read a pickle entry."""
    src = tmp_path / "k.lzc"
    lazyckpt.save({"t": torch.arange(4), "obj": Thing(1, "x")}, src)
    pickle_entry = next(i for i, e in enumerate(parse(src).doc["entries"]) if e["kind"] == "pickle")
    dst = _footer_variant(src, tmp_path, lambda d: d["tree"]["v"][0].update(e=pickle_entry))
    _load_fails_cleanly(dst, allow_pickle=True)
    dst = _footer_variant(src, tmp_path, lambda d: d["tree"]["v"][1].update(e=0))
    _load_fails_cleanly(dst, allow_pickle=True)


# --------------------------------------------------------------------------- pickled objects


@dataclasses.dataclass
class Thing:
    n: int
    label: str
    items: list = dataclasses.field(default_factory=list)


class Plain:
    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return type(other) is Plain and other.x == self.x


def test_arbitrary_objects_need_allow_pickle(tmp_path):
    path = tmp_path / "obj.lzc"
    state = {"w": torch.ones(3), "cfg": Thing(3, "abc", [1, 2]),
             "outer": {"inner": Plain(torch.arange(3))}, "objs": [slice(1, 5, 2)]}
    lazyckpt.save(state, path)

    with pytest.raises(lazyckpt.UnsafeObjectError) as info:
        lazyckpt.load(path)
    err = info.value
    assert isinstance(err, lazyckpt.CheckpointError)
    assert "allow_pickle=True" in str(err)
    assert err.entry in ("cfg", "outer/inner", "objs/0")
    assert err.entry in str(err)

    for key, entry in (("cfg", "cfg"), ("outer", "outer/inner"), ("objs", "objs/0")):
        with pytest.raises(lazyckpt.UnsafeObjectError) as info:
            lazyckpt.load(path, keys=[key])
        assert info.value.entry == entry and entry in str(info.value)
        assert "allow_pickle=True" in str(info.value)
    assert torch.equal(lazyckpt.load(path, keys=["w"])["w"], torch.ones(3))

    out = lazyckpt.load(path, allow_pickle=True)
    assert out["cfg"] == Thing(3, "abc", [1, 2])
    assert out["outer"]["inner"].x.tolist() == [0, 1, 2]
    assert out["objs"] == [slice(1, 5, 2)]


def _make_local_object():
    class Local:
        pass
    return Local()


@pytest.mark.parametrize("obj", [lambda: 1, _make_local_object()], ids=["lambda", "local-class"])
def test_unpicklable_object_fails_with_a_checkpoint_error(tmp_path, obj):
    """save() promises CheckpointError subclasses for failed saves; pickle
    reports some unpicklable objects with AttributeError."""
    path = tmp_path / "bad.lzc"
    with pytest.raises(lazyckpt.CheckpointError):
        lazyckpt.save({"w": torch.ones(2), "bad": obj}, path)
    assert os.listdir(tmp_path) == []


class Evil:
    """Unpickling this runs os.system; pickling it only records the call."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class EvilExec:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


@pytest.mark.parametrize("cls", [Evil, EvilExec])
def test_hostile_pickle_does_not_run_without_allow_pickle(tmp_path, cls):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.lzc"
    lazyckpt.save({"weights": torch.arange(3), "payload": cls(marker)}, path)
    assert not marker.exists()

    with pytest.raises(lazyckpt.UnsafeObjectError):
        lazyckpt.load(path)
    assert not marker.exists()
    assert lazyckpt.load(path, keys=["weights"])["weights"].tolist() == [0, 1, 2]
    assert not marker.exists()
    with pytest.raises(lazyckpt.UnsafeObjectError):
        lazyckpt.load(path, verify_checksums=False)
    assert not marker.exists()

    lazyckpt.load(path, allow_pickle=True)       # the payload is live: opting in runs it
    assert marker.exists()


def _crafted_pickle_file(tmp_path, marker, node_for_payload):
    """A file whose bytes entry holds a malicious pickle stream, re-tagged by hand."""
    payload = pickle.dumps(EvilExec(marker))
    src = tmp_path / "plain.lzc"
    lazyckpt.save({"payload": payload, "ok": 1}, src)
    doc = parse(src).doc
    doc["entries"][0]["kind"] = "pickle"
    node_for_payload(doc)
    dst = tmp_path / "crafted.lzc"
    write_with_footer(src, dst, doc)
    return dst


PICKLE_HIDING_PLACES = {
    "value": lambda d: d["tree"]["v"].__setitem__(0, {"$": "pickle", "type": "builtins.int", "e": 0}),
    "dict-key": lambda d: d["tree"].update(k=[{"$": "pickle", "type": "builtins.str", "e": 0}, "ok"],
                                           v=[1, 1]),
    "inside-seq": lambda d: d["tree"]["v"].__setitem__(
        0, {"$": "seq", "t": "tuple", "v": [1, {"$": "pickle", "type": "x", "e": 0}]}),
    "inside-custom": lambda d: d["tree"]["v"].__setitem__(
        0, {"$": "custom", "name": "nobody", "v": {"$": "pickle", "type": "x", "e": 0}}),
    "nested-dict-key": lambda d: d["tree"]["v"].__setitem__(
        0, {"$": "dict", "k": [{"$": "pickle", "type": "x", "e": 0}], "v": [2]}),
}


@pytest.mark.parametrize("hide", list(PICKLE_HIDING_PLACES.values()), ids=list(PICKLE_HIDING_PLACES))
def test_crafted_hostile_pickle_is_refused(tmp_path, hide):
    marker = tmp_path / "PWNED"
    dst = _crafted_pickle_file(tmp_path, marker, hide)
    try:
        lazyckpt.load(dst)
    except lazyckpt.CheckpointError:
        pass
    except BaseException as e:      # noqa: BLE001
        pytest.fail(f"raw {type(e).__name__}: {e}")
    else:
        pytest.fail("a file with a pickle node loaded without allow_pickle")
    assert not marker.exists()


def test_crafted_hostile_pickle_runs_only_with_opt_in(tmp_path):
    marker = tmp_path / "PWNED"
    dst = _crafted_pickle_file(tmp_path, marker, PICKLE_HIDING_PLACES["value"])
    with pytest.raises(lazyckpt.UnsafeObjectError) as info:
        lazyckpt.load(dst)
    assert info.value.entry == "payload" and not marker.exists()
    lazyckpt.load(dst, allow_pickle=True)
    assert marker.exists()


def test_bytes_node_never_unpickles(tmp_path):
    """Only the pickle tag may unpickle: a bytes node over a pickle stream gives bytes
    (or an error), never an object."""
    marker = tmp_path / "PWNED"
    payload = pickle.dumps(EvilExec(marker))
    path = tmp_path / "b.lzc"
    lazyckpt.save({"payload": payload}, path)
    for allow in (False, True):
        assert lazyckpt.load(path, allow_pickle=allow)["payload"] == payload
    # Even when the entry claims to be a pickle.
    doc = parse(path).doc
    doc["entries"][0]["kind"] = "pickle"
    dst = tmp_path / "b2.lzc"
    write_with_footer(path, dst, doc)
    for allow in (False, True):
        try:
            value = lazyckpt.load(dst, allow_pickle=allow)["payload"]
            assert value == payload
        except lazyckpt.CorruptCheckpointError:
            pass
    assert not marker.exists()


def test_custom_node_without_registered_provider(multi_file, tmp_path):
    dst = _footer_variant(multi_file, tmp_path, lambda d: _replace_value(
        d, "step", {"$": "custom", "name": "evil.module.Thing", "v": 1}))
    with pytest.raises(lazyckpt.CheckpointError, match="evil.module.Thing"):
        lazyckpt.load(dst)
