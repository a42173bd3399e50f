"""DCP's own data file (``__<rank>_0.distcp``), written by lazyckpt's engine (docs/FORMAT.md §13.3).

``torch.distributed.checkpoint.FileSystemReader`` -- what ``dcp.load(...,
checkpoint_id=)`` uses, and torchtitan with it -- reads each item of a rank's
plan from ``(relative_path, offset, length)`` in ``.metadata``: a ``BYTE_IO``
item is its bytes there, a tensor is a whole ``torch.save`` zip there, read
with ``torch.load(weights_only=True)`` through a view of the file that starts
at ``offset``. This layout is those runs, one after the other: each tensor is
a :class:`~lazyckpt.saving.torchzip.TorchZipLayout` of its own (its offsets
relative to its start, as ``torch.save`` into DCP's stream makes them) placed
at a page boundary, so its storage bytes stay aligned in the file and go from
the live (or staged) state through the host cache to the disk, never pickled
or copied by Python. The per-record CRC-32 fields are patched at the end, as
for a ``file_format="torch"`` file.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from lazyckpt.formats.datafile import align_up
from .foreign_formats import CrcField, FileLayout, crc_kept_blocks, crc_patches
from .torchzip import PAGE_ALIGNMENT, TorchZipLayout, fast_crc32

#: DCP's file name for a rank's data (FileSystemWriter: ``{prefix}{index}{suffix}``).
DISTCP_SUFFIX = ".distcp"


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with a storage of exactly its own bytes. ``torch.save`` writes a
    view's whole storage, and DCP's items are often views (a staged state is one
    arena; a shard is a piece of a parameter): DCP's own writer clones them. A
    contiguous CPU view is aliased instead -- same memory, a storage that starts
    and ends with it -- so the bytes still move only once, from the state to the
    file; a strided view is cloned, as DCP does."""
    if tensor.device.type != "cpu":
        return tensor                   # (write_data has moved every tensor to the host)
    if not tensor.is_contiguous():
        return tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes:
        return tensor
    if nbytes == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    alias = torch.from_numpy(tensor.detach().reshape(-1).view(torch.uint8).numpy())
    return alias.view(tensor.dtype).view(tensor.shape)


class DcpFileLayout(FileLayout):
    """``entries``: (key, bytes or tensor), in the order they go into the file;
    :attr:`spans` maps each key to its (offset, length), DCP's ``_StorageInfo``."""

    span_checksum = staticmethod(fast_crc32)

    def __init__(self, entries: List[Tuple[str, Any]]):
        super().__init__()
        self.spans: Dict[str, Tuple[int, int]] = {}
        self._archives: List[Tuple[TorchZipLayout, int, Dict[int, int]]] = []   # archive, base, its index -> ours
        cursor = 0
        for key, payload in entries:
            if isinstance(payload, torch.Tensor):
                base = align_up(cursor, PAGE_ALIGNMENT)
                archive = TorchZipLayout(own_storage(payload))
                index_of: Dict[int, int] = {}
                for index, offset, length, data in archive.items():
                    index_of[index] = len(self._items)
                    self._items.append((len(self._items), base + offset, length, data))
                self.sources.extend(archive.sources)
                self._archives.append((archive, base, index_of))
                self.spans[key] = (base, archive.size)
                cursor = base + archive.size
            else:
                data = memoryview(bytes(payload))
                if len(data):
                    self._items.append((len(self._items), cursor, len(data), data))
                self.spans[key] = (cursor, len(data))
                cursor += len(data)
        self.size = cursor

    def crc_fields(self, in_place: bool = True) -> List[CrcField]:
        """Each archive's CRC fields, at the file's item indices and offsets
        (``in_place=False``: the central directories' only, see TorchZipLayout)."""
        return [(index_of[index], base + data_offset, size, [base + at for at in ats])
                for archive, base, index_of in self._archives
                for index, data_offset, size, ats in archive.crc_fields(in_place)]

    def kept_blocks(self, in_place: bool = True) -> List[int]:
        return crc_kept_blocks(self.crc_fields(in_place))

    def patches(self, sums: Dict[int, List[int]], kept: Dict[int, bytes], block_bytes: int,
                in_place: bool = True) -> List[Tuple[int, bytes]]:
        # The writer's span checksums are per cache block of the whole file: each record's CRC
        # is combined from them at its absolute offset (its archive's own offsets are relative).
        return crc_patches(self.crc_fields(in_place), sums, kept, block_bytes)
