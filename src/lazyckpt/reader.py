"""Reading a checkpoint file: validated footer, parallel aligned reads,
checksums verified, each entry's bytes returned as a CPU UntypedStorage.

Entries are grouped into runs of adjacent entries (at most one chunk long
each, or one large entry); each run is read with O_DIRECT straight into a
fresh page-aligned buffer that then backs the returned storages, so the bytes
are copied once, by the disk, and never again on CPU loads.
"""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
from typing import Dict, Iterable, List, Tuple

import torch

from . import format as fmt
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .fileio import open_for_read, pread_into
from .knobs import Options


class CheckpointFile:
    """An open checkpoint file: its footer is parsed and validated on open."""

    def __init__(self, path: str, options: Options):
        self.path = path
        self.options = options
        try:
            self.size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such checkpoint file", path=path) from None
        if self.size < fmt.HEADER_BYTES + fmt.TRAILER_BYTES:
            raise CorruptCheckpointError(f"{path}: truncated file ({self.size} bytes)", path=path)
        with open(path, "rb") as f:
            fmt.check_header(f.read(fmt.HEADER_BYTES), path)
            f.seek(self.size - fmt.TRAILER_BYTES)
            trailer = fmt.parse_trailer(f.read(fmt.TRAILER_BYTES), self.size, path,
                                        options.max_footer_bytes)
            f.seek(trailer.footer_offset)
            raw = f.read(trailer.footer_length)
        if len(raw) != trailer.footer_length or fmt.checksum(raw) != trailer.footer_checksum:
            raise CorruptCheckpointError(f"{path}: footer checksum mismatch (file damaged)", path=path)
        self.footer = fmt.decode_footer(raw, trailer.footer_offset, path)

    @property
    def entries(self) -> List[fmt.Entry]:
        return self.footer.entries

    def read_entries(self, indices: Iterable[int], pool: cf.ThreadPoolExecutor
                     ) -> Dict[int, torch.UntypedStorage]:
        """Read (and verify) the given entries in parallel."""
        wanted = sorted(set(indices), key=lambda i: self.entries[i].offset)
        for i in wanted:
            if not 0 <= i < len(self.entries):
                raise CorruptCheckpointError(f"{self.path}: reference to missing entry {i}",
                                             path=self.path, entry=str(i))
        out: Dict[int, torch.UntypedStorage] = {}
        runs = self._plan_runs([i for i in wanted if self.entries[i].length > 0])
        for i in wanted:
            if self.entries[i].length == 0:
                out[i] = torch.UntypedStorage(0)
        if not runs:
            return out
        fd, direct = open_for_read(self.path, self.options.o_direct)
        try:
            jobs = []
            buffers = []
            for run in runs:
                start = self.entries[run[0]].offset
                end = self.entries[run[-1]].offset + self.entries[run[-1]].length
                buf = mmap.mmap(-1, fmt.align_up(end - start),
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                buffers.append((run, start, end, buf))
                view = memoryview(buf)
                step = self.options.chunk_bytes
                for lo in range(0, fmt.align_up(end - start), step):
                    hi = min(lo + step, fmt.align_up(end - start))
                    jobs.append(pool.submit(self._read_piece, fd, view[lo:hi], start + lo,
                                            min(hi, end - start) - lo))
            for job in jobs:
                job.result()
            verify = []
            for run, start, end, buf in buffers:
                view = memoryview(buf)
                for i in run:
                    e = self.entries[i]
                    piece = view[e.offset - start:e.offset - start + e.length]
                    if self.options.verify_checksums:
                        verify.append(pool.submit(self._verify, i, piece))
                    out[i] = torch.frombuffer(piece, dtype=torch.uint8).untyped_storage()
            for job in verify:
                job.result()
        finally:
            os.close(fd)
        return out

    def _plan_runs(self, indices: List[int]) -> List[List[int]]:
        """Group entries that sit next to each other in the file into one read."""
        runs: List[List[int]] = []
        limit = self.options.chunk_bytes
        for i in indices:
            e = self.entries[i]
            if runs:
                last = self.entries[runs[-1][-1]]
                first = self.entries[runs[-1][0]]
                adjacent = fmt.align_up(last.offset + last.length) == e.offset
                if adjacent and e.offset + e.length - first.offset <= limit:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        return runs

    def _read_piece(self, fd: int, buf: memoryview, offset: int, needed: int) -> None:
        got = pread_into(fd, buf, offset, self.path)
        if got < needed:
            raise CorruptCheckpointError(f"{self.path}: truncated file (wanted {needed} bytes at "
                                         f"offset {offset}, got {got})", path=self.path)

    def _verify(self, index: int, data: memoryview) -> None:
        e = self.entries[index]
        block = self.footer.block_bytes
        for (a, b), expected in zip(fmt.block_spans(e.offset, e.length, block), e.checksums):
            if fmt.checksum(data[a - e.offset:b - e.offset]) != expected:
                raise CorruptCheckpointError(
                    f"{self.path}: checksum mismatch in entry {e.name!r} at file offset {a} "
                    f"(data damaged)", path=self.path, entry=e.name)

    def verify_all(self, pool: cf.ThreadPoolExecutor) -> None:
        self.read_entries(range(len(self.entries)), pool)
