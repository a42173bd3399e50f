"""The ``torch.save`` zip layout, written by lazyckpt's engine (docs/FORMAT.md §13.2).

``torch.load`` (``weights_only=True`` or not, ``mmap=True`` too) reads a zip of
stored (uncompressed) records under one top-level folder::

    archive/data.pkl                  the state, pickled (protocol 2) with a persistent
                                      id ("storage", storage type, key, location, numel)
                                      in place of every storage: torch.save's own pickler
    archive/byteorder                 "little"
    archive/data/<key>                one record per storage: its raw bytes
    archive/version                   "3\\n"
    archive/.data/serialization_id    40 decimal digits
    central directory, zip64 end of central directory record and locator, end record

The pickle is made at ``save()`` with the persistent id function of
``torch.serialization._save``, so views, shared storages, Parameters,
``requires_grad`` and devices load exactly as from ``torch.save``. Storage
records are placed right after it, their data aligned (64 bytes like
torch, 4096 from 64 KiB up) by a padding extra field in the local header
(id "FB", as torch's writer pads), so every offset is known before any byte
moves and the storages' bytes go from the live state through the host
cache to the file.

Each record carries its CRC-32 (in its local header and in the central
directory, no data descriptors): the writer threads compute one CRC per
(record, cache block) span from the host cache and the layout combines them
and patches the header blocks at the end (lazyckpt/saving/foreign_formats.py); ISA-L's
crc32 where ``isal`` is installed (the ``torch-format`` extra), else zlib's. Not
written: ``.format_version`` and ``.storage_alignment`` (torch >= 2.5 writes
them): with them torch may compute record offsets assuming its own writer's
exact layout (meta-device loads, ``calculate_storage_offsets``); without
them it reads every offset from the record's header, as for files of torch < 2.5.
"""

from __future__ import annotations

import io
import pickle
import struct
import uuid
import zlib
from typing import Any, Dict, List, Tuple

import torch
from torch.serialization import location_tag, normalize_storage_type

from lazyckpt.formats.datafile import align_up
from lazyckpt.state.providers import Source
from .foreign_formats import CrcField, FileLayout, crc_kept_blocks, crc_patches

try:        # ISA-L's CRC-32 (PCLMUL): ~3.5 GB/s per core here against zlib's 0.4-1.4 (BENCHMARKS.md §19)
    from isal.isal_zlib import crc32 as fast_crc32
except ImportError:                                 # pragma: no cover (the torch-format extra installs it)
    fast_crc32 = zlib.crc32

PREFIX = "archive/"
#: torch.save's default pickle protocol (torch.serialization.DEFAULT_PROTOCOL).
PICKLE_PROTOCOL = 2
#: The file format version torch's writer records (kProducedFileFormatVersion).
VERSION = b"3\n"
#: Field values at or above this go to the zip64 extra field.
ZIP64_LIMIT = 0xFFFFFFFF
#: Storage data alignment: torch's for small records, a page from this size up.
SMALL_ALIGNMENT, PAGE_ALIGNMENT, PAGE_ALIGN_FROM = 64, 4096, 64 << 10
_DOS_DATE = 0x21                # 1980-01-01: zip's epoch (torch writes 0)


def pickle_state(state: Any) -> Tuple[bytes, Dict[str, torch.UntypedStorage]]:
    """``data.pkl`` and the storages by key, as ``torch.serialization._save``
    makes them (its persistent id function, minus the fake-tensor cases)."""
    storages: Dict[str, torch.UntypedStorage] = {}
    id_map: Dict[int, str] = {}
    storage_dtypes: Dict[int, torch.dtype] = {}

    def persistent_id(obj: Any) -> Any:
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            storage_dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            storage_numel = obj._size()
        else:
            storage = obj
            storage_dtype = torch.uint8
            storage_type = normalize_storage_type(type(obj))
            storage_numel = storage.nbytes()
        if storage.device.type == "meta":
            raise ValueError("file_format='torch': a tensor on the meta device has no bytes to save")
        if storage.data_ptr() != 0:
            known = storage_dtypes.setdefault(storage.data_ptr(), storage_dtype)
            if known != storage_dtype:
                raise ValueError("file_format='torch': tensors or storages view the same data as different "
                                 "dtypes, which torch.save refuses too")
        key = id_map.setdefault(storage._cdata, str(len(id_map)))
        storages[key] = storage
        return ("storage", storage_type, key, location_tag(storage), storage_numel)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return persistent_id(obj)

    buf = io.BytesIO()
    _Pickler(buf, protocol=PICKLE_PROTOCOL).dump(state)
    return buf.getvalue(), storages


