"""File layouts other than lazyckpt's own, written by the same engine.

``lazyckpt.save(..., file_format=)`` and ``AsyncFileWriter.save(...,
file_format=)`` write files that the frameworks' own loaders read:

* ``"safetensors"`` (:mod:`lazyckpt.saving.safetensors_file`): what
  ``safetensors.torch.load_file`` and ``from_pretrained`` read;
* ``"torch"`` (:mod:`lazyckpt.saving.torchzip`): the zip that ``torch.save`` writes,
  read by ``torch.load`` (``weights_only`` and ``mmap`` included).

A layout is planned on the caller's thread, at ``save()``: every byte of the
file is placed before any byte moves. Tensor bytes stay in the live state
and are captured by the engine through the host cache and written by the
writer threads, as for lazyckpt's format; the small records (headers,
pickles) are bytes made at ``save()``. What cannot be known before the
tensor bytes are written (torch zip's CRC-32 fields) is patched at the end:
the writer keeps a copy of the 4 KiB blocks holding those fields as it
writes them and rewrites them once the writer threads' per-span checksums
are combined (:meth:`FileLayout.patches`).
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple

from lazyckpt.formats.datafile import ALIGNMENT, block_spans
from lazyckpt.state.providers import Flattened, Source
from .engine import FilePart

#: The file formats a single-file save writes.
FILE_FORMATS = ("lazyckpt", "torch", "safetensors")

#: (item index, file offset, length, data): data is a flat uint8 tensor of the
#: live state (captured by the engine) or a memoryview of bytes made at save().
Item = Tuple[int, int, int, Any]


def check_file_format(file_format: str) -> str:
    if file_format not in FILE_FORMATS:
        raise ValueError(f"file_format={file_format!r}: expected one of {', '.join(map(repr, FILE_FORMATS))}")
    return file_format


class FileLayout:
    """Where every byte of one file goes (see the module docstring).

    ``sources``: the live tensors' bytes (for the host cache's sizing, the
    device events and the capture barrier's storage pointers); ``items()``:
    every run of bytes of the file, sorted by offset, not overlapping (gaps
    are zeros); ``size``: the file's size."""

    #: Checksum of one (item, cache block) span, computed by the writer threads
    #: from the host cache; None: none needed.
    span_checksum: Optional[Callable[[Any], int]] = None

    def __init__(self) -> None:
        self.sources: List[Source] = []
        self._items: List[Item] = []
        self.size = 0

    def items(self) -> List[Item]:
        return self._items

    def kept_blocks(self, in_place: bool = True) -> List[int]:
        """Sorted 4 KiB-aligned offsets of the blocks :meth:`patches` rewrites.
        ``in_place=False``: the output cannot rewrite cheaply (an object's parts
        are uploaded once, ``Output.rewrites_in_place``): only the fields readers
        need, as few blocks as the format allows."""
        return []

    def patches(self, sums: Dict[int, List[int]], kept: Dict[int, bytes], block_bytes: int,
                in_place: bool = True) -> List[Tuple[int, bytes]]:
        """(aligned offset, bytes) runs to rewrite once every item is written;
        ``sums[i]``: item i's span checksums, one per cache block it overlaps;
        ``kept``: the kept blocks as written; ``in_place`` as for :meth:`kept_blocks`."""
        return []

    def flattened(self) -> Flattened:
        return Flattened(None, self.sources, [])

    def part(self, events: Optional[Dict[Any, Any]] = None) -> FilePart:
        """The engine's unit of work for this file."""
        return FilePart(self.flattened(), {}, events, layout=self)


# --------------------------------------------------------------------------- patching


def blocks_of(ranges: List[Tuple[int, int]]) -> List[int]:
    """The aligned blocks that byte ranges (offset, length) overlap."""
    out = set()
    for offset, length in ranges:
        for block in range(offset // ALIGNMENT * ALIGNMENT, offset + length, ALIGNMENT):
            out.add(block)
    return sorted(out)


def apply_patches(values: List[Tuple[int, bytes]], kept: Dict[int, bytes]) -> List[Tuple[int, bytes]]:
    """Write ``values`` (offset, bytes) into copies of the kept blocks; return
    the patched blocks merged into contiguous runs (few, large writes)."""
    blocks: Dict[int, bytearray] = {}
    for offset, data in values:
        for i, byte in enumerate(data):
            pos = offset + i
            block = pos // ALIGNMENT * ALIGNMENT
            buf = blocks.get(block)
            if buf is None:
                buf = blocks[block] = bytearray(kept[block])
            buf[pos - block] = byte
    runs: List[Tuple[int, bytearray]] = []
    for block in sorted(blocks):
        if runs and runs[-1][0] + len(runs[-1][1]) == block:
            runs[-1][1].extend(blocks[block])
        else:
            runs.append((block, bytearray(blocks[block])))
    return [(offset, bytes(data)) for offset, data in runs]


# --------------------------------------------------------------------------- CRC-32 of spans

_CRC_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC-32 polynomial (reflected), as zlib's crc32_combine."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


def _powers() -> List[int]:
    p, out = 1 << 30, []            # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _powers()


@functools.lru_cache(maxsize=256)
def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial: shifts a CRC past n zero bytes."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of A+B from crc32(A), crc32(B) and len(B) (zlib's, which Python's
    zlib module does not expose). Spans are checksummed by the writer threads
    in any order; this joins them."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def combined_crc(offset: int, length: int, sums: List[int], block_bytes: int) -> int:
    """The CRC-32 of an item from its per-block span CRCs."""
    crc = 0
    for (a, b), span_crc in zip(block_spans(offset, length, block_bytes), sums):
        crc = crc32_combine(crc, span_crc, b - a)
    return crc


#: (item index, absolute data offset, size, absolute offsets of the 4-byte CRC fields to patch).
CrcField = Tuple[int, int, int, List[int]]


def crc_kept_blocks(fields: List[CrcField]) -> List[int]:
    """The blocks holding CRC fields: kept as written, patched at the end."""
    return blocks_of([(at, 4) for _, _, _, ats in fields for at in ats])


def crc_patches(fields: List[CrcField], sums: Dict[int, List[int]], kept: Dict[int, bytes],
                block_bytes: int) -> List[Tuple[int, bytes]]:
    """Each item's CRC-32, combined from the writer threads' span CRCs at its
    absolute offset, written into its fields (:meth:`FileLayout.patches`)."""
    values = []
    for index, data_offset, size, ats in fields:
        crc = struct.pack("<I", combined_crc(data_offset, size, sums[index], block_bytes))
        values += [(at, crc) for at in ats]
    return apply_patches(values, kept)


# --------------------------------------------------------------------------- building


