"""The safetensors layout, written by lazyckpt's engine (docs/FORMAT.md §13.1).

::

    [0, 8)          u64 little-endian N: the header's length
    [8, 8 + N)      UTF-8 JSON: {"__metadata__": {str: str}, name: {"dtype", "shape",
                    "data_offsets": [begin, end]}, ...}, padded with spaces so that
                    8 + N is a multiple of 4096 (safetensors allows trailing spaces)
    [8 + N, end)    the tensors' raw bytes, packed with no gap (the format
                    requires it), largest element size first then by name, as
                    safetensors orders them: each tensor is aligned to its element

The header is made at ``save()`` (every offset is known then); the tensors'
bytes go from the live state through the host cache to the file. No checksum
is computed: the format has none.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Dict, List, Mapping, Optional

import torch

from lazyckpt.formats.datafile import align_up
from lazyckpt.state.providers import Source, _flat_bytes_of_storage
from .foreign_formats import FileLayout

#: torch dtype -> safetensors dtype name: those safetensors.torch (0.4-0.8) loads.
DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("float8_e4m3fnuz", "F8_E4M3FNUZ"), ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
                     ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code

#: safetensors refuses larger headers (MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000
DATA_ALIGNMENT = 4096


class SafetensorsLayout(FileLayout):
    """A flat ``{str: Tensor}`` dict as one safetensors file.

    Refused, with the key named: anything but a flat dict of string keys and
    dense (strided) tensors; a dtype safetensors does not load; tensors whose
    bytes overlap (tied weights: as ``safetensors.torch.save_file``, which
    refuses them too; drop the duplicate keys, as ``save_pretrained`` does).
    Views that do not overlap are written each with its own bytes. A
    non-contiguous tensor is copied to a contiguous one at ``save()`` (on the
    caller's thread: the copy is the capture of that tensor).
    """

    def __init__(self, state: Any, metadata: Optional[Dict[str, Any]] = None):
        super().__init__()
        tensors = _check_state(state)
        _refuse_overlaps(tensors)
        header: Dict[str, Any] = {}
        if metadata:
            if not isinstance(metadata, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                            for k, v in metadata.items()):
                raise TypeError("file_format='safetensors': metadata must map str to str (the format's "
                                "__metadata__); convert values with str() or json.dumps()")
            header["__metadata__"] = dict(metadata)
        order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
        offset, placed = 0, []
        for name in order:
            t = tensors[name]
            if not t.is_contiguous():
                t = t.contiguous()
            nbytes = t.numel() * t.element_size()
            header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + nbytes]}
            placed.append((name, t, offset, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        data_start = align_up(8 + len(raw), DATA_ALIGNMENT)
        raw += b" " * (data_start - 8 - len(raw))
        if len(raw) > MAX_HEADER_BYTES:
            raise ValueError(f"file_format='safetensors': the header would be {len(raw)} bytes, over the "
                             f"format's limit of {MAX_HEADER_BYTES}; split the state into several files")
        self._items.append((0, 0, 8 + len(raw), memoryview(struct.pack("<Q", len(raw)) + raw)))
        for name, t, begin, nbytes in placed:
            if nbytes == 0:
                continue
            start = t.storage_offset() * t.element_size()
            data = _flat_bytes_of_storage(t)[start:start + nbytes]
            self.sources.append(Source("data", data=data, name=name, length=nbytes, tensors=[t]))
            self._items.append((len(self._items), data_start + begin, nbytes, data))
        self.size = data_start + offset


def _check_state(state: Any) -> Dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise TypeError(f"file_format='safetensors' holds a flat dict of tensors, not a "
                        f"{type(state).__qualname__}; use file_format='torch' or 'lazyckpt' for other state")
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"file_format='safetensors': key {key!r} is a {type(key).__qualname__}; "
                            f"safetensors names tensors with strings")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"file_format='safetensors': {key!r} is a {type(value).__qualname__}, not a "
                            f"tensor; safetensors holds tensors only (nested state: file_format='torch' or "
                            f"'lazyckpt'; strings: metadata=)")
        if value.layout != torch.strided:
            raise TypeError(f"file_format='safetensors': {key!r} is a {value.layout} tensor; safetensors "
                            f"holds dense tensors only (call .to_dense())")
        if value.device.type == "meta":
            raise ValueError(f"file_format='safetensors': {key!r} is on the meta device: it has no bytes")
        if value.dtype not in DTYPES:
            raise TypeError(f"file_format='safetensors': {key!r} has dtype {value.dtype}, which safetensors "
                            f"cannot hold (it holds {', '.join(sorted(DTYPES.values()))})")
    return dict(state)


def _refuse_overlaps(tensors: Dict[str, torch.Tensor]) -> None:
    """Tensors that share bytes: refused as ``safetensors.torch.save_file`` does."""
    by_storage: Dict[Any, List[tuple]] = {}
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            continue
        storage = t.untyped_storage()
        begin = t.storage_offset() * t.element_size()
        # The bytes a (possibly strided) tensor spans, first to last element.
        span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1) * t.element_size()
        by_storage.setdefault((t.device, storage.data_ptr()), []).append((begin, begin + span, name))
    shared = []
    for ranges in by_storage.values():
        ranges.sort()
        end, holder = ranges[0][1], ranges[0][2]
        for begin, stop, name in ranges[1:]:
            if begin < end:
                shared.append(f"{holder!r} and {name!r}")
            if stop > end:
                end, holder = stop, name
    if shared:
        raise ValueError(f"file_format='safetensors': tensors share memory: {', '.join(shared)}; safetensors "
                         f"stores each tensor's bytes once and cannot keep them tied. Save one of each group "
                         f"(transformers' save_pretrained drops tied weights; safetensors.torch.save_model "
                         f"does the same) or clone one of them")
