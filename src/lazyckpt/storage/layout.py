# Why one module of ~770 lines (issue 23 asks for a reason above 600): it is the one set of rules
# for what a process may delete in a Checkpointer directory. Retention, leftovers and the writer
# lease all consult the same leases and read locks, so they are read and changed together; the
# names live in formats/names.py and the bytes in storage/fileio.py.
"""Directory layout: how checkpoints are named, listed, committed, retired and
protected on a file system. This module knows checkpoints, not bytes; it is
the one place the Checkpointer, the CLI tools and the integrations use for
names, `latest`, retention, leftovers and the protection of live saves and
of steps being read (docs/FORMAT.md §11).

Live saves are protected by **leases**, not pid guessing: a process writing a
temporary file holds an exclusive ``flock`` on it for as long as the save is
in progress and refreshes its modification time every ``heartbeat_s`` (one
small keeper thread per process). A temporary file or directory is removed
only when it is *provably dead*: no file of it is locked by anyone and none
was modified within ``lease_expiry_s``. Either signal alone keeps it: the lock
covers a clock skew between hosts, the heartbeat covers file systems whose
locks are node-local or absent. A process never probes its own leases (a
POSIX lock emulation would drop them on close).

Steps being read are protected by a shared lock on their manifest: retention
skips a step whose manifest another process holds, and retries at its next
pass; a reader that finds its step gone (a file system without locks, or a
superseded step) reports precisely that it was deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import stat
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import ABANDONED_PREFIX, DELETING_PREFIX, LATEST, MANIFEST, SIBLING_TEMP, SMALL_TEMP, STEP_DIR, TEMP_PREFIX, WRITER, rank_filename, step_dirname
from lazyckpt.history import LocalRecord, manifest_event
from .base import Leftover, StepRecord
from .fileio import NotARegularFile, fsync_dir, read_small_file, remove_quietly, write_file_atomic

log = logging.getLogger("lazyckpt")


DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_EXPIRY_S = 60.0


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def sibling_temp(path: str) -> str:
    """A hidden sibling of ``path`` for a save in progress (renamed over ``path`` once durable)."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.tmp-{new_token()}")


# --------------------------------------------------------------------------- leases

_LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_held: Dict[Tuple[int, int], int] = {}          # (st_dev, st_ino) -> count, leases of this process
_held_lock = threading.Lock()


class Lease:
    """A save in progress holds this on a file it writes: an exclusive flock for
    as long as the save lives, and a heartbeat (the file's mtime refreshed every
    ``heartbeat_s`` by the keeper thread). The file is created if missing and
    never truncated here. ``release()`` is idempotent."""

    def __init__(self, path: str, heartbeat_s: float = DEFAULT_HEARTBEAT_S):
        self.path = path
        self.heartbeat_s = heartbeat_s
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        st = os.fstat(self.fd)
        self.key = (st.st_dev, st.st_ino)
        self.locked = False
        try:
            _flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.locked = True
        except OSError as exc:
            if exc.errno not in _LOCK_UNSUPPORTED:
                os.close(self.fd)
                raise
            log.debug("lazyckpt: %s: no file locks here (%s); the heartbeat alone protects it", path, exc)
        with _held_lock:
            _held[self.key] = _held.get(self.key, 0) + 1
        _keeper.add(self)

    def beat(self) -> None:
        try:
            os.utime(self.fd)
        except OSError:
            pass                    # the file may be gone already (committed, or removed)

    def release(self) -> None:
        if self.fd < 0:
            return
        _keeper.remove(self)
        with _held_lock:
            n = _held.get(self.key, 1) - 1
            if n:
                _held[self.key] = n
            else:
                _held.pop(self.key, None)
        os.close(self.fd)           # drops the lock
        self.fd = -1


class _Keeper:
    """One daemon thread per process that refreshes every live lease's heartbeat;
    it exits when no lease is left."""

    def __init__(self) -> None:
        self._leases: List[Lease] = []
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def add(self, lease: Lease) -> None:
        with self._cond:
            self._leases.append(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lazyckpt-lease", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def remove(self, lease: Lease) -> None:
        with self._cond:
            if lease in self._leases:
                self._leases.remove(lease)
            thread = self._thread if not self._leases else None
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            # Gone with the last lease: no thread outlives the saves. Not a fixed 1 s join: on
            # a loaded machine the thread may take longer to wake (the CI run that leaked it);
            # stop waiting only if a new lease took the thread over (or after 30 s).
            deadline = time.monotonic() + 30.0
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.1)
                with self._cond:
                    if self._leases:
                        break

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._leases:
                    self._thread = None
                    return
                leases = list(self._leases)
                period = min(lease.heartbeat_s for lease in leases)
            for lease in leases:
                lease.beat()
            with self._cond:
                self._cond.wait(period)


