"""The local file system as a :class:`lazyckpt.storage.base.Store`: files
written and read at explicit offsets (O_DIRECT or buffered, as measured by
``iomode``), Checkpointer directories committed by rename (``layout``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

from lazyckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.knobs import Options
from .base import Store
from .fileio import InputFile, NotARegularFile, OutputFile, open_regular
from .iomode import use_o_direct
from .layout import CheckpointDir, PendingSiblingFile


class LocalStore(Store):
    name = "local"
    is_remote = False

    def claims(self, path: str) -> bool:
        return True                     # the registry asks it last, after every URL scheme

    def normalize(self, path: str) -> str:
        return os.path.abspath(os.fspath(path))

    def join(self, base: str, *names: str) -> str:
        return os.path.join(base, *names)

    def check(self, path: str, options: Options) -> None:
        pass                            # a missing directory is each caller's own error

    def open_output(self, path: str, options: Options, block_bytes: int) -> OutputFile:
        return OutputFile(path, use_o_direct(path, "write", options.o_direct, options.writer_threads))

    def open_input(self, path: str, options: Options, threads: Optional[int] = None) -> InputFile:
        return InputFile(path, use_o_direct(path, "read", options.o_direct,
                                            options.reader_threads if threads is None else threads))

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
