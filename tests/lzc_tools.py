"""Helpers shared by the test modules: reading and rewriting the on-disk
format by hand (independently of the library's own parser) and comparing
loaded state bit-exactly."""

from __future__ import annotations

import collections
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import torch
import xxhash

HEADER = struct.Struct("<8sII")
TRAILER = struct.Struct("<QQQ8s")
MAGIC = b"LAZYCKPT"
FOOTER_MAGIC = b"LZCKFOOT"
PAGE = 4096


@dataclass
class Parsed:
    data: bytes
    footer_offset: int
    footer_length: int
    footer_digest: int
    footer_raw: bytes
    doc: Dict[str, Any]


def parse(path) -> Parsed:
    """Parse a checkpoint file with nothing but struct/json/xxhash."""
    with open(path, "rb") as f:
        data = f.read()
    offset, length, digest, magic = TRAILER.unpack(data[-TRAILER.size:])
    assert magic == FOOTER_MAGIC
    raw = data[offset:offset + length]
    return Parsed(data, offset, length, digest, raw, json.loads(raw))


def write_with_footer(src, dst, doc: Optional[Dict[str, Any]] = None, *, raw: Optional[bytes] = None,
                      digest: Optional[int] = None) -> None:
    """Copy ``src`` to ``dst`` with its footer replaced by ``doc`` (or ``raw``
    bytes) and a consistent trailer (offset, length, xxh3-64 of the footer)."""
    p = parse(src)
    footer = raw if raw is not None else json.dumps(doc, separators=(",", ":")).encode()
    if digest is None:
        digest = xxhash.xxh3_64_intdigest(footer)
    body = p.data[:p.footer_offset] + footer + TRAILER.pack(p.footer_offset, len(footer), digest,
                                                            FOOTER_MAGIC)
    with open(dst, "wb") as f:
        f.write(body)


def flip_byte(path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def entry_by_name(doc: Dict[str, Any], name: str) -> Dict[str, Any]:
    for e in doc["entries"]:
        if e["name"] == name:
            return e
    raise KeyError(name)


# --------------------------------------------------------------------------- comparison


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in logical order. Works for every dtype
    (even those with no copy kernel) by reading the storage as uint8."""
    if t.numel() == 0:
        return b""
    k = t.element_size()
    raw = torch.empty((0,), dtype=torch.uint8).set_(t.untyped_storage())
    elems = raw.as_strided(tuple(t.shape) + (k,), tuple(s * k for s in t.stride()) + (1,),
                           t.storage_offset() * k)
    return elems.contiguous().numpy().tobytes()


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _float_same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_same(a: Any, b: Any, where: str = "<root>") -> None:
    """Bit-exact structural equality: container types, key order, dtypes,
    shapes, strides, storage offsets and every byte of every tensor/array."""
    assert type(a) is type(b), f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        assert a.device == b.device, where
        assert a.requires_grad == b.requires_grad, where
        if a.numel():
            assert a.stride() == b.stride(), f"{where}: stride {a.stride()} != {b.stride()}"
            assert a.storage_offset() == b.storage_offset(), where
        assert tensor_bytes(a) == tensor_bytes(b), f"{where}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{where}: array differs"
    elif isinstance(a, (np.str_, np.bytes_)):
        # As the str/bytes they are (a[:]): numpy's str(), repr() and item()
        # strip trailing NULs, so np.str_('\\x00') would show as np.str_('').
        assert a.dtype == b.dtype and a[:] == b[:], f"{where}: {a.dtype} {a[:]!a} != {b.dtype} {b[:]!a}"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, (dict, collections.OrderedDict)):
        assert list(a.keys()) == list(b.keys()), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b), f"{where}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert _float_same(a, b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, complex):
        assert _float_same(a.real, b.real) and _float_same(a.imag, b.imag), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def clone_state(x: Any, device: Any = None) -> Any:
    """A copy of a nested state whose tensors are detached clones (moved to
    ``device`` if given), keeping container types: a reference taken at save()."""
    if isinstance(x, dict):
        return type(x)((k, clone_state(v, device)) for k, v in x.items())
    if isinstance(x, list):
        return [clone_state(v, device) for v in x]
    if isinstance(x, torch.Tensor):
        x = x.detach()
        return x.to(device, copy=True) if device is not None else x.clone()
    return x


def tensors_with_paths(x: Any, where: str = "") -> list:
    """(path, tensor) of every tensor in a nested state, in walk order."""
    out = []
    if isinstance(x, torch.Tensor):
        out.append((where, x))
    elif isinstance(x, dict):
        for k, v in x.items():
            out += tensors_with_paths(v, f"{where}/{k}")
    elif isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        for i, v in enumerate(x):
            out += tensors_with_paths(v, f"{where}/{i}")
    return out


def assert_same_aliasing(original: Any, loaded: Any) -> None:
    """Two tensors share a storage after load exactly when they did before
    (tensors with empty storages are ignored: their pointers mean nothing)."""
    a = [(p, t) for p, t in tensors_with_paths(original) if t.untyped_storage().nbytes()]
    b = dict((p, t) for p, t in tensors_with_paths(loaded))
    for i, (p1, t1) in enumerate(a):
        for p2, t2 in a[i + 1:]:
            shared_before = storage_key(t1) == storage_key(t2)
            shared_after = storage_key(b[p1]) == storage_key(b[p2])
            assert shared_before == shared_after, \
                f"{p1} and {p2}: shared storage before={shared_before}, after={shared_after}"


def assert_same_model_and_optim(a, b):
    """Two (model state dict, optimizer per-parameter state) pairs are bit-identical."""
    (ma, oa), (mb, ob) = a, b
    assert ma.keys() == mb.keys() and oa.keys() == ob.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    for i in oa:
        for k in oa[i]:
            assert torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k])), (i, k)
