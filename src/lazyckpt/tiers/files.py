"""The persistent tier of a framework's own files (``persist_to=`` of Lightning's
``LazyCheckpointIO``): every checkpoint file the framework commits locally is
uploaded to an object store in the background, the framework's rotation is
applied there too, and a run whose local directory is gone finds its files
again on the store.

A file at ``<local_root>/<relative path>`` is mirrored at
``<persist_to>/<relative path>``. One thread runs the operations in the order
they were asked: upload a committed file, copy one file's object to another
name (``last.ckpt`` naming the newest top-k file), delete an object. That
order is the framework's own order locally (a new file, then ``last``, then
the removal of the old one), so at every instant the store holds what the
local directory held at some earlier instant: a kill never leaves the store
without a complete ``last.ckpt`` once one was there, and never with the new
file's removal ahead of its upload. Each operation is one atomic step of the
store (an upload completes whole; a copy or a delete is one request).

What a kill leaves: the store behind the local directory (files not yet
uploaded, removals not yet applied). The first save into a directory after a
restart reconciles it (``sync``): local files the store lacks are uploaded.
Objects whose local file is gone are left: from the store alone nothing tells
a file the framework removed (its removal not applied before the kill) from
one a resume did not fetch back, and deleting the second would lose a
checkpoint the framework still tracks; such a leftover is a complete, older
checkpoint.

A failed operation is raised at the integration's next save; from then on this
mirror skips deletions (an older complete checkpoint on the store beats none
when the upload that was to replace it failed), and a directory's marker is
sent only if every other file of it was.

Cost: one listing of a directory's prefix at its first save in a process, then
O(1) requests per operation, whatever the run's length.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import os
import shutil
import threading
from typing import Callable, Deque, List, Optional, Set, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from lazyckpt.knobs import Options
from lazyckpt.storage.fileio import fsync_dir
from lazyckpt.storage.sidefiles import sibling_temp
from lazyckpt.storage.base import Store
from lazyckpt.storage.stores import LOCAL
from .drain import RateLimit
from .persistent import upload_file

log = logging.getLogger("lazyckpt")


class FileMirror:
    """Mirrors files under ``local_root`` to ``persist_to`` (see the module docstring).

    Failures are kept and raised once, by :meth:`raise_errors` (the integration
    calls it at its next save and at teardown); an operation that failed is not
    retried, and the ones after it still run (a later upload makes the store
    current again)."""

    def __init__(self, store: Store, persist_to: str, local_root: str, options: Options):
        """``store``: ``persist_to``'s, looked up by the integration that was given it."""
        if not store.is_remote:
            raise ValueError(f"persist_to={persist_to!r}: expected an object store URL (s3://bucket/prefix): "
                             f"the persistent tier is where the files survive the loss of this node")
        self.url = store.normalize(persist_to).rstrip("/")
        self.store = store
        self.local_root = os.path.abspath(local_root)
        self.options = options
        store.check(self.url, options)              # credentials, the bucket: one clear error now
        self._ops: Deque[Tuple[str, Callable[[], None], bool]] = collections.deque()
        #: An operation failed: deletions are skipped from then on (module docstring).
        self._failed = False
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._busy = False
        self._errors: List[BaseException] = []
        self._synced: Set[str] = set()
        self._pool: Optional[cf.ThreadPoolExecutor] = None
        self._limit = RateLimit(options.persist_bandwidth or 0)
        #: Operations done (for tests and the note: proves the tier ran).
        self.done = 0

    # ------------------------------------------------------------------ names

    def key(self, local: str) -> str:
        """The object URL that mirrors the local path ``local`` (a file or a
        directory under ``local_root``, or ``local_root`` itself)."""
        rel = os.path.relpath(os.path.abspath(local), self.local_root)
        if rel.startswith(os.pardir + os.sep) or rel == os.pardir:
            raise ValueError(f"{local}: outside local_root={self.local_root!r}; persist_to mirrors the files under "
                             f"it (pass local_root= a directory that holds every checkpoint directory)")
        return self.url if rel == os.curdir else self.store.join(self.url, *rel.split(os.sep))

    # ------------------------------------------------------------------ operations (queued in order)

    def uploaded(self, local: str) -> None:
        """``local`` was just committed: upload it (the file as it is when the upload runs)."""
        remote = self.key(local)
        self._queue(f"upload {local}", lambda: self._upload(local, remote))

    def copied(self, source: str, dest: str) -> None:
        """``dest`` now names the same checkpoint as ``source`` (a last.ckpt link or stand-in)."""
        src, dst = self.key(source), self.key(dest)

        def copy() -> None:
            try:
                self.store.copy_file(src, dst, self.options)
            except CheckpointNotFoundError:
                # ``source`` was removed locally before its upload's turn (rotation):
                # ``dest`` is a file of its own there (a hard link or a copy); send it.
                self._upload(dest, dst)
        self._queue(f"copy {source} -> {dest}", copy)

    def removed(self, local: str) -> None:
        """The framework removed ``local`` (rotation): remove its object."""
        remote = self.key(local)
        self._queue(f"delete {local}", lambda: self.store.delete_file(remote, self.options), deletes=True)

    def sync(self, directory: str, is_checkpoint: Callable[[str], bool]) -> None:
        """Once per directory and process, before its first new file: bring the
        store's copy of ``directory`` level with it (see the module docstring)."""
        self._sync_once(directory, lambda d, name: is_checkpoint(name), self.names, self.uploaded)

    def _sync_once(self, directory: str, is_complete: Callable[[str, str], object],
                   on_store: Callable[[str], List[str]], upload: Callable[[str], None]) -> None:
        """What :meth:`sync` and :meth:`sync_dirs` share: once per directory and
        process, upload the complete local entries (``is_complete(directory,
        name)``) the store lacks (``on_store(directory)``: their names there).
        An empty or missing directory uploads nothing (new, or lost: the store
        keeps its files) and asks the store nothing."""
        directory = os.path.abspath(directory)
        if directory in self._synced:
            return
        self._synced.add(directory)
        try:
            local = {n for n in os.listdir(directory) if is_complete(directory, n)}
        except FileNotFoundError:
            return
        if local:
            for name in sorted(local - set(on_store(directory))):
                upload(os.path.join(directory, name))

    # Directories of files committed together (the HF Trainer's checkpoint-<step>): on the
    # store such a directory is complete once its ``marker`` file is there, uploaded last
    # and deleted first.

    def uploaded_dir(self, local_dir: str, marker: str) -> None:
        """Every file of the committed ``local_dir``, ``marker`` last, as one
        operation: the marker is not sent unless every other file was (a failed
        upload must not leave a checkpoint marked complete there). An earlier
        copy of the same directory (a step saved again) loses its marker first."""
        remote_dir = self.key(local_dir)
        names = LOCAL.list_files(local_dir, self.options, recursive=True)     # what it mirrors is local

        def upload() -> None:
            old = self.store.list_files(remote_dir, self.options, recursive=True)
            if old:
                self._delete_dir(remote_dir, marker)
            for name in [n for n in names if n != marker] + ([marker] if marker in names else []):
                self._upload(os.path.join(local_dir, *name.split("/")), self.store.join(remote_dir, *name.split("/")))
        self._queue(f"upload {local_dir}", upload)

    def sync_dirs(self, directory: str, marker: str, is_checkpoint: Callable[[str], object]) -> None:
        """Once per ``directory`` and process, before its first new checkpoint: the
        complete local checkpoint directories the store lacks are uploaded."""
        self._sync_once(directory,
                        lambda d, name: is_checkpoint(name) and os.path.isfile(os.path.join(d, name, marker)),
                        lambda d: self.complete_dirs(d, marker), lambda path: self.uploaded_dir(path, marker))

    def removed_dir(self, local_dir: str, marker: str) -> None:
        """The framework removed ``local_dir``: its objects, ``marker`` first."""
        remote_dir = self.key(local_dir)
        self._queue(f"delete {local_dir}", lambda: self._delete_dir(remote_dir, marker), deletes=True)

    def removed_dirs_where(self, directory: str, marker: str, doomed: Callable[[str], bool]) -> None:
        """Remove from the store every complete subdirectory of ``directory`` whose
        name ``doomed`` accepts (listed when its turn comes, on the tier's thread):
        the framework's rotation applied to what only the store still has."""
        def delete() -> None:
            for name in self.complete_dirs(directory, marker):
                if doomed(name):
                    self._delete_dir(self.key(os.path.join(directory, name)), marker)
        self._queue(f"rotate {directory}", delete, deletes=True)

    def _delete_dir(self, remote_dir: str, marker: str) -> None:
        names = self.store.list_files(remote_dir, self.options, recursive=True)
        if marker in names:                 # first: an interrupted deletion leaves it incomplete
            self.store.delete_file(self.store.join(remote_dir, marker), self.options)
        for name in names:
            if name != marker:
                self.store.delete_file(self.store.join(remote_dir, *name.split("/")), self.options)

    def complete_dirs(self, directory: str, marker: str) -> List[str]:
        """Names of the subdirectories of ``directory`` that are complete on the store (one listing)."""
        names = self.store.list_files(self.key(directory), self.options, recursive=True)
        return sorted(n[:-len(marker) - 1] for n in names if n.endswith("/" + marker) and n.count("/") == 1)

    def fetch_dir(self, local_dir: str) -> None:
        """Download the store's copy of ``local_dir`` into a hidden sibling (the
        name leftover cleanup knows), then rename it into place: a complete
        directory or none. Several processes of one node may fetch the same
        directory at once (every rank resuming): the first rename wins, the
        others find it there and drop their copy."""
        remote_dir = self.key(local_dir)
        names = self.store.list_files(remote_dir, self.options, recursive=True)
        if not names:
            raise CheckpointNotFoundError(f"{remote_dir}: nothing on the persistent tier", path=remote_dir)
        staging = sibling_temp(local_dir)
        try:
            for name in names:
                self.fetch(os.path.join(local_dir, *name.split("/")), into=os.path.join(staging, *name.split("/")))
            try:
                os.rename(staging, local_dir)
            except OSError:
                if not os.path.isdir(local_dir):
                    raise
                log.info("lazyckpt: %s: fetched by another process meanwhile", local_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        fsync_dir(os.path.dirname(os.path.abspath(local_dir)))

    # ------------------------------------------------------------------ the read side

    def names(self, directory: str) -> List[str]:
        """The files the store holds for ``directory`` (one listing)."""
        return self.store.list_files(self.key(directory), self.options)

    def fetch(self, local: str, into: Optional[str] = None) -> None:
        """Download the object that mirrors ``local`` to ``local`` (or ``into``):
        whole, then renamed into place and fsynced. A resume from the store after
        the local copy was lost."""
        data = self.store.read_whole(self.key(local), self.options, limit=1 << 62)
        target = into or local
        LOCAL.write_whole(target, data, self.options)

    # ------------------------------------------------------------------ waiting, errors, closing

    def wait(self) -> None:
        """Block until every operation queued so far ran."""
        with self._cond:
            while self._ops or self._busy:
                self._cond.wait()

    def raise_errors(self) -> None:
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self.wait()
        with self._cond:
            thread, self._thread = self._thread, None
            self._cond.notify_all()
        if thread is not None:
            thread.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ------------------------------------------------------------------ internals

    def _upload(self, local: str, remote: str) -> None:
        if not os.path.isfile(local):
            return                                  # removed before its turn: its removal follows
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max(1, self.options.writer_threads),
                                               thread_name_prefix="lazyckpt-mirror")
        try:
            upload_file(local, self.store, remote, self.options, max(self.options.chunk_bytes, 8 << 20), self._pool,
                        self._limit)
        except FileNotFoundError:
            return                                  # removed since the check: its removal follows

    def _queue(self, what: str, fn: Callable[[], None], deletes: bool = False) -> None:
        with self._cond:
            self._ops.append((what, fn, deletes))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lazyckpt-mirror", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ops and self._thread is threading.current_thread():
                    self._cond.wait()
                if not self._ops:
                    return                          # closed
                what, fn, deletes = self._ops.popleft()
                self._busy = True
            try:
                if deletes and self._failed:
                    # An upload failed: what it would have replaced stays (an older complete
                    # checkpoint on the store beats none); the error is raised at the next save.
                    log.warning("lazyckpt: %s: persistent tier: not running '%s' after a failed operation",
                                self.url, what)
                    continue
                fn()
                self.done += 1
            except BaseException as exc:
                error = exc if isinstance(exc, CheckpointError) else CheckpointWriteError(
                    f"{self.url}: persistent tier: {what} failed: {type(exc).__name__}: {exc}", path=self.url)
                log.warning("lazyckpt: %s", error)
                with self._cond:
                    self._errors.append(error)
                    self._failed = True
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def check_mirror_target(store: Store, path: str) -> None:
    """A file that ``persist_to`` would mirror (on ``store``) must be local."""
    if store.is_remote:
        raise ValueError(f"{path}: already on an object store; persist_to mirrors local files (drop persist_to, "
                         f"or write locally)")


__all__ = ["FileMirror", "check_mirror_target"]
