"""Low-level file I/O: O_DIRECT with a buffered fallback, full writes and
reads, and the fsyncs a commit needs."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import logging
import mmap
import os
import shutil
import stat
import threading
from typing import Callable, Optional

from lazyckpt.errors import CorruptCheckpointError
from lazyckpt.keptpools import KeptPool

_O_DIRECT = getattr(os, "O_DIRECT", 0)
log = logging.getLogger("lazyckpt")


class OutputFile:
    """A file written at explicit offsets by several threads.

    Opened with O_DIRECT when asked and accepted; if the file system refuses
    it (tmpfs at open, some file systems at the first write with EINVAL), the
    file is reopened buffered and the write retried, transparently.
    """

    rewrites_in_place = True

    def __init__(self, path: str, o_direct: bool, create: bool = True):
        """``create``: make the file (or empty it); else open the existing one
        (a second descriptor of a file being written in two modes)."""
        self.path = path
        self._lock = threading.Lock()
        self._retired: list = []
        flags = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0) | ((os.O_CREAT | os.O_TRUNC) if create else 0)
        self.direct = False
        self.fd = -1
        if o_direct and _O_DIRECT:
            try:
                self.fd = os.open(path, flags | _O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o644)

    def _fall_back_to_buffered(self) -> None:
        with self._lock:
            if not self.direct:
                return
            # Keep the old descriptor open until close(): other writer threads may be using it.
            self._retired.append(self.fd)
            self.fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            self.direct = False

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset``, looping over short writes."""
        done = 0
        total = len(data)
        while done < total:
            # Read both together: another thread may switch to buffered between them.
            fd, direct = self.fd, self.direct
            try:
                n = os.pwrite(fd, data[done:], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and (direct or fd != self.fd):
                    self._fall_back_to_buffered()
                    continue
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"write returned {n}", self.path)
            done += n

    def will_rewrite(self, offsets: list) -> None:
        """Nothing to keep: a file's blocks are rewritten where they are."""

    def finish(self, size: int) -> None:
        """Cut the file to its exact size (O_DIRECT wrote whole pages) and make it durable."""
        os.ftruncate(self.fd, size)
        os.fsync(self.fd)

    def close(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: Buffers at least this large ask for transparent huge pages.
HUGE_PAGE_MIN = 4 << 20


def anonymous_buffer(nbytes: int, huge_pages: bool = False) -> mmap.mmap:
    """Zeroed, page-aligned memory (as O_DIRECT needs) for bulk I/O. With
    ``huge_pages``, large ones ask for transparent huge pages (a no-op where
    THP is off): memory kept and reused (the host cache) always asks, a
    load's fresh buffers only after the process's first load
    (:func:`read_buffer`, the policy; the figures are below).

    Huge pages fresh to a process can cost far more than small ones: the
    first load of a new process ran 1.5-1.7x slower with them (0.81 GB, cold
    cache, ABBA: medians 0.685 vs 0.400 s over 10 rounds, kernel CPU 0.92 vs
    0.36 s). The likely cause on a VM: free page reporting hands free 2 MiB
    blocks back to the host, so a fresh huge page is a host fault. Earlier
    days' figures went both ways (1.91 vs 1.36 s for 1.27 GB in their favour
    on 2026-12-01, equal on 12-03), and an object store's socket buffers
    were 2.7x slower with them (8 ranks restoring at once: 13 s against 5 s)."""
    buf = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and nbytes >= HUGE_PAGE_MIN and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


#: Whether a load has ended in this process (see :func:`read_buffer`).
_loaded_before = False


def read_buffer(nbytes: int, remote: bool = False) -> mmap.mmap:
    """Fresh memory for bytes being read from a local file: small pages for
    the first load of a process, huge pages once one has ended. A restart's
    one load ran 1.5-1.7x slower with huge pages (see :func:`anonymous_buffer`);
    a process that loads again and again (studies, evaluation) ran its later
    loads up to 1.4x faster with them, by reusing the huge pages earlier loads
    freed (its second load pays for the first fresh ones). Buffers a socket
    fills (``remote``) never ask."""
    return anonymous_buffer(nbytes, huge_pages=_loaded_before and not remote)


def a_load_ended() -> None:
    """Called by the loader after every load (whichever way it ended)."""
    global _loaded_before
    _loaded_before = True


def make_dirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, and each directory it creates made
    durable in its parent (the parent fsynced): a file later published in
    ``path`` and its directory fsynced is then durable whole, not lost with a
    directory entry that a power loss takes back."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
    missing = []
    while not os.path.lexists(path):        # a file in the way: mkdir below says "Not a directory"
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:
            if not os.path.isdir(directory):
                raise
            continue                    # made by someone else meanwhile: theirs to make durable
        fsync_dir(os.path.dirname(directory))


def fsync_dir(path: str) -> None:
    fsync_file(path, getattr(os, "O_DIRECTORY", 0))


def fsync_file(path: str, flags: int = 0) -> None:
    """fsync what is at ``path`` (written through another descriptor, or by
    another library)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class InputFile:
    """A file read at explicit offsets by several threads, O_DIRECT when asked
    and accepted, falling back to buffered reads where O_DIRECT reads fail."""

    def __init__(self, path: str, o_direct: bool):
        self.path = path
        self.fd, self.direct = open_for_read(path, o_direct)
        self._lock = threading.Lock()
        self._retired: list = []

    def read_into(self, buf: memoryview, offset: int) -> int:
        """Read into ``buf`` until full or end of file; return bytes read."""
        done = 0
        total = len(buf)
        while done < total:
            fd, direct = self.fd, self.direct
            try:
                n = os.preadv(fd, [buf[done:]], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and (direct or fd != self.fd):
                    self._fall_back_to_buffered()
                    continue
                raise
            if n == 0:
                break
            done += n
        return done

    def _fall_back_to_buffered(self) -> None:
        with self._lock:
            if not self.direct:
                return
            self._retired.append(self.fd)
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self.direct = False

    def close(self) -> None:
        for fd in self._retired + [self.fd]:
            os.close(fd)
        self._retired.clear()
        self.fd = -1


def open_for_read(path: str, o_direct: bool) -> tuple:
    """Return (fd, direct) for reading."""
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    if o_direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags), False


def pread_into(fd: int, buf: memoryview, offset: int, path: str) -> int:
    """Read into ``buf`` until full or end of file; return bytes read."""
    done = 0
    total = len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def write_file_atomic(path: str, data: bytes) -> None:
    """Write a small file so that readers see the old or the new content, never a mix."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp-{os.urandom(6).hex()}"
    # A new file of its own (O_EXCL, never through a symlink planted at its name);
    # the rename then replaces ``path`` itself, a symlink there included.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)         # a full disk must not also leave a temporary behind
        raise
    fsync_dir(directory)


#: Closes the descriptors :func:`replace_releasing_later` and
#: :func:`unlink_releasing_later` hold: the close that frees a dropped
#: file's blocks runs here, one at a time.
_releaser = KeptPool(1, "lazyckpt-release")


def replace_releasing_later(src: str, dst: str) -> None:
    """``os.replace(src, dst)``, with the blocks of the file it replaces freed
    on a kept thread, not the caller's. A rename over a file frees that file's
    blocks inside the rename; on a file system mounted with ``discard`` (this
    machine's ext4, many cloud disks) that is a synchronous TRIM: 0.36 s for a
    0.8 GB file here, a third of saving it again. A descriptor held on the old
    file across the rename leaves it an orphan (crash-safe: the file system
    drops orphans at mount); the descriptor's close, on the release thread,
    frees the blocks. A process forked meanwhile holds its copy until it
    exits or execs (the descriptor is close-on-exec)."""
    _releasing_later(dst, lambda: os.replace(src, dst))


def unlink_releasing_later(path: str) -> None:
    """``os.unlink(path)``, the file's blocks freed on the release thread (see
    :func:`replace_releasing_later`): a Lightning top-k removal runs on the
    training thread."""
    _releasing_later(path, lambda: os.unlink(path))


def _releasing_later(path: str, drop_name: Callable[[], None]) -> None:
    """``drop_name()`` (which drops ``path``'s name) with a descriptor held on
    what ``path`` names, closed afterwards on the release thread."""
    held = _hold(path)
    try:
        drop_name()
    except BaseException:
        if held is not None:
            os.close(held)
        raise
    if held is not None:
        _releaser.get().submit(_release, held, path)


def _release(fd: int, path: str) -> None:
    try:
        os.close(fd)
    except OSError as exc:      # nobody waits for this close: say it, do not lose it
        log.warning("lazyckpt: %s: freeing the file this name had was refused: %s", path, exc)


def free_later(free: Callable[[str], None], path: str) -> "cf.Future":
    """Run ``free(path)`` (the removal of a tree already renamed aside) on the
    release thread, after the frees submitted before it; its failure is
    logged, not raised: the tree is a leftover that the next scan removes."""
    def run() -> None:
        try:
            free(path)
        except Exception as exc:
            log.warning("lazyckpt: %s: freeing it failed (removed at the next open): %s", path, exc)
    return _releaser.get().submit(run)


def wait_for_releases(timeout: Optional[float] = None) -> None:
    """Return once the files replaced so far are freed (benchmarks isolate
    their methods with it; tests check nothing stays held)."""
    _releaser.get().submit(lambda: None).result(timeout)


def _hold(path: str) -> Optional[int]:
    """A descriptor on what ``path`` names (a symlink itself, never its
    target; no read permission needed, a FIFO does not block), or None where
    there is nothing or the platform has no O_PATH."""
    o_path = getattr(os, "O_PATH", 0)
    if not o_path:
        return None
    try:
        return os.open(path, o_path | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def replace_with_link(target: str, linkpath: str, hard: bool = False) -> None:
    """Atomically make ``linkpath`` a relative symlink to ``target`` (``hard``: a
    hard link, a file of its own that outlives ``target``'s removal; a copy where
    links are refused), then fsync the directory: a kill leaves the old link or
    the new one, never none."""
    import shutil
    import uuid
    directory = os.path.dirname(linkpath)
    if os.path.isdir(linkpath) and not os.path.islink(linkpath):
        shutil.rmtree(linkpath)
    tmp = os.path.join(directory, f".{os.path.basename(linkpath)}.{uuid.uuid4().hex[:8]}.link")
    try:
        if hard:
            os.link(target, tmp)
        else:
            os.symlink(os.path.relpath(target, directory), tmp)
    except OSError:
        shutil.copy(target, tmp)
    replace_releasing_later(tmp, linkpath)      # the old link may have been a file's last name
    fsync_dir(directory)


class NotARegularFile(CorruptCheckpointError, OSError):
    """A path that should be a checkpoint file is a FIFO, a device, a directory...
    (a symlink to ``/dev/zero`` as ``history.json``): the directory is damaged, an
    error of the library's family; still an OSError, with ``errno`` and ``filename``."""

    def __init__(self, errno_: int, strerror: str, path: str):
        super().__init__(f"{path}: {strerror}; a checkpoint's files are regular files (remove or replace "
                         f"this one)", path=path)
        self.errno, self.strerror, self.filename = errno_, strerror, path

    def __str__(self) -> str:   # OSError would format its own way
        return Exception.__str__(self)


def open_regular(path: str, follow: bool = True) -> int:
    """Open ``path`` for reading, refusing anything but a regular file (a FIFO
    would block the reader forever); ``follow=False``: a symlink too."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags if follow else flags | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if not follow and exc.errno == errno.ELOOP:
            raise NotARegularFile(errno.ELOOP, "a symbolic link", path) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, "not a regular file", path)
    return fd


def read_small_file(path: str, limit: int, follow: bool = True) -> Optional[bytes]:
    """The whole file if it exists; at most ``limit + 1`` bytes (so callers can
    tell it is too large), allocating only what the file holds."""
    try:
        fd = open_regular(path, follow)
    except FileNotFoundError:
        return None
    try:
        size = min(os.fstat(fd).st_size, limit + 1)
        chunks, done = [], 0
        while done < size:
            chunk = os.read(fd, size - done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_quietly(path: str) -> None:
    """Remove a file that may not exist (cleanup after a failure)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_tree(path: str) -> None:
    """Remove a file or a directory tree; a path already gone is fine."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
