"""Which I/O mode, O_DIRECT or buffered, each transfer takes.

Neither mode wins everywhere: on this project's virtual disk buffered reads
ran at 1.3-2.0 GB/s while O_DIRECT reads ran at 0.4-0.96 GB/s, and on other
days O_DIRECT reads ran at 3 GB/s against 1.8 for buffered; NVMe usually
favours O_DIRECT, tmpfs refused it before Linux 6.6. With the knob
``o_direct="auto"`` (the default) the mode follows the disk, per transfer:
each file system has, in the process and per direction, a mode in use
(:class:`ModeTracker`; O_DIRECT at first); one transfer in the other mode is
measured at the first transfer, then every ``EXPLORE_S`` and whenever the
mode in use slows, and the other mode is taken if that transfer ran
``SWITCH_MARGIN`` faster than the transfers that ran beside it
(``RETURN_MARGIN`` back to O_DIRECT). So a drifting disk is followed, within a
long load or save too. A buffered read whose bytes are in the page cache is
not a measure of the disk (:func:`in_page_cache`). A file gets one descriptor
per mode (:class:`AdaptiveInputFile`, :class:`AdaptiveOutputFile`).

A buffered write's cost would show only at the file's fsync, so in this mode
a buffered write is followed by ``sync_file_range`` over its bytes (start
writeback, wait for it): its time is its cost, comparable with an O_DIRECT
write's. That is also the faster way to write buffered here: 4 threads
writing 0.8 GB in 32 MiB pieces took 0.285 s so, against 0.377 s with one
fsync at the end (O_DIRECT: 0.238 s). The file's fsync at commit is
unchanged: it is what makes the file durable, whatever wrote it.

This replaced a probe at first use (64 MiB in each mode), whose verdict was
kept for the process and shared through a cache file for an hour: a verdict
of "buffered" for reads, measured on 64 MiB, kept 0.8 GB loads at 0.6 of
O_DIRECT's speed on a day when O_DIRECT read at 2.9 GB/s (BENCHMARKS section
33); the disk drifts by 1.5x from minute to minute, and its best mode with it.

``True`` or ``False`` force a mode (buffered writes then fsync once, at the
end). Both modes write the same bytes and fsync the same way: format,
checksums and durability do not depend on the choice.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import logging
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from .fileio import InputFile, OutputFile

log = logging.getLogger("lazyckpt")

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


#: Linux's sync_file_range (None elsewhere: writes then use O_DIRECT where it exists).
_sync_file_range = _load_sync_file_range()
#: SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
_WRITE_AND_WAIT = 1 | 2 | 4


def write_back(fd: int, offset: int, nbytes: int) -> None:
    """Write ``nbytes`` of dirty pages from ``offset`` to the disk and wait (no
    metadata, no cache flush: the file's fsync still makes it durable)."""
    if _sync_file_range(fd, offset, nbytes, _WRITE_AND_WAIT) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def in_page_cache(fd: int, offset: int) -> bool:
    """Whether the page at ``offset`` of a buffered descriptor is in the page
    cache: a read that asks for no I/O (RWF_NOWAIT) got bytes. A file just
    written buffered (a save's own buffered measures, a framework's file) is;
    a buffered measure of it ran at memory speed and, judged against O_DIRECT
    reads of the disk, sent every read of a bench's first repetition
    buffered (at half O_DIRECT's speed, until the next measure 20 s later)."""
    if not _RWF_NOWAIT:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], offset, _RWF_NOWAIT) > 0
    except OSError:                 # EAGAIN: not cached; EOPNOTSUPP: cannot tell
        return False


@dataclass(frozen=True)
class Choice:
    direction: str                  # "read" or "write"
    device: int                     # st_dev of the file system
    where: str                      # the first directory measured there
    o_direct: bool                  # the mode in use
    direct_gbps: Optional[float]    # measured, per transfer (None: not measured)
    buffered_gbps: Optional[float]
    reason: str

    def describe(self) -> str:
        fig = ", ".join(f"{name} {v:.2f} GB/s" for name, v in (("O_DIRECT", self.direct_gbps),
                                                              ("buffered", self.buffered_gbps)) if v is not None)
        return (f"{self.direction}s on {self.where} (dev {self.device}): "
                f"{'O_DIRECT' if self.o_direct else 'buffered'} ({self.reason}{'; ' + fig if fig else ''})")


