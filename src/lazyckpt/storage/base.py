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
              ``locks.Lease``,                   ``s3leases.ObjectLease``,
              ``locks.WriterLease``              ``s3leases.ObjectWriterLease``
held step     ``locks.StepDir.reading``          ``s3leases.reading_object_step``
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

The read side is here too: :meth:`Store.locate` is the one resolver (what a
path designates), :meth:`Store.reading_step` holds a step while it is read,
and the ``Directory`` read members give listing and prune one record per step
and per leftover on every store.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Dict, List, Optional, Protocol, Tuple, runtime_checkable

from lazyckpt.formats.names import MANIFEST

if TYPE_CHECKING:
    from lazyckpt.errors import CheckpointNotFoundError
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
    #: Whether bytes already written may be written again before :meth:`finish` at no
    #: extra cost (a file). An object's parts are uploaded once: rewriting one means
    #: keeping it in memory, so a foreign layout patches only what a reader needs there.
    rewrites_in_place: bool

    def pwrite_all(self, data: memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` (thread-safe; any order)."""

    def will_rewrite(self, offsets: List[int]) -> None:
        """The 4 KiB blocks at these offsets will be written again before
        :meth:`finish` (a foreign layout's checksum fields, patched at the end)."""

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

    def open_output(self, path: str, options: "Options", block_bytes: int) -> Output:
        """A new file of this save at ``path`` (:meth:`file_path`), written in
        ``block_bytes`` windows (as :meth:`Store.open_output`)."""

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

# ---------------------------------------------------------------------- records

# Plain data the read side gets from any store: what a path designates, the
# committed steps and the leftovers of a directory. Dataclasses, not protocols:
# a store fills them in, callers only read them.

@dataclass
class Located:
    """What a path designates (:meth:`Store.locate`)."""
    #: "file" (one data file), "step" (a committed step) or "directory" (a
    #: Checkpointer directory: its latest committed step is the one to read).
    kind: str
    #: The path, normalized by its store.
    path: str
    #: Where the step to read is ("step": the path itself or its committed save;
    #: "directory": its latest step); None for a file.
    step_path: Optional[str] = None
    #: That step's number where its name says it, else None.
    step: Optional[int] = None
    #: Committed steps, oldest first ("directory" with ``all_steps`` only, or
    #: where the index could not tell and the directory was listed).
    steps: List[int] = field(default_factory=list)
    #: The step is read where its commit left it before its last rename (a local
    #: commit between its record and its rename): it may move under the reader,
    #: which then locates it again.
    moving: bool = False


@dataclass
class StepRecord:
    """One committed step in a directory's listing (:meth:`Directory.step_records`)."""
    step: int
    #: Its name relative to the directory (``step_X``, or ``step_X/<save_id>``).
    name: str
    #: Where it is read from (:meth:`Directory.step_path`).
    path: str
    #: Bytes of everything it holds.
    bytes: int
    #: When its commit was written, where the listing says so without another
    #: request (an object's LastModified); None otherwise.
    mtime: Optional[float] = None


@dataclass
class Leftover:
    """A name in a checkpoint directory that is not a committed step."""
    name: str
    #: "saving" (a live save), "interrupted-save" (provably dead), "deleting",
    #: "abandoned" (superseded by a rollback), "small-tmp", "incomplete-step", "dead-writer",
    #: "prepared" (a node's save waiting for the job's decision, replicas=)
    kind: str
    bytes: int
    step: Optional[int] = None
    #: Its full address, where the name alone is not enough to reach it (an object prefix).
    path: Optional[str] = None
    #: Seconds since it was last written, where the store measures leftovers by age.
    age_s: Optional[float] = None

    def describe(self) -> str:
        if self.kind == "interrupted-save" and self.age_s is not None:
            return f"interrupted save: no {MANIFEST}, last written {self.age_s:.0f} s ago"
        return {"saving": "save in progress (leased)",
                "interrupted-save": "interrupted save (its lease expired)",
                "deleting": "interrupted delete",
                "abandoned": "abandoned: superseded by a save of an older step (rollback)",
                "small-tmp": "interrupted update of a small file",
                "dead-writer": "writer lease of a Checkpointer that died (unlocked, heartbeat expired)",
                "incomplete-step": f"not committed: no {MANIFEST}",
                "prepared": "prepared on this node for a job-wide commit (replicas=): the job decides "
                            "when its Checkpointers next open"}[self.kind]

    @property
    def removable(self) -> bool:
        """What a cleanup may remove without asking: provably dead leftovers."""
        return self.kind in ("interrupted-save", "deleting", "small-tmp", "dead-writer")


# ---------------------------------------------------------------------- directory

@runtime_checkable
class HeldStep(Protocol):
    """A committed step held for reading (:meth:`Store.reading_step`): while it
    is held, retention and prune in any process leave it alone."""

    #: The step's location, as given.
    path: str
    #: Its number where its name says it, else None.
    step: Optional[int]
    #: The Checkpointer directory it belongs to (the identity of its run).
    directory: str

    def read_manifest(self) -> Dict[str, Any]:
        """Its manifest, read under the hold (``CheckpointNotFoundError`` if none)."""

    def still_there(self) -> bool:
        """Whether the step is still committed; True when the store cannot say
        (then the caller's original error is the one to report)."""

    def deleted(self) -> "CheckpointNotFoundError":
        """The error that says the step was deleted while it was being read."""


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

    def apply_retention(self, policy: Any) -> List[int]:
        """Delete the steps ``policy`` (a ``lazyckpt.retention`` policy, an int for
        ``KeepLast``, or None: keep every step) does not keep -- as
        ``retention.plan`` decides: never the newest, never one a kept step
        refers to -- and the superseded steps unless ``retention.keeps_superseded``;
        a step being read stays until a later pass. Returns those deleted."""

    def reading(self, step: int) -> ContextManager[Any]:
        """Hold committed ``step`` while it is read or sent to another tier (not
        entered yet: ``with directory.reading(step)``); entering raises
        ``CheckpointNotFoundError`` if it is no longer committed."""

    def delete_step(self, step: int, even_if_read: bool = False) -> bool:
        """Delete one step; False (and kept) if a reader holds it, unless ``even_if_read``."""

    def clean_leftovers(self) -> List[str]:
        """Remove what is provably dead (expired saves, interrupted deletes); never data."""

    def locate_step(self, step: Optional[int], mark: Optional[bytes] = None) -> Optional[Tuple[int, str]]:
        """(step, where it is) for a committed step (None: the latest), or None;
        from the store's index where it can answer, without listing.
        ``mark``: :meth:`index_mark` as just read (not read again)."""

    def index_mark(self) -> bytes:
        """What every commit changes, read in one request (b"": nothing worth
        sharing, the lookup costs a few ``stat`` calls): a lookup made while it
        had these bytes still holds while it has them (loading/joblatest.py)."""

    def start_tidy(self) -> None:
        """At open: start the cleanup of leftovers (in the background where a
        listing grows with the steps kept)."""

    def tidy(self) -> List[str]:
        """After a commit: clean what needs another look (never data)."""

    def close(self) -> None:
        """Cancel what :meth:`start_tidy` started, without waiting for it."""

    def wait_for_frees(self, timeout: Optional[float] = None) -> bool:
        """Block until the steps :meth:`apply_retention` deleted are freed
        (where their removal runs after it returns); False if ``timeout`` ran
        out first."""

    def recover(self, wait: bool = True) -> List[int]:
        """Finish a commit a crash interrupted after its commit point (roll
        forward); returns the steps it superseded. Where a commit is one atomic
        publish (an object store's manifest), there is nothing to finish."""

    def acquire_writer(self, heartbeat_s: float, expiry_s: float, takeover: bool = False,
                       fence: Optional[str] = None) -> WriterLease:
        """Become this directory's one writer (refused with the holder's name).
        ``fence``: what this writer's save ids begin with (``<fence>-``), where the
        store fences a displaced writer by them (the lease's ``fence``)."""

    def pending(self, step: int, save_id: str, token: str) -> PendingStep:
        """A new save of ``step`` (nothing is created yet). ``save_id`` names it in
        the manifest; ``token`` makes its temporary name unique where the store
        names it by something else than ``save_id``."""

    def record_event(self, event: Any) -> None:
        """Record a commit event (``history.Event``) where this directory keeps its
        line of history (before the step it numbers becomes visible)."""

    def step_paths(self) -> Dict[int, str]:
        """Every committed step -> where it is read from, from one listing."""

    def listing(self) -> Tuple[Dict[int, str], List[Any]]:
        """(committed step -> its save id, the commit events recorded here as
        ``history.Event``s): what the line of history over two tiers is built
        from. A step whose save id cannot be read is left out of the first."""

    def save_path(self, step: int, save_id: str) -> str:
        """Where the committed save ``save_id`` of ``step`` is read from."""

    # The read side: what listing, prune and the study tools ask of a directory.

    def step_records(self) -> List[StepRecord]:
        """The committed steps with their sizes, oldest first (reads nothing else)."""

    def latest_file(self) -> Optional[int]:
        """What the advisory ``latest`` says, or None (missing or unreadable)."""

    def leftovers(self, expiry_s: Optional[float] = None) -> List[Leftover]:
        """What is here besides committed steps (reads only); a save counts as
        dead once older than ``expiry_s`` (default: the directory's lease expiry)."""

    def remove_leftovers(self, leftovers: List[Leftover]) -> Dict[str, Optional[str]]:
        """Remove these leftovers (of :meth:`leftovers`, removable or abandoned):
        name -> None when gone, or why it was kept. One that became live since
        it was listed stays where the store can tell."""

    def retention_plan(self, policy: Any) -> Tuple[List[int], List[int]]:
        """(steps ``policy`` does not keep, to delete newest first; older steps
        kept because a kept step refers to them)."""

    def retire_old(self, policy: Any) -> Tuple[List[int], List[int]]:
        """Apply :meth:`retention_plan`: (deleted, kept because referred to or
        being read)."""


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
    #: incremental references and replicas need a local directory), never the path's
    #: spelling.
    is_remote: bool = False
    #: Whether a step here may refer to bytes of earlier steps (incremental saves):
    #: a reader then resolves references in the step's directory. Only stores
    #: that write incremental steps say so (today the local file system).
    holds_references: bool = False

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

    @abc.abstractmethod
    def write_whole(self, path: str, data: bytes, options: "Options") -> None:
        """A small file at ``path`` in one piece (parents created): readers see
        the old content or the new, never a mix, and it is durable on return.
        What commits a framework's checkpoint that is not a Checkpointer step
        (DCP's ``.metadata``)."""

    # Whole files a framework names and rotates itself (Lightning's .ckpt files).

    @abc.abstractmethod
    def list_files(self, directory: str, options: "Options", recursive: bool = False) -> List[str]:
        """Sorted names of the files directly in ``directory`` (a prefix's objects
        one level down; ``recursive``: every file below it, as relative paths with
        ``/``); empty if there is none. One listing."""

    @abc.abstractmethod
    def exists(self, path: str, options: "Options") -> bool:
        """Whether something is at ``path`` (a file, a link, an object)."""

    @abc.abstractmethod
    def delete_file(self, path: str, options: "Options") -> None:
        """Remove what is at ``path``, if anything (a file, a link, a directory a
        framework wrote there, an object)."""

    @abc.abstractmethod
    def copy_file(self, source: str, dest: str, options: "Options") -> None:
        """Make ``dest`` a complete copy of the complete file ``source`` in one
        step (the old ``dest`` or the new one, never neither), durable on return;
        a link where the store has them, a server-side copy on an object store."""

    @abc.abstractmethod
    def read_whole(self, path: str, options: "Options", limit: int) -> bytes:
        """The bytes of the small file at ``path``; ``CheckpointNotFoundError``
        if there is none, ``CorruptCheckpointError`` if it is over ``limit`` bytes."""

    # The read side: the one resolver (what a path means), a step's manifest, a held step.

    @abc.abstractmethod
    def locate(self, path: str, options: "Options", empty_ok: bool = False, all_steps: bool = False) -> Located:
        """What ``path`` designates: one data file, a committed step, or a
        Checkpointer directory (and its latest step). Raises
        ``CheckpointNotFoundError`` if nothing is there, or (unless ``empty_ok``)
        a directory without a committed step. Reads no manifest. A directory's
        latest step comes from its index (a few ``stat`` calls or requests
        whatever the steps kept); ``all_steps``: list them too
        (``Located.steps``, a listing)."""

    @abc.abstractmethod
    def read_manifest(self, step_path: str, options: "Options") -> Dict[str, Any]:
        """The parsed manifest of the committed step at ``step_path``
        (``CheckpointNotFoundError`` if it has none)."""

    @abc.abstractmethod
    def reading_step(self, step_path: str, options: "Options",
                     step: Optional[int] = None) -> ContextManager[HeldStep]:
        """Hold the committed step at ``step_path`` while it is read (a shared
        lock, a reader lease): ``with store.reading_step(p, options) as held``.
        Raises ``CheckpointNotFoundError`` if it is not (or no longer) committed
        where the store can tell at once."""


#: The stores named by a URL scheme, asked in registration order
#: (``stores.for_path``). A store module registers its instance when imported.
URL_STORES: List[Store] = []


def register_store(store: Store) -> Store:
    """Make ``store`` claim the paths of its ``scheme`` (a new one, or replacing
    the store registered for it). Returns it."""
    if not store.scheme:
        raise ValueError(f"{type(store).__name__}: a registered store names its URL scheme")
    URL_STORES[:] = [s for s in URL_STORES if s.scheme != store.scheme] + [store]
    return store
