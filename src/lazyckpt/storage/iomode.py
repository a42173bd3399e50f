"""Which I/O mode, O_DIRECT or buffered, each file system gets, per direction.

Neither mode wins everywhere: on this project's virtual disk buffered reads
ran at 1.3-2.0 GB/s while O_DIRECT reads ran at 0.4-0.96 GB/s, and on other
days O_DIRECT reads ran at 3 GB/s against 1.8 for buffered; NVMe usually
favours O_DIRECT, tmpfs refuses it. With the knob ``o_direct="auto"`` (the
default) the mode follows the disk:

- **Reads** choose per read (:class:`ModeTracker`, :class:`AdaptiveInputFile`).
  Each file system keeps, in the process, the throughput recent reads got in
  each mode; a read uses the faster, and the other is measured again (one
  read) once its last measure is ``EXPLORE_S`` old, so a drifting disk is
  followed, within a long load too; a mode that slows below the other's last
  measure is left at once. A process's first load reads its first blocks in
  both modes, side by side, under the same load. A decision
  cached for an hour (this module's earlier design) kept buffered reads at
  0.6 of O_DIRECT's speed for the whole hour after one 64 MiB probe, on a day
  when a 0.8 GB load ran 1.6x faster with O_DIRECT (BENCHMARKS section 33).
- **Writes** are decided per file system by a short probe at first use: the
  same bytes written in both modes, interleaved (direct, buffered, buffered,
  direct), with the writer's thread count; the faster mode is kept for the
  life of the process, and logged. A buffered write's cost shows only at its
  fsync, so one write cannot be timed alone the way a read is. The probe file
  is unlinked as soon as it is created, so nothing can be left behind.

``True`` or ``False`` force a mode. Both modes write the same bytes and fsync
the same way: format, checksums and durability do not depend on the choice.

A write verdict is remembered in the process and, for ``CACHE_TTL_S`` (an
hour), in a small per-user file (``$XDG_CACHE_HOME/lazyckpt/iomode.json``, or
``LAZYCKPT_IOMODE_CACHE``): the eight ranks of a node then probe once, not
eight times at once (measuring each other), and a restarted job does not
probe again. Not longer: the disk's speed drifts between days, and a device
number can name another file system after a reboot. The probe runs under an
exclusive lock on that file; where it cannot be written, every process
probes for itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import fcntl
import json
import logging
import mmap
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

from .fileio import InputFile, OutputFile

log = logging.getLogger("lazyckpt")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: Bytes of one probe transfer; each mode moves two of them (ABBA).
PROBE_PIECE = 16 << 20
#: Unit of one probe I/O call (several threads issue them, like the writer's chunks).
PROBE_IO = 4 << 20


@dataclass(frozen=True)
class Choice:
    direction: str                  # "read" or "write"
    device: int                     # st_dev of the file system
    where: str                      # the directory probed
    o_direct: bool                  # the mode chosen
    direct_gbps: Optional[float]    # measured (None: O_DIRECT refused or not probed)
    buffered_gbps: Optional[float]
    reason: str

    def describe(self) -> str:
        fig = ", ".join(f"{name} {v:.2f} GB/s" for name, v in (("O_DIRECT", self.direct_gbps),
                                                              ("buffered", self.buffered_gbps)) if v is not None)
        return (f"{self.direction}s on {self.where} (dev {self.device}): "
                f"{'O_DIRECT' if self.o_direct else 'buffered'} ({self.reason}{'; ' + fig if fig else ''})")


#: How long a probe's choice is reused by other processes (seconds).
CACHE_TTL_S = 3600.0

_choices: Dict[Tuple[int, str], Choice] = {}
_lock = threading.Lock()


def cache_path() -> str:
    explicit = os.environ.get("LAZYCKPT_IOMODE_CACHE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lazyckpt", "iomode.json")


def choices() -> List[Dict[str, Any]]:
    """Every choice made in this process (for benchmarks and reports): the
    write verdicts, and where reads were measured, what the reads found."""
    with _lock:
        made = list(_choices.values())
        trackers = list(_trackers.values())
    return [asdict(c) for c in made] + [asdict(t.as_choice()) for t in trackers]


def forget() -> None:
    """Drop the remembered choices and what reads measured (the next write
    probes again, the next read measures both modes again)."""
    with _lock:
        _choices.clear()
        _trackers.clear()


#: Reads smaller than this neither teach a tracker nor explore: their time is latency.
MIN_SAMPLE = 1 << 20
#: The mode not in use is measured again (one read) once its last measure is this old.
EXPLORE_S = 20.0
#: Weight of a new read in a mode's running throughput.
ALPHA = 0.3


class ModeTracker:
    """The reads of one file system in this process: the throughput recent
    reads got in each mode (an exponential average of each read's bytes per
    second, as it ran beside the others), and which mode the next read takes.

    Reads run ``reader_threads`` at a time, so a read's own throughput is its
    share of the disk; reads in both modes measured side by side share it the
    same way, which is what makes them comparable. A read in the slower mode
    costs its extra time on one thread of several: the mode not in use is
    measured once every ``EXPLORE_S`` (1 read of the 32 of a 0.8 GB load),
    not one read in every N, which cost a 0.8 GB load 6-10 % where buffered
    reads ran at 0.4 of O_DIRECT's speed."""

    def __init__(self, device: int, where: str):
        self.device, self.where = device, where
        self._lock = threading.Lock()
        self._gbps: Dict[bool, Optional[float]] = {True: None, False: None}
        self._seen: Dict[bool, float] = {True: float("-inf"), False: float("-inf")}
        self._trying: Dict[bool, int] = {True: 0, False: 0}
        self._counts: Dict[bool, int] = {True: 0, False: 0}
        self._direct_refused = False
        self._last_best: Optional[bool] = None

    def pick(self, nbytes: int) -> Tuple[bool, bool]:
        """(O_DIRECT?, exploring?) for a read of ``nbytes``; every pick is
        followed by :meth:`observe`, whatever happens to the read."""
        with self._lock:
            if self._direct_refused:
                return False, False
            best = self._best()
            if nbytes >= MIN_SAMPLE:
                now = time.monotonic()
                for mode in (True, False):
                    if now - self._seen[mode] > EXPLORE_S and self._trying[mode] == 0:
                        self._trying[mode] += 1     # not measured (lately): this read measures it
                        return mode, True
            # Nothing known yet (both modes' first reads in flight): O_DIRECT, the
            # historical default, until they end.
            return (True if best is None else best), False

    def _best(self) -> Optional[bool]:
        d, b = self._gbps[True], self._gbps[False]
        if d is None and b is None:
            return None
        if d is None or b is None:
            return d is not None
        return d >= b

    def observe(self, o_direct: bool, exploring: bool, nbytes: int, seconds: float) -> None:
        """What a read picked with :meth:`pick` got (``nbytes`` 0: it failed)."""
        with self._lock:
            if exploring:
                self._trying[o_direct] -= 1
            if nbytes < MIN_SAMPLE or seconds <= 0:
                return
            gbps = nbytes / seconds / 1e9
            now = time.monotonic()
            old = self._gbps[o_direct]
            stale = old is None or now - self._seen[o_direct] > EXPLORE_S
            self._gbps[o_direct] = gbps if stale else (1 - ALPHA) * old + ALPHA * gbps
            self._seen[o_direct] = now
            self._counts[o_direct] += 1
            best = self._best()
            if best != self._last_best and self._gbps[True] is not None and self._gbps[False] is not None:
                log.debug("lazyckpt: reads on %s now %s (O_DIRECT %.2f, buffered %.2f GB/s a read)",
                          self.where, "O_DIRECT" if best else "buffered", self._gbps[True], self._gbps[False])
                self._last_best = best

    def refuse_direct(self) -> None:
        """The file system refused O_DIRECT: every later read is buffered."""
        with self._lock:
            self._direct_refused = True

    def as_choice(self) -> Choice:
        with self._lock:
            best = self._best()
            return Choice("read", self.device, self.where, not self._direct_refused and best is not False,
                          self._gbps[True], self._gbps[False],
                          "the file system refuses O_DIRECT" if self._direct_refused else
                          f"adaptive: {self._counts[True]} O_DIRECT and {self._counts[False]} buffered reads "
                          f"measured")


_trackers: Dict[int, ModeTracker] = {}


def read_tracker(path: str) -> Optional[ModeTracker]:
    """The tracker of the file system holding ``path`` (None where O_DIRECT
    does not exist, or the file system cannot be looked at: reads are then
    plain)."""
    if not _O_DIRECT:
        return None
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return None
    with _lock:
        tracker = _trackers.get(device)
        if tracker is None:
            tracker = _trackers[device] = ModeTracker(device, directory)
        return tracker


class AdaptiveInputFile:
    """A file read at explicit offsets by several threads, each read in the
    mode its file system's :class:`ModeTracker` picks (one descriptor per
    mode, opened at its first read)."""

    def __init__(self, path: str, tracker: ModeTracker):
        self.path = path
        self._tracker = tracker
        self._files: Dict[bool, InputFile] = {}
        self._lock = threading.Lock()
        # Opened now in the mode a first read would take: a missing file is
        # refused at open, as with a plain InputFile.
        self._file(tracker.pick(0)[0])

    def _file(self, o_direct: bool) -> InputFile:
        with self._lock:
            f = self._files.get(o_direct)
            if f is None:
                f = self._files[o_direct] = InputFile(self.path, o_direct)
                if o_direct and not f.direct:
                    self._tracker.refuse_direct()
            return f

    def read_into(self, buf: memoryview, offset: int) -> int:
        """Read into ``buf`` until full or end of file; return bytes read."""
        o_direct, exploring = self._tracker.pick(len(buf))
        got, t = 0, time.perf_counter()
        try:
            f = self._file(o_direct)
            got = f.read_into(buf, offset)
            if o_direct and not f.direct:       # O_DIRECT refused at the read: now buffered
                self._tracker.refuse_direct()
            return got
        finally:
            self._tracker.observe(o_direct, exploring, got, time.perf_counter() - t)

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()