_lock = threading.Lock()


def choices() -> List[Dict[str, Any]]:
    """What the transfers of this process found, per file system and direction
    (for benchmarks and reports)."""
    with _lock:
        trackers = list(_trackers.values())
    return [asdict(t.as_choice()) for t in trackers]


def forget() -> None:
    """Drop what transfers measured (the next ones measure both modes again)."""
    with _lock:
        _trackers.clear()


def _forget_in_child() -> None:
    """After a fork: a tracker's lock may have been held by a parent's thread;
    the child measures afresh."""
    global _lock
    _lock = threading.Lock()
    _trackers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


#: Transfers smaller than this neither teach a tracker nor explore: their time is latency.
MIN_SAMPLE = 1 << 20
#: A measure of the other mode moves this much of its transfer (the rest goes
#: in the mode in use): enough that its time is bandwidth, not latency, and
#: an eighth of a 32 MiB read in the slower mode.
MEASURE_BYTES = 4 << 20
#: The mode not in use is measured again (one transfer) once its last measure is this old.
EXPLORE_S = 20.0
#: The other mode is taken only if its transfer ran this much faster than the
#: transfers in the mode in use that ran beside it. Not less: a buffered read
#: measured beside O_DIRECT ones gets more than its share of the disk. On a day
#: when an all-buffered 0.8 GB load ran 1.5x slower than an all-O_DIRECT one,
#: a margin of 1.2 sent up to 31 % of a bench's reads buffered and 1.5 26-63 %;
#: so did a burst of 4 transfers judged against the last 4 in the mode in use
#: (30-58 %, loads at 0.77-0.97 of raw O_DIRECT; BENCHMARKS section 33). The days
#: when buffered reads won here, they won by 2x or more (1.3-2.0 against
#: 0.4-0.96 GB/s).
SWITCH_MARGIN = 2.0
#: Back to O_DIRECT from buffered, a smaller margin: an O_DIRECT transfer
#: measured beside buffered ones gets less than its share of the disk (the
#: same bias, the other way), so one that still ran faster is O_DIRECT
#: winning. In the bench run where a lucky measure had switched reads to
#: buffered, O_DIRECT transfers ran 0.98 GB/s against buffered's 0.49: just
#: the 2x a switch back would have needed (BENCHMARKS section 34).
RETURN_MARGIN = 1.2
#: A measure is judged once this many transfers of the mode in use overlapped it
#: (or one started after it ended, or ``TRIAL_WAIT_S`` passed).
NEIGHBOURS = 3
TRIAL_WAIT_S = 1.0
#: The mode in use slowed: its last ``RECENT_FOR_DROP`` transfers' median fell
#: under ``DROP`` of its median when last judged: measure the other mode now
#: (not sooner than ``DROP_GAP_S`` after the last measure: a transfer's speed
#: varies 2-3x with its place in a load, and each measure costs one transfer
#: in the slower mode).
DROP = 0.6
RECENT_FOR_DROP = 8
DROP_GAP_S = 2.0


