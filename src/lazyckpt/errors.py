"""The library's one exception family.

Every error lazyckpt raises on purpose derives from :class:`CheckpointError`,
so ``except lazyckpt.CheckpointError`` catches them all. Subclasses carry
structured fields (``path``, ``entry``, ``step``) besides the message.
"""

from __future__ import annotations

from typing import Optional, Sequence


class CheckpointError(Exception):
    """Base class of every error lazyckpt raises on purpose."""

    def __init__(self, message: str, *, path: Optional[str] = None,
                 entry: Optional[str] = None, step: Optional[int] = None):
        super().__init__(message)
        self.path = path
        self.entry = entry
        self.step = step


class CorruptCheckpointError(CheckpointError):
    """The file is damaged: bad magic, bad checksum, truncated, inconsistent footer."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (committed) checkpoint at the given path or step."""


class UnsupportedVersionError(CheckpointError):
    """The file was written in a format version this reader does not read."""

    def __init__(self, message: str, *, found: int, supported: Sequence[int],
                 path: Optional[str] = None):
        super().__init__(message, path=path)
        self.found = found
        self.supported = tuple(supported)


class UnsafeObjectError(CheckpointError):
    """Loading an entry would unpickle (run code from the file) without opt-in."""


class CheckpointWriteError(CheckpointError):
    """Writing or committing a checkpoint failed (disk full, I/O error, ...)."""


class CheckpointReadError(CheckpointError, OSError):
    """Reading a checkpoint failed in the operating system (EIO, ESTALE, ...):
    ``path`` names the file, ``errno`` the cause. The file may be intact."""

    def __init__(self, message: str, *, path: Optional[str] = None, errno_: Optional[int] = None,
                 step: Optional[int] = None):
        super().__init__(message, path=path, step=step)
        self.errno = errno_

    def __str__(self) -> str:   # OSError would format its own way
        return Exception.__str__(self)


class StateMismatchError(CheckpointError):
    """``into=`` holds a tensor whose shape or dtype differs from the checkpoint."""


class MissingKeyError(CheckpointError, KeyError):
    """``keys=`` names an entry the checkpoint does not hold, or ``into=`` holds
    tensors the checkpoint does not (``missing``: their paths, "a/b/c")."""

    def __init__(self, message: str, *, missing: Optional[Sequence[str]] = None, **fields):
        super().__init__(message, **fields)
        self.missing = list(missing or [])

    def __str__(self) -> str:   # KeyError would quote the message
        return Exception.__str__(self)