_keeper = _Keeper()


def _held_here(st: os.stat_result) -> bool:
    with _held_lock:
        return (st.st_dev, st.st_ino) in _held


def locked_by_someone(path: str) -> Optional[bool]:
    """True if another holder has ``path`` locked (shared or exclusive); False if
    not; None if this file system cannot tell (no locks)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if _held_here(os.fstat(fd)):
            return True
        try:
            _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            if exc.errno in _LOCK_UNSUPPORTED:
                return None
            return False
        return False
    finally:
        os.close(fd)            # also drops the probe's own shared lock


def is_live(path: str, expiry_s: float, now: Optional[float] = None) -> bool:
    """Whether a temporary file or directory (and the files directly in it) may
    belong to a save in progress: any file locked, or anything modified within
    ``expiry_s``. Only a save that is provably dead is not live. Cheap checks
    first: a fresh directory answers without looking inside."""
    now = time.time() if now is None else now
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if now - st.st_mtime < expiry_s:
        return True
    if not stat.S_ISDIR(st.st_mode):
        return stat.S_ISREG(st.st_mode) and locked_by_someone(path) is True
    try:
        names = os.listdir(path)
    except OSError:
        return True                 # cannot look inside: do not touch it
    for name in names:
        p = os.path.join(path, name)
        try:
            s = os.lstat(p)
        except FileNotFoundError:
            continue
        if now - s.st_mtime < expiry_s or (stat.S_ISREG(s.st_mode) and locked_by_someone(p) is True):
            return True
    return False


# --------------------------------------------------------------------------- steps being read


class StepDir:
    """One committed step directory (``DIR/step_XXXXXXXXXX``)."""

    def __init__(self, path: str, step: Optional[int] = None):
        self.path = os.path.abspath(path)
        self.step = step

    @contextlib.contextmanager
    def reading(self) -> Iterator["_Held"]:
        """Hold a shared lock on the manifest while the step is read, so that
        retention (in any process) does not delete it under the reader."""
        manifest = os.path.join(self.path, MANIFEST)
        try:
            fd = os.open(manifest, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: no committed checkpoint (no {MANIFEST})",
                                          path=self.path, step=self.step) from None
        try:
            try:
                _flock(fd, fcntl.LOCK_SH)
            except OSError as exc:
                if exc.errno not in _LOCK_UNSUPPORTED:
                    raise
            held = _Held(self, fd, manifest)
            # Locked, but the step may have been renamed away just before.
            if not held.still_there():
                raise held.deleted()
            yield held
        finally:
            os.close(fd)


class _Held:
    """A step held by :meth:`StepDir.reading` (a ``base.HeldStep``)."""

    def __init__(self, step_dir: StepDir, fd: int, manifest: str):
        self.step_dir, self.fd, self.manifest = step_dir, fd, manifest     # the manifest's path
        self.path, self.step = step_dir.path, step_dir.step
        self.directory = os.path.realpath(os.path.dirname(step_dir.path))

    def read_manifest(self) -> Dict:
        """The manifest, read again now that the step is held."""
        try:
            raw = read_small_file(self.manifest, manifests.MAX_MANIFEST_BYTES)
        except NotARegularFile:
            raise CorruptCheckpointError(f"{self.manifest}: not a regular file",
                                         path=self.manifest) from None
        if raw is None:
            raise CheckpointNotFoundError(f"{self.path}: no committed checkpoint (no {MANIFEST})",
                                          path=self.path, step=self.step)
        return manifests.parse(raw, self.manifest)

    def still_there(self) -> bool:
        """Whether the step's path still names the manifest being held."""
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.manifest))
        except OSError:
            return False

    def deleted(self) -> CheckpointNotFoundError:
        return deleted_while_reading(self.step_dir.path, self.step_dir.step)


def _flock(fd: int, operation: int) -> None:
    """``fcntl.flock`` (a seam: file systems without locks raise ENOLCK here)."""
    fcntl.flock(fd, operation)


