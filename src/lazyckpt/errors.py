"""The library's one exception family.

Every error lazyckpt raises on purpose derives from :class:`CheckpointError`,
so ``except lazyckpt.CheckpointError`` catches them all. Subclasses carry
structured fields (``path``, ``entry``, ``step``) besides the message.
"""

from __future__ import annotations

import pickle
from typing import Optional, Sequence


class CheckpointError(Exception):
    """Base class of every error lazyckpt raises on purpose."""

    def __init__(self, message: str, *, path: Optional[str] = None,
                 entry: Optional[str] = None, step: Optional[int] = None):
        super().__init__(message)
        self.path = path
        self.entry = entry
        self.step = step

    def __reduce__(self):
        # DCP hands a rank's error to every rank by pickling it (gather_object): a field
        # that cannot travel (a save's handle: locks, threads) stays behind, or the
        # pickling error would replace this one. The message and plain fields travel.
        state = {}
        for name, value in self.__dict__.items():
            try:
                pickle.dumps(value)
            except Exception:
                continue
            state[name] = value
        if isinstance(self, OSError):       # its fields are slots, not in __dict__
            state.update(errno=self.errno, strerror=self.strerror, filename=self.filename)
        return _rebuild, (type(self), self.args, state)


def _rebuild(cls: type, args: tuple, state: dict) -> "CheckpointError":
    error = cls.__new__(cls, *args)
    BaseException.__init__(error, *args)
    for name, value in state.items():
        setattr(error, name, value)
    return error


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


class WrongReaderError(CheckpointError):
    """A lazyckpt checkpoint was handed to a reader of another format (DCP's
    default ``FileSystemReader``, ``torch.load`` under Lightning's loaders);
    the message names the reader to use. Each case also derives from the
    error that reader raised before (AttributeError, pickle.UnpicklingError),
    so code that caught that still catches it."""


class MapLocationError(CheckpointError, TypeError):
    """The caller's ``map_location`` callable raised, or returned something that
    is not a storage: the caller's argument failed, not the file."""


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
