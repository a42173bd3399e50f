"""Checks a ``torch.save`` zip before anything trusts its bytes: torch's reader
(``torch.load``, mmap or not) does not verify the records' CRC-32s, so a
damaged data record loads as other values with no error.

Every record of the central directory is checked against the file: its
local header where it says (signature, name), its data within the file, its CRC-32 fields (local header or data descriptor,
central entry) equal, and its bytes against that CRC-32 (ISA-L's crc32 where
installed, as the writer computes it, else zlib's). A CRC of 0 over a
non-empty record is taken as "not computed": ``torch.serialization.
set_crc32_options(False)`` writes 0. Failures are CorruptCheckpointError
naming the file and the record."""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
from typing import Union

from lazyckpt.errors import CorruptCheckpointError
from lazyckpt.saving.torchzip import fast_crc32

#: CRC in slices: a GIL-holding zlib over a whole multi-GB record is fine, but a
#: slice keeps a memoryview of a mapping small enough to release promptly.
_SLICE = 64 << 20

#: The DOS directory bit of a zip entry's external attributes (miniz tests it).
_DOS_DIRECTORY = 0x10


def check_torch_zip(source: Union[str, bytes, bytearray, memoryview], label: str) -> None:
    """Verify every record of the zip at ``source`` (a path, or the zip's bytes);
    ``label`` names it in errors."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        _check(memoryview(source), label)
        return
    size = os.path.getsize(source)
    if size == 0:
        raise CorruptCheckpointError(f"{label}: empty file, not a torch.save zip", path=label)
    with open(source, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        view = memoryview(mapping)
        try:
            _check(view, label)
        finally:
            view.release()
    finally:
        mapping.close()


def _check(view: memoryview, label: str) -> None:
    size = len(view)
    try:
        with zipfile.ZipFile(_ViewFile(view)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError, struct.error,
            NotImplementedError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{label}: not a readable zip (its central directory is damaged: "
                                     f"{exc})", path=label) from None
    for info in infos:
        name = info.filename
        at = info.header_offset
        if name.endswith("/") or info.external_attr & _DOS_DIRECTORY:
            # torch's reader (miniz) takes such a record for a directory: it reads none
            # of its bytes and checks no CRC, so the tensor would load as other values.
            raise CorruptCheckpointError(f"{label}: record {name!r} is marked as a directory (external "
                                         f"attributes {info.external_attr:#x}); torch.save writes none",
                                         path=label, entry=name)
        if not 0 <= at <= size - 30:
            raise CorruptCheckpointError(f"{label}: record {name!r}: its header offset {at} is outside the "
                                         f"file ({size} bytes)", path=label, entry=name)
        signature, = struct.unpack_from("<I", view, at)
        if signature != 0x04034B50:
            raise CorruptCheckpointError(f"{label}: record {name!r}: no local header at byte {at}",
                                         path=label, entry=name)
        name_len, extra_len = struct.unpack_from("<HH", view, at + 26)
        start = at + 30 + name_len + extra_len
        stored = info.compress_size
        if start + stored > size or info.file_size < 0 or stored < 0:
            raise CorruptCheckpointError(f"{label}: record {name!r} claims {stored} bytes at byte {start}, "
                                         f"past the end of the file ({size} bytes)", path=label, entry=name)
        if info.compress_type != zipfile.ZIP_STORED:
            continue           # torch writes stored records only; a compressed one is zipfile's to check
        if stored != info.file_size:
            raise CorruptCheckpointError(f"{label}: record {name!r}: stored size {stored} differs from its "
                                         f"size {info.file_size}", path=label, entry=name)
        # The CRC is written twice: in the local header, or (flag bit 3, as torch's
        # writer does) in a data descriptor after the data, and in the central entry.
        # They must agree where both are written, so that one damaged field cannot turn
        # the check off (a writer that patches only the central entry, as lazyckpt's
        # DCP writer does on an object store, leaves the local one 0).
        flags, local_crc = struct.unpack_from("<H", view, at + 6)[0], struct.unpack_from("<I", view, at + 14)[0]
        if flags & 8:
            desc = start + stored
            if bytes(view[desc:desc + 4]) == b"PK\x07\x08":
                desc += 4
            if desc + 4 > size:
                raise CorruptCheckpointError(f"{label}: record {name!r}: its data descriptor is past the end "
                                             f"of the file", path=label, entry=name)
            local_crc = struct.unpack_from("<I", view, desc)[0]
        if local_crc != info.CRC and local_crc != 0:
            raise CorruptCheckpointError(f"{label}: record {name!r}: the CRC-32 of its local header or data "
                                         f"descriptor ({local_crc:#010x}) differs from its central entry's "
                                         f"({info.CRC:#010x}) (the file is damaged)", path=label, entry=name)
        if info.CRC == 0 and stored:
            continue
        crc = 0
        for lo in range(start, start + stored, _SLICE):
            crc = fast_crc32(view[lo:min(start + stored, lo + _SLICE)], crc)
        if crc != info.CRC:
            raise CorruptCheckpointError(f"{label}: record {name!r} fails its CRC-32 (the file is damaged)",
                                         path=label, entry=name)


class _ViewFile:
    """A read-only, seekable file over a memoryview (zipfile reads the central
    directory through it without copying the whole file)."""

    def __init__(self, view: memoryview):
        self.view = view
        self.pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, len(self.view))[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the file")
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n is None or n < 0 else min(len(self.view), self.pos + n)
        out = self.view[self.pos:end].tobytes() if self.pos < end else b""
        self.pos = max(self.pos, end)
        return out

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass
