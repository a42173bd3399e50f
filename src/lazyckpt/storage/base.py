"""The storage interface: what the rest of lazyckpt may ask of a place that
holds checkpoints, declared once, so that a new store (GCS, Azure, a parallel
file system's own API) is one module written from this file alone, plus one
line in :mod:`lazyckpt.storage.stores`.

Three levels, each with one implementation per store today:

============  =================================  ==========================================
level         local file system                  S3-compatible object store
============  =================================  ==========================================
store         ``localstore.LocalStore``          ``s3store.S3Store``
bytes         ``fileio.OutputFile`` /            ``s3.ObjectOutput`` / ``s3.ObjectInput``
              ``fileio.InputFile``
directory     ``layout.CheckpointDir``,          ``s3layout.ObjectCheckpointDir``,
              ``layout.Lease``,                  ``s3layout.ObjectLease``,
              ``layout.WriterLease``             ``s3layout.ObjectWriterLease``
============  =================================  ==========================================

Why an ABC for :class:`Store` and ``Protocol`` classes for the rest: a store is
what gets registered and what a new backend starts from, so forgetting a method
should fail when it is instantiated (an ABC does that), and a store is a small
class written for this purpose. The objects a store hands out are the
existing hot-path classes (the writer's ``pwrite_all`` runs per chunk, tests
patch their methods): they keep their own hierarchy and are checked
structurally against the protocols below, by ``tests/test_storage_interface.py``
(every member present, every signature compatible).

What is *not* here, on purpose: making a step visible. A local step is a
directory renamed into place, an object-store step is a manifest object
written last; the two commit strategies (``saving.commit.StepCommit`` and
``ObjectStepCommit``) differ in more than the storage call, so each
directory's ``commit`` stays its own.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, List, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lazyckpt.knobs import Options


# ---------------------------------------------------------------------- bytes

@runtime_checkable
class Output(Protocol):
    """One checkpoint file being written, at explicit offsets, by several writer
    threads at once. Nothing is visible under ``path`` as a complete file
    before :meth:`finish`; :meth:`close` without :meth:`finish` leaves nothing
    that a reader could take for a checkpoint (an object store aborts the
    upload)."""

    path: str
    #: Whether writes bypass the page cache (O_DIRECT): windows must then be page-aligned.
    direct: bool

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (thread-safe; any order)."""

    def finish(self, size: int) -> None:
        """The file is exactly ``size`` bytes and durable on return."""

    def close(self) -> None:
        """Release the handle; idempotent after :meth:`finish`."""


@runtime_checkable
class Input(Protocol):
    """One checkpoint file read at explicit offsets by several reader threads."""

    path: str
    #: Whether reads bypass the page cache: offsets and lengths must then be page-aligned.
    direct: bool

    def read_into(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``; return the bytes read (fewer only at the end)."""

    def close(self) -> None:
        """Release the handle."""


# ---------------------------------------------------------------------- directory

@runtime_checkable
class Lease(Protocol):
    """Something a save or a reader holds while it lives (a heartbeat the store
    can see, so that cleanup never removes what is in use)."""

    def release(self) -> None:
        """Stop holding it; idempotent."""


@runtime_checkable
class WriterLease(Protocol):
    """One writer per checkpoint directory (docs/FORMAT.md §11.5)."""

    def check(self) -> None:
        """Raise ``CheckpointError`` naming the new holder if another writer took over."""

    def release(self) -> None:
        """Give the directory up; idempotent."""


@runtime_checkable
class Directory(Protocol):
    """A Checkpointer directory: committed steps on one line of history, their
    retention and the leftovers of dead saves (docs/FORMAT.md §11)."""

    #: The directory as given to the store (absolute path, or canonical URL).
    path: str
    #: The writer lease this process holds here, checked before every commit.
    writer: Optional[Any]

    def step_path(self, step: int) -> str:
        """Where committed ``step`` is read from (raises if it is not committed
        where the name alone does not say it)."""

    def temp_path(self, step: int, token: str) -> str:
        """Where a save in progress of ``step`` writes its files, invisible to readers."""

    def steps(self) -> List[int]:
        """Committed steps, oldest (= first committed) first."""

    def latest(self) -> Optional[int]:
        """The newest committed step, or None."""

    def write_latest(self, step: int) -> None:
        """Record ``step`` as the advisory ``latest`` (readers trust the listing)."""

    def apply_retention(self, keep_last: Optional[int]) -> List[int]:
        """Delete all but the ``keep_last`` newest steps; return those deleted."""

    def delete_step(self, step: int, even_if_read: bool = False) -> bool:
        """Delete one step; False (and kept) if a reader holds it, unless ``even_if_read``."""

    def clean_leftovers(self) -> List[str]:
        """Remove what is provably dead (expired saves, interrupted deletes); never data."""

    def acquire_writer(self, heartbeat_s: float, expiry_s: float, takeover: bool = False) -> WriterLease:
        """Become this directory's one writer (refused with the holder's name)."""


# ---------------------------------------------------------------------- store

class Store(abc.ABC):
    """One kind of place checkpoints live in, and how to reach it. Stateless:
    one instance per kind, registered in :mod:`lazyckpt.storage.stores`, which
    alone decides which store a path belongs to."""

    #: Short name for messages and listings ("local", "s3").
    name: str = ""
    #: The URL prefix this store claims (``"s3://"``); empty for the local file system,
    #: which takes every path that does not look like a URL.
    scheme: str = ""
    #: Whether the bytes leave this host. A remote store has no rename, no flock and
    #: no node-local steps: callers ask this for policy (``persist_to`` must be remote,
    #: incremental references and replicas need a local directory, foreign file formats
    #: are written locally), never the path's spelling.
    is_remote: bool = False

    def claims(self, path: str) -> bool:
        """Whether ``path`` names this store; a malformed path of this store's
        scheme raises ``InvalidURLError`` here rather than becoming another store's."""
        return bool(self.scheme) and path.startswith(self.scheme)

    @abc.abstractmethod
    def normalize(self, path: str) -> str:
        """The canonical spelling (an absolute path, a parsed and reprinted URL)."""

    @abc.abstractmethod
    def join(self, base: str, *names: str) -> str:
        """``base`` and names below it, in this store's separator."""

    @abc.abstractmethod
    def check(self, path: str, options: "Options") -> None:
        """Fail now, with one clear error, if ``path`` cannot be reached at all
        (credentials, a missing bucket); a no-op where nothing can be checked."""

    @abc.abstractmethod
    def open_output(self, path: str, options: "Options", block_bytes: int) -> Output:
        """A new file at ``path`` written in ``block_bytes`` windows."""

    @abc.abstractmethod
    def open_input(self, path: str, options: "Options", threads: Optional[int] = None) -> Input:
        """An existing file at ``path`` for ranged reads by ``threads`` threads
        (default ``options.reader_threads``). Raises ``FileNotFoundError`` (or the
        library's not-found error) if there is none."""

    @abc.abstractmethod
    def read_ends(self, path: str, options: "Options", parse: Any) -> Any:
        """``parse(size, read)`` on the file at ``path``, where ``read(offset, n)``
        returns bytes: a file's header and footer, read without opening it for
        bulk reads. Raises ``CheckpointNotFoundError`` if there is no such file."""

    @abc.abstractmethod
    def checkpoint_dir(self, path: str, options: "Options") -> Directory:
        """The Checkpointer directory at ``path`` (nothing is created or checked)."""
