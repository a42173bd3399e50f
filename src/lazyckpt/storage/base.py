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

Making a save visible is the store's too (:class:`PendingFile`,
:class:`PendingStep`): a local step is a directory renamed into place, an
object-store step a manifest object written last, and the commit strategies
of :mod:`lazyckpt.saving.commit` (which agree between ranks and decide what
goes into the manifest) only call ``publish``.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, runtime_checkable

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


# ---------------------------------------------------------------------- pending saves

@runtime_checkable
class PendingFile(Protocol):
    """One file being saved to ``final`` (``lazyckpt.save``, the frameworks'
    single files): written at :attr:`path`, where no reader of ``final`` sees
    it, until :meth:`publish` makes the complete file appear there at once."""

    #: Where the bytes are written now (a hidden sibling, or ``final`` itself where
    #: the store only shows an upload once it completed).
    path: str
    #: Where the complete file appears.
    final: str

    def hold(self, heartbeat_s: float) -> Optional[Lease]:
        """What keeps cleanup (any process) off :attr:`path` while it is written;
        None where nothing can remove it."""

    def publish(self) -> None:
        """The complete, durable file at :attr:`path` becomes ``final`` atomically."""

    def discard(self) -> None:
        """Nothing of this save remains (never the old ``final``); idempotent."""


@runtime_checkable
class PendingStep(Protocol):
    """One save of one step of a :class:`Directory`, being written by every rank
    of its commit group: invisible to readers and listings until
    :meth:`publish`, removable by cleanup only once its holds have lapsed."""

    #: Where this save's files go (a temporary directory, a save prefix).
    path: str
    step: int
    save_id: str
    #: Whether :meth:`create` must run (on the coordinator) before any rank writes
    #: into :attr:`path` (a directory must exist; a prefix needs nothing).
    needs_create: bool

    def create(self) -> None:
        """Make :attr:`path` exist (refused if it does)."""

    def file_path(self, rank: int) -> str:
        """Where ``rank`` writes its data file."""

    def hold(self, rank: int, heartbeat_s: float) -> Lease:
        """What keeps cleanup off this save while ``rank`` writes into it."""

    def put_side(self, name: str, data: bytes) -> None:
        """A small side file next to the data files (a rank's report too large for
        the rendezvous store); never part of the committed step."""

    def take_side(self, name: str) -> bytes:
        """Read and remove a side file (``CheckpointError`` if it is missing)."""

    def read_ends(self, rank: int, options: "Options", parse: Any) -> Any:
        """``parse(size, read)`` on ``rank``'s data file (see :meth:`Store.read_ends`)."""

    def publish(self, manifest_raw: bytes, event: Optional[Any], keep_superseded: bool) -> List[int]:
        """Record the commit ``event`` (``history.Event``, or None) where the
        directory keeps its line of history, then write the manifest: the step
        is committed. Committed steps >= this step are superseded first (kept
        aside where ``keep_superseded`` and the store can); returns them."""

    def discard(self) -> None:
        """Remove what this save wrote, never a committed step; idempotent."""


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

    def pending(self, step: int, save_id: str, token: str) -> PendingStep:
        """A new save of ``step`` (nothing is created yet). ``save_id`` names it in
        the manifest; ``token`` makes its temporary name unique where the store
        names it by something else than ``save_id``."""

    def record_event(self, event: Any) -> None:
        """Record a commit event (``history.Event``) where this directory keeps its
        line of history (before the step it numbers becomes visible)."""

    def step_paths(self) -> Dict[int, str]:
        """Every committed step -> where it is read from, from one listing."""


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

    @abc.abstractmethod
    def pending_file(self, final: str, options: "Options", make_parents: bool = False,
                     beside: Optional[str] = None) -> PendingFile:
        """A save of one file to ``final``; nothing is written yet but, with
        ``make_parents``, missing parent directories (else a missing parent is
        ``CheckpointNotFoundError`` here, where the store has directories).
        ``beside``: where a temporary name is needed, make it a sibling of this
        path (a directory a framework assembles and then moves into place)."""
