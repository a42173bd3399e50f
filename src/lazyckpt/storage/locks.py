"""Who holds what on a local file system: the leases of saves in progress,
the shared locks of steps being read, and the one-writer lease of a
Checkpointer directory (docs/FORMAT.md §11). ``layout`` decides what may be
deleted; this module only answers whether someone still holds a path.

Live saves are protected by **leases**, not pid guessing: a process writing a
temporary file holds an exclusive ``flock`` on it for as long as the save is
in progress and refreshes its modification time every ``heartbeat_s`` (one
small keeper thread per process). A temporary file or directory is *live*
while any file of it is locked by anyone or was modified within
``lease_expiry_s``. Either signal alone keeps it: the lock covers a clock skew
between hosts, the heartbeat covers file systems whose locks are node-local
or absent. A process never probes its own leases (a POSIX lock emulation
would drop them on close).

Steps being read are protected by a shared lock on their manifest: retention
skips a step whose manifest another process holds; a reader that finds its
step gone reports precisely that it was deleted.

Every flock goes through :func:`_flock`, the one seam tests use to play a
file system without locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
from typing import Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import MANIFEST, WRITER
from .fileio import NotARegularFile, fsync_dir, pid_alive, read_small_file, remove_quietly

log = logging.getLogger("lazyckpt")

DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_EXPIRY_S = 60.0
#: How long ``WriterLease.release`` (``close()``) waits for the directory's commit
#: lock to remove ``.writer``; past it the file stays, released (see there).
RELEASE_WAIT_S = 5.0


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def _host_tag() -> str:
    """This host in this boot, in 8 hex digits (a pid means nothing on another host or
    after a reboot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.sha1(f"{socket.gethostname()}/{boot}".encode()).hexdigest()[:8]


HOST_TAG = _host_tag()
_HOLDER_TOKEN = re.compile(r"^[0-9a-f]{12}-(?P<pid>\d+)-(?P<host>[0-9a-f]{8})$")


def holder_token() -> str:
    """A temporary's token that names its holder: random, pid, host tag. Cleanup may
    then remove it at once when that process is gone (``holder_died_here``)."""
    return f"{new_token()}-{os.getpid()}-{HOST_TAG}"


def holder_died_here(token: str, path: str) -> bool:
    """Whether the temporary at ``path`` named by ``token`` (``holder_token``) belongs
    to a process of this host and boot that no longer exists, and nothing holds a lock
    in it: its save is provably over, whatever its heartbeat says. A pid reused by
    another process only delays cleanup to the lease's expiry; a lock held (another
    pid namespace sharing the host name) keeps it."""
    m = _HOLDER_TOKEN.match(token)
    if m is None or m.group("host") != HOST_TAG or int(m.group("pid")) == os.getpid() \
            or pid_alive(int(m.group("pid"))):
        return False
    paths = [path]
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            paths = [os.path.join(path, n) for n in os.listdir(path)]
        except OSError:
            return False
    return all(locked_by_someone(p) is False for p in paths if os.path.isfile(p))


# --------------------------------------------------------------------------- leases

_LOCK_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_held: Dict[Tuple[int, int], int] = {}          # (st_dev, st_ino) -> count, leases of this process
_held_lock = threading.Lock()


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _not_a_lease_file(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}, where lazyckpt keeps a lease file; refusing to write "
                                  f"through it (remove it if nothing of yours put it there)", path=path)