class ModeTracker:
    """The reads (or the writes) of one file system in this process: which mode
    is in use, and when to measure the other.

    Transfers run ``reader_threads`` (``writer_threads``) at a time, so one
    transfer's throughput is its share of the disk, and it varies 2-3x with
    its place in a load (the first ones also fault their memory in, the last
    run alone). So the other mode is judged against the transfers in the mode
    in use that ran *beside* its measure (their intervals overlap; the median
    of ``NEIGHBOURS`` of them), which shared the disk the same way at the same
    moment, and taken only if ``SWITCH_MARGIN`` faster. An exponential
    average of each mode's transfers, compared whole, flipped a 0.8 GB load
    to buffered reads after one lucky buffered read at a load's start
    (against O_DIRECT's average pulled down by the tail of the previous
    load), and that load took 0.72 s instead of 0.47.

    The other mode is measured once every ``EXPLORE_S`` (1 transfer of the 32
    of a 0.8 GB load), and at once when the mode in use slows (``DROP``)."""

    def __init__(self, direction: str, device: int, where: str):
        self.direction, self.device, self.where = direction, device, where
        self._lock = threading.Lock()
        self._mode = True                       # O_DIRECT until measured otherwise
        self._direct_refused = False
        self._measured_at = float("-inf")       # when the other mode was last measured
        self._measuring = False                 # a measure of the other mode in flight
        self._trial: Optional[Dict[str, Any]] = None    # an ended measure awaiting its neighbours
        self._recent: Deque[Tuple[float, float, float]] = collections.deque(maxlen=32)
        self._level: Optional[float] = None     # the mode in use's median when last judged
        self._confirm = False                   # switched to buffered: measure O_DIRECT again soon
        self._last: Dict[bool, Optional[float]] = {True: None, False: None}   # for reports
        self._counts: Dict[bool, int] = {True: 0, False: 0}

    def pick(self, nbytes: int) -> Tuple[bool, bool]:
        """(O_DIRECT?, measuring the other mode?) for a transfer of ``nbytes``;
        every pick is followed by :meth:`observe`, whatever happens to it."""
        with self._lock:
            if self._direct_refused:
                return False, False
            now = time.monotonic()
            if self._trial is not None and now - self._trial["end"] > TRIAL_WAIT_S:
                self._judge()                   # nothing more ran beside it: judged with what did
            if nbytes >= MIN_SAMPLE and not self._measuring and self._trial is None and self._due(now):
                self._measuring = True
                self._confirm = False
                return (not self._mode), True
            return self._mode, False

    def _due(self, now: float) -> bool:
        if now - self._measured_at >= EXPLORE_S:
            return True
        if self._confirm and len(self._recent) >= RECENT_FOR_DROP:
            return True
        if self._level is not None and len(self._recent) >= RECENT_FOR_DROP \
                and now - self._measured_at >= DROP_GAP_S:
            recent = statistics.median(g for _s, _e, g in list(self._recent)[-RECENT_FOR_DROP:])
            return recent < DROP * self._level
        return False

    def observe(self, o_direct: bool, measuring: bool, nbytes: int, start: float, end: float) -> None:
        """What a transfer picked with :meth:`pick` got, between ``start`` and
        ``end`` (``time.monotonic``); ``nbytes`` 0: it failed."""
        with self._lock:
            if measuring:
                self._measuring = False
                self._measured_at = end
            if nbytes < MIN_SAMPLE or end <= start:
                return
            gbps = nbytes / (end - start) / 1e9
            self._counts[o_direct] += 1
            if measuring:
                self._last[o_direct] = gbps
                near = [g for s, e, g in self._recent if s < end and e > start]
                self._trial = {"mode": o_direct, "start": start, "end": end, "gbps": gbps, "near": near}
                if len(near) >= NEIGHBOURS:
                    self._judge()
                return
            if o_direct != self._mode:
                return                          # picked before a switch: says nothing of the mode in use
            self._recent.append((start, end, gbps))
            trial = self._trial
            if trial is not None:
                if start < trial["end"] and end > trial["start"]:
                    trial["near"].append(gbps)
                if len(trial["near"]) >= NEIGHBOURS or start >= trial["end"]:
                    self._judge()

    def _judge(self) -> None:
        """The other mode's measure against the transfers that ran beside it (or,
        where none did, the mode in use's recent median)."""
        trial, self._trial = self._trial, None
        recent = [g for _s, _e, g in self._recent]
        ref = trial["near"] or recent
        margin = RETURN_MARGIN if trial["mode"] else SWITCH_MARGIN
        if ref and trial["gbps"] > margin * statistics.median(ref):
            log.debug("lazyckpt: %ss on %s now %s (%.2f GB/s against %.2f beside it)", self.direction, self.where,
                      "O_DIRECT" if trial["mode"] else "buffered", trial["gbps"], statistics.median(ref))
            if recent:
                self._last[self._mode] = statistics.median(recent)     # its figure, for reports
            self._mode = trial["mode"]
            self._recent.clear()
            # The measure that won is the new mode's level: if its transfers
            # then run under DROP of it (a lucky measure), the other mode is
            # measured again within DROP_GAP_S, not EXPLORE_S later.
            self._level = trial["gbps"]
            # A switch away from O_DIRECT is confirmed: O_DIRECT is measured
            # again after RECENT_FOR_DROP transfers, at whatever speed they
            # ran (one transfer in the slower mode if the switch was right).
            # Not the other way: that would let two biased measures alternate.
            self._confirm = not trial["mode"]
        elif recent:
            self._level = statistics.median(recent)

    def not_a_measure(self) -> None:
        """The measure just picked would not measure the disk (its bytes are
        in the page cache): it runs, teaches nothing, and the next transfer
        measures instead."""
        with self._lock:
            self._measuring = False

    def refuse_direct(self) -> None:
        """The file system refused O_DIRECT: every later transfer is buffered."""
        with self._lock:
            self._direct_refused = True
            self._mode = False

    @property
    def direct_refused(self) -> bool:
        return self._direct_refused

    @property
    def mode(self) -> bool:
        """The mode in use (True: O_DIRECT)."""
        return self._mode

    def as_choice(self) -> Choice:
        with self._lock:
            figures = dict(self._last)
            if self._recent:
                figures[self._mode] = statistics.median(g for _s, _e, g in self._recent)
            return Choice(self.direction, self.device, self.where, self._mode, figures[True], figures[False],
                          "the file system refuses O_DIRECT" if self._direct_refused else
                          f"adaptive: {self._counts[True]} O_DIRECT and {self._counts[False]} buffered "
                          f"{self.direction}s measured")