class TorchZipLayout(FileLayout):
    """Any state ``torch.save`` takes, as the zip ``torch.load`` reads."""

    span_checksum = staticmethod(fast_crc32)
    #: (data.pkl, {record key: storage or flat uint8 tensor}); a subclass may pickle differently.
    pickle_state = staticmethod(pickle_state)

    def __init__(self, state: Any, force_zip64: bool = False):
        super().__init__()
        #: Tests: write the zip64 fields whatever the sizes (readers must take them).
        self._limit = 0 if force_zip64 else ZIP64_LIMIT
        data_pkl, storages = self.pickle_state(state)
        records: List[Tuple[str, Any]] = [("data.pkl", data_pkl), ("byteorder", b"little")]
        for key, storage in storages.items():
            # A flat uint8 tensor: the record's bytes as given (integrations/deepspeed_files.py).
            flat = storage if isinstance(storage, torch.Tensor) else \
                torch.empty((0,), dtype=torch.uint8, device=storage.device).set_(storage)
            records.append((f"data/{key}", flat))
        records.append(("version", VERSION))
        records.append((".data/serialization_id", f"{uuid.uuid4().int:040d}"[-40:].encode()))

        cursor = 0
        central: List[bytes] = []
        self._crc_fields: List[Tuple[int, int, int, int]] = []      # item, data offset, size, header offset
        pending_cd: List[Tuple[int, int, int]] = []                 # item, central entry index, local crc at
        for name, payload in records:
            is_storage = isinstance(payload, torch.Tensor)
            size = payload.numel() if is_storage else len(payload)
            name_bytes = (PREFIX + name).encode("ascii")
            big = size >= self._limit
            extra = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
            fixed = cursor + 30 + len(name_bytes) + len(extra)
            if is_storage:
                alignment = PAGE_ALIGNMENT if size >= PAGE_ALIGN_FROM else SMALL_ALIGNMENT
                data_offset = align_up(fixed + 4, alignment)
                pad = data_offset - fixed - 4
                extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad     # "FB": torch's padding field
                crc = 0                 # patched once the writer threads have checksummed the bytes
            else:
                data_offset = fixed
                crc = zlib.crc32(payload)
            field = ZIP64_LIMIT if big else size
            local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if big else 20, 0, 0, 0, _DOS_DATE, crc,
                                field, field, len(name_bytes), len(extra)) + name_bytes + extra
            self._items.append((len(self._items), cursor, len(local), memoryview(local)))
            if size:
                index = len(self._items)
                if is_storage:
                    self.sources.append(Source("data", data=payload, name=PREFIX + name, length=size))
                    pending_cd.append((index, len(central), cursor + 14))
                    self._crc_fields.append((index, data_offset, size, cursor))
                self._items.append((index, data_offset, size, payload if is_storage else memoryview(payload)))
            central.append(self._central_entry(name_bytes, size, crc, cursor))
            cursor = data_offset + size

        cd_offset = cursor
        self._patch_at: Dict[int, List[int]] = {}
        entry_offsets, pos = [], cd_offset
        for entry in central:
            entry_offsets.append(pos)
            pos += len(entry)
        for index, entry, local_crc_at in pending_cd:
            self._patch_at[index] = [local_crc_at, entry_offsets[entry] + 16]
        cd = b"".join(central)
        tail = self._end_records(len(central), cd_offset, len(cd))
        self._items.append((len(self._items), cd_offset, len(cd) + len(tail), memoryview(cd + tail)))
        self.size = cd_offset + len(cd) + len(tail)

    def _central_entry(self, name: bytes, size: int, crc: int, header_offset: int) -> bytes:
        fields = []
        if size >= self._limit:
            fields += [size, size]
        if header_offset >= self._limit:
            fields.append(header_offset)
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        sized = ZIP64_LIMIT if size >= self._limit else size
        offset = ZIP64_LIMIT if header_offset >= self._limit else header_offset
        return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if fields else 20, 0, 0, 0, _DOS_DATE, crc,
                           sized, sized, len(name), len(extra), 0, 0, 0, 0, offset) + name + extra

    @staticmethod
    def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
        # Always the zip64 end records (torch's writer does the same), then the classic one.
        zip64_end = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        locator = struct.pack("<IIQI", 0x07064B50, 0, cd_offset + cd_size, 1)
        end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                          min(cd_size, ZIP64_LIMIT), min(cd_offset, ZIP64_LIMIT), 0)
        return zip64_end + locator + end

    def crc_fields(self, in_place: bool = True) -> List[CrcField]:
        """Every storage record's CRC-32 to patch: (item index, data offset, size,
        offsets of its CRC fields), offsets from the archive's start. Both fields
        (local header, central directory) where the output rewrites in place;
        else the central directory's only, at the archive's end: readers take the
        CRC from there (zipfile, lazyckpt's DCP reader), ``torch.load`` checks
        neither, and the local header keeps 0 (docs/FORMAT.md §13)."""
        return [(index, data_offset, size, self._patch_at[index] if in_place else self._patch_at[index][1:])
                for index, data_offset, size, _ in self._crc_fields]

    def kept_blocks(self, in_place: bool = True) -> List[int]:
        return crc_kept_blocks(self.crc_fields(in_place))

    def patches(self, sums: Dict[int, List[int]], kept: Dict[int, bytes], block_bytes: int,
                in_place: bool = True) -> List[Tuple[int, bytes]]:
        return crc_patches(self.crc_fields(in_place), sums, kept, block_bytes)