def open_lease_file(path: str) -> int:
    """Open (create) a lease file for reading and writing, never through a
    symlink (one planted at ``DIR/.writer`` would make a save truncate a file
    outside the directory) and never anything but a regular file (a FIFO, a
    directory): those are :class:`CorruptCheckpointError` naming the path."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                     0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            what = "a symbolic link" if st is not None and stat.S_ISLNK(st.st_mode) else \
                "a directory" if st is not None and stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise _not_a_lease_file(path, what) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lease_file(path, "not a regular file")
    return fd


class Lease:
    """A save in progress holds this on a file it writes: an exclusive flock for
    as long as the save lives, and a heartbeat (the file's mtime refreshed every
    ``heartbeat_s`` by the keeper thread). The file is created if missing and
    never truncated here. ``release()`` is idempotent."""

    def __init__(self, path: str, heartbeat_s: float = DEFAULT_HEARTBEAT_S):
        self.path = path
        self.heartbeat_s = heartbeat_s
        self.fd = open_lease_file(path)
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
        with _forkable_lock:
            _forkable.add(self)
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
        with _forkable_lock:
            _forkable.discard(self)
        os.close(self.fd)           # drops the lock
        self.fd = -1

    def _drop_in_child(self) -> None:
        """In a forked child: close this process's copy of the descriptor (the
        parent's lock stays held) and forget the lease (nothing heartbeats it here)."""
        _close_in_child(self)


def _close_in_child(holder: "Lease | _Held") -> None:
    """Close a forked child's copy of a lock's descriptor (flock belongs to the
    open file description: the parent's lock stays held)."""
    if holder.fd >= 0:
        try:
            os.close(holder.fd)
        except OSError:
            pass
        holder.fd = -1


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

#: Every descriptor of this process that holds a lock: leases (the writer's,
#: saves in progress) and the shared locks of steps being read.
_forkable: set = set()
_forkable_lock = threading.Lock()


def _after_fork_in_child() -> None:
    """Locks are not inherited through fork. A flock belongs to the open file
    description, which a fork shares: a child that kept its copy (a DataLoader
    worker forked after the Checkpointer took its lease) would hold the
    directory's writer lease, or pin a step being read, after its parent was
    killed, and refuse every restart. The child closes its copies (the
    parent's locks stay held: the parent's descriptors still refer to them)
    and starts with no lease, no keeper thread and fresh locks."""
    global _held_lock, _forkable_lock
    _held_lock, _forkable_lock = threading.Lock(), threading.Lock()     # another thread may have held them
    _held.clear()
    _keeper.__init__()
    for holder in list(_forkable):
        holder._drop_in_child()
    _forkable.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


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
        held = _Held(self, fd, manifest)
        with _forkable_lock:
            _forkable.add(held)
        try:
            try:
                _flock(fd, fcntl.LOCK_SH)
            except OSError as exc:
                if exc.errno not in _LOCK_UNSUPPORTED:
                    raise
            # Locked, but the step may have been renamed away just before.
            if not held.still_there():
                raise held.deleted()
            yield held
        finally:
            with _forkable_lock:
                _forkable.discard(held)
            if held.fd >= 0:            # not closed already by a fork (in the child)
                os.close(held.fd)
                held.fd = -1


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

    def _drop_in_child(self) -> None:
        _close_in_child(self)

    def still_there(self) -> bool:
        """Whether the step's path still names the manifest being held."""
        try:
            return os.path.samestat(os.fstat(self.fd), os.stat(self.manifest))
        except OSError:
            return False

    def deleted(self) -> CheckpointNotFoundError:
        return deleted_while_reading(self.step_dir.path, self.step_dir.step)