def open_local_input(path: str, options: Any) -> Any:
    """A local file for ranged reads: forced O_DIRECT or buffered, or (``"auto"``)
    each read in the mode its file system's reads currently favour."""
    if options.o_direct is True or options.o_direct is False:
        return InputFile(path, options.o_direct)
    tracker = read_tracker(path)
    return InputFile(path, False) if tracker is None else AdaptiveInputFile(path, tracker)


def use_o_direct(path: str, direction: str, setting: Any, threads: int = 4) -> bool:
    """Whether to open ``path`` (a file to read or write) with O_DIRECT."""
    if setting is True or setting is False:
        return setting
    if not _O_DIRECT:
        return False
    directory = os.path.dirname(os.path.abspath(path)) or "."
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return True                 # the open that follows reports the real problem
    key = (device, direction)
    choice = _choices.get(key)
    if choice is None:
        with _lock:                 # one probe at a time: probes must not measure each other
            choice = _choices.get(key)
            if choice is None:
                choice = _shared_choice(directory, device, direction, threads)
                _choices[key] = choice
    return choice.o_direct


def _shared_choice(directory: str, device: int, direction: str, threads: int) -> Choice:
    """The choice another process made recently, or a new probe (recorded for them)."""
    path = cache_path()
    name = f"{device}:{direction}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError:
        lock_fd = -1
    try:
        if lock_fd >= 0:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)      # other processes wait for this probe's result
        known = _read_cache(path) if lock_fd >= 0 else {}
        entry = known.get(name)
        if isinstance(entry, dict) and 0 <= time.time() - entry.get("at", 0) < CACHE_TTL_S:
            try:
                return Choice(**{k: entry[k] for k in Choice.__dataclass_fields__})
            except (KeyError, TypeError):
                pass                                  # a damaged record: probe again
        choice = _probe(directory, device, direction, threads)
        log.info("lazyckpt: I/O mode for %s", choice.describe())
        if lock_fd >= 0 and not choice.reason.startswith("not probed"):   # a full disk is no verdict
            known[name] = dict(asdict(choice), at=time.time())
            _write_cache(path, known)
        return choice
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)                         # drops the lock


