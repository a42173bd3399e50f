"""Reading a checkpoint file: validated footer, parallel aligned reads,
checksums verified, each entry's bytes returned as a CPU UntypedStorage.

Entries are grouped into runs of adjacent entries (at most one chunk long
each, or one large entry); each run is read with O_DIRECT straight into a
fresh page-aligned buffer that then backs the returned storages, so the bytes
are copied once, by the disk, and never again on CPU loads. Entries the
caller copies elsewhere as soon as they are verified (``load(into=)``) are
read instead into a few reused buffers (:class:`StagingBuffers`): memory the
kernel zeroes once per load, not once per byte loaded.

Checksums are verified off the readers (lazyckpt/checksums.py): a reader
hands the block it read to a checksum thread and starts its next read at
once, so the disk always has ``reader_threads`` requests and verification
costs only the last block's hash.

Runs smaller than ``SMALL_READ_BYTES`` (the entries a ``keys=`` selection
picks out of a file of many tensors) are read ``SMALL_READ_DEPTH`` times
deeper: such a request costs more in its latency than in its bytes, and only
more of them in flight keep the disk busy.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import mmap
import os
import threading
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional, Tuple

import torch

from lazyckpt import checksums
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError
from lazyckpt.formats import datafile as fmt
from lazyckpt.formats.names import rank_filename, step_dirname
from lazyckpt.keptpools import KeptPool
from lazyckpt.knobs import Options
from lazyckpt.storage.base import Input, Store
from lazyckpt.storage.fileio import read_buffer


#: Runs (read requests) below this many bytes are read ``SMALL_READ_DEPTH`` x
#: ``reader_threads`` at a time. Raw O_DIRECT reads of every other block of a
#: 0.54 GB file, per byte of a sequential read (4 threads, 32 MiB pieces): 64 KiB
#: blocks 0.57 at 4 in flight, 0.82 at 16; 264 KiB 0.84 and 1.06; 1 MiB 0.99 and
#: 0.97; 4 MiB 0.93 and 0.91 (BENCHMARKS section 33).
SMALL_READ_BYTES = 1 << 20
SMALL_READ_DEPTH = 4

_small_read_pools: Dict[int, KeptPool] = {}
_small_read_pools_lock = threading.Lock()


def small_read_pool(threads: int) -> KeptPool:
    """The process's pool for small reads with ``threads`` in flight: kept, as
    its threads end when idle (a load's own pool is ``reader_threads`` deep)."""
    with _small_read_pools_lock:
        pool = _small_read_pools.get(threads)
        if pool is None:
            pool = _small_read_pools[threads] = KeptPool(threads, f"lazyckpt-reader-small{threads}")
        return pool


class CheckpointFile:
    """An open checkpoint file: its footer is parsed and validated on open.
    ``refs`` resolves its "ref" entries (incremental checkpoints) to the
    earlier steps' files that hold their bytes."""

    def __init__(self, path: str, options: Options, refs: Optional["RefResolver"] = None, *, store: Store):
        self.path = path
        self.options = options
        self.refs = refs
        #: The store it is on (the caller's: looked up once, where the path entered).
        self.store = store
        try:
            self.version, self.footer = self.store.read_ends(path, options, self._read_ends)
        except CheckpointError:
            raise
        except OSError as exc:
            raise self.read_error(exc) from exc
        #: The footer's entries (an attribute, not a property: a load of 2,000
        #: entries looks it up some 20,000 times).
        self.entries: List[fmt.Entry] = self.footer.entries

    def _read_ends(self, size: int, read: Callable[[int, int], bytes]):
        self.size = size
        return fmt.read_ends(size, read, self.path, self.options.max_footer_bytes)

    def read_error(self, exc: OSError) -> CheckpointReadError:
        """An OSError while reading this file, as the library's error (with the path)."""
        if isinstance(exc, CheckpointReadError):
            return exc
        return CheckpointReadError(f"{self.path}: read failed: {exc.strerror or exc}", path=self.path,
                                   errno_=exc.errno)

    def _open_input(self) -> Input:
        try:
            return self.store.open_input(self.path, self.options)
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: no such checkpoint file", path=self.path) from None
        except OSError as exc:
            raise self.read_error(exc) from exc

    def read_entries(self, indices: Iterable[int], pool: cf.ThreadPoolExecutor,
                     on_entry: Optional[Callable[[int, torch.UntypedStorage], None]] = None,
                     staged: Collection[int] = (),
                     while_reading: Optional[Callable[[Dict[int, torch.UntypedStorage]], None]] = None,
                     ) -> Dict[int, torch.UntypedStorage]:
        """Read (and verify) the given entries in parallel. ``on_entry(index,
        storage)`` is called, on a reader thread, as soon as an entry's bytes
        are read and every block of it verified (per run of adjacent entries),
        while other runs are still being read; its errors fail the read.
        ``staged``: entries ``on_entry`` copies out and nobody reads after it
        returns; their bytes are read into reused buffers and they are not in
        the result. ``while_reading(storages)`` runs on this thread once every
        read is submitted, before they are waited for: the storages (whose
        bytes may not have arrived) must not be read there."""
        wanted = set(indices)
        for i in wanted:
            if type(i) is not int or not 0 <= i < len(self.entries):
                raise CorruptCheckpointError(f"{self.path}: reference to missing entry {i}",
                                             path=self.path, entry=str(i))
        out: Dict[int, torch.UntypedStorage] = {}
        referred = [i for i in wanted if self.entries[i].kind == "ref"]
        if referred:
            out.update(self._read_referred(referred, pool))
            if on_entry is not None:
                for i in referred:
                    on_entry(i, out[i])
        wanted = sorted((i for i in wanted if self.entries[i].kind != "ref"), key=lambda i: self.entries[i].offset)
        staged = set(staged) if on_entry is not None else set()
        runs = self._plan_runs([i for i in wanted if self.entries[i].length > 0], staged)
        for i in wanted:
            if self.entries[i].length == 0:
                out[i] = torch.UntypedStorage(0)
                if on_entry is not None:
                    on_entry(i, out[i])
        if not runs:
            if while_reading is not None:
                while_reading(out)
            return out
        fd = self._open_input()
        staging = StagingBuffers(2 * max(1, self.options.reader_threads) * self.options.chunk_bytes,
                                 self.store.is_remote) if staged else None
        jobs: List[cf.Future] = []
        # Runs that stay in the result share fresh buffers of up to chunk_bytes
        # (one allocation, not one per run), and their pieces go to the readers
        # in batches of up to ``batch`` bytes: one job and one checksum hand-off
        # per batch, not per piece (1,000 keys of 130 KB: 910 runs). Small runs
        # go to a deeper pool, in batches small enough to keep all of it busy.
        sizes = [fmt.align_up(self._run_end(r) - self.entries[r[0]].offset) for r in runs]
        threads = max(1, self.options.reader_threads)
        deep = SMALL_READ_DEPTH * threads
        pools = {False: pool, True: small_read_pool(deep)}
        kept = [(n < SMALL_READ_BYTES, n) for r, n in zip(runs, sizes) if not (staging is not None and r[0] in staged)]
        kept_total = sum(n for _, n in kept)
        small_total = sum(n for small, n in kept if small)
        batch = {False: max(256 << 10, min(4 << 20, (kept_total - small_total) // threads)),
                 True: max(4096, min(4 << 20, small_total // deep))}
        shared: List[Any] = [None, 0]       # [buffer, bytes used]
        pending: Dict[bool, List[_Piece]] = {False: [], True: []}
        pending_bytes = {False: 0, True: 0}

        def submit(small: bool) -> None:
            if pending[small]:
                jobs.append(self._read_and_verify(pools[small], fd, list(pending[small])))
                pending[small].clear()
                pending_bytes[small] = 0
        try:
            for run, n in zip(runs, sizes):
                start, end = self.entries[run[0]].offset, self._run_end(run)
                small = n < SMALL_READ_BYTES
                reuse = staging is not None and run[0] in staged     # a run is all staged or none
                if reuse:
                    submit(False)       # a take may wait for jobs: none may be held back here
                    submit(True)
                    buf = staging.take(n, lambda: _failed(jobs))
                    if buf is None:
                        break           # a read failed: raised below, after the others end
                    view = memoryview(buf)
                elif n >= self.options.chunk_bytes:
                    view = memoryview(read_buffer(n, self.store.is_remote))
                else:
                    if shared[0] is None or len(shared[0]) - shared[1] < n:
                        size = min(self.options.chunk_bytes, kept_total)
                        shared[0], shared[1] = read_buffer(max(size, n), self.store.is_remote), 0
                    view = memoryview(shared[0])[shared[1]:shared[1] + n]
                    shared[1] += n
                    kept_total -= n
                storages = {}
                for i in run:
                    e = self.entries[i]
                    piece = view[e.offset - start:e.offset - start + e.length]
                    storages[i] = torch.frombuffer(piece, dtype=torch.uint8).untyped_storage()
                if not reuse:
                    out.update(storages)
                spans = self._read_pieces(start, end)
                finished = _RunDone(len(spans), run, storages, on_entry) if on_entry is not None else None
                # Each piece counts once it is read and every checksum block in it
                # verified (on a checksum thread, while the reader reads on).
                run_entries = [self.entries[i] for i in run]
                pieces = [_Piece(view, start, lo, hi, run_entries, finished) for lo, hi in spans]
                if reuse:
                    run_jobs = [self._read_and_verify(pools[small], fd, [p]) for p in pieces]
                    jobs.extend(run_jobs)
                    # Back to the staging buffers once every read of the run has ended
                    # (after on_entry copied it out, or after a failure).
                    _when_all_done(run_jobs, lambda buf=buf: staging.give(buf))
                    continue
                for p in pieces:
                    if pending[small] and pending_bytes[small] + (p.hi - p.lo) > batch[small]:
                        submit(small)
                    pending[small].append(p)
                    pending_bytes[small] += p.hi - p.lo
            submit(False)
            submit(True)
            if while_reading is not None:
                while_reading(out)
            # Every job ends before this returns or raises: none may still be
            # filling buffers (or, through on_entry, the caller's tensors) after.
            cf.wait(jobs)
            for job in jobs:
                job.result()
        finally:
            cf.wait(jobs)
            fd.close()
        return out

    def _read_referred(self, indices: List[int], pool: cf.ThreadPoolExecutor) -> Dict[int, torch.UntypedStorage]:
        """Entries whose bytes an earlier step's file holds, read from there."""
        by_file: Dict[int, tuple] = {}
        for i in indices:
            other, j = self.resolve(i)
            by_file.setdefault(id(other), (other, []))[1].append((i, j))
        out = {}
        for other, pairs in by_file.values():
            got = other.read_entries([j for _, j in pairs], pool)
            out.update({i: got[j] for i, j in pairs})
        return out

    def resolve(self, index: int) -> Tuple["CheckpointFile", int]:
        """(the file holding a "ref" entry's bytes, the entry's index there)."""
        if self.refs is None:
            e = self.entries[index]
            raise CorruptCheckpointError(f"{self.path}: entry {e.name!r} refers to step {e.ref['step']}'s file; "
                                         f"load it from its checkpoint directory", path=self.path, entry=e.name)
        return self.refs.resolve(self, index)

    @property
    def step(self) -> Optional[int]:
        step = self.footer.metadata.get("step")
        return step if type(step) is int else None

    @property
    def save_id(self) -> Optional[str]:
        mine = self.footer.metadata.get("lazyckpt")
        return mine.get("save_id") if isinstance(mine, dict) else None

    def _read_pieces(self, start: int, end: int) -> List[Tuple[int, int]]:
        """File range [start, end) cut into reads: whole checksum blocks, merged
        while a read stays within ``chunk_bytes`` (or one block, if larger). A
        run of two 12 MB entries across a block boundary is then one 25 MB read,
        not a 7 and an 18 MB one: reads of a run's whole length ran as fast as
        raw 32 MiB reads here (0.296 against 0.294 s for 0.8 GB), reads cut at
        every block boundary 4-8 % slower."""
        limit = max(self.footer.block_bytes, self.options.chunk_bytes)
        pieces: List[Tuple[int, int]] = []
        for lo, hi in fmt.block_spans(start, end - start, self.footer.block_bytes):
            if pieces and hi - pieces[-1][0] <= limit:
                pieces[-1] = (pieces[-1][0], hi)
            else:
                pieces.append((lo, hi))
        return pieces

    def _run_end(self, run: List[int]) -> int:
        last = self.entries[run[-1]]
        return last.offset + last.length

    def _read_and_verify(self, pool: cf.ThreadPoolExecutor, fd: Input, pieces: List["_Piece"]) -> cf.Future:
        """A future that ends once every piece (a file range of a run) is read,
        one after the other on ``pool``, and, with ``verify_checksums``,
        verified (on a checksum thread, while the reader reads its next
        batch); then each piece's ``finished`` counts it."""
        done: cf.Future = cf.Future()

        def settle(check: Callable[[], None]) -> None:
            # The batch's last step: checked, counted, its future ended (either way).
            try:
                check()
                for p in pieces:
                    if p.finished is not None:
                        p.finished.block_done()
            except BaseException as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)

        def verify() -> None:
            for p in pieces:
                self._verify_piece(p)

        def read() -> None:
            try:
                for p in pieces:
                    self._read_block(fd, p.view, p.run_start, p.lo, p.hi)
                if self.options.verify_checksums:
                    checksums.pool().submit(settle, verify)
                    return
            except BaseException as exc:
                done.set_exception(exc)
                return
            settle(lambda: None)
        # A pool shut down with its queue cancelled (Resources.close) never runs
        # ``read``: the block's future is cancelled with it, so nobody waits forever.
        pool.submit(read).add_done_callback(lambda job: job.cancelled() and done.cancel())
        return done

    def _read_block(self, fd: Input, view: memoryview, run_start: int, lo: int, hi: int) -> None:
        """Read file range [lo, hi) of a run (padded to whole pages)."""
        a, b = lo - run_start, min(fmt.align_up(hi) - run_start, len(view))
        try:
            got = fd.read_into(view[a:b], lo)
        except OSError as exc:
            raise self.read_error(exc) from exc
        if got < hi - lo:
            raise CorruptCheckpointError(f"{self.path}: truncated file (wanted {hi - lo} bytes at "
                                         f"offset {lo}, got {got})", path=self.path)

    def _verify_piece(self, p: "_Piece") -> None:
        """Check the checksums of the entries' bytes inside file range [lo, hi)
        of a run, entry by entry. A run read whole by this one piece hands each
        entry to ``on_entry`` as soon as it is verified: ``into=`` then copies
        bytes the hash has just brought into cache, not the run's from memory."""
        block = self.footer.block_bytes
        view, base, lo, hi = p.view, p.run_start, p.lo, p.hi
        each = p.finished is not None and p.finished.whole
        for k, e in enumerate(p.entries):
            s, t = max(lo, e.offset), min(hi, e.offset + e.length)
            if s >= t:
                continue
            first = e.offset // block
            for a, b in fmt.block_spans(s, t - s, block):
                if fmt.checksum(view[a - base:b - base]) != e.checksums[a // block - first]:
                    raise CorruptCheckpointError(
                        f"{self.path}: checksum mismatch in entry {e.name!r} at file offset {a} "
                        f"(data damaged)", path=self.path, entry=e.name)
            if each:
                p.finished.entry_done(k)

    def _plan_runs(self, indices: List[int], staged: Collection[int] = ()) -> List[List[int]]:
        """Group entries that sit next to each other in the file into one read
        (staged entries only with staged ones), reading a gap of up to
        ``read_through_bytes`` between two of them through: one request costs
        about as much as reading 50-250 KB more here (docs/ARCHITECTURE.md)."""
        runs: List[List[int]] = []
        limit = self.options.chunk_bytes
        gap = self.options.read_through_bytes
        for i in indices:
            e = self.entries[i]
            if runs:
                last = self.entries[runs[-1][-1]]
                first = self.entries[runs[-1][0]]
                after = fmt.align_up(last.offset + last.length)
                adjacent = after <= e.offset <= after + gap and (i in staged) == (runs[-1][0] in staged)
                if adjacent and e.offset + e.length - first.offset <= limit:
                    runs[-1].append(i)
                    continue
            runs.append([i])
        return runs

    def read_range(self, index: int, start: int, end: int, pool: cf.ThreadPoolExecutor) -> torch.Tensor:
        """Bytes [start, end) of one entry, as a uint8 tensor. Whole checksum
        blocks around the range are read so that each can be verified."""
        e = self.entries[index]
        if e.kind == "ref":
            other, j = self.resolve(index)
            return other.read_range(j, start, end, pool)
        if not 0 <= start <= end <= e.length:
            raise CorruptCheckpointError(f"{self.path}: range [{start}, {end}) outside entry {e.name!r} "
                                         f"of {e.length} bytes", path=self.path, entry=e.name)
        if start == end:
            return torch.empty((0,), dtype=torch.uint8)
        block = self.footer.block_bytes
        lo = max(e.offset, (e.offset + start) // block * block)
        hi = min(e.offset + e.length, -(-(e.offset + end) // block) * block)
        # Checksums of the blocks covered, in order: the entry's list from the first one.
        first = lo // block - e.offset // block
        span = fmt.Entry(e.kind, lo, hi - lo, e.checksums[first:first + fmt.block_count(lo, hi - lo, block)],
                         e.name)
        fd = self._open_input()
        try:
            buf = read_buffer(fmt.align_up(hi - lo), self.store.is_remote)
            view = memoryview(buf)
            jobs = [self._read_and_verify(pool, fd, [_Piece(view, lo, a, b, [span], None)])
                    for a, b in self._read_pieces(lo, hi)]
            for job in jobs:
                job.result()
        finally:
            fd.close()
        data = torch.frombuffer(view, dtype=torch.uint8)
        return data[e.offset + start - lo:e.offset + end - lo]

    def verify_all(self, pool: cf.ThreadPoolExecutor) -> None:
        self.read_entries(range(len(self.entries)), pool)


class _Piece:
    """File range [lo, hi) of a run whose bytes go to ``view`` (the run's
    buffer, from file offset ``run_start``); ``finished`` counts it."""

    __slots__ = ("view", "run_start", "lo", "hi", "entries", "finished")

    def __init__(self, view: memoryview, run_start: int, lo: int, hi: int, entries: List[fmt.Entry],
                 finished: Optional["_RunDone"]):
        self.view, self.run_start, self.lo, self.hi = view, run_start, lo, hi
        self.entries, self.finished = entries, finished


class _RunDone:
    """Counts a run's verified pieces; the thread finishing the last one hands
    the run's entries to ``on_entry`` (those not handed one by one already:
    a run of one piece hands each entry once verified, see ``_verify_piece``)."""

    def __init__(self, pieces: int, run: List[int], out: Dict[int, torch.UntypedStorage],
                 on_entry: Callable[[int, torch.UntypedStorage], None]):
        self._left = pieces
        self._lock = threading.Lock()
        self.run, self.out, self.on_entry = run, out, on_entry
        #: One piece holds the whole run: its entries can go one by one.
        self.whole = pieces == 1
        self._handed = 0                # entries handed one by one, in order

    def entry_done(self, k: int) -> None:
        """Entry ``k`` of a one-piece run is verified (its piece's checksum thread)."""
        i = self.run[k]
        self.on_entry(i, self.out[i])
        self._handed = k + 1

    def block_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            for i in self.run[self._handed:]:
                self.on_entry(i, self.out[i])


def _failed(jobs: List[cf.Future]) -> bool:
    return any(j.done() and j.exception() is not None for j in jobs)


def _when_all_done(jobs: List[cf.Future], then: Callable[[], None]) -> None:
    """Call ``then()`` once every one of ``jobs`` has ended, whichever way."""
    left = [len(jobs)]
    lock = threading.Lock()

    def one_done(_job: cf.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            then()
    for job in jobs:
        job.add_done_callback(one_done)


class StagingBuffers:
    """Read buffers reused from run to run, for entries copied out as soon as
    they are verified (``load(into=)``): a fresh buffer per run costs the
    kernel zeroing every page of it, as much CPU as the copy out again. At
    most ``limit`` bytes are held (more only for one run larger than that);
    :meth:`take` waits for a buffer to come back."""

    def __init__(self, limit: int, remote: bool = False):
        self.limit, self.remote = limit, remote
        self._free: List[mmap.mmap] = []
        self._held = 0                  # bytes of every buffer, free or in use
        self._cond = threading.Condition()

    def take(self, nbytes: int, stop: Callable[[], bool]) -> Optional[mmap.mmap]:
        """A buffer of at least ``nbytes``; None once ``stop()`` is true."""
        with self._cond:
            while not stop():
                fit = [b for b in self._free if len(b) >= nbytes]
                if fit:
                    buf = min(fit, key=len)
                    self._free.remove(buf)
                    return buf
                while self._free and self._held + nbytes > self.limit:
                    self._held -= len(self._free.pop())     # too small: its memory goes back
                in_use = self._held - sum(len(b) for b in self._free)
                if self._held + nbytes <= self.limit or in_use == 0:
                    self._held += nbytes
                    return read_buffer(nbytes, self.remote)
                self._cond.wait(0.05)
            return None

    def give(self, buf: mmap.mmap) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()


class RefResolver:
    """Opens the earlier steps' files that "ref" entries point at, for one load
    (or verify): each referenced step is held with a read lock until
    ``close()`` (retention elsewhere leaves it alone meanwhile), and every
    reference is checked against the file it lands in -- same save, a data
    entry at the same place with the same checksums -- so a file replaced or
    damaged since is refused with an error naming both steps."""

    def __init__(self, directory: str, options: Options):
        self.directory = directory          # the Checkpointer directory holding step_* dirs
        self.options = options
        self._files: Dict[tuple, CheckpointFile] = {}
        self._holds = contextlib.ExitStack()
        self._lock = threading.Lock()       # a load may resolve from several threads

    def resolve(self, referrer: CheckpointFile, index: int) -> Tuple[CheckpointFile, int]:
        e = referrer.entries[index]
        ref = e.ref
        here = f"{referrer.path} (step {referrer.step})"
        key = (ref["step"], ref["rank"])
        path = os.path.join(self.directory, step_dirname(ref["step"]), rank_filename(ref["rank"]))
        with self._lock:
            other = self._open(key, path, referrer, here, e)
        j = ref["entry"]
        target = other.entries[j] if j < len(other.entries) else None
        if other.save_id != ref["save_id"] or target is None or target.kind != "data" \
                or (target.offset, target.length, target.checksums) != (ref["offset"], ref["length"],
                                                                       ref["checksums"]) \
                or other.footer.block_bytes != ref["block_bytes"]:
            raise CorruptCheckpointError(f"{here}: entry {e.name!r} refers to entry {j} of step {ref['step']} "
                                         f"({path}), which does not hold those bytes (the file was replaced "
                                         f"or damaged)", path=referrer.path, entry=e.name)
        return other, j

    def _open(self, key: tuple, path: str, referrer: CheckpointFile, here: str, e: fmt.Entry) -> CheckpointFile:
        """The referred-to file, opened once per load and held with a read lock."""
        other = self._files.get(key)
        if other is not None:
            return other
        step = e.ref["step"]
        try:
            self._holds.enter_context(referrer.store.reading_step(os.path.dirname(path), self.options, step))
            other = CheckpointFile(path, self.options, self, store=referrer.store)
        except CheckpointNotFoundError as exc:
            raise CorruptCheckpointError(f"{here}: entry {e.name!r} refers to step {step}, whose "
                                         f"file is missing ({exc})", path=referrer.path, entry=e.name) from None
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{here}: entry {e.name!r} refers to step {step}, whose "
                                         f"file is damaged: {exc}", path=referrer.path, entry=e.name) from None
        self._files[key] = other
        return other

    def close(self) -> None:
        self._files.clear()
        self._holds.close()

    def __enter__(self) -> "RefResolver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolver_for(path: str, options: Options) -> RefResolver:
    """The resolver for a data file inside ``DIR/step_XXXXXXXXXX/``: references
    are looked up in ``DIR``."""
    return RefResolver(os.path.dirname(os.path.dirname(os.path.abspath(path))), options)