def deleted_while_reading(path: str, step: Optional[int]) -> CheckpointNotFoundError:
    what = f"step {step}" if step is not None else path
    return CheckpointNotFoundError(f"{path}: {what} was deleted while it was being read (retention, a "
                                   f"newer save superseding it, or `lazyckpt prune` in another process)",
                                   path=path, step=step)


def _lock_for_delete(step_path: str) -> Tuple[Optional[int], bool]:
    """(fd holding an exclusive lock on the manifest or None, True if a reader holds it)."""
    manifest = os.path.join(step_path, MANIFEST)
    fd = -1
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            fd = os.open(manifest, flags | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            break
        except OSError:
            continue
    if fd < 0:
        return None, False
    try:
        _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None, True
        return None, False
    return fd, False


# --------------------------------------------------------------------------- leftovers


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under ``path`` (or of the file itself)."""
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
    except OSError:
        return 0
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _step_in(name: str) -> Optional[int]:
    m = re.search(r"step_(\d{10})", name)
    return int(m.group(1)) if m else None


def remove_tree(path: str) -> None:
    """Remove a file or a directory tree; a path already gone is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- a Checkpointer directory


class CheckpointDir:
    """A directory of committed steps (docs/FORMAT.md §11).

    Invariant: the committed steps form one line of history, so the step
    order *is* the commit order and the latest step is the most recently
    committed one. Committing step S supersedes every committed step >= S
    (a run resumed from an older step abandons the newer ones): they are
    renamed out of the committed namespace before S appears, so a crash at
    any instant leaves a consistent line (at worst without S and without the
    superseded steps). Superseded steps are kept aside as ``.abandoned-*``
    when retention is off, deleted otherwise.
    """

    def __init__(self, path: str, lease_expiry_s: float = DEFAULT_EXPIRY_S):
        self.path = os.path.abspath(os.fspath(path))
        self.lease_expiry_s = lease_expiry_s
        #: The writer lease this process holds here (``WriterLease``), checked at every commit.
        self.writer: Optional["WriterLease"] = None

    # ---------------------------------------------------------------- names

    def step_path(self, step: int) -> str:
        return os.path.join(self.path, step_dirname(step))

    def temp_path(self, step: int, token: str) -> str:
        return os.path.join(self.path, f"{TEMP_PREFIX}{step_dirname(step)}-{token}")

    # ---------------------------------------------------------------- listing

    def steps(self) -> List[int]:
        """Committed steps, oldest (= first committed) first."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: no such directory", path=self.path) from None
        out = []
        for name in names:
            m = STEP_DIR.match(name)
            if m and os.path.isfile(os.path.join(self.path, name, MANIFEST)):
                out.append(int(m.group(1)))
        return sorted(out)

    def latest(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def latest_file(self) -> Optional[int]:
        """What ``DIR/latest`` says (advisory: readers trust the listing)."""
        raw = read_small_file(os.path.join(self.path, LATEST), 64)
        try:
            return int(raw.decode().strip()) if raw is not None else None
        except (UnicodeDecodeError, ValueError):
            return None

    # ---------------------------------------------------------------- commit

    def commit(self, tmp: str, step: int, keep_superseded: bool) -> List[int]:
        """Make the complete, fsynced temporary directory ``tmp`` the committed
        ``step``; returns the steps it superseded (>= step)."""
        if self.writer is not None:
            self.writer.check()         # displaced by a takeover since save(): commit nothing
        superseded = [s for s in self.steps() if s >= step]
        retired = []
        for s in sorted(superseded, reverse=True):
            trash = self._retire(s, ABANDONED_PREFIX if keep_superseded else DELETING_PREFIX, force=True)
            if trash is not None:
                retired.append(trash)
        if retired:
            fsync_dir(self.path)        # the old line is gone before the new step appears
            log.warning("lazyckpt: %s: step %d supersedes step(s) %s of an abandoned run (%s)", self.path,
                        step, superseded, "kept as .abandoned-*" if keep_superseded else "deleted")
        os.rename(tmp, self.step_path(step))
        fsync_dir(self.path)
        if not keep_superseded:
            for trash in retired:
                self._remove_trash(trash)
        return superseded

    def pending(self, step: int, save_id: str, token: str) -> "PendingStepDir":
        return PendingStepDir(self, step, save_id, token)

    def listing(self) -> Tuple[Dict[int, str], List[Any]]:
        # The save ids are in the manifests (one small read per step); the events in DIR/history.json.
        committed = {}
        for step in self.steps():
            event = manifest_event(read_small_file(os.path.join(self.step_path(step), MANIFEST),
                                                   manifests.MAX_MANIFEST_BYTES))
            if event is not None and event.step == step:
                committed[step] = event.save_id
        return committed, LocalRecord(self.path).read()[1]

    def save_path(self, step: int, save_id: str) -> str:
        return self.step_path(step)         # one save per step name here: the committed one

    def record_event(self, event: Any) -> None:
        """The local record of the line of history (``DIR/history.json``)."""
        LocalRecord(self.path).add(event, self.steps())

    def write_latest(self, step: int) -> None:
        write_file_atomic(os.path.join(self.path, LATEST), f"{step}\n".encode())

    def acquire_writer(self, heartbeat_s: float, expiry_s: float, takeover: bool = False) -> "WriterLease":
        return WriterLease(self.path, heartbeat_s, expiry_s, takeover=takeover)

    # ---------------------------------------------------------------- retention

    def apply_retention(self, keep_last: Optional[int]) -> List[int]:
        """Delete all but the ``keep_last`` newest steps -- except steps a kept
        step refers to (incremental checkpoints) -- and abandoned steps. A step
        another process is reading is kept until a later pass."""
        if keep_last is None:
            return []
        deleted, _kept = self.retire_old(keep_last)
        for leftover in self.leftovers():
            if leftover.kind == "abandoned":
                self._remove_trash(os.path.join(self.path, leftover.name))
        return deleted

    def references(self, step: int) -> Optional[List[int]]:
        """The earlier steps whose files hold bytes of ``step`` (its manifest);
        None if the manifest cannot be read (then it may need any of them)."""
        raw = read_small_file(os.path.join(self.step_path(step), MANIFEST), manifests.MAX_MANIFEST_BYTES)
        if raw is None:
            return []                                  # gone meanwhile: needs nothing
        try:
            return manifests.references(manifests.parse(raw, self.step_path(step)))
        except Exception:                              # unreadable: assume it needs everything older
            return None

    def retention_plan(self, keep: int) -> Tuple[List[int], List[int]]:
        """(steps to delete, newest first; older steps kept because a kept step
        refers to them). Deleting newest first never leaves a remaining step
        referring to a deleted one, whatever instant a crash hits."""
        steps = self.steps()
        kept = steps[-keep:]
        needed = set(kept)
        for step in sorted(kept, reverse=True):
            self._need(step, needed, steps)
        doomed = [s for s in reversed(steps) if s not in needed]
        return doomed, sorted(needed - set(kept))

    def _need(self, step: int, needed: set, steps: List[int]) -> None:
        todo = [step]
        while todo:
            current = todo.pop()
            refs = self.references(current)
            for r in ([s for s in steps if s < current] if refs is None else refs):
                if r not in needed:
                    needed.add(r)
                    todo.append(r)

    def retire_old(self, keep: int) -> Tuple[List[int], List[int]]:
        """Apply ``retention_plan``: returns (deleted, kept because referred to
        or being read)."""
        doomed, referred = self.retention_plan(keep)
        steps = self.steps()
        needed = set(steps) - set(doomed)
        deleted, kept = [], list(referred)
        for step in doomed:                            # newest first
            if step in needed:                         # a busy step below needs it
                kept.append(step)
                continue
            if self.delete_step(step):
                deleted.append(step)
            else:
                log.info("lazyckpt: %s: step %d is being read; deleting it later", self.path, step)
                kept.append(step)
                needed.add(step)
                self._need(step, needed, steps)        # it stays, so must what it refers to
        if referred:
            log.info("lazyckpt: %s: keeping step(s) %s: kept steps refer to their bytes", self.path, referred)
        return deleted, sorted(kept)

    def delete_step(self, step: int, even_if_read: bool = False) -> bool:
        """Rename the step to ``.deleting-*``, fsync, then remove it (FORMAT.md §11.4).
        Returns False (and leaves it) if a reader holds it, unless ``even_if_read``."""
        trash = self._retire(step, DELETING_PREFIX, force=even_if_read)
        if trash is None:
            return False
        fsync_dir(self.path)
        self._remove_trash(trash)
        return True

    def _retire(self, step: int, prefix: str, force: bool) -> Optional[str]:
        path = self.step_path(step)
        fd, busy = _lock_for_delete(path)
        if busy and not force:
            return None
        trash = os.path.join(self.path, f"{prefix}{step_dirname(step)}-{new_token()}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return None                 # removed meanwhile (a prune in another process)
        finally:
            if fd is not None:
                os.close(fd)
        return trash

    def _remove_trash(self, trash: str) -> None:
        fd, busy = _lock_for_delete(trash)
        if fd is not None:
            os.close(fd)
        if busy:
            return                      # a reader still holds it: a later cleanup removes it
        shutil.rmtree(trash, ignore_errors=True)

    # ---------------------------------------------------------------- leftovers

    def leftovers(self, expiry_s: Optional[float] = None) -> List[Leftover]:
        expiry = self.lease_expiry_s if expiry_s is None else expiry_s
        out = []
        now = time.time()
        for name in sorted(os.listdir(self.path)):
            path = os.path.join(self.path, name)
            if name.startswith(TEMP_PREFIX + "step_"):
                kind = "saving" if is_live(path, expiry, now) else "interrupted-save"
            elif name.startswith(DELETING_PREFIX + "step_"):
                kind = "deleting"
            elif name.startswith(ABANDONED_PREFIX + "step_"):
                kind = "abandoned"
            elif SMALL_TEMP.match(name):
                kind = "saving" if is_live(path, expiry, now) else "small-tmp"
            elif name == WRITER:
                if is_live(path, expiry, now):
                    continue            # a live writer's lease: not a leftover
                kind = "dead-writer"
            elif STEP_DIR.match(name) and os.path.isdir(path) and \
                    not os.path.isfile(os.path.join(path, MANIFEST)):
                kind = "incomplete-step"
            else:
                continue
            out.append(Leftover(name, kind, tree_bytes(path), _step_in(name)))
        return out

    def clean_leftovers(self) -> List[str]:
        """Remove what is provably dead: expired saves, interrupted deletes (not
        being read), stale small temporaries. Never a live save, never data."""
        removed = []
        for leftover in self.leftovers():
            if not leftover.removable:
                continue
            path = os.path.join(self.path, leftover.name)
            if leftover.kind == "deleting":
                self._remove_trash(path)
            else:
                remove_tree(path)
            if not os.path.lexists(path):
                removed.append(leftover.name)
        if removed:
            log.info("lazyckpt: %s: removed leftovers of interrupted saves: %s", self.path, removed)
        return removed

    # ---------------------------------------------------------------- the read side (base.Directory)

    def step_paths(self) -> Dict[int, str]:
        return {step: self.step_path(step) for step in self.steps()}

    def step_records(self) -> List[StepRecord]:
        return [StepRecord(step, os.path.basename(path), path, tree_bytes(path))
                for step, path in self.step_paths().items()]

    def remove_leftovers(self, leftovers: List[Leftover]) -> Dict[str, Optional[str]]:
        """What ``leftovers()`` listed goes as it is (prune asked for it); locks
        were checked when it was listed."""
        out: Dict[str, Optional[str]] = {}
        for leftover in leftovers:
            try:
                remove_tree(os.path.join(self.path, leftover.name))
                out[leftover.name] = None
            except OSError as exc:
                out[leftover.name] = f"{exc.strerror or exc}"
        return out


# --------------------------------------------------------------------------- saves in progress

class PendingStepDir:
    """A save of one step into a :class:`CheckpointDir` (``base.PendingStep``):
    a temporary directory ``.tmp-step_X-<token>`` that the commit renames into
    place once every rank's file and the manifest are durable."""

    needs_create = True

    def __init__(self, directory: CheckpointDir, step: int, save_id: str, token: str):
        self.directory, self.step, self.save_id = directory, step, save_id
        self.path = directory.temp_path(step, token)

    def create(self) -> None:
        os.makedirs(self.path, exist_ok=False)

    def file_path(self, rank: int) -> str:
        return os.path.join(self.path, rank_filename(rank))

    def hold(self, rank: int, heartbeat_s: float) -> "Lease":
        # On the data file itself: cleanup sees it locked (and its mtime fresh).
        return Lease(self.file_path(rank), heartbeat_s)

    def put_side(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.path, name), "wb") as f:
            f.write(data)

    def take_side(self, name: str) -> bytes:
        path = os.path.join(self.path, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: a rank's shard report is missing", path=path, step=self.step) from None
        os.unlink(path)
        return data

    def read_ends(self, rank: int, options: Any, parse: Callable[[int, Callable[[int, int], bytes]], Any]) -> Any:
        fd = os.open(self.file_path(rank), os.O_RDONLY)
        try:
            return parse(os.fstat(fd).st_size, lambda offset, n: os.pread(fd, n, offset))
        finally:
            os.close(fd)

    def publish(self, manifest_raw: bytes, event: Optional[Any], keep_superseded: bool) -> List[int]:
        write_file_atomic(os.path.join(self.path, MANIFEST), manifest_raw)
        fsync_dir(self.path)
        if event is not None:
            # Recorded before the renames: a crash in between leaves the record
            # saying the superseded steps are abandoned, never live.
            self.directory.record_event(event)
        return self.directory.commit(self.path, self.step, keep_superseded)

    def discard(self) -> None:
        if os.path.isdir(self.path):     # not renamed: nothing of this step may remain
            remove_tree(self.path)


class PendingSiblingFile:
    """A save of one file (``base.PendingFile``): written as a hidden sibling
    (``.NAME.tmp-<token>``, which cleanup recognizes) of ``final`` -- or of
    ``beside``, the directory a framework is assembling around it --
    fsynced, renamed over the final path, the directory fsynced."""

    def __init__(self, final: str, make_parents: bool, beside: Optional[str] = None):
        self.final = os.path.abspath(os.fspath(final))
        near = os.path.abspath(os.fspath(beside)) if beside else self.final
        if make_parents:
            os.makedirs(os.path.dirname(near), exist_ok=True)
        elif not os.path.isdir(os.path.dirname(self.final)):
            raise CheckpointNotFoundError(f"{final}: directory {os.path.dirname(self.final)} does not exist",
                                          path=final)
        self.path = sibling_temp(near)

    def hold(self, heartbeat_s: float) -> "Lease":
        return Lease(self.path, heartbeat_s)

    def publish(self) -> None:
        os.replace(self.path, self.final)
        fsync_dir(os.path.dirname(self.final))

    def discard(self) -> None:
        remove_quietly(self.path)


def clean_sibling_temps(directory: str, expiry_s: float = DEFAULT_EXPIRY_S) -> List[str]:
    """Remove provably dead ``sibling_temp`` files and directories in ``directory``."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not SIBLING_TEMP.match(name):
            continue
        path = os.path.join(directory, name)
        if is_live(path, expiry_s, now):
            continue
        try:
            remove_tree(path)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("lazyckpt: %s: removed leftovers of interrupted saves: %s", directory, removed)
    return removed


# --------------------------------------------------------------------------- the writer lease


class WriterLease:
    """One writer per checkpoint directory (docs/FORMAT.md §11.5).

    A Checkpointer that saves holds ``DIR/.writer``: a :class:`Lease` on it (an
    exclusive flock for as long as it lives, its mtime refreshed by the keeper
    thread), and JSON naming the holder (pid, host, an id, since when). A
    second writer -- another process, or another Checkpointer object in this
    one -- is refused with the holder's name. A dead holder's flock is gone
    with its process, so a restart is never blocked; on a file system without
    locks the heartbeat alone decides (a holder not heard from within
    ``expiry_s`` is dead).

    ``takeover=True`` displaces a live holder: the new lease is a new file
    renamed over ``.writer``, so the old holder's lock is on a file that no
    longer has that name; its :meth:`check` (every save, and every commit)
    then fails, naming who took over."""

    def __init__(self, directory: str, heartbeat_s: float, expiry_s: float, takeover: bool = False):
        self.directory = directory
        self.path = os.path.join(directory, WRITER)
        self.expiry_s = expiry_s
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), "id": uuid.uuid4().hex,
                       "since": time.time()}
        self._lease = self._take_over(heartbeat_s) if takeover else self._acquire(heartbeat_s)

    # ---------------------------------------------------------------- taking it

    def _acquire(self, heartbeat_s: float) -> Lease:
        for _ in range(100):            # retried only when a takeover renames the file under us
            try:
                before = os.stat(self.path)
            except FileNotFoundError:
                before = None
            if before is not None and _held_here(before):
                # Another Checkpointer of this process. Probing would be wrong: a
                # POSIX-lock emulation of flock (NFS) grants it to the same process.
                raise self._refused(read_writer(self.path), same_process=True)
            try:
                lease = Lease(self.path, heartbeat_s)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise self._refused(read_writer(self.path)) from None
                raise
            if not self._current(lease):
                lease.release()         # locked a file a takeover had just replaced: retry on the new one
                continue
            if not lease.locked and before is not None:     # no locks here: the heartbeat alone decides
                holder = read_writer(self.path)             # (its mtime from before our own keeper beats it)
                if holder and not holder.get("released") and time.time() - before.st_mtime < self.expiry_s:
                    lease.release()
                    raise self._refused(holder)
            self._write(lease.fd, self.holder)
            return lease
        raise CheckpointError(f"{self.directory}: could not take the writer lease ({self.path} keeps being "
                              f"replaced: writers taking it over from each other)", path=self.directory)

    def _take_over(self, heartbeat_s: float) -> Lease:
        previous = read_writer(self.path)
        tmp = f"{self.path}.tmp-{new_token()}"
        lease = Lease(tmp, heartbeat_s)
        try:
            holder = dict(self.holder)
            if previous and not previous.get("released"):
                holder["took_over_from"] = {k: previous.get(k) for k in ("pid", "host", "id")}
                log.warning("lazyckpt: %s: taking over the writer lease from %s (takeover=True)", self.directory,
                            describe_writer(previous))
            self._write(lease.fd, holder)
            os.rename(tmp, self.path)
            fsync_dir(self.directory)
        except BaseException:
            lease.release()
            remove_quietly(tmp)
            raise
        lease.path = self.path
        return lease

    def _current(self, lease: Lease) -> bool:
        """Whether ``.writer`` still names the file ``lease`` holds."""
        try:
            return os.path.samestat(os.fstat(lease.fd), os.stat(self.path))
        except OSError:
            return False

    @staticmethod
    def _write(fd: int, holder: Dict) -> None:
        import json
        data = json.dumps(holder, sort_keys=True).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))     # written first, then cut: never an empty holder

    def _refused(self, holder: Optional[Dict], same_process: bool = False) -> CheckpointError:
        who = describe_writer(holder)
        if same_process or (holder and holder.get("pid") == os.getpid()
                            and holder.get("host") == socket.gethostname()):
            who += " (this process: another Checkpointer on this directory is still open; close() it)"
        return CheckpointError(f"{self.directory}: another Checkpointer is saving into this directory: {who}. "
                               f"One writer per directory: two would supersede each other's steps and refer "
                               f"to each other's bytes. Load with this one, or pass takeover=True to make it "
                               f"the writer (the other one's next save then fails)", path=self.directory)

    # ---------------------------------------------------------------- holding it

    def check(self) -> None:
        """Raise unless this is still the directory's writer (before every save
        and at every commit)."""
        lease = self._lease
        if lease.fd < 0:
            raise CheckpointError(f"{self.directory}: this Checkpointer gave up its writer lease (closed)",
                                  path=self.directory)
        if self._current(lease):
            return
        holder = read_writer(self.path)
        if holder is None:
            raise CheckpointError(f"{self.directory}: the writer lease {self.path} was removed while this "
                                  f"Checkpointer held it; it no longer saves here", path=self.directory)
        raise CheckpointError(f"{self.directory}: another Checkpointer took over this directory "
                              f"({describe_writer(holder)}, takeover=True); this one can no longer save "
                              f"into it", path=self.directory)

    def release(self) -> None:
        """Idempotent. Removes ``.writer`` while it still names this lease (and
        the lock is still held, so an acquirer that opened it meanwhile sees it
        gone and retries), then drops the lock. A takeover renaming its file in
        between the check and the unlink loses that file: its holder's next
        save then fails clearly (``check``); nothing is committed wrongly."""
        lease = self._lease
        if lease.fd < 0:
            return
        try:
            if self._current(lease):
                self._write(lease.fd, {**self.holder, "released": True})   # for file systems without locks
                os.unlink(self.path)
        except OSError:
            pass
        lease.release()


def read_writer(path: str) -> Optional[Dict]:
    """The holder a ``.writer`` file names, or None (missing, being written)."""
    import json
    raw = read_small_file(path, 1 << 16)
    try:
        holder = json.loads(raw.decode()) if raw else None
    except (UnicodeDecodeError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def describe_writer(holder: Optional[Dict]) -> str:
    if not holder:
        return "a writer whose lease file is being written"
    since = holder.get("since")
    age = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}" \
        if isinstance(since, (int, float)) else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{age}"