def remove_dead_lease(path: str, expiry_s: float) -> Optional[str]:
    """Unlink a lease file (``DIR/.writer``) only if it is provably dead,
    deciding on the file that is unlinked, not on its name: it is opened,
    locked exclusively (a holder's lock refuses it), found not fresh, and still
    the file at ``path`` while the lock is held, then unlinked. A writer that
    opens it meanwhile finds it locked and the name gone, and takes it anew
    (:meth:`WriterLease._acquire`). Returns None when it is gone, else why it
    stays. The caller excludes takeovers (their rename over ``path``): the
    commit lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot open it: {exc.strerror or exc}"
    try:
        if _held_here(os.fstat(fd)):
            return "held by this process"
        try:
            _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return "held by a live writer"
            if exc.errno not in _LOCK_UNSUPPORTED:
                raise
            # No locks here: the heartbeat alone says whether it is alive.
        st = os.fstat(fd)
        if time.time() - st.st_mtime < expiry_s:
            return "its heartbeat is fresh"
        try:
            if not os.path.samestat(st, os.stat(path)):
                return "replaced since it was looked at (a new writer's lease)"
        except FileNotFoundError:
            return None
        os.unlink(path)
        return None
    finally:
        os.close(fd)


def _flock(fd: int, operation: int) -> None:
    """``fcntl.flock`` (a seam: file systems without locks raise ENOLCK here)."""
    fcntl.flock(fd, operation)


def deleted_while_reading(path: str, step: Optional[int]) -> CheckpointNotFoundError:
    what = f"step {step}" if step is not None else path
    return CheckpointNotFoundError(f"{path}: {what} was deleted while it was being read (retention, a "
                                   f"newer save superseding it, or `lazyckpt prune` in another process)",
                                   path=path, step=step)


def lock_for_delete(step_path: str) -> Tuple[Optional[int], bool]:
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

    def __init__(self, directory: str, heartbeat_s: float, expiry_s: float, takeover: bool = False,
                 commit_lock: Optional[Callable[[Optional[float]], ContextManager[bool]]] = None):
        self.directory = directory
        self.path = os.path.join(directory, WRITER)
        self.expiry_s = expiry_s
        #: The directory's commit lock (``CheckpointDir.commit_lock``), which every takeover's
        #: rename over ``.writer`` and every removal of a dead one hold: the release's check
        #: and unlink are one act under it, and a writer meeting a removal waits for it.
        #: Without it (None) the caller excludes takeovers and removals itself.
        self._commit_lock = commit_lock
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(), "id": uuid.uuid4().hex,
                       "since": time.time()}
        self._lease = self._take_over(heartbeat_s) if takeover else self._acquire(heartbeat_s)

    # ---------------------------------------------------------------- taking it

    def _acquire(self, heartbeat_s: float) -> Lease:
        with contextlib.ExitStack() as under:
            return self._acquire_in(heartbeat_s, under)

    def _acquire_in(self, heartbeat_s: float, under: contextlib.ExitStack) -> Lease:
        waited = False                  # for a removal of a dead lease: once, then under the commit lock
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
                    if self._unlinked_since(before):
                        continue        # locked by a cleanup proving a dead lease dead: take it anew
                    holder = read_writer(self.path)
                    if not waited and self._commit_lock is not None and not _alive_here(holder):
                        # The lock may be a removal's (remove_dead_lease holds the dead file's lock
                        # to unlink it, under the commit lock) that stalls: wait for the commit
                        # lock, bounded, and look again holding it. No removal runs then, so a
                        # lock still there is a live holder's. Nothing is taken meanwhile: the
                        # lease is only ever a lock won on the file ``.writer`` names.
                        waited = True
                        if not under.enter_context(self._commit_lock(self.expiry_s)):
                            raise self._stalled(holder) from None
                        continue
                    raise self._refused(holder) from None
                raise
            if not self._current(lease):
                lease.release()         # locked a file a takeover had just replaced: retry on the new one
                continue
            if not lease.locked and before is not None:     # no locks here: the heartbeat alone decides
                holder = read_writer(self.path)             # (its mtime from before our own keeper beats it)
                if holder and not holder.get("released"):
                    lease.release()
                    if time.time() - before.st_mtime < self.expiry_s:
                        raise self._refused(holder)
                    # Expired, but its holder may only be stalled: a file of our own renamed
                    # over it, so that its holder's check (the same file?) fails from now on.
                    return self._take_over(heartbeat_s, "its heartbeat expired, on a file system without locks")
            try:
                self._write(lease.fd, self.holder)
            except BaseException:
                # Not taken: the lock and this process's record of it go, or every
                # later acquire here would be refused as another Checkpointer's.
                lease.release()
                raise
            return lease
        raise CheckpointError(f"{self.directory}: could not take the writer lease ({self.path} keeps being "
                              f"replaced: writers taking it over from each other)", path=self.directory)

    def _take_over(self, heartbeat_s: float, why: str = "takeover=True") -> Lease:
        previous = read_writer(self.path)
        tmp = f"{self.path}.tmp-{new_token()}"
        lease = Lease(tmp, heartbeat_s)
        try:
            holder = dict(self.holder)
            if previous and not previous.get("released"):
                holder["took_over_from"] = {k: previous.get(k) for k in ("pid", "host", "id")}
                log.warning("lazyckpt: %s: taking over the writer lease from %s (%s)", self.directory,
                            describe_writer(previous), why)
            self._write(lease.fd, holder)
            os.rename(tmp, self.path)
            fsync_dir(self.directory)
        except BaseException:
            lease.release()
            remove_quietly(tmp)
            raise
        lease.path = self.path
        return lease

    def _unlinked_since(self, before: Optional[os.stat_result], wait_s: float = 0.2) -> bool:
        """Whether the lease file found locked was a dead lease being removed
        (:func:`remove_dead_lease` locks it only to unlink it): within
        ``wait_s`` the name goes, or names another file."""
        if before is None:
            return False
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if not os.path.samestat(before, os.stat(self.path)):
                    return True
            except FileNotFoundError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

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

    def _stalled(self, holder: Optional[Dict]) -> CheckpointError:
        return CheckpointError(f"{self.directory}: cannot take the writer lease: {self.path} (naming "
                               f"{describe_writer(holder)}) is locked by another process, and the directory's "
                               f"commit lock has been held for over {self.expiry_s:g} s by a process that is "
                               f"committing or removing a dead writer's lease (a Checkpointer's cleanup at open, "
                               f"or `lazyckpt prune`): its file is being removed, or a commit is stalled. Retry "
                               f"once that process is done (a process stalled there keeps every writer out)",
                               path=self.directory)

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
            if self.holder.get("pid") != os.getpid():
                raise CheckpointError(f"{self.directory}: this Checkpointer was inherited through fork (by pid "
                                      f"{os.getpid()} from pid {self.holder.get('pid')}); the writer lease stays "
                                      f"with the parent: save from the parent, or open a Checkpointer here",
                                      path=self.directory)
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
        gone and retries), then drops the lock. The check and the unlink are
        one act under the directory's commit lock, which a takeover holds to
        rename its new file over ``.writer``: the takeover comes before (the
        name is not this lease's any more: nothing is removed) or after (its
        file takes a free name), never in between, where the unlink would
        remove the takeover's lease. The lock is waited for at most
        ``RELEASE_WAIT_S``: held longer (a commit stalled in another process),
        the file stays, marked released and unlocked, and the next writer takes
        it (the next open's cleanup removes it)."""
        lease = self._lease
        if lease.fd < 0:
            return
        try:
            with (self._commit_lock(RELEASE_WAIT_S) if self._commit_lock is not None
                  else contextlib.nullcontext(True)) as held:
                if self._current(lease):
                    self._write(lease.fd, {**self.holder, "released": True})   # for file systems without locks
                    if held:
                        os.unlink(self.path)
        except OSError:
            pass
        lease.release()


def _alive_here(holder: Optional[Dict]) -> bool:
    """Whether ``holder`` (``read_writer``) names a process of this host that
    exists: its lock is surely its own. Anything else (another host, a file
    being written or released) may be locked by a removal proving it dead."""
    if not holder or holder.get("released") or holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and pid_alive(pid)


def read_writer(path: str) -> Optional[Dict]:
    """The holder a ``.writer`` file names, or None (missing, being written)."""
    import json
    try:
        raw = read_small_file(path, 1 << 16, follow=False)
    except NotARegularFile:
        try:
            link = stat.S_ISLNK(os.lstat(path).st_mode)
        except OSError:
            link = False
        raise _not_a_lease_file(path, "a symbolic link" if link else "not a regular file") from None
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
