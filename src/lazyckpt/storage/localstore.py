"""The local file system as a :class:`lazyckpt.storage.base.Store`: files
written and read at explicit offsets (O_DIRECT or buffered, as measured by
``iomode``), Checkpointer directories committed by rename (``layout``)."""

from __future__ import annotations

import os
import shutil
import stat
from typing import Any, Callable, ContextManager, Dict, List, Optional

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import MANIFEST, STEP_DIR
from lazyckpt.knobs import Options
from .base import HeldStep, Input, Located, Store
from .fileio import (NotARegularFile, OutputFile, fsync_dir, make_dirs_durable, open_regular, read_small_file,
                     replace_with_link, unlink_releasing_later, write_file_atomic)
from .iomode import open_local_input, open_local_output
from .layout import CheckpointDir, PendingSiblingFile
from .locks import StepDir, deleted_while_reading


class LocalStore(Store):
    name = "local"
    is_remote = False
    holds_references = True             # incremental steps refer to their siblings' files

    def claims(self, path: str) -> bool:
        return True                     # the registry asks it last, after every URL scheme

    def normalize(self, path: str) -> str:
        return os.path.abspath(os.fspath(path))

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def check(self, path: str, options: Options) -> None:
        pass                            # a missing directory is each caller's own error

    def open_output(self, path: str, options: Options, block_bytes: int) -> OutputFile:
        return open_local_output(path, options)

    def open_input(self, path: str, options: Options, threads: Optional[int] = None) -> Input:
        return open_local_input(path, options)

    def read_ends(self, path: str, options: Options, parse: Callable[[int, Callable[[int, int], bytes]], Any]) -> Any:
        """Through a plain descriptor opened non-blocking (a FIFO would block the
        reader forever; anything but a regular file is refused). Other
        ``OSError``s propagate: the reader words them with the file's path."""
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such checkpoint file", path=path) from None
        except NotARegularFile:
            raise CorruptCheckpointError(f"{path}: not a regular file", path=path) from None
        try:
            return parse(os.fstat(fd).st_size, lambda offset, n: os.pread(fd, n, offset))
        finally:
            os.close(fd)

    def checkpoint_dir(self, path: str, options: Options) -> CheckpointDir:
        return CheckpointDir(path, options.lease_expiry_s)

    def pending_file(self, final: str, options: Options, make_parents: bool = False,
                     beside: Optional[str] = None) -> PendingSiblingFile:
        return PendingSiblingFile(final, make_parents, beside)

    def write_whole(self, path: str, data: bytes, options: Options) -> None:
        make_dirs_durable(os.path.dirname(os.path.abspath(path)))
        write_file_atomic(path, data)

    def list_files(self, directory: str, options: Options, recursive: bool = False) -> List[str]:
        if recursive:
            return sorted(os.path.relpath(os.path.join(top, name), directory).replace(os.sep, "/")
                          for top, _, files in os.walk(directory) for name in files)
        try:
            return sorted(e.name for e in os.scandir(directory) if e.is_file(follow_symlinks=False)
                          or e.is_symlink())
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str, options: Options) -> bool:
        return os.path.lexists(path)

    def delete_file(self, path: str, options: Options) -> None:
        if os.path.islink(path) or os.path.isfile(path):
            unlink_releasing_later(path)         # a removal on the training thread (Lightning's top-k)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        else:
            return
        # Removed when this returns, as an object store's acknowledged delete: without
        # the directory's fsync a power loss brings the file back, an orphan that
        # Lightning's top-k rotation and the persistent tier's mirror no longer know.
        fsync_dir(os.path.dirname(os.path.abspath(path)))

    def copy_file(self, source: str, dest: str, options: Options) -> None:
        """A hard link (a file of its own, which outlives ``source``; a copy where
        links are refused) put in place by rename, then the directory fsynced."""
        replace_with_link(source, dest, hard=True)

    def read_whole(self, path: str, options: Options, limit: int) -> bytes:
        try:
            data = read_small_file(path, limit)
        except NotARegularFile:
            raise CorruptCheckpointError(f"{path}: not a regular file", path=path) from None
        if data is None:
            raise CheckpointNotFoundError(f"{path}: no such file", path=path)
        if len(data) > limit:
            raise CorruptCheckpointError(f"{path}: larger than {limit} bytes", path=path)
        return data

    # ---------------------------------------------------------------- the read side

    def locate(self, path: str, options: Options, empty_ok: bool = False, all_steps: bool = False) -> Located:
        path = self.normalize(path)
        # One stat decides what the path is: `lazyckpt prune` (or retention) may rename a
        # step away between two looks, and a path that vanished is "not found", never
        # "not a regular file or directory" (which stays for a FIFO, a device...).
        try:
            st = os.stat(path)
        except FileNotFoundError:
            # empty_ok: a listing, which only takes a directory
            what = "directory" if empty_ok else "file or directory"
            raise CheckpointNotFoundError(f"{path}: no such {what}", path=path) from None
        if stat.S_ISREG(st.st_mode):
            return Located("file", path)
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file or directory", path=path)
        m = STEP_DIR.match(os.path.basename(path))
        if os.path.isfile(os.path.join(path, MANIFEST)):
            if m and self.checkpoint_dir(os.path.dirname(path), options).superseded_by_record(path):
                raise CheckpointNotFoundError(f"{path}: step {int(m.group(1))} was abandoned: a later commit of an "
                                              f"older step superseded it (a run resumed from an earlier step)",
                                              path=path, step=int(m.group(1)))
            return Located("step", path, path, int(m.group(1)) if m else None)
        if m and not _still(path, st):
            raise deleted_while_reading(path, int(m.group(1)))
        directory = self.checkpoint_dir(path, options)
        if all_steps:
            paths = directory.step_paths()
        else:
            # The index: a few stat calls; where it cannot tell, locate_step
            # lists the directory itself, so None means no committed step.
            found = directory.locate_step(None)
            if found is not None:
                return Located("directory", path, found[1], found[0],
                               moving=found[1] != directory.step_path(found[0]))
            paths = {}
        steps = list(paths)
        if not steps:
            if empty_ok:
                return Located("directory", path)
            hint = ""
            if os.path.isfile(os.path.join(path, ".metadata")):
                hint = " (it looks like a torch.distributed.checkpoint directory: use `lazyckpt convert`)"
            raise CheckpointNotFoundError(f"{path}: no committed checkpoint in this directory{hint}", path=path)
        latest = paths[steps[-1]]
        return Located("directory", path, latest, steps[-1], steps,
                       moving=latest != directory.step_path(steps[-1]))

    def read_manifest(self, step_path: str, options: Options) -> Dict[str, Any]:
        path = os.path.join(step_path, MANIFEST)
        raw = read_small_file(path, manifests.MAX_MANIFEST_BYTES)
        if raw is None:
            raise CheckpointNotFoundError(f"{step_path}: not a committed step (no {MANIFEST})", path=step_path)
        return manifests.parse(raw, path)

    def reading_step(self, step_path: str, options: Options,
                     step: Optional[int] = None) -> ContextManager[HeldStep]:
        """A shared lock on its manifest (``locks.StepDir.reading``)."""
        if step is None:
            m = STEP_DIR.match(os.path.basename(os.path.abspath(step_path)))
            step = int(m.group(1)) if m else None
        return StepDir(step_path, step).reading()


def _still(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` still names the directory ``st`` describes."""
    try:
        return os.path.samestat(os.stat(path), st)
    except OSError:
        return False