_trackers: Dict[Tuple[int, str], ModeTracker] = {}


def tracker_for(path: str, direction: str) -> Optional[ModeTracker]:
    """The tracker of the file system holding ``path``, for "read" or "write"
    (None where O_DIRECT does not exist, buffered writes cannot be timed, or
    the file system cannot be looked at: transfers are then plain)."""
    if not _O_DIRECT or (direction == "write" and _sync_file_range is None):
        return None
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return None
    with _lock:
        tracker = _trackers.get((device, direction))
        if tracker is None:
            tracker = _trackers[(device, direction)] = ModeTracker(direction, device, directory)
        return tracker


class _AdaptiveFile:
    """What the adaptive input and output share: one descriptor per mode,
    opened at its first use, and every transfer timed for the tracker."""

    path: str

    def __init__(self, tracker: ModeTracker):
        self._tracker = tracker
        self._files: Dict[bool, Any] = {}
        self._lock = threading.Lock()

    def _open(self, o_direct: bool) -> Any:
        raise NotImplementedError

    def _file(self, o_direct: bool) -> Any:
        with self._lock:
            f = self._files.get(o_direct)
            if f is None:
                f = self._files[o_direct] = self._open(o_direct)
                if o_direct and not f.direct:
                    self._tracker.refuse_direct()   # O_DIRECT refused at open: it is the buffered one
                    self._files.setdefault(False, f)
            return f

    def _transfer(self, nbytes: int, move: Callable[[Any, int, int], int], offset: int = -1) -> int:
        """``move(descriptor, skip, length)`` (bytes ``[skip, skip + length)``
        of the transfer) in the mode the tracker picks; returns what it
        moved. A measure of the other mode takes ``MEASURE_BYTES`` only, the
        rest is picked again (the mode in use, or a measure again if this one
        was not one: its bytes were in the page cache): a whole 32 MiB read
        in the slower mode (buffered at 0.18 GB/s, O_DIRECT at 0.66, a
        process's first load) was the read every other waited for."""
        done = 0
        while done < nbytes:
            rest = nbytes - done
            o_direct, measuring = self._tracker.pick(rest)
            length = MEASURE_BYTES if measuring and rest >= 2 * MEASURE_BYTES else rest
            moved = self._move(o_direct, measuring, length, done, move, offset)
            done += moved
            if moved < length:
                break                           # the end of the file
        return done

    def _move(self, o_direct: bool, measuring: bool, length: int, skip: int,
              move: Callable[[Any, int, int], int], offset: int) -> int:
        """One transfer, timed for the tracker. ``offset``: a read's, whose
        buffered measure is not one where the page in its middle is in the
        page cache (a copy from memory, not the disk; not its first page: a
        file's header page is read and cached apart, at open)."""
        moved, start = 0, time.monotonic()
        try:
            f = self._file(o_direct)
            if measuring and not o_direct and offset >= 0 \
                    and in_page_cache(f.fd, (offset + skip + length // 2) & ~4095):
                self._tracker.not_a_measure()
                measuring = False
            moved = move(f, skip, length)
            if o_direct and not f.direct:       # O_DIRECT refused at the transfer: now buffered
                self._tracker.refuse_direct()
            return moved
        finally:
            self._tracker.observe(o_direct, measuring, moved, start, time.monotonic())

    def close(self) -> None:
        with self._lock:
            files, self._files = {id(f): f for f in self._files.values()}, {}
        for f in files.values():             # one descriptor may serve both modes
            f.close()


class AdaptiveInputFile(_AdaptiveFile):
    """A file read at explicit offsets by several threads, each read in the
    mode its file system's :class:`ModeTracker` picks (one descriptor per
    mode, opened at its first read)."""

    def __init__(self, path: str, tracker: ModeTracker):
        super().__init__(tracker)
        self.path = path
        #: Reads are whole pages where either mode may read (harmless when buffered).
        self.direct = not tracker.direct_refused
        # Opened now in the mode in use: a missing file is refused at open, as
        # with a plain InputFile.
        self._file(tracker.mode)

    def _open(self, o_direct: bool) -> InputFile:
        f = InputFile(self.path, o_direct)
        if not f.direct and hasattr(os, "posix_fadvise"):
            # No readahead past each read: a read's time is then the cost of its
            # own bytes (readahead would charge them to the reads beside it).
            # Reads are whole runs of MiBs: 0.437 against 0.404 s for 0.8 GB.
            os.posix_fadvise(f.fd, 0, 0, os.POSIX_FADV_RANDOM)
        return f

    def read_into(self, buf: memoryview, offset: int) -> int:
        """Read into ``buf`` until full or end of file; return bytes read."""
        return self._transfer(len(buf), lambda f, skip, n: f.read_into(buf[skip:skip + n], offset + skip), offset)


class AdaptiveOutputFile(_AdaptiveFile):
    """A new file written at explicit offsets by several threads, each write
    in the mode its file system's :class:`ModeTracker` picks; a buffered write
    is written back before it returns (:func:`write_back`), so that its time
    is its cost. The file is created (truncated) once, by the first
    descriptor; the other mode's is opened on its first write."""

    rewrites_in_place = True

    def __init__(self, path: str, tracker: ModeTracker):
        super().__init__(tracker)
        self.path = path
        self._first = self._file(tracker.mode)
        #: Windows are whole pages where either mode may write (finish() cuts the file).
        self.direct = not tracker.direct_refused

    def _open(self, o_direct: bool) -> OutputFile:
        return OutputFile(self.path, o_direct, create=not self._files)

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (buffered: and written back)."""
        def move(f: OutputFile, skip: int, n: int) -> int:
            f.pwrite_all(data[skip:skip + n], offset + skip)
            if not f.direct:
                write_back(f.fd, offset + skip, n)
            return n
        self._transfer(len(data), move)

    def will_rewrite(self, offsets: list) -> None:
        """Nothing to keep: a file's blocks are rewritten where they are."""

    def finish(self, size: int) -> None:
        """Cut the file to its exact size and make it durable (one fsync covers
        what every descriptor wrote: they share the file)."""
        self._first.finish(size)


def open_local_input(path: str, options: Any) -> Any:
    """A local file for ranged reads: forced O_DIRECT or buffered, or (``"auto"``)
    each read in the mode its file system's reads currently favour."""
    if options.o_direct is True or options.o_direct is False:
        return InputFile(path, options.o_direct)
    tracker = tracker_for(path, "read")
    return InputFile(path, False) if tracker is None else AdaptiveInputFile(path, tracker)


def open_local_output(path: str, options: Any) -> Any:
    """A new local file written at explicit offsets: forced O_DIRECT or
    buffered, or (``"auto"``) each write in the mode its file system's writes
    currently favour."""
    if options.o_direct is True or options.o_direct is False:
        return OutputFile(path, options.o_direct)
    tracker = tracker_for(path, "write")
    return OutputFile(path, bool(_O_DIRECT)) if tracker is None else AdaptiveOutputFile(path, tracker)