def _read_cache(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: str, data: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _probe(directory: str, device: int, direction: str, threads: int) -> Choice:
    def chosen(o_direct: bool, reason: str, d: Optional[float] = None, b: Optional[float] = None) -> Choice:
        return Choice(direction, device, directory, o_direct, d, b, reason)

    path = os.path.join(directory, f".lazyckpt-iomode-probe-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        # A read-only directory (a checkpoint on a read-only mount): keep the
        # historical default rather than guess.
        return chosen(True, f"not probed: cannot create a probe file ({os.strerror(exc.errno)})")
    try:
        os.unlink(path)             # nothing to clean up, whatever happens next
        buf = mmap.mmap(-1, PROBE_IO, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.write(os.urandom(4096) * (PROBE_IO // 4096))    # incompressible enough, page-aligned
        pool = cf.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="lazyckpt-probe")
        try:
            if not _set_direct(fd, True):
                return chosen(False, "the file system refuses O_DIRECT")
            _set_direct(fd, False)
            if direction == "write":
                timings = _probe_writes(fd, buf, pool)
            else:
                timings = _probe_reads(fd, buf, pool)
        finally:
            pool.shutdown(wait=True)
            del buf                 # not close(): views may live on in a traceback; unmapped when freed
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return chosen(False, f"O_DIRECT failed in the probe ({os.strerror(exc.errno)})")
        return chosen(True, f"not probed: {os.strerror(exc.errno)} during the probe")
    finally:
        os.close(fd)
    direct_s, buffered_s = timings
    nbytes = 2 * PROBE_PIECE
    d, b = nbytes / direct_s / 1e9, nbytes / buffered_s / 1e9
    return chosen(direct_s <= buffered_s, f"probed {nbytes * 2 >> 20} MiB", d, b)


def _set_direct(fd: int, on: bool) -> bool:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    return True


def _transfer(fd: int, buf: mmap.mmap, pool: cf.ThreadPoolExecutor, offset: int, write: bool) -> None:
    view = memoryview(buf)

    def one(at: int) -> None:
        done = 0
        while done < PROBE_IO:
            n = (os.pwrite(fd, view[done:], at + done) if write
                 else os.preadv(fd, [view[done:]], at + done))
            if n <= 0:
                raise OSError(errno.EIO, "short probe transfer")
            done += n
    for job in [pool.submit(one, offset + k) for k in range(0, PROBE_PIECE, PROBE_IO)]:
        job.result()


def _probe_writes(fd: int, buf: mmap.mmap, pool: cf.ThreadPoolExecutor) -> Tuple[float, float]:
    """Seconds to write (and fsync) 2 pieces in each mode, interleaved D B B D."""
    spent = {True: 0.0, False: 0.0}
    for i, direct in enumerate((True, False, False, True)):
        _set_direct(fd, direct)
        t0 = time.perf_counter()
        _transfer(fd, buf, pool, i * PROBE_PIECE, write=True)
        os.fsync(fd)
        spent[direct] += time.perf_counter() - t0
    return spent[True], spent[False]


def _probe_reads(fd: int, buf: mmap.mmap, pool: cf.ThreadPoolExecutor) -> Tuple[float, float]:
    """Seconds to read 2 cold pieces in each mode, interleaved D B B D."""
    _set_direct(fd, False)
    for i in range(4):
        _transfer(fd, buf, pool, i * PROBE_PIECE, write=True)
    os.fsync(fd)
    spent = {True: 0.0, False: 0.0}
    for i, direct in enumerate((True, False, False, True)):
        # Clean pages of a synced file are dropped by DONTNEED: every read starts cold.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        _set_direct(fd, direct)
        t0 = time.perf_counter()
        _transfer(fd, buf, pool, i * PROBE_PIECE, write=False)
        spent[direct] += time.perf_counter() - t0
    return spent[True], spent[False]


def open_local_output(path: str, options: Any) -> OutputFile:
    """A new local file written at explicit offsets: O_DIRECT or buffered, as
    measured for its directory (``use_o_direct``)."""
    return OutputFile(path, use_o_direct(path, "write", options.o_direct, options.writer_threads))
