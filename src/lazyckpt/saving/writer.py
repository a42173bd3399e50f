"""The save pipeline for one checkpoint file.

Stages, all overlapped::

    capture (one thread)        writers (N threads)
    --------------------        -------------------
    take a free cache chunk  ->  [wait for the chunk's copy event (CUDA)]
    copy the bytes of every      write it at its file offset (O_DIRECT), while
    entry that falls in the      a checksum thread hashes each entry's piece
    chunk's file range           give the chunk back to the cache

    serializer (one thread): pickles objects while tensors are written; their
    bytes are appended after the tensors once ready.

Tensor entries get their offsets before any byte moves, so their chunks are
written as soon as they are filled. The file is written under a temporary
name; committing it (rename, manifests) is the caller's job.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from lazyckpt import checksums
from lazyckpt.formats import datafile as fmt
from lazyckpt.knobs import Options
from lazyckpt.state.providers import Source
from lazyckpt.storage.base import Output
from .capture import DeviceCopier, wait_copies
from .hostcache import HostCache


class Aborted(Exception):
    """Internal: the job was cancelled or a sibling stage failed."""


@dataclass
class _Item:
    index: int          # entry index
    offset: int         # absolute file offset
    length: int
    data: Any           # flat uint8 tensor or memoryview


@dataclass
class WriteStats:
    bytes_written: int = 0
    capture_s: float = 0.0        # from start until every byte left the live state
    flush_s: float = 0.0          # from start until the file is durable
    file_bytes: int = 0


class FileWriteJob:
    """Writes ``tree`` and ``sources`` to ``path``. Not reusable.

    ``snapshot_done`` is set once every byte has been copied out of the
    caller's state (into the cache or to disk) and every object serialized:
    from then on the caller may modify the state freely. ``on_captured`` is
    called (on the thread running the job) at that moment, on success only.
    ``capture_events`` are the CUDA events recorded at ``save()``, by device.
    """

    def __init__(self, path: str, tree: Any, sources: List[Source], metadata: Dict[str, Any],
                 options: Options, cache: HostCache, writers: cf.ThreadPoolExecutor,
                 serializer: cf.ThreadPoolExecutor, capture_events: Optional[Dict[Any, Any]] = None,
                 on_captured: Optional[Callable[[], None]] = None, align_size: bool = False,
                 layout: Any = None, *, open_output: Callable[[str, Options, int], Output]):
        self.path = path
        #: Opens the file (path, options, block bytes): the commit strategy's store's
        #: (a local file, O_DIRECT or buffered; an object's multipart upload).
        self._open_output = open_output
        #: A foreign file layout (lazyckpt/saving/foreign_formats.py: torch zip, safetensors)
        #: instead of lazyckpt's own; None for lazyckpt's.
        self.layout = layout
        #: The per-(entry, block) checksum the writer threads compute.
        self._span_sum = fmt.checksum if layout is None else layout.span_checksum
        #: File blocks the layout patches at the end, copied as they are written.
        self._keep: List[int] = []
        self._kept: Dict[int, bytes] = {}
        #: Pad the footer with JSON whitespace so the file size is a multiple of
        #: 4 KiB: the ranks of a multi-rank step then mostly share one size, and
        #: the manifest's run-length list of sizes stays O(1) in the ranks.
        self.align_size = align_size
        self.tree = tree
        self.sources = sources
        self.metadata = metadata
        self.options = options
        self.cache = cache
        self.block = cache.chunk_bytes
        self.writers = writers
        self.serializer = serializer
        self.copier = DeviceCopier(capture_events)
        self.on_captured = on_captured
        self.snapshot_done = threading.Event()
        self.stats = WriteStats()
        self._failure: Optional[BaseException] = None
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._pending: List[cf.Future] = []
        self._sums: Dict[int, List[int]] = {}
        self._offsets: Dict[int, int] = {}
        self._lengths: Dict[int, int] = {}
        self._file: Optional[Output] = None
        self._start = 0.0
        #: After run(): the footer's entries and the file's format version.
        self.entries: List[fmt.Entry] = []
        self.version = fmt.FORMAT_VERSION_1

    # ------------------------------------------------------------------ control

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def _stopping(self) -> bool:
        return self._cancel.is_set() or self._failure is not None

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = exc

    # ------------------------------------------------------------------ run

    def run(self) -> WriteStats:
        """Write the file; raise the first failure of any stage."""
        self._start = time.perf_counter()
        pickles: List[Tuple[int, cf.Future]] = []
        try:
            self._file = self._open_output(self.path, self.options, self.block)
            if self.layout is not None:
                return self._run_layout()
            # The header first: its version follows from the entry kinds, known
            # now; an object store's first part is then complete early.
            self.version = fmt.FORMAT_VERSION_2 if any(s.kind == "ref" for s in self.sources) \
                else fmt.FORMAT_VERSION_1
            self._write_bytes(0, fmt.pack_header(self.version))
            # Serialize objects in the background while tensors stream out.
            pickles = [(i, self.serializer.submit(s.make_bytes))
                       for i, s in enumerate(self.sources) if s.deferred and s.kind not in ("remote", "ref")]
            offset = fmt.DATA_START
            items = []
            for i, s in enumerate(self.sources):
                if s.kind in ("remote", "ref"):     # written by another rank, or by an earlier step
                    self._offsets[i], self._lengths[i], self._sums[i] = fmt.DATA_START, 0, []
                    continue
                if s.deferred:
                    continue
                items.append(_Item(i, offset, s.length, s.data))
                offset = fmt.align_up(offset + s.length)
            tensor_end = offset
            self._stream_region(fmt.DATA_START, tensor_end, items)
            self.copier.synchronize()
            objects = []
            for i, future in pickles:
                data = self._result(future)
                objects.append(_Item(i, offset, len(data), memoryview(data)))
                offset = fmt.align_up(offset + len(data))
            self.stats.capture_s = time.perf_counter() - self._start
            self.snapshot_done.set()
            if self.on_captured is not None:
                self.on_captured()
            self._stream_region(tensor_end, offset, objects)
            self._drain()
            if self._cancel.is_set():       # writers skip chunks once cancelled: never finish the file
                raise Aborted("cancelled")
            self._write_footer(offset)
            self.stats.flush_s = time.perf_counter() - self._start
            return self.stats
        except BaseException as exc:
            self._fail(exc)
            self._cancel.set()
            for _, future in pickles:
                future.cancel()
            self._drain(raise_errors=False)
            raise self._failure from None
        finally:
            # No device-to-host copy may still be writing into a chunk once we return.
            self.copier.synchronize()
            self.snapshot_done.set()
            if self._file is not None:
                self._file.close()

    def _run_layout(self) -> WriteStats:
        """A foreign layout: every byte but its checksums is placed before the
        capture (tensor bytes straight from the cache, small records as bytes);
        the 4 KiB blocks that hold checksums are copied as they are written
        and rewritten, patched, once every span's checksum is known."""
        layout = self.layout
        size = layout.size
        items = [_Item(*item) for item in layout.items()]
        in_place = self._file.rewrites_in_place
        self._keep = layout.kept_blocks(in_place)
        self._file.will_rewrite(self._keep)
        # Whole pages for O_DIRECT (finish() cuts the file); an output without it gets the
        # exact bytes: an object's last part must not be uploaded with the padding.
        self._stream_region(0, fmt.align_up(size) if self._file.direct else size, items)
        self.copier.synchronize()
        self.stats.capture_s = time.perf_counter() - self._start
        self.snapshot_done.set()
        if self.on_captured is not None:
            self.on_captured()
        self._drain()
        if self._cancel.is_set():
            raise Aborted("cancelled")
        for offset, data in layout.patches(self._sums, self._kept, self.block, in_place):
            self._write_bytes(offset, data if self._file.direct else data[:max(0, size - offset)])
        self._file.finish(size)
        self.stats.file_bytes = size
        self.stats.flush_s = time.perf_counter() - self._start
        return self.stats

    def _result(self, future: cf.Future) -> bytes:
        while True:
            if self._stopping():
                raise self._failure or Aborted("cancelled")
            try:
                return future.result(timeout=0.1)
            except cf.TimeoutError:
                continue

    # ------------------------------------------------------------------ capture

    def _stream_region(self, start: int, end: int, items: List[_Item]) -> None:
        """Fill and submit the cache chunks covering [start, end) of the file."""
        for it in items:
            self._offsets[it.index] = it.offset
            self._lengths[it.index] = it.length
            self._sums[it.index] = [0] * fmt.block_count(it.offset, it.length, self.block)
        k = 0                       # first item that may overlap the current window
        pos = start
        while pos < end:
            window_end = min(end, (pos // self.block + 1) * self.block)
            chunk = self.cache.acquire(self._stopping)
            if chunk is None:
                raise self._failure or Aborted("cancelled")
            try:
                spans, events = self._fill(chunk, pos, window_end, items, k)
            except BaseException:
                self.copier.synchronize()       # a copy into this chunk may be in flight
                self.cache.release(chunk)
                raise
            while k < len(items) and items[k].offset + items[k].length <= window_end:
                k += 1
            future = self.writers.submit(self._write_chunk, chunk, pos, window_end - pos, spans, events)
            self._pending.append(future)
            pos = window_end

    def _fill(self, chunk: int, start: int, end: int, items: List[_Item], k: int):
        dst = self.cache.chunk_tensor(chunk)
        host = np.frombuffer(self.cache.chunk_memory(chunk), dtype=np.uint8)
        cursor = start
        spans = []
        events = []
        for it in items[k:]:
            if it.offset >= end:
                break
            a, b = max(start, it.offset), min(end, it.offset + it.length)
            if a >= b:
                continue
            if a > cursor:
                host[cursor - start:a - start] = 0
            src_lo, src_hi = a - it.offset, b - it.offset
            event = self.copier.copy(host[a - start:b - start], dst[a - start:b - start],
                                     it.data[src_lo:src_hi])
            if event is not None:
                events.append(event)
            block = a // self.block - it.offset // self.block
            spans.append((it.index, block, a - start, b - start))
            cursor = b
        if cursor < end:
            host[cursor - start:end - start] = 0
        return spans, events

    # ------------------------------------------------------------------ writers

    def _write_chunk(self, chunk: int, offset: int, length: int, spans, events) -> None:
        try:
            # Even when stopping: the chunk goes back to the cache only once no
            # device-to-host copy is writing into it any more.
            wait_copies(events)
            if self._stopping():
                return
            memory = self.cache.chunk_memory(chunk)
            # Hashed on a checksum thread while this one writes (lazyckpt/checksums.py).
            sums = checksums.pool().submit(self._sum_spans, memory, spans) \
                if self._span_sum is not None and spans else None
            try:
                self._file.pwrite_all(memory[:length], offset)
            finally:
                # The chunk goes back to the cache only once nothing reads it any more.
                if sums is not None:
                    cf.wait([sums])
            if sums is not None:
                for (index, block, _a, _b), value in zip(spans, sums.result()):
                    self._sums[index][block] = value
            if self._keep:
                lo, hi = bisect.bisect_left(self._keep, offset), bisect.bisect_left(self._keep, offset + length)
                for kept in self._keep[lo:hi]:
                    self._kept[kept] = bytes(memory[kept - offset:kept - offset + fmt.ALIGNMENT])
            with self._lock:
                self.stats.bytes_written += length
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self.cache.release(chunk)

    def _sum_spans(self, memory: memoryview, spans) -> List[int]:
        return [self._span_sum(memory[a:b]) for _index, _block, a, b in spans]

    def _drain(self, raise_errors: bool = True) -> None:
        for future in self._pending:
            try:
                future.result()
            except BaseException:
                if raise_errors:
                    raise self._failure from None
        self._pending.clear()
        if raise_errors and self._failure is not None:
            raise self._failure

    def _write_footer(self, data_end: int) -> None:
        entries = []
        for i, source in enumerate(self.sources):
            entries.append(fmt.Entry(source.kind, self._offsets[i], self._lengths[i], self._sums[i],
                                     source.name, source.owner if source.kind == "remote" else None,
                                     source.ref if source.kind == "ref" else None))
        version = fmt.version_for(entries)
        assert version == self.version, "the header written first must match the entries"
        footer = fmt.encode_footer(entries, self.tree, self.block, self.metadata, version)
        if self.align_size:
            footer += b" " * (-(len(footer) + fmt.TRAILER_BYTES) % fmt.ALIGNMENT)
        footer_offset = fmt.align_up(data_end)
        tail = footer + fmt.pack_trailer(footer_offset, footer)
        self._write_bytes(footer_offset, tail)
        size = footer_offset + len(tail)
        self._file.finish(size)
        self.stats.file_bytes = size
        self.entries = entries

    def _write_bytes(self, offset: int, data: bytes) -> None:
        """Write small metadata through the (aligned) cache, chunk by chunk."""
        view = memoryview(data)
        while view:
            chunk = self.cache.acquire(self._stopping)
            if chunk is None:
                raise self._failure or Aborted("cancelled")
            try:
                n = min(len(view), self.cache.chunk_bytes)
                memory = self.cache.chunk_memory(chunk)
                memory[:n] = view[:n]
                # Padded to whole pages for O_DIRECT only: an object store would otherwise
                # upload the padding as part of the object (a last part completed by it).
                padded = fmt.align_up(n) if self._file.direct else n
                memory[n:padded] = bytes(padded - n)
                self._file.pwrite_all(memory[:padded], offset)
            finally:
                self.cache.release(chunk)
            offset += n
            view = view[n:]
