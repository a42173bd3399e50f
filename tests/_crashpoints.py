"""Enumerated crash points (issue 33 item 4; after ALICE, OSDI'14, and
CrashMonkey, OSDI'18): instead of killing a process at random instants, number
every mutating call the library makes while one short "operation under test"
runs, and crash the process before each of them in turn.

Pieces (tests/test_crash_points.py and scripts/soak_crash_points.py use them):

* :class:`Interceptor` -- installed in a forked child: wraps the file-system
  calls that change durable state (``os.open``/``builtins.open``/``io.open``
  with a write, create or truncate flag, ``os.write``, ``os.pwrite``,
  ``os.writev``, ``os.pwritev``, ``os.fsync``, ``os.fdatasync``,
  ``os.ftruncate``, ``os.truncate``, ``os.rename``, ``os.replace``,
  ``os.unlink``, ``os.remove``, ``os.rmdir``, ``os.mkdir`` -- so also
  ``os.makedirs`` and ``shutil.rmtree``'s inner unlinks and rmdirs, which call
  them through the ``os`` module --, ``os.link``, ``os.symlink``; below
  Python, ``os.sendfile`` -- ``shutil.copyfile``'s way on Linux --,
  ``os.copy_file_range``, ``os.posix_fallocate``, ``torch.save`` to a path
  (torch's C++ writer: one point, journaled as an open that creates), and the
  ``sync_file_range`` that ``storage/iomode.py`` calls through ctypes after a
  buffered write in the default ``o_direct="auto"`` mode; lazyckpt makes no
  other call through ctypes and writes no file through a mapping) on paths
  under the case's directory, and every mutating object-store request (PUT,
  POST, DELETE: a botocore ``before-send`` hook on the clients lazyckpt builds,
  ``storage.s3.ObjectStore``; reads change nothing, so a crash before one is
  the crash before the next mutating call). Only calls made while the
  operation is *armed* count, from any thread. At call ``k`` the child writes a
  one-line description of the call to a side file and SIGKILLs itself before
  performing it.
* Two kinds of mode. ``kill``: the process dies, the kernel keeps everything it
  did (page cache included). The power modes (``POWER_TAILS``: ``power``,
  ``power-zero``, ``power-partial``): a power loss is simulated on top: the
  interceptor also keeps a journal -- per file (by inode), the size at its last
  fsync and a copy of its content before the operation first wrote it; per
  directory (by inode), the entries created (open O_CREAT, mkdir, link,
  symlink), renamed into it, unlinked and rmdir'd since its last fsync, with
  what brings a dropped entry back (a hard link to an unlinked or replaced
  file, kept beside the backups: its inode and bytes; a symlink's target; a
  removed directory's inode, held open so that its number is not reused).
  After the crash the parent undoes, newest first, every entry change whose
  directory was not fsynced after it (a created entry is removed; a rename is
  moved back and the entry it replaced -- a file, a hard link whose inode
  another name holds, a symlink, an empty directory -- brought back; an
  unlinked file or symlink comes back; an rmdir'd directory comes back empty,
  then the unlinks that emptied it, so a ``shutil.rmtree`` not followed by
  its parent's fsync leaves the whole tree), then gives every file written
  during the operation its content up to its last fsync (a never-fsynced new
  file: none; a never-fsynced old one: its content before the operation),
  and its un-fsynced tail beyond that, by mode: ``power`` cuts it (the file
  at its fsynced size); ``power-zero`` keeps the size and zeros the tail
  (XFS: the size logged, the data never written); ``power-partial`` keeps
  half the tail, in whole 512-byte sectors (ext4's delalloc/ordered
  writeback had written part of it). ``sync_file_range`` makes nothing
  durable (no metadata, no cache flush).
  In these modes the mutating calls are serialized (from a call's number to its
  journal entry), so the journal at a crash holds every call made before it.

  What the power model does NOT model: reordering inside a file or between
  files beyond "the last fsync" (a real disk may keep some unsynced writes and
  drop others, or keep a later write and lose an earlier one; an overwrite
  below the fsynced size after the fsync is taken as durable); tails other
  than cut, zeros and half (one prefix per crash, not every one); metadata
  other than sizes and names (mode, mtime, the lease
  heartbeats); torn sectors; file systems that persist more than POSIX asks
  (ext4's journal commits every earlier metadata change with any fsync, so the
  model is stricter than ext4 and may report what ext4 would not show); the
  object store (its acknowledged writes are taken as durable).
* Mode ``error`` (tests/_crasherrors.py, ``FaultInterceptor``, a subclass):
  the call at ``k`` fails instead (ENOSPC for writes and creates, EIO for the
  rest, fsync included, whose lost pages are then overwritten unless the
  library rewrote them; HTTP 500 for a store request) and the process goes
  on: the error it raised, what is committed, its next save and a fresh
  process's restart are checked. Its driver is ``_crasherrors.enumerate_program``.
* A fork server: the test process imports torch and lazyckpt once; each crash
  point is a ``fork()`` of it running the program with the interceptor armed
  at ``k``; the checks run in another fresh fork (the parent never holds a
  Checkpointer, a boto3 client nor a lease). A dry run (``k`` = infinity)
  counts the program's points first.
* :class:`Program` (a function run in the child, from a prepared directory
  copied for each ``k``) and :class:`World` (the oracle, as data: the states a
  crash may leave, each with its latest step, the steps it may list with their
  exact values, and the steps it must list). :func:`check_case` checks the
  invariants after a crash; :func:`enumerate_program` runs everything.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import select
import shutil
import signal
import stat
import sys
import threading
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

INFINITY = 1 << 62
#: The power-loss point after an operation's last call (``Interceptor._Armed``).
END_POINT = "#end"
MODES = ("kill", "power")
#: The power modes, by what a file's un-fsynced tail becomes after the power loss
#: (:func:`apply_power_loss`): "cut" to the last fsynced size; "zero": the size kept,
#: the tail reads zeros (XFS's choice: the size was logged, the data never written);
#: "partial": a prefix of the tail kept (ext4's delalloc/ordered writeback had
#: written some of it). "power" is the cut variant (the mode CI runs at every point).
POWER_TAILS = {"power": "cut", "power-zero": "zero", "power-partial": "partial"}


def is_power(mode: str) -> bool:
    return mode in POWER_TAILS

# ----------------------------------------------------------------------------- the interceptor

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_TOKEN = re.compile(r"[0-9a-f]{12,}")


def _mask(text: str) -> str:
    """Random tokens (temporary names, save ids) as <hex>: stable descriptions."""
    return _TOKEN.sub("<hex>", text)


class Interceptor:
    """Numbers the mutating calls under ``root``; crashes at call ``crash_at``.

    One per child process (``install`` patches the ``os`` module, ``builtins``
    and ``io`` of the child only: the parent is untouched by the fork)."""

    def __init__(self, root: str, crash_at: int, side_file: str, mode: str = "kill"):
        self.root = os.path.realpath(root)
        self.crash_at = crash_at
        self.side_file = side_file
        self.mode = mode
        self.count = 0
        self.armed = False
        self.descriptions: List[str] = []
        #: Processes killed with this one at the crash (the other ranks of a job: a job
        #: whose rank died is dead), before it kills itself.
        self.peers: List[int] = []
        #: What the program is doing (a longer program names its current operation): in the crash record.
        self.tag: Optional[str] = None
        self._lock = threading.RLock()
        self._local = threading.local()     # re-entrancy: our own bookkeeping calls are not counted
        # the power-loss journal
        self.seq = 0
        self.files: Dict[int, Dict[str, Any]] = {}        # ino -> {"new", "backup", "synced"}
        self.entries: List[Dict[str, Any]] = []
        self.dir_sync: Dict[int, int] = {}
        self.backup_dir = side_file + ".backups"
        self._pinned: List[int] = []        # descriptors holding removed directories' inodes
        self._orig: Dict[str, Any] = {}

    # ---------------------------------------------------------------- paths

    def _fdpath(self, fd: int) -> Optional[str]:
        try:
            return self._orig["readlink"](f"/proc/self/fd/{fd}")
        except OSError:
            return None

    def _path(self, path: Any, dir_fd: Optional[int] = None) -> Optional[str]:
        if isinstance(path, int):
            return self._fdpath(path)
        try:
            p = os.fsdecode(path)
        except TypeError:
            return None
        if dir_fd is not None and not os.path.isabs(p):
            base = self._fdpath(dir_fd)
            if base is None:
                return None
            p = os.path.join(base, p)
        p = os.path.abspath(p)
        head, tail = os.path.split(p)
        return os.path.join(os.path.realpath(head), tail)

    def _under(self, p: Optional[str]) -> bool:
        return p is not None and (p == self.root or p.startswith(self.root + os.sep))

    def _rel(self, p: Optional[str]) -> str:
        if p is None:
            return "?"
        return os.path.relpath(p, os.path.dirname(self.root)) if self._under(p) else p

    # ---------------------------------------------------------------- counting

    def _busy(self) -> bool:
        return getattr(self._local, "busy", False)

    def point(self, description: str) -> None:
        """A mutating call is about to be made: count it; crash if it is the k-th."""
        with self._lock:
            self.count += 1
            n = self.count
            desc = f"#{n} [{threading.current_thread().name}] {_mask(description)}"
            if self.crash_at >= INFINITY:
                self.descriptions.append(desc)
            if n == self.crash_at:
                self._crash(desc)

    def _crash(self, desc: str) -> None:
        self._local.busy = True
        record = {"point": self.crash_at, "op": desc, "tag": self.tag}
        if is_power(self.mode):
            record["journal"] = self.journal()
        data = (json.dumps(record) + "\n").encode()
        fd = self._orig["open"](self.side_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._orig["write"](fd, data)
        os.close(fd)
        for pid in self.peers:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)          # not reached

    # ---------------------------------------------------------------- the journal (power mode)

    def _track(self) -> bool:
        return is_power(self.mode) and self.armed

    def _serialized(self, wrapper: Callable) -> Callable:
        """Power mode: one mutating call at a time, from its number through its
        journal entry, so that the journal written at a crash holds every call
        made before it (another thread cannot be between its call and its entry)."""
        if not is_power(self.mode):
            return wrapper
        lock = self._lock

        def serialized(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return wrapper(*args, **kwargs)
        return serialized

    def _backup(self, ino: int, path: str, new: bool = False) -> None:
        """Before the operation first changes an existing file: keep its content."""
        if ino in self.files:
            return
        info = {"new": new, "backup": None, "synced": None}
        if not new:
            os.makedirs(self.backup_dir, exist_ok=True)
            dst = os.path.join(self.backup_dir, str(ino))
            try:
                with self._orig["builtins.open"](path, "rb") as src, self._orig["builtins.open"](dst, "wb") as out:
                    out.write(src.read())
                info["backup"] = dst
            except OSError:
                return
        self.files[ino] = info

    def _backup_existing(self, path: str, fd: Optional[int] = None) -> None:
        """_backup of the regular file at ``path`` (or open as ``fd``), if there is one."""
        self._local.busy = True
        try:
            st = os.fstat(fd) if fd is not None else os.stat(path)
            if stat.S_ISREG(st.st_mode):
                self._backup(st.st_ino, path)
        except OSError:
            pass
        finally:
            self._local.busy = False

    def _entry(self, kind: str, parent: str, name: str, ino: int, **extra: Any) -> None:
        self.seq += 1
        try:
            pino = os.stat(parent).st_ino
        except OSError:
            return
        self.entries.append({"seq": self.seq, "kind": kind, "parent": pino, "name": name, "ino": ino, **extra})

    def _synced(self, fd: int) -> None:
        self.seq += 1
        try:
            st = os.fstat(fd)
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode):
            self.dir_sync[st.st_ino] = self.seq
        elif st.st_ino in self.files:
            self.files[st.st_ino]["synced"] = st.st_size

    def _pin(self, path: str) -> Optional[Dict[str, Any]]:
        """Before an unlink, an rmdir or a rename over ``path`` drops its entry:
        what brings the entry back if the power loss undoes the drop. A file: a
        hard link to it beside the backups (the same inode comes back, so the
        file journal still applies to it); a symlink: its target; a directory:
        its inode held open and its mode (it comes back empty: the unlinks and
        rmdirs that emptied it are undone on their own). Holding the inode
        also keeps its number from being reused by a file the operation
        creates later, which the journal, keyed by inode, would mistake for it."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if stat.S_ISREG(st.st_mode):
            os.makedirs(self.backup_dir, exist_ok=True)
            keep = os.path.join(self.backup_dir, f"dropped-{self.seq}-{st.st_ino}")
            try:
                os.link(path, keep)
            except OSError:
                shutil.copyfile(path, keep)         # links refused: its bytes, under a new inode
            return {"what": "file", "ino": st.st_ino, "keep": keep}
        if stat.S_ISLNK(st.st_mode):
            return {"what": "symlink", "ino": st.st_ino, "target": os.readlink(path)}
        if stat.S_ISDIR(st.st_mode):
            try:
                self._pinned.append(os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
            except OSError:
                pass
            return {"what": "dir", "ino": st.st_ino, "mode": stat.S_IMODE(st.st_mode)}
        return None                                 # a FIFO, a socket: not brought back

    def journal(self) -> Dict[str, Any]:
        paths = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                try:
                    paths[str(os.lstat(p).st_ino)] = p
                except OSError:
                    pass
        return {"files": {str(k): v for k, v in self.files.items()}, "entries": self.entries,
                "dir_sync": {str(k): v for k, v in self.dir_sync.items()}, "paths_at_crash": paths}

    # ---------------------------------------------------------------- wrappers

    def _wrap_path_op(self, name: str, fn: Callable, kind: str) -> Callable:
        me = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if me._busy() or not me.armed:
                return fn(*args, **kwargs)
            if kind in ("rename", "link", "symlink"):
                src = me._path(args[0], kwargs.get("src_dir_fd")) if kind != "symlink" else os.fsdecode(args[0])
                dst = me._path(args[1], kwargs.get("dst_dir_fd") if kind != "symlink" else kwargs.get("dir_fd"))
                if not (me._under(dst) or (kind == "rename" and me._under(src))):
                    return fn(*args, **kwargs)
                me.point(f"os.{name} {me._rel(src)} -> {me._rel(dst)}")
                replaced = None             # what the rename drops at dst (a file, a symlink, an empty directory)
                me._local.busy = True
                try:
                    if me._track() and kind == "rename":
                        try:
                            if os.lstat(dst).st_ino != os.lstat(src).st_ino:    # the same inode: rename does nothing
                                replaced = me._pin(dst)
                        except OSError:
                            pass
                finally:
                    me._local.busy = False
                result = fn(*args, **kwargs)
                if me._track():
                    me._local.busy = True
                    try:
                        ino = os.lstat(dst).st_ino
                        if kind == "rename":
                            me.seq += 1
                            me.entries.append({"seq": me.seq, "kind": "rename", "parent": os.stat(os.path.dirname(dst)).st_ino,
                                               "name": os.path.basename(dst), "ino": ino,
                                               "src_parent": os.stat(os.path.dirname(src)).st_ino,
                                               "src_name": os.path.basename(src), "replaced": replaced})
                        else:
                            me._entry("create", os.path.dirname(dst), os.path.basename(dst), ino)
                    except OSError:
                        pass
                    finally:
                        me._local.busy = False
                return result
            p = me._path(args[0] if args else kwargs.get("path"), kwargs.get("dir_fd"))
            if not me._under(p):
                return fn(*args, **kwargs)
            me.point(f"os.{name} {me._rel(p)}")
            if kind == "truncate" and me._track():
                me._backup_existing(p)
            dropped = None                  # unlink, rmdir: what brings the entry back
            if kind in ("unlink", "rmdir") and me._track():
                me._local.busy = True
                try:
                    dropped = me._pin(p)
                finally:
                    me._local.busy = False
            result = fn(*args, **kwargs)
            if kind == "mkdir" and me._track():
                me._local.busy = True
                try:
                    me._entry("mkdir", os.path.dirname(p), os.path.basename(p), os.lstat(p).st_ino)
                except OSError:
                    pass
                finally:
                    me._local.busy = False
            if dropped is not None:
                me._local.busy = True
                try:
                    me._entry(kind, os.path.dirname(p), os.path.basename(p), dropped["ino"], kept=dropped)
                finally:
                    me._local.busy = False
            return result
        return wrapper

    def _wrap_fd_op(self, name: str, fn: Callable, kind: str) -> Callable:
        me = self

        def wrapper(fd: int, *args: Any, **kwargs: Any) -> Any:
            if me._busy() or not me.armed:
                return fn(fd, *args, **kwargs)
            p = me._fdpath(fd)
            if not me._under(p):
                return fn(fd, *args, **kwargs)
            if kind == "write":
                nbytes = sum(len(memoryview(b)) for b in args[0]) if name in ("writev", "pwritev") else len(memoryview(args[0]))
                at = f" at {args[1]}" if name in ("pwrite", "pwritev") and len(args) > 1 else ""
                me.point(f"os.{name} {me._rel(p)} {nbytes} B{at}")
            elif kind == "ftruncate":
                me.point(f"os.ftruncate {me._rel(p)} to {args[0]}")
            else:
                me.point(f"os.{name} {me._rel(p)}")
            if kind in ("write", "ftruncate") and me._track():
                me._backup_existing(p, fd)
            result = fn(fd, *args, **kwargs)
            if kind == "sync" and me._track():
                me._local.busy = True
                try:
                    me._synced(fd)
                finally:
                    me._local.busy = False
            return result
        return wrapper

    def _open_common(self, p: str, creates: bool, truncates: bool, desc: str, do_open: Callable) -> Any:
        existed = os.path.lexists(p)
        self.point(desc)
        if self._track() and existed:
            self._backup_existing(p)
        result = do_open()
        if self._track() and not existed and creates:
            self._local.busy = True
            try:
                ino = os.lstat(p).st_ino
                self._backup(ino, p, new=True)
                self._entry("create", os.path.dirname(p), os.path.basename(p), ino)
            except OSError:
                pass
            finally:
                self._local.busy = False
        return result

    def _wrap_os_open(self, fn: Callable) -> Callable:
        me = self

        def wrapper(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Optional[int] = None) -> int:
            if me._busy() or not me.armed or not flags & _WRITE_FLAGS:
                return fn(path, flags, mode, dir_fd=dir_fd)
            p = me._path(path, dir_fd)
            if not me._under(p):
                return fn(path, flags, mode, dir_fd=dir_fd)
            names = [n for n in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_EXCL", "O_APPEND", "O_DIRECT")
                     if flags & getattr(os, n, 0)]
            return me._open_common(p, bool(flags & os.O_CREAT), bool(flags & os.O_TRUNC),
                                   f"os.open {me._rel(p)} {'|'.join(names)}",
                                   lambda: fn(path, flags, mode, dir_fd=dir_fd))
        return wrapper

    def _wrap_builtin_open(self, fn: Callable) -> Callable:
        me = self

        def wrapper(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if me._busy() or not me.armed or isinstance(file, int) or not any(c in mode for c in "wax+"):
                return fn(file, mode, *args, **kwargs)
            p = me._path(file)
            if not me._under(p):
                return fn(file, mode, *args, **kwargs)
            return me._open_common(p, any(c in mode for c in "wax"), "w" in mode,
                                   f"open {me._rel(p)} {mode!r}", lambda: fn(file, mode, *args, **kwargs))
        return wrapper

    def install(self) -> None:
        self._orig = {"open": os.open, "write": os.write, "readlink": os.readlink, "builtins.open": builtins.open}
        path_ops = {"rename": "rename", "replace": "rename", "link": "link", "symlink": "symlink",
                    "unlink": "unlink", "remove": "unlink", "rmdir": "rmdir", "mkdir": "mkdir",
                    "truncate": "truncate"}
        for name, kind in path_ops.items():
            if hasattr(os, name):
                setattr(os, name, self._serialized(self._wrap_path_op(name, getattr(os, name), kind)))
        fd_ops = {"write": "write", "pwrite": "write", "writev": "write", "pwritev": "write",
                  "fsync": "sync", "fdatasync": "sync", "ftruncate": "ftruncate"}
        for name, kind in fd_ops.items():
            if hasattr(os, name):
                setattr(os, name, self._serialized(self._wrap_fd_op(name, getattr(os, name), kind)))
        os.open = self._serialized(self._wrap_os_open(os.open))
        wrapped = self._serialized(self._wrap_builtin_open(builtins.open))
        builtins.open = wrapped
        io.open = wrapped
        self._install_below_python()
        self._install_s3_hook()

    def _wrap_fd_call(self, name: str, fn: Callable, fd_at: int, describe: Callable[[tuple], str],
                      changes: bool = True) -> Callable:
        """A call that writes a file through the descriptor ``args[fd_at]`` without
        passing its bytes through Python (os.sendfile's output, shutil.copyfile's way
        on Linux; os.copy_file_range's destination; os.posix_fallocate), or, with
        ``changes`` False, one that only asks the kernel to write pages back
        (sync_file_range): a point like the others, nothing made durable by it."""
        me = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if me._busy() or not me.armed or len(args) <= fd_at:
                return fn(*args, **kwargs)
            p = me._fdpath(args[fd_at])
            if not me._under(p):
                return fn(*args, **kwargs)
            me.point(f"{name} {me._rel(p)} {describe(args)}")
            if changes and me._track():
                me._backup_existing(p, args[fd_at])
            return fn(*args, **kwargs)
        return wrapper

    def _wrap_torch_save(self, fn: Callable) -> Callable:
        """``torch.save(obj, path)``: torch's C++ writer opens, writes and closes
        ``path`` itself (no Python call does): one point, journaled as an open
        that creates or truncates (``convert --to torch`` saves so). A file
        object's own open was the point."""
        me = self

        def wrapper(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if me._busy() or not me.armed or not isinstance(f, (str, bytes, os.PathLike)):
                return fn(obj, f, *args, **kwargs)
            p = me._path(f)
            if not me._under(p):
                return fn(obj, f, *args, **kwargs)
            return me._open_common(p, True, True, f"torch.save {me._rel(p)} (torch's C++ writer)",
                                   lambda: fn(obj, f, *args, **kwargs))
        return wrapper

    def _install_below_python(self) -> None:
        """The calls that move file bytes below Python: the os functions that copy
        between descriptors or allocate, torch.save to a path, and the libc
        functions lazyckpt calls through ctypes (the module attribute it calls
        them by is replaced)."""
        calls = {"sendfile": (0, lambda a: f"{a[3]} B from fd at {a[2]}"),
                 "copy_file_range": (1, lambda a: f"{a[2]} B"),
                 "posix_fallocate": (0, lambda a: f"{a[2]} B at {a[1]}")}
        for name, (fd_at, describe) in calls.items():
            if hasattr(os, name):
                setattr(os, name, self._serialized(self._wrap_fd_call(f"os.{name}", getattr(os, name), fd_at,
                                                                      describe)))
        torch = sys.modules.get("torch")
        if torch is not None and hasattr(torch, "save"):
            torch.save = self._serialized(self._wrap_torch_save(torch.save))
        try:
            from lazyckpt.storage import iomode
        except Exception:
            return
        if iomode._sync_file_range is not None:
            iomode._sync_file_range = self._serialized(self._wrap_fd_call(
                "sync_file_range", iomode._sync_file_range, 0, lambda a: f"{a[2]} B at {a[1]}", changes=False))

    def _install_s3_hook(self) -> None:
        try:
            from lazyckpt.storage import s3
        except Exception:
            return
        me = self
        s3._stores.clear()          # never a client (or a socket) inherited from the parent

        def before_send(request: Any = None, **_kw: Any) -> None:
            method = getattr(request, "method", "")
            if me.armed and not me._busy() and method in ("PUT", "POST", "DELETE"):
                url = getattr(request, "url", "")
                me.point(f"s3 {method} {url.split('://', 1)[-1].split('/', 1)[-1]}")
        original = s3.ObjectStore.__init__

        def init(self_store: Any, *args: Any, **kwargs: Any) -> None:
            original(self_store, *args, **kwargs)
            self_store.client.meta.events.register("before-send.s3", before_send)
        s3.ObjectStore.__init__ = init

    # ---------------------------------------------------------------- the operation under test

    class _Armed:
        def __init__(self, owner: "Interceptor"):
            self.owner = owner

        def __enter__(self) -> None:
            self.owner.armed = True

        def __exit__(self, *exc: Any) -> None:
            owner = self.owner
            owner.armed = False
            if is_power(owner.mode) and exc[0] is None and owner.crash_at == owner.count + 1:
                # The point after the last: the operation returned, then the power went.
                # What it promised durable on return must survive (run_case: the last world).
                owner._crash(f"{END_POINT} (the operation returned)")

    def operation(self) -> "Interceptor._Armed":
        """``with icp.operation(): ...``: the calls made inside (by any thread) count."""
        return Interceptor._Armed(self)


def _partial_prefix(n: int) -> int:
    """How much of an un-fsynced tail of ``n`` bytes the "partial" variant keeps:
    half, in whole 512-byte sectors once it is a sector or more (writeback had
    reached some of it; a tear in the middle of a page and of a footer)."""
    half = n // 2
    return half - half % 512 if half >= 512 else half


def _bring_back(kept: Dict[str, Any], path: str) -> int:
    """Recreate a dropped entry from what :meth:`Interceptor._pin` kept; its inode now."""
    if kept["what"] == "file":
        try:
            os.link(kept["keep"], path)
            os.unlink(kept["keep"])             # its link count as before the drop
        except OSError:
            shutil.copyfile(kept["keep"], path)
    elif kept["what"] == "symlink":
        os.symlink(kept["target"], path)
    else:
        os.mkdir(path, kept.get("mode", 0o755))
    return os.lstat(path).st_ino


def apply_power_loss(journal: Dict[str, Any], root: str, tail: str = "cut") -> List[str]:
    """Drop from ``root`` what the journal says was not durable; returns what was done.

    Entry changes (creates, mkdirs, links, renames, unlinks, rmdirs) whose
    directory was not fsynced after them are undone, newest first; then each
    file written during the operation keeps its content up to its last fsync
    (a never-fsynced new file: none; a never-fsynced old one: its content
    before the operation) and its un-fsynced tail becomes, by ``tail``:
    "cut" (gone), "zero" (the size kept, zeros) or "partial" (a prefix kept,
    :func:`_partial_prefix`)."""
    if tail not in ("cut", "zero", "partial"):
        raise ValueError(f"tail must be 'cut', 'zero' or 'partial', got {tail!r}")
    done: List[str] = []
    dir_sync = {int(k): v for k, v in journal["dir_sync"].items()}
    # A dropped entry brought back under a new inode (a directory, a copied file): new -> journal's.
    alias: Dict[int, int] = {}

    def ino(st: os.stat_result) -> int:
        return alias.get(st.st_ino, st.st_ino)

    def paths() -> Dict[int, str]:
        out = {ino(os.lstat(root)): root}
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                try:
                    out[ino(os.lstat(p))] = p
                except OSError:
                    pass
        return out

    def rel(p: str) -> str:
        return os.path.relpath(p, os.path.dirname(root))

    def bring_back(kept: Dict[str, Any], p: str) -> None:
        now = _bring_back(kept, p)
        if now != kept["ino"]:
            alias[now] = kept["ino"]

    for e in reversed(journal["entries"]):
        if dir_sync.get(e["parent"], -1) > e["seq"]:
            continue                         # its directory was fsynced after it: durable
        where = paths()
        parent = where.get(e["parent"])
        if parent is None:
            continue                         # the directory itself went (an undone mkdir, a durable rmdir)
        p = os.path.join(parent, e["name"])
        if e["kind"] in ("unlink", "rmdir"):
            if os.path.lexists(p):
                done.append(f"cannot undo {e['kind']} {rel(p)}: the name is taken")
                continue
            bring_back(e["kept"], p)
            done.append(f"undo {e['kind']} {rel(p)}")
            continue
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if ino(st) != e["ino"]:
            continue
        if e["kind"] in ("create", "mkdir"):
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            done.append(f"undo {e['kind']} {rel(p)}")
        elif e["kind"] == "rename":
            src_parent = where.get(e["src_parent"])
            if src_parent is None:
                continue
            src = os.path.join(src_parent, e["src_name"])
            if os.path.lexists(src):
                continue
            os.rename(p, src)
            done.append(f"undo rename {rel(src)} -> {rel(p)}")
            kept = e.get("replaced")
            if kept is not None:
                # The entry the rename replaced comes back: a file as its own inode (a
                # hard link whose inode another name holds is that link again), a
                # symlink, an empty directory.
                bring_back(kept, p)
                done.append(f"restore {rel(p)} (the {kept['what']} the rename replaced)")
    where = paths()
    for ino_, info in journal["files"].items():
        p = where.get(int(ino_))
        if p is None or not os.path.isfile(p) or os.path.islink(p):
            continue
        size = os.path.getsize(p)
        if info["synced"] is None and not info["new"]:
            if not info["backup"]:
                continue
            durable = os.path.getsize(info["backup"])
            if tail == "cut" or size <= durable:
                shutil.copyfile(info["backup"], p)
                done.append(f"{rel(p)}: never fsynced, content before the operation")
                continue
            with open(info["backup"], "rb") as src, open(p, "r+b") as dst:
                dst.write(src.read())
            what = f"{rel(p)}: never fsynced, content before the operation"
        else:
            durable = info["synced"] or 0
            what = f"{rel(p)}: " + (f"fsynced at {durable} B" if info["synced"] is not None else "never fsynced")
        if size <= durable:
            continue
        if tail == "cut":
            os.truncate(p, durable)
            done.append(f"{rel(p)}: cut to its fsynced {durable} B" if info["synced"] is not None
                        else f"{what}, 0 bytes")
        elif tail == "zero":
            with open(p, "r+b") as f:
                f.seek(durable)
                f.write(bytes(size - durable))
            done.append(f"{what}, its {size - durable} B past that read zeros")
        else:
            keep = _partial_prefix(size - durable)
            os.truncate(p, durable + keep)
            done.append(f"{what}, {keep} of its {size - durable} B past that kept")
    return done


# ----------------------------------------------------------------------------- fork helpers

def run_forked(fn: Callable[[], Any], timeout: float = 120.0) -> Tuple[str, Any]:
    """Run ``fn`` in a forked child; ("ok", value) / ("error", traceback) /
    ("killed", signal) / ("timeout", None)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child
        os.close(r)
        code = 0
        try:
            payload = ("ok", fn())
        except BaseException:
            payload = ("error", traceback.format_exc())
            code = 1
        report_and_exit(w, payload, code)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout", None
            ready, _, _ = select.select([r], [], [], left)
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed", os.WTERMSIG(status)
    data = b"".join(chunks)
    if not data:
        return "error", f"child exited {os.waitstatus_to_exitcode(status)} without a result"
    return pickle.loads(data)


# ----------------------------------------------------------------------------- states and oracle

def make_state(seed: int, big: bool = False, frozen_seed: Optional[int] = None) -> Dict[str, Any]:
    """A small deterministic state (about 20 KiB; ``big``: plus a frozen 32 KiB
    tensor, over the incremental hashing's 16 KiB sample)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    state: Dict[str, Any] = {"model": {"w": torch.randn(48, 64, generator=g), "b": torch.randn(64, generator=g)},
                             "opt": {"m": torch.randn(32, 32, generator=g).to(torch.bfloat16),
                                     "n": torch.arange(seed, seed + 100, dtype=torch.int64)},
                             "step": seed}
    if big:
        f = torch.Generator().manual_seed(10_000 + (frozen_seed if frozen_seed is not None else 0))
        state["frozen"] = {"emb": torch.randn(8192, generator=f), "head": torch.randn(4096, generator=f)}
    return state


def flat(tree: Any, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flat(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = tree
    return out


def differs(expected: Any, got: Any) -> List[str]:
    """Paths whose values differ (tensors bit-exact, with dtype and shape)."""
    import torch
    a, b = flat(expected), flat(got)
    bad = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k, "<missing>"), b.get(k, "<missing>")
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                    and x.shape == y.shape and torch.equal(x.view(-1).view(torch.uint8) if x.numel() else x,
                                                           y.view(-1).view(torch.uint8) if y.numel() else y)):
                bad.append(k)
        elif x != y:
            bad.append(k)
    return bad


@dataclasses.dataclass
class World:
    """One state a crash may leave: ``latest`` (None: nothing), the steps it may
    list with the exact state each must load as, and the steps it must list."""
    name: str
    latest: Optional[int]
    allowed: Dict[int, Any]
    required: Tuple[int, ...] = ()


@dataclasses.dataclass
class Ctx:
    """What a program's functions get: the case directory, the object store (or None)."""
    case: str                              # the case's directory (copied from the prepared one)
    persist_to: Optional[str] = None       # s3://bucket/prefix of this case
    storage_options: Optional[Dict[str, Any]] = None
    base_prefix: Optional[str] = None      # the prepared object-store prefix (copied per case)


@dataclasses.dataclass
class Program:
    """A short program: ``prepare(ctx)`` builds the starting directory once
    (in a child), ``run(ctx, icp)`` performs the operation under test inside
    ``with icp.operation():`` (in the crash child), ``worlds`` the oracle,
    ``kind``: "dir" (a Checkpointer directory, ``ctx.case/run``) or "file"
    (``ctx.case/model.lzc``); ``kwargs``: the Checkpointer's arguments for the
    checks; ``persist``: uses the object store."""
    name: str
    prepare: Callable[[Ctx], None]
    run: Callable[[Ctx, Interceptor], None]
    worlds: List[World]
    kind: str = "dir"
    kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    persist: bool = False
    restart_values: Any = None
    #: The restart's save's metadata= (a policy ranking steps by a metric refuses a save without it).
    restart_metadata: Optional[Dict[str, Any]] = None
    #: Longer programs: the worlds given the crash record's tag (None: the program ended).
    worlds_at: Optional[Callable[[Optional[str]], List[World]]] = None
    #: Imports to make once in the fork server, not in every child (a framework: seconds).
    preload: Optional[Callable[[], None]] = None
    #: kind="objects": the directory under the case that the program mirrors to
    #: persist_to/<mirror_dir> (checked on both sides); None: its files are on the store only.
    mirror_dir: Optional[str] = None


#: Knobs every program uses: deterministic I/O (one writer thread, O_DIRECT
#: forced -- no probe --, chunks small enough for a few writes per file).
KNOBS = dict(writer_threads=1, reader_threads=1, o_direct=True, chunk_bytes=8192, host_cache_bytes=16384)


# ----------------------------------------------------------------------------- the checks

def _world_of(worlds: List[World], step: Optional[int], values: Any) -> Tuple[Optional[World], str]:
    for w in worlds:
        if w.latest == step and (step is None or not differs(w.allowed[step], values)):
            return w, ""
    for w in worlds:
        for s, v in w.allowed.items():
            if s == step and not differs(v, values):
                return None, f"load() returned step {step} of world '{w.name}', which is not its latest ({w.latest})"
    return None, f"load() returned step {step}, which is no world's latest ({[(w.name, w.latest) for w in worlds]})" + \
        (" or an abandoned/unknown save" if step is not None else "")


def _checkpointer(ctx: Ctx, program: Program, directory: Optional[str] = None) -> Any:
    import lazyckpt
    from _groups import groups
    kw = dict(KNOBS)
    kw.update(program.kwargs)
    if program.persist:
        kw["persist"] = lazyckpt.Persist(ctx.persist_to, storage_options=ctx.storage_options)
    return lazyckpt.Checkpointer(directory or os.path.join(ctx.case, "run"), **groups(kw))


def index_problems(directory: str, when: str) -> List[str]:
    """The index (``CheckpointDir.tail``/``locate_step``: the record's last
    commit and ``latest``, a few stats) against the listing (``step_paths``:
    the names and the record), on a local directory: where the index answers,
    it must give what the listing gives (issue 34). A listing that changed
    while the index was asked (retention of a drained tier) is asked again."""
    from lazyckpt.storage.layout import CheckpointDir
    if not os.path.isdir(directory):
        return []
    layout = CheckpointDir(directory)
    for _attempt in range(5):
        listing = layout.step_paths()
        newest = (max(listing), listing[max(listing)]) if listing else None
        problems = []
        tail = layout.tail()
        if tail is not None and tail != newest:
            problems.append(f"{when}: the index says the latest step is {tail}, the listing {newest}")
        if layout.locate_step(None) != newest:
            problems.append(f"{when}: locate_step(None) = {layout.locate_step(None)}, the listing {newest}")
        for s in sorted(set(listing) | {s + 1 for s in listing}):
            want = (s, listing[s]) if s in listing else None
            if layout.locate_step(s) != want:
                problems.append(f"{when}: locate_step({s}) = {layout.locate_step(s)}, the listing {want}")
        if layout.latest() != (newest[0] if newest else None):
            problems.append(f"{when}: latest() = {layout.latest()}, the listing {newest}")
        if not problems or layout.step_paths() == listing:
            return problems
    return problems


def tiers_index_problems(ckpt: Any, when: str) -> List[str]:
    """With ``persist_to``: the copies the two tiers' indexes name as the newest
    save's (``Line._newest_copies``: ``Line.newest_save``) against
    the line over both tiers built from every manifest and a listing of the
    store: where the indexes answer, they name the line's newest save's
    copies, local first (issue 34)."""
    for _attempt in range(5):
        line = ckpt.line._line_candidates(None)
        fast = ckpt.line._newest_copies()
        if not fast:
            return []
        newest = [c for c in line if c[0] == line[0][0]] if line else []
        # A copy in a temporary directory (renames pending) is the same copy as under its name.
        same = [(s, t, ckpt.step_path(s) if t == "local" else p) for s, t, p in fast] == newest
        if same:
            return []
        if ckpt.line._line_candidates(None) == line:
            return [f"{when}: the two tiers' indexes name {fast} as the newest save's copies, the line {newest}"]
    return []


def remote_index_problems(url: str, storage_options: Any, when: str) -> List[str]:
    """The object-store index (``ObjectCheckpointDir.tail``: ``head.json``
    checked against the events after it) against the listing's line: where it
    answers, it names the newest live save (issue 34)."""
    from lazyckpt.knobs import resolve
    from lazyckpt.storage.s3layout import ObjectCheckpointDir
    tier = ObjectCheckpointDir(url, resolve(storage_options=storage_options))
    for _attempt in range(5):
        live = tier.committed()
        newest = (max(live), live[max(live)]) if live else None
        tail = tier.tail()
        got = (tail.step, tail.save_id) if tail is not None else None
        if tail is None or got == newest:
            return []
        if tier.committed() == live:
            return [f"{when}: the store's index says the latest save is {got}, its listing's line {newest}"]
    return [f"{when}: the store's index says the latest save is {got}, its listing's line {newest}"]


def save_and_reload(ckpt: Any, program: Program, values: Any, step: int) -> Optional[str]:
    """``values`` saved as ``step`` through ``ckpt`` and waited for (persisted too
    with a persistent tier), then ``load()``: None where it returns that save, else
    what it returned instead. What the save or load raised propagates."""
    h = ckpt.save(values, step=step, metadata=program.restart_metadata)
    h.wait(**({"persisted": True} if program.persist else {}))
    got = ckpt.load()
    if ckpt.loaded_from["step"] != step or differs(values, got):
        return f"save(step={step}).wait() then load() returned step {ckpt.loaded_from['step']} / other values"
    return None


def check_case(ctx: Ctx, program: Program) -> List[str]:
    """The invariants after a crash (run in a fresh child). Returns the violations."""
    import lazyckpt
    from lazyckpt.errors import CheckpointNotFoundError
    if program.kind == "file":
        return _check_file(ctx, program)
    if program.kind == "objects":
        return _check_objects(ctx, program)
    if program.kind == "hf":
        return _check_hf(ctx, program)
    if program.kind == "dcp":
        return _check_dcp(ctx, program)
    if program.kind in ("megatron", "deepspeed"):   # tests/_crashmegatron.py, _crashdeepspeed.py: their own checks
        return program.kwargs["check"](ctx, program)
    problems: List[str] = []
    directory = os.path.join(ctx.case, "run")
    problems += index_problems(directory, "after the crash, before any open")
    if program.persist:
        problems += remote_index_problems(ctx.persist_to, ctx.storage_options, "after the crash")
    union = {}
    for w in program.worlds:
        union.update({(s, id(v)): (s, v) for s, v in w.allowed.items()})
    if program.persist:
        # The persistent tier alone (the node lost), before anything reopens the directory.
        try:
            with _checkpointer(ctx, program, os.path.join(ctx.case, "alone1")) as alone:
                got = alone.load()
                s = alone.loaded_from["step"]
            if not any(s == t and not differs(v, got) for t, v in union.values()):
                problems.append(f"persistent tier alone (before the restart): load() returned step {s}: "
                                f"no save of the program's line has it")
        except CheckpointNotFoundError:
            pass
        except Exception as exc:
            problems.append(f"persistent tier alone (before the restart): {type(exc).__name__}: {exc}")
    try:
        ckpt = _checkpointer(ctx, program)
    except Exception as exc:
        return problems + [f"Checkpointer(dir) after the crash: {type(exc).__name__}: {exc}"]
    problems += index_problems(directory, "after the open's recovery")
    if program.persist:
        problems += tiers_index_problems(ckpt, "after the open")
    world = None
    try:
        try:
            got = ckpt.load()
            step = ckpt.loaded_from["step"]
        except CheckpointNotFoundError:
            got, step = None, None
        world, why = _world_of(program.worlds, step, got)
        if world is None:
            problems.append(why)
        else:
            listed = ckpt.steps()
            for s in world.required:
                if s not in listed:
                    problems.append(f"world '{world.name}': committed step {s} is lost (steps() = {listed})")
            for s in listed:
                if s not in world.allowed:
                    problems.append(f"world '{world.name}': steps() lists step {s}, not on its line "
                                    f"(abandoned or unknown; steps() = {listed})")
                    continue
                try:
                    v = ckpt.load(step=s)
                except CheckpointNotFoundError:
                    continue
                except Exception as exc:
                    problems.append(f"load(step={s}): {type(exc).__name__}: {exc}")
                    continue
                d = differs(world.allowed[s], v)
                if d:
                    problems.append(f"load(step={s}) differs from its save in {d[:4]}")
            if listed:
                from lazyckpt.loading import verify as lzverify
                from lazyckpt.storage.stores import LOCAL
                report = lzverify.verify(store=LOCAL, path=directory)
                if not report.ok:
                    problems.append(f"verify: {[p.message for p in report.problems][:3]}")
        if program.persist and world is not None:
            ckpt.wait()                     # a resumed upload (the previous run's) ends
            try:
                with _checkpointer(ctx, program, os.path.join(ctx.case, "alone2")) as alone:
                    got = alone.load()
                    s = alone.loaded_from["step"]
                if s not in world.allowed or differs(world.allowed[s], got):
                    problems.append(f"persistent tier alone (after the restart, local world '{world.name}'): "
                                    f"load() returned step {s}, not a live save of that line "
                                    f"(abandoned or unknown)")
            except CheckpointNotFoundError:
                if world.latest is not None:
                    problems.append("persistent tier alone (after the restart): nothing")
            except Exception as exc:
                problems.append(f"persistent tier alone (after the restart): {type(exc).__name__}: {exc}")
        # The run goes on: a new save round-trips.
        new_step = (world.latest if world is not None and world.latest is not None else 0) + 1
        values = program.restart_values if program.restart_values is not None else make_state(999)
        try:
            bad = save_and_reload(ckpt, program, values, new_step)
            if bad:
                problems.append(f"restart: {bad}")
        except Exception as exc:
            problems.append(f"restart: save(step={new_step}): {type(exc).__name__}: {exc}")
        problems += index_problems(directory, "after the restart's save")
        if program.persist:
            problems += remote_index_problems(ctx.persist_to, ctx.storage_options, "after the restart's save")
            problems += tiers_index_problems(ckpt, "after the restart's save")
    finally:
        try:
            ckpt.close()
        except Exception as exc:
            problems.append(f"close(): {type(exc).__name__}: {exc}")
    if program.persist and not problems:
        try:
            with _checkpointer(ctx, program, os.path.join(ctx.case, "alone3")) as alone:
                got = alone.load()
                if alone.loaded_from["step"] != new_step or differs(values, got):
                    problems.append(f"persistent tier alone after the restart's save: step "
                                    f"{alone.loaded_from['step']}, expected {new_step}")
        except Exception as exc:
            problems.append(f"persistent tier alone after the restart's save: {type(exc).__name__}: {exc}")
    return problems


def _check_file(ctx: Ctx, program: Program) -> List[str]:
    import lazyckpt
    path = os.path.join(ctx.case, "model.lzc")
    problems = []
    try:
        got = lazyckpt.load(path)
        if not any(not differs(w.allowed[w.latest], got) for w in program.worlds):
            problems.append(f"load({os.path.basename(path)}) returned values of neither the old nor the new file")
    except Exception as exc:
        problems.append(f"load({os.path.basename(path)}): {type(exc).__name__}: {exc}")
    values = make_state(999)
    try:
        lazyckpt.save(values, path, **{k: v for k, v in KNOBS.items()})
        if differs(values, lazyckpt.load(path)):
            problems.append("restart: save() then load() differs")
    except Exception as exc:
        problems.append(f"restart: save(): {type(exc).__name__}: {exc}")
    return problems


def _check_objects(ctx: Ctx, program: Program) -> List[str]:
    """A framework's files on an object store (``kind="objects"``, the worlds' steps
    1 and 2 being the old and the new top-k file): every object under the prefix
    is a whole checkpoint of one world, last.ckpt names one, and the new one once
    the old file is gone; then a new save and load work."""
    import io
    import torch
    from lazyckpt.integrations.lightning import LazyCheckpointIO
    from lazyckpt.storage.s3 import store_for
    store, prefix = store_for(ctx.persist_to, _storage_options_key(ctx.storage_options))
    problems = []
    sides = {"store": {}}
    if program.mirror_dir is None:
        for o in store.list(prefix + "/"):
            name = o["Key"][len(prefix) + 1:]
            sides["store"][name] = lambda n=name: store.get(f"{prefix}/{n}")
    else:
        directory = os.path.join(ctx.case, program.mirror_dir)
        for o in store.list(f"{prefix}/{program.mirror_dir}/"):
            name = o["Key"][len(prefix) + len(program.mirror_dir) + 2:]
            sides["store"][name] = lambda n=name: store.get(f"{prefix}/{program.mirror_dir}/{n}")
        sides["local"] = {n: (lambda n=n: open(os.path.join(directory, n), "rb").read())
                          for n in sorted(os.listdir(directory)) if not n.startswith(".")}
    for side, files in sides.items():
        found = {}
        for name, read in sorted(files.items()):
            data = read()
            if not data:
                # Told apart (finding 23 once saw "EOFError" here): listed then gone when read,
                # against an object that is there and empty.
                problems.append(f"{side}: {name}: " + ("listed, then absent when read" if data is None
                                                       else "an empty object"))
                continue
            try:
                got = torch.load(io.BytesIO(data), weights_only=True)
            except Exception as exc:
                problems.append(f"{side}: {name}: does not load: {type(exc).__name__}: {exc}")
                continue
            worlds = [w.latest for w in program.worlds if not differs(w.allowed[w.latest], got)]
            if not worlds:
                problems.append(f"{side}: {name}: holds neither the old nor the new checkpoint")
            found[name] = worlds[0] if worlds else None
        topk = {n: s for n, s in found.items() if n != "last.ckpt"}
        known = [s for s in topk.values() if s is not None]     # a file of neither world is reported above
        if "last.ckpt" not in found:
            problems.append(f"{side}: no last.ckpt ({sorted(files)})")
        elif known and found["last.ckpt"] is not None and found["last.ckpt"] < min(known):
            problems.append(f"{side}: last.ckpt names step {found['last.ckpt']}, older than every top-k file "
                            f"({topk})")
        if not topk:
            problems.append(f"{side}: no top-k file left ({sorted(files)})")
    values = make_state(999)
    try:
        if program.mirror_dir is None:
            plugin = LazyCheckpointIO(storage_options=ctx.storage_options, **KNOBS)
            target = f"{ctx.persist_to}/restart.ckpt"
        else:
            plugin = LazyCheckpointIO(storage_options=ctx.storage_options, persist=ctx.persist_to,
                                      local_root=ctx.case, **KNOBS)
            target = os.path.join(ctx.case, program.mirror_dir, "restart.ckpt")
        plugin.save_checkpoint(values, target)
        plugin.teardown()
        if differs(values, plugin.load_checkpoint(target)):
            problems.append("restart: save then load differs")
        if program.mirror_dir is not None:
            # The restart's first save brought the store level with the directory.
            missing = set(os.listdir(os.path.dirname(target))) - set(plugin.mirror.names(os.path.dirname(target)))
            if {n for n in missing if not n.startswith(".")}:
                problems.append(f"restart: files not on the store after the first save: {sorted(missing)}")
    except Exception as exc:
        problems.append(f"restart: {type(exc).__name__}: {exc}")
    return problems


def _check_hf(ctx: Ctx, program: Program) -> List[str]:
    """The HF Trainer's checkpoint-<step> directories, locally and on the store
    (``kind="hf"``, the worlds' latest steps the allowed ones): the newest complete
    one on each side loads and is an allowed step, every complete one on the
    store is whole, and with the local directory gone a restart resumes from the
    store and finishes."""
    import lazyckpt
    from _crashprograms import hf_trainer
    from lazyckpt.integrations.hf_callbacks import CHECKPOINT_DIR, last_complete_checkpoint
    from lazyckpt.storage.stores import for_path
    from lazyckpt.knobs import resolve
    allowed = {w.latest for w in program.worlds}
    out, problems = os.path.join(ctx.case, "out"), []
    local = last_complete_checkpoint(out)
    if local is None:
        problems.append(f"local: no complete checkpoint ({os.listdir(out) if os.path.isdir(out) else 'no dir'})")
    else:
        step = int(CHECKPOINT_DIR.match(os.path.basename(local)).group(1))
        try:
            saved = lazyckpt.load(os.path.join(local, "lazyckpt.lzc"))
            if step not in allowed or saved["global_step"] != step:
                problems.append(f"local: {os.path.basename(local)} holds step {saved['global_step']}")
        except Exception as exc:
            problems.append(f"local: {os.path.basename(local)}: {type(exc).__name__}: {exc}")
    options = resolve(storage_options=ctx.storage_options)
    store, tier = for_path(ctx.persist_to), ctx.persist_to
    names = store.list_files(tier, options, recursive=True)
    complete = sorted({n.split("/")[0] for n in names if n.endswith("/trainer_state.json")})
    if not complete:
        problems.append(f"store: no complete checkpoint ({names})")
    for name in complete:
        files = sorted(n.split("/", 1)[1] for n in names if n.startswith(name + "/"))
        if files != ["config.json", "lazyckpt.lzc", "trainer_state.json"]:
            problems.append(f"store: {name} is marked complete but holds {files}")
            continue
        m = CHECKPOINT_DIR.match(name)
        try:
            saved = lazyckpt.load(f"{tier}/{name}/lazyckpt.lzc", storage_options=ctx.storage_options)
            if m is None or int(m.group(1)) not in allowed or saved["global_step"] != int(m.group(1)):
                problems.append(f"store: {name} holds step {saved['global_step']}")
        except Exception as exc:
            problems.append(f"store: {name}: {type(exc).__name__}: {exc}")
    shutil.rmtree(out, ignore_errors=True)                  # the node is lost: resume from the store
    try:
        trainer = hf_trainer(ctx)
        path = trainer._lazyckpt_resume_path()              # what resume_from_checkpoint=True takes
        if complete and os.path.basename(path) != max(complete, key=lambda n: int(n.split("-")[1])):
            problems.append(f"restart from the store: resumes from {os.path.basename(path)}, not the newest "
                            f"complete one ({complete})")
        trainer.train(resume_from_checkpoint=path)
        if trainer.state.global_step < 4:                   # (at max_steps, a resume still trains one step)
            problems.append(f"restart from the store: ended at step {trainer.state.global_step}")
    except Exception as exc:
        problems.append(f"restart from the store: {type(exc).__name__}: {exc}")
    return problems


def _check_dcp(ctx: Ctx, program: Program) -> List[str]:
    """DCP checkpoints ``step1`` (before the operation) and ``step2`` (its save):
    step1 loads its exact values; step2 loads the new values whole (with
    LazyStorageReader, and DCP's own FileSystemReader for its layout) or is
    refused as no checkpoint; then saving step2 again works."""
    import torch.distributed.checkpoint as dcp
    from lazyckpt.errors import CheckpointError
    from lazyckpt.integrations.dcp import LazyStorageReader
    place, save, fmt = program.kwargs["place"], program.kwargs["save"], program.kwargs["file_format"]
    problems: List[str] = []
    options = {"storage_options": ctx.storage_options} if ctx.storage_options else {}

    def load(name: str, values: Any, plain: bool = False) -> Any:
        into = make_state(0)
        reader = dcp.FileSystemReader(place(ctx, name)) if plain else LazyStorageReader(place(ctx, name), **options)
        dcp.load(into, storage_reader=reader, no_dist=True)
        return differs(values, into)

    try:
        bad = load("step1", program.kwargs["old"])
        if bad:
            problems.append(f"step1 (before the operation) changed: {bad[:3]}")
    except BaseException as exc:
        problems.append(f"step1: {type(exc).__name__}: {exc}")
    new = program.worlds[-1].allowed[2]
    try:
        bad = load("step2", new)
        if bad:
            problems.append(f"step2 loads, but not the saved values: {bad[:3]}")
        elif fmt == "dcp" and not program.persist and load("step2", new, plain=True):
            problems.append("step2: DCP's own FileSystemReader reads other values")
    except BaseException as exc:            # DCP's CheckpointException is a BaseException
        # DCP (torch 2.13, no_dist) re-raises the reader's error as an AssertionError
        # inside a CheckpointException: lazyckpt's refusal, by its words.
        causes = [exc] + list(getattr(exc, "failures", {}).values())
        if len(program.worlds) == 1:            # the save returned: it must be there
            problems.append(f"step2: the save returned, then it is gone: {type(exc).__name__}: {exc}")
        elif not any(isinstance(c, (FileNotFoundError, CheckpointError))
                     or "no committed DCP checkpoint" in str(c) for c in causes):
            problems.append(f"step2: neither whole nor refused as no checkpoint: {type(exc).__name__}: {exc}")
    try:
        values = make_state(999)
        save(ctx, values, "step2")
        if load("step2", values):
            problems.append("restart: saving step2 again, then loading it, differs")
    except BaseException as exc:
        problems.append(f"restart: {type(exc).__name__}: {exc}")
    return problems


def _storage_options_key(options: Optional[Dict[str, Any]]) -> Any:
    from lazyckpt.knobs import resolve
    return resolve(storage_options=options).storage_options


# ----------------------------------------------------------------------------- one case, one program

def fingerprint(root: str) -> str:
    """The local state a check sees: names, types, sizes and contents."""
    h = hashlib.sha1()
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            rel = _mask(rel)
            if os.path.isdir(p):
                h.update(f"d {rel}\n".encode())
            else:
                with open(p, "rb") as f:
                    h.update(f"f {rel} {hashlib.sha1(f.read()).hexdigest()}\n".encode())
    return h.hexdigest()


def _copy_prefix(ctx: Ctx) -> None:
    """The prepared object-store prefix, copied under this case's prefix."""
    from lazyckpt.storage.s3 import ObjectURL  # noqa: F401  (import check: s3 extra)
    import boto3
    from botocore.config import Config
    o = ctx.storage_options or {}
    client = boto3.client("s3", endpoint_url=o.get("endpoint_url"), aws_access_key_id=o.get("access_key_id"),
                          aws_secret_access_key=o.get("secret_access_key"), region_name=o.get("region"),
                          config=Config(s3={"addressing_style": "path"}))
    bucket, prefix = ctx.persist_to[len("s3://"):].split("/", 1)
    src = ctx.base_prefix
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=src + "/"):
        for obj in page.get("Contents", []):
            key = prefix + obj["Key"][len(src):]
            client.copy_object(Bucket=bucket, Key=key, CopySource={"Bucket": bucket, "Key": obj["Key"]})


@dataclasses.dataclass
class Outcome:
    program: str
    mode: str
    points: int
    descriptions: List[str]
    violations: List[Dict[str, Any]]
    checked: int              # distinct states checked (the others were seen at a smaller k)
    seconds: float
    errors: List[str]


def _prepare(program: Program, work: str, s3: Optional[Dict[str, Any]]) -> Ctx:
    base = os.path.join(work, "prepared")
    if not os.path.isdir(base):
        os.makedirs(base)
        ctx = _ctx(program, base, s3, "prepared")
        status, value = run_forked(lambda: program.prepare(ctx), timeout=300)
        if status != "ok":
            raise RuntimeError(f"{program.name}: prepare failed: {status}: {value}")
    return _ctx(program, base, s3, "prepared")


def _ctx(program: Program, case: str, s3: Optional[Dict[str, Any]], tag: str) -> Ctx:
    if not program.persist or s3 is None:
        return Ctx(case)
    base_prefix = f"{program.name}/prepared"
    return Ctx(case, f"s3://{s3['bucket']}/{program.name}/{tag}", s3["storage_options"], base_prefix)


def quiet() -> None:
    """In a child: the library's warnings (superseded steps, leftovers removed) are expected here."""
    import logging
    logging.getLogger("lazyckpt").setLevel(logging.ERROR)


def _crash_child(program: Program, ctx: Ctx, k: int, side: str, mode: str) -> Any:
    quiet()
    if program.persist:
        _copy_prefix(ctx)
    icp = Interceptor(ctx.case, k, side, mode)
    icp.install()
    program.run(ctx, icp)
    return {"count": icp.count, "descriptions": icp.descriptions, "tag": icp.tag}


def dry_run(program: Program, work: str, s3: Optional[Dict[str, Any]] = None) -> Tuple[int, List[str]]:
    _prepare(program, work, s3)
    case = os.path.join(work, "dry")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    ctx = _ctx(program, case, s3, "dry")
    status, value = run_forked(lambda: _crash_child(program, ctx, INFINITY, case + ".side", "kill"), timeout=300)
    if status != "ok":
        raise RuntimeError(f"{program.name}: dry run failed: {status}: {value}")
    return value["count"], value["descriptions"]


def run_case(program: Program, work: str, k: int, mode: str, s3: Optional[Dict[str, Any]] = None,
             seen: Optional[Dict[str, List[str]]] = None, tag: str = "") -> Dict[str, Any]:
    """Crash the program at point ``k`` in ``mode``, then check. Returns
    {"k", "op", "status", "problems", "dropped", "duplicate"}."""
    case = os.path.join(work, f"case-{mode}-{k}{tag}")
    shutil.rmtree(case, ignore_errors=True)
    shutil.copytree(os.path.join(work, "prepared"), case, symlinks=True)
    ctx = _ctx(program, case, s3, f"{mode}-{k}{tag}")
    side = case + ".side"
    status, value = run_forked(lambda: _crash_child(program, ctx, k, side, mode), timeout=300)
    out: Dict[str, Any] = {"k": k, "op": None, "status": status, "problems": [], "dropped": [], "duplicate": False}
    tag = None
    if status == "killed" and os.path.exists(side):
        record = json.loads(open(side).read())
        out["op"] = record["op"]
        tag = out["tag"] = record.get("tag")
        if is_power(mode):
            out["dropped"] = apply_power_loss(record["journal"], ctx.case, POWER_TAILS[mode])
        if out["op"].startswith(END_POINT):
            # Returned, then the power went: only the world after the operation (the
            # programs list it last) is allowed; what it reported done must be there.
            program = dataclasses.replace(program, worlds=program.worlds[-1:], worlds_at=None)
            seen = None                     # other rules than the points before: checked anew
    elif status == "ok":
        out["op"] = f"(no point {k}: the program made {value['count']} calls this time)"
        tag = value.get("tag")
    else:
        out["problems"].append(f"the crash child: {status}: {str(value)[-2000:]}")
        return out
    if program.worlds_at is not None:
        program = dataclasses.replace(program, worlds=program.worlds_at(tag))
        seen = None
    if seen is not None and not program.persist:
        fp = fingerprint(ctx.case)
        if fp in seen:
            out["duplicate"] = True
            out["problems"] = list(seen[fp])
            _cleanup(case, side)
            return out
    status, value = run_forked(lambda: (quiet(), check_case(ctx, program))[1], timeout=300)
    if status != "ok":
        out["problems"].append(f"the check: {status}: {str(value)[-2000:]}")
    else:
        out["problems"] = value
    if seen is not None and not program.persist:
        seen[fp] = out["problems"]
    _cleanup(case, side)
    return out


def _cleanup(case: str, side: str) -> None:
    shutil.rmtree(case, ignore_errors=True)
    shutil.rmtree(side + ".backups", ignore_errors=True)
    try:
        os.unlink(side)
    except FileNotFoundError:
        pass


def preload(program: Program) -> None:
    """Import in the fork server what every child would import again (boto3:
    0.4 s a child here). Imports only: no client, no socket, no thread."""
    if program.preload is not None:
        program.preload()
    if program.persist:
        import boto3
        import botocore.config  # noqa: F401
        import botocore.loaders
        import lazyckpt.storage.s3  # noqa: F401
        # botocore parses its JSON service models again for every client (0.3 s here,
        # three clients a crash point): parse them once, here, for every child.
        loader = botocore.loaders.JSONFileLoader
        if not getattr(loader.load_file, "_crashpoints_cache", False):
            original, cache = loader.load_file, {}

            def load_file(self: Any, file_path: str) -> Any:
                if file_path not in cache:
                    cache[file_path] = original(self, file_path)
                return cache[file_path]
            load_file._crashpoints_cache = True          # type: ignore[attr-defined]
            loader.load_file = load_file
            boto3.session.Session().client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9")


def enumerate_program(program: Program, mode: str, work: str, s3: Optional[Dict[str, Any]] = None,
                      points: Optional[List[int]] = None, log: Optional[Callable[[str], None]] = None,
                      every: int = 1, always_last: int = 0, first: int = 1) -> Outcome:
    """Dry run, then a crash at every point (or at ``points``; ``every``: every
    ``every``-th from ``first``, plus the last ``always_last``) and the checks."""
    t0 = time.monotonic()
    preload(program)
    n, descriptions = dry_run(program, work, s3)
    seen: Dict[str, List[str]] = {}
    violations, errors, checked = [], [], 0
    # Power loss also right after the operation returned (point n + 1, END_POINT).
    last = n + is_power(mode)
    if points is None:
        points = sorted(set(range(first, last + 1, every)) | set(range(max(1, last - always_last + 1), last + 1))) \
            if every > 1 else list(range(1, last + 1))
    for k in points:
        result = run_case(program, work, k, mode, s3, seen)
        checked += not result["duplicate"]
        if result["problems"]:
            violations.append(result)
            if log:
                log(f"{program.name} {mode} k={k}/{n} {result['op']}: {result['problems']}")
    return Outcome(program.name, mode, n, descriptions, violations, checked, time.monotonic() - t0, errors)


def summarize(outcome: Outcome) -> str:
    lines = [f"{outcome.program} [{outcome.mode}]: {outcome.points} points, {outcome.checked} distinct states "
             f"checked, {len(outcome.violations)} with violations, {outcome.seconds:.1f} s"]
    for v in outcome.violations:
        lines.append(f"  k={v['k']} before {v['op']}: " + " | ".join(v["problems"])[:1500])
        if v["dropped"]:
            lines.append(f"      power loss dropped: {v['dropped'][:6]}")
    return "\n".join(lines)


def report_and_exit(w: int, payload, code: int) -> None:
    """A forked child's last act: its result, pickled, down the pipe ``w``; then ``os._exit``."""
    try:
        data = pickle.dumps(payload)
    except Exception:
        data = pickle.dumps(("error", f"unpicklable result: {payload!r}"[:4000]))
    view = memoryview(data)
    while view:
        n = os.write(w, view)
        view = view[n:]
    os.close(w)
    os._exit(code)
