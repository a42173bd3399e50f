# Why one module of ~780 lines (a module above 600 lines says why): it is the one save
# engine. Handles, parts, the CommitStrategy interface, run_job and SaveEngine share one set of
# rules (ordering, the capture barrier, the error rule, leases, the exit policy: the docstring
# below), each written once here; the strategies, the writer and the capture have their own modules.
"""The save engine: every background save of lazyckpt runs here.

``Checkpointer``, the integrations (DeepSpeed, DCP staging, Lightning, the
Hugging Face Trainer) and the synchronous ``lazyckpt.save`` all hand their
work to this module, so a rule about ordering, barriers, errors, leases or
shutdown is written once.

A *job* is one checkpoint: one or more *parts* (a file to write, or a
staging copy), optionally a planner that decides what each file holds before
it is written (a Checkpointer step's references and dedup:
:mod:`lazyckpt.saving.planner`), and a :class:`CommitStrategy` that says where
the parts are written and how they become a checkpoint (single file: temp +
rename; a step directory, with the multi-rank two-phase commit; a DeepSpeed
tag; no commit for a DCP staging copy). One :class:`SaveEngine` has

* one FIFO queue of jobs, bounded by ``max_pending_saves`` (or skipping, with
  a warning, under ``queue_policy="skip"``);
* one capture thread that runs the jobs in order and exits when the queue is
  empty (the next save starts it again), so an idle engine holds no thread
  and an unreferenced one is garbage-collected, freeing its host cache;
* one handle type, :class:`SaveHandle`, and one error rule: a failure is
  stored, logged, and raised once -- by ``handle.wait()`` or by the next
  ``save()``/``wait()``/``wait_for_snapshot()`` -- as a ``CheckpointWriteError``
  naming the checkpoint and the cause;
* the capture barrier (:mod:`lazyckpt.saving.barrier`): optimizer pre-step hooks and
  a forward guard for persistent buffers that a training-mode forward mutates;
* an interpreter-exit policy: pending saves are drained before the
  interpreter's thread pools shut down (``exit_policy="drain"``), or cancelled
  with a warning naming them (``"warn"``); never silently dropped.
"""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures.thread  # noqa: F401  (its exit hook must be registered before ours)
import logging
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Union

import torch

from lazyckpt.errors import CheckpointError, CheckpointWriteError
from lazyckpt.knobs import Options
from lazyckpt.state.plancache import PendingFlat
from lazyckpt.state.providers import Flattened
from lazyckpt.storage.base import Output
from lazyckpt.storage.sidefiles import file_lease
from .barrier import CaptureBarrier
from .capture import DeviceCopier, device_guard
from .resources import Resources
from .tierstate import PERSISTENT, REPLICA, TierState
from .writer import Aborted, FileWriteJob, WriteStats

log = logging.getLogger("lazyckpt")


# --------------------------------------------------------------------------- handles


def _tier_view(tier: str, attribute: str, doc: str) -> property:
    """A read-only attribute of a handle: ``attribute`` of its state on ``tier``, or None."""
    def get(handle: "SaveHandle") -> Any:
        state = handle.tier_states.get(tier)
        return None if state is None else getattr(state, attribute)
    return property(get, doc=f"The {tier} tier: {doc}; None without it.")


class SaveHandle:
    """One requested checkpoint. ``wait()`` returns once it is committed and durable."""

    def __init__(self, name: str, step: Optional[int] = None, path: Optional[str] = None,
                 t0: Optional[float] = None):
        #: What the checkpoint is called in messages ("step 5", a path, a tag).
        self.name = name
        self.step = step
        #: Where the checkpoint appears once committed (a file or a directory), if known.
        self.path = path
        self.snapshot_done = threading.Event()
        self._done = threading.Event()
        self.error: Optional[CheckpointError] = None
        self.skipped = False
        self.cancelled = False
        self.reported = False
        #: Seconds the caller spent inside save().
        self.blocking_s = 0.0
        #: Seconds the training spent waiting at the capture barrier for this save
        #: (``wait_for_snapshot``, the optimizer and forward hooks); complete once captured.
        self.barrier_wait_s = 0.0
        #: Seconds from save() until every byte was copied out of the live state.
        self.capture_s = 0.0
        #: Seconds from save() until committed and durable.
        self.flush_s = 0.0
        #: Bytes in the checkpoint's data file(s).
        self.bytes = 0
        self._t0 = time.perf_counter() if t0 is None else t0
        #: True where the commit itself is on persistent storage (an s3:// Checkpointer).
        self.persistent = False
        #: Where this save stands on each tier beyond the local commit, by tier:
        #: PERSISTENT (Checkpointer(persist=)), REPLICA (Checkpointer(replicas=k)).
        #: Attached and ended by the tier's drain (track_tier); read through the properties below.
        self.tier_states: Dict[str, TierState] = {}

    def done(self) -> bool:
        return self._done.is_set()

    @property
    def gbps(self) -> float:
        return self.bytes / self.flush_s / 1e9 if self.flush_s else 0.0

    def wait(self, timeout: Optional[float] = None, persisted: bool = False) -> "SaveHandle":
        """Block until committed and durable; raise its error if it failed.

        ``persisted=True`` also waits for the persistent tier
        (``Checkpointer(persist=...)``) to hold this step -- or, when a newer
        step superseded it in the drain queue before its upload started, that
        newer step (``persist_state`` says so) -- and raises a failed upload."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._done.wait(timeout):
            raise CheckpointError(f"{self.name}: not committed within {timeout} s", step=self.step)
        if self.error is not None:
            self.reported = True            # raised here: the engine will not raise it again
            raise self.error
        if persisted:
            mine = self.tier_states.get(PERSISTENT)
            if mine is None:
                if self.persistent:
                    return self
                raise CheckpointError(f"{self.name}: there is no persistent tier to wait for (pass "
                                      f"persist= to the Checkpointer)", step=self.step)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            final = mine.final(left)
            if final is None:
                raise CheckpointError(f"{self.name}: not persisted within {timeout} s", step=self.step)
            final.raise_error()       # marked reported: the Checkpointer's wait() will not raise it again
        return self

    def track_tier(self, tier: str) -> TierState:
        """A tier's drain queued this save: its state there, pending until the drain ends it."""
        state = self.tier_states[tier] = TierState(self._t0)
        return state

    # What the docs and benchmarks read of each tier: read-only views of its TierState
    # (None where the save was never queued on that tier).
    persist_state = _tier_view(PERSISTENT, "state", '"pending", "persisted", "failed", "superseded by step N" '
                                                   'or "abandoned"')
    persist_error = _tier_view(PERSISTENT, "error", "why the upload failed")
    persisted_s = _tier_view(PERSISTENT, "seconds", "seconds from save() until uploaded (or failed)")
    persist_url = _tier_view(PERSISTENT, "where", "the uploaded object's URL")
    replica_state = _tier_view(REPLICA, "state", '"pending", "replicated", "failed: ...", "superseded by step N" '
                                                'or "abandoned"')
    replicated_s = _tier_view(REPLICA, "seconds", "seconds from save() until replicated (or failed)")

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> None:
        if not self.snapshot_done.wait(timeout):
            raise CheckpointError(f"{self.name}: capture not finished within {timeout} s", step=self.step)

    def stats(self) -> Dict[str, Any]:
        out = {"step": self.step, "blocking_s": self.blocking_s, "capture_s": self.capture_s,
               "flush_s": self.flush_s, "bytes": self.bytes, "gbps": self.gbps}
        if self.persist_state is not None:
            # When each tier had it: seconds from save().
            out.update(persist=self.persist_state, tiers={"local": self.flush_s, "persistent": self.persisted_s},
                       persist_url=self.persist_url)
        if self.replica_state is not None:
            out.setdefault("tiers", {"local": self.flush_s})["replica"] = self.replicated_s
            out["replicas"] = self.replica_state
        return out

    def __repr__(self) -> str:
        state = "failed" if self.error else "committed" if self.done() else "pending"
        return f"SaveHandle({self.name}, {state})"


# --------------------------------------------------------------------------- parts


def storage_pointers(tensors: Any) -> frozenset:
    """The storage addresses of ``tensors``. Called by the forward guard on the
    training thread: never raises (a gathered save may hold a sparse tensor
    where its plan had a dense one; its resolve walks it in full)."""
    pointers = set()
    for t in tensors:
        try:
            p = t.untyped_storage().data_ptr()
        except Exception:           # no storage (sparse, mkldnn): not a module buffer's
            continue
        if p:
            pointers.add(p)
    return frozenset(pointers)


class Part:
    """One unit of a job's work, run on the capture thread."""

    def __init__(self) -> None:
        self.captured = threading.Event()
        self._pointers: Optional[frozenset] = frozenset()

    @property
    def pointers(self) -> frozenset:
        """Storage addresses this part reads from the live state, for the
        forward guard: found when first asked (by the guard, on the training
        thread, only if a module with persistent buffers runs forward before
        the capture is done), so that ``save()`` does not pay for it."""
        pointers = self._pointers
        if pointers is None:
            pointers = self._pointers = self._find_pointers()
        return pointers

    def _find_pointers(self) -> frozenset:
        return frozenset()

    def release_pointers(self) -> None:
        """Captured: the live state is no longer read."""
        self._pointers = frozenset()

    def run(self, job: "Job", resources: Resources, options: Options) -> None:
        raise NotImplementedError


class FilePart(Part):
    """A file of flattened state, written through the host cache."""

    def __init__(self, flat: Flattened, metadata: Dict[str, Any], events: Optional[Dict[Any, Any]] = None,
                 final_path: Optional[str] = None, layout: Any = None):
        super().__init__()
        #: A foreign file layout (torch zip, safetensors: lazyckpt/saving/foreign_formats.py), else None.
        self.layout = layout
        #: A PendingFlat (a save gathered along a plan) is resolved first thing in run().
        self.flat: Optional[Union[Flattened, PendingFlat]] = flat
        self.metadata = metadata
        self.events = events or {}
        self.final_path = final_path
        self.shards = flat.shards
        self.digest = flat.replicated_digest
        self.path: Optional[str] = None
        self.stats: Optional[WriteStats] = None
        #: After run(): the file's footer entries and format version.
        self.entries: List[Any] = []
        self.version = 1
        self.block_bytes = 0
        self._live: Optional[Union[Flattened, PendingFlat]] = flat     # until captured
        self._pointers = None

    def _find_pointers(self) -> frozenset:
        flat = self._live
        return storage_pointers(flat.live_tensors()) if flat is not None else frozenset()

    def release_pointers(self) -> None:
        self._live = None
        super().release_pointers()

    def run(self, job: "Job", resources: Resources, options: Options) -> None:
        flat = self.flat
        if isinstance(flat, PendingFlat):
            flat = self.flat = flat.resolve()
            self.digest = flat.replicated_digest
        if job.planner is not None:
            job.planner.plan(job, self, resources)
        self.path = job.strategy.part_path(job, self)
        writer = FileWriteJob(self.path, flat.tree, flat.sources, self.metadata, options,
                              resources.cache_for(flat.sources), resources.writers, resources.serializer,
                              capture_events=self.events, on_captured=lambda: job.captured(self),
                              align_size=getattr(job.strategy, "align_file_size", False), layout=self.layout,
                              open_output=job.strategy.part_output)
        job.current = writer
        try:
            self.stats = writer.run()
        finally:
            job.current = None
            self.flat = self.layout = None      # the live state is no longer needed
        self.entries, self.version, self.block_bytes = writer.entries, writer.version, writer.block
        job.handle.bytes += self.stats.file_bytes


class CopyPart(Part):
    """Copies (host destination, live source) tensor pairs of equal shape and
    dtype: a staging copy."""

    def __init__(self, pairs: List[tuple], events: Optional[Dict[Any, Any]] = None):
        super().__init__()
        self.pairs = pairs
        self.events = events or {}
        self._pointers = frozenset(src.untyped_storage().data_ptr() for _, src in pairs)

    def run(self, job: "Job", resources: Resources, options: Options) -> None:
        copier = DeviceCopier(self.events)
        try:
            for dst, src in self.pairs:
                if job.cancelled:
                    raise Aborted("cancelled")
                if src.is_contiguous() and src.numel():
                    flat = dst.reshape(-1).view(torch.uint8)
                    copier.copy(flat.numpy(), flat, src.reshape(-1).view(torch.uint8))
                elif src.numel():
                    with device_guard(src.device):
                        dst.copy_(src)  # strided: torch's copy, synchronous
                job.handle.bytes += dst.numel() * dst.element_size()
        finally:
            copier.synchronize()        # on every path: no copy in flight into the buffer
            self.pairs = []
        job.captured(self)


# --------------------------------------------------------------------------- commit strategies


class CommitStrategy:
    """How a job's parts become a checkpoint. Runs on the thread running the
    job. Call order (with the job's planner, if any, :mod:`lazyckpt.saving.planner`):
    ``begin``; per part ``planner.plan`` then ``part_path`` (before writing) and
    ``part_done``; then ``commit``, or ``abort`` then ``planner.abort`` on any
    failure; once committed ``planner.committed``, the job's ``on_committed``,
    then ``after_commit`` (errors of these three are only logged: the
    checkpoint is committed)."""

    #: Where the checkpoint lives, for error messages.
    path: Optional[str] = None

    def begin(self, job: "Job") -> None:
        pass

    def part_path(self, job: "Job", part: FilePart) -> str:
        raise NotImplementedError

    def part_output(self, path: str, options: Options, block_bytes: int) -> Output:
        """The file at ``path`` (what :meth:`part_path` returned) opened for
        writing in ``block_bytes`` windows, on the store the strategy writes to
        (the engine never looks a path's store up)."""
        raise NotImplementedError

    def part_done(self, job: "Job", part: Part) -> None:
        pass

    def commit(self, job: "Job") -> None:
        pass

    def abort(self, job: "Job", error: BaseException) -> None:
        pass

    def after_commit(self, job: "Job") -> None:
        pass

    def failure_message(self, job: "Job", cause: str) -> str:
        return f"{job.handle.name}: checkpoint save failed: {cause}"


class NoCommit(CommitStrategy):
    """For parts that only capture (a staging copy): nothing to commit."""


@dataclass
class Job:
    handle: SaveHandle
    strategy: CommitStrategy
    parts: List[Part]
    sealed: bool = True
    cancelled: bool = False
    current: Optional[FileWriteJob] = None
    #: Leases on the files it writes (anything with ``release()``), released when it ends.
    leases: List[Any] = field(default_factory=list)
    #: Held until the job ends: e.g. read locks on the steps it refers to.
    holds: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    engine: Any = None                 # weak: the engine tracking captures, if any
    #: Called once the job ended (its handle is done), on the job's thread.
    on_end: Optional[Callable[["Job"], None]] = None
    #: Decides what each file part holds before it is written (a saving.planner.SavePlanner), or None.
    planner: Any = None
    #: Called once committed, before the strategy's after_commit (its retention): the
    #: submitter hands the committed checkpoint on (the Checkpointer's tiers).
    on_committed: Optional[Callable[["Job"], None]] = None

    def captured(self, part: Part) -> None:
        part.captured.set()
        if self.sealed and all(p.captured.is_set() for p in self.parts):
            self.handle.capture_s = time.perf_counter() - self.handle._t0
        engine = self.engine() if self.engine is not None else None
        if engine is not None:
            engine._untrack(part)

    def lease(self, path: str, heartbeat_s: float) -> Any:
        """A lease on ``path`` (a temporary this job writes), held until the job ends."""
        lease = file_lease(path, heartbeat_s)
        self.leases.append(lease)
        return lease

    def cancel(self) -> None:
        self.cancelled = True
        writer = self.current
        if writer is not None:
            writer.cancel()


def run_job(job: Job, resources: Resources, options: Options,
            next_part: Optional[Callable[[Job, int], Optional[Part]]] = None) -> None:
    """Run ``job`` to its end on the calling thread: parts, commit, tidy-up. A
    failure is recorded on the handle (never raised here) before the barrier
    lets the caller go on, so the barrier can raise it."""
    handle = job.handle
    next_part = next_part or (lambda j, i: j.parts[i] if i < len(j.parts) else None)
    committed = False
    try:
        job.strategy.begin(job)
        i = 0
        while True:
            part = next_part(job, i)
            if part is None:
                break
            i += 1
            if job.cancelled:
                raise Aborted("cancelled by close()")
            part.run(job, resources, options)
            job.strategy.part_done(job, part)
        if job.cancelled:
            raise Aborted("cancelled by close()")
        job.strategy.commit(job)
        handle.flush_s = time.perf_counter() - handle._t0
        committed = True
    except BaseException as exc:
        _record_failure(job, exc)
        _abort(job, exc)
    finally:
        for part in job.parts:
            if not part.captured.is_set():
                job.captured(part)
        handle.snapshot_done.set()
        if not handle.flush_s:
            handle.flush_s = time.perf_counter() - handle._t0
        for lease in job.leases:
            lease.release()
        job.leases.clear()
        job.holds.close()
    if committed:
        try:
            if job.planner is not None:
                job.planner.committed(job)      # what the next plan builds on
            if job.on_committed is not None:
                job.on_committed(job)
            job.strategy.after_commit(job)
        except Exception as exc:
            # Committed: failing to tidy up must not report it as lost.
            log.warning("lazyckpt: %s committed, but tidying up after it failed: %s: %s", handle.name,
                        type(exc).__name__, exc)
        if not isinstance(job.strategy, NoCommit):
            log.info("lazyckpt: %s committed: %.1f MB, blocking %.2f ms, capture %.3f s, durable %.3f s "
                     "(%.2f GB/s)", handle.name, handle.bytes / 1e6, handle.blocking_s * 1e3,
                     handle.capture_s, handle.flush_s, handle.gbps)


def _abort(job: Job, exc: BaseException) -> None:
    """After a failure: the strategy cleans up (and fails its round on the other
    ranks), then the planner (its own round); one failing does not stop the other."""
    aborts = [job.strategy.abort] + ([job.planner.abort] if job.planner is not None else [])
    for abort in aborts:
        try:
            abort(job, exc)
        except Exception as cleanup:
            log.warning("lazyckpt: %s: cleaning up after the failure failed too: %s", job.handle.name, cleanup)


def _record_failure(job: Job, exc: BaseException) -> None:
    handle = job.handle
    if isinstance(exc, Aborted) or job.cancelled:
        handle.cancelled = True
        handle.error = CheckpointError(f"{handle.name}: save cancelled by close()", step=handle.step,
                                       path=job.strategy.path)
        handle.reported = True          # a cancellation the caller asked for is not a failure
        return
    cause = f"{type(exc).__name__}: {exc}"
    error = CheckpointWriteError(job.strategy.failure_message(job, cause), step=handle.step,
                                 path=job.strategy.path)
    error.__cause__ = exc
    error.handle = handle               # type: ignore[attr-defined]
    handle.error = error
    engine = job.engine() if job.engine is not None else None
    if engine is not None:
        engine._add_error(error)        # before the barrier lets anyone go on, so it raises this
    log.error("lazyckpt: %s", error)


def run_now(strategy: CommitStrategy, parts: List[Part], resources: Resources, options: Options,
            name: str) -> SaveHandle:
    """Run a job synchronously on the caller's thread (the functional save, DCP's
    write_data); raise its failure. KeyboardInterrupt and SystemExit pass through."""
    handle = SaveHandle(name, path=strategy.path)
    job = Job(handle, strategy, parts)
    with resources.save_lock:
        run_job(job, resources, options)
    handle._done.set()
    if handle.error is not None:
        cause = handle.error.__cause__
        if cause is not None and not isinstance(cause, Exception):
            raise cause
        handle.reported = True
        raise handle.error
    return handle


# --------------------------------------------------------------------------- the engine

_LIVE: "weakref.WeakSet[SaveEngine]" = weakref.WeakSet()


class SaveEngine:
    """A queue of jobs, one capture thread, the barrier, and the error rule."""

    def __init__(self, options: Options, *, guard_buffers: bool = True):
        self.options = options
        self.resources = Resources(options)
        self.barrier = CaptureBarrier(self, guard_buffers)
        self._cond = threading.Condition()
        self._jobs: Deque[Job] = collections.deque()
        self._errors: List[CheckpointError] = []        # failures not raised yet, oldest first
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._tracked: List[Part] = []                  # parts not captured yet
        self._capturing: Optional[frozenset] = frozenset()
        self._tracked_generation = 0
        #: Seconds every caller of wait_for_snapshot() has waited in all (lazyckpt/saving/costs.py).
        self.waited_s = 0.0
        _LIVE.add(self)
        # An engine dropped without close() (its owner was collected) frees its cache
        # and removes its hooks once idle: nothing of it keeps it alive but its thread.
        self._finalizer = weakref.finalize(self, _release, self.resources, self.barrier)

    # ---------------------------------------------------------------- submitting

    def submit(self, strategy: CommitStrategy, parts: List[Part], *, name: str, step: Optional[int] = None,
               sealed: bool = True, t0: Optional[float] = None,
               on_end: Optional[Callable[[Job], None]] = None, planner: Any = None,
               on_committed: Optional[Callable[[Job], None]] = None) -> Job:
        """Queue a job; returns it at once (``job.handle`` is its handle). An
        unsealed job takes more parts (``add_part``) until ``seal``."""
        handle = SaveHandle(name, step, strategy.path, t0)
        job = Job(handle, strategy, list(parts), sealed, engine=weakref.ref(self), on_end=on_end,
                  planner=planner, on_committed=on_committed)
        with self._cond:
            self._check_open()
            # The job in flight plus max_pending_saves waiting behind it.
            while len(self._jobs) > self.options.max_pending_saves:
                if self.options.queue_policy == "skip":
                    warnings.warn(f"lazyckpt: {name} skipped: {len(self._jobs)} saves already queued "
                                  f"(queue_policy='skip')", RuntimeWarning, stacklevel=3)
                    handle.skipped = True
                    handle.snapshot_done.set()
                    handle._done.set()
                    handle.blocking_s = time.perf_counter() - handle._t0
                    return job
                self._cond.wait(0.1)
                self._raise_errors_locked()
            for part in job.parts:
                self._track(part)
            # Set before the job is visible to the capture thread (its commit records it);
            # updated below to include arming the barrier.
            handle.blocking_s = time.perf_counter() - handle._t0
            self._jobs.append(job)
            self._ensure_thread()
            self._cond.notify_all()
        self.barrier.arm()
        handle.blocking_s = time.perf_counter() - handle._t0
        return job

    def add_part(self, job: Job, part: Part) -> None:
        with self._cond:
            if job.sealed:
                raise CheckpointError(f"{job.handle.name}: no part can be added after it was sealed")
            self._track(part)
            job.parts.append(part)
            self._cond.notify_all()
        self.barrier.arm()

    def seal(self, job: Job) -> None:
        with self._cond:
            job.sealed = True
            self._cond.notify_all()

    # ---------------------------------------------------------------- barrier and waits

    def pending(self) -> List[SaveHandle]:
        with self._cond:
            return [job.handle for job in self._jobs]

    def has_pending(self) -> bool:
        """Whether a save is queued or in flight; lock-free (a hint: the iteration clock asks every step)."""
        return bool(self._jobs)

    def pending_jobs(self) -> List[Job]:
        with self._cond:
            return list(self._jobs)

    def capturing_anything(self) -> bool:
        """Whether a pending job still reads the live state."""
        return any(not p.captured.is_set() for job in self.pending_jobs() for p in job.parts)

    def wait_for_snapshot(self, timeout: Optional[float] = None, raise_errors: bool = True) -> None:
        """Block until every part queued so far has been captured (copied out of the live state)."""
        for job in self.pending_jobs():
            since = None
            for part in list(job.parts):
                if since is None and not part.captured.is_set():
                    since = time.perf_counter()         # the training waits: a cost of this save
                if not part.captured.wait(timeout):
                    raise CheckpointError(f"{job.handle.name}: capture not finished within {timeout} s",
                                          step=job.handle.step)
            if since is not None:
                waited = time.perf_counter() - since
                job.handle.barrier_wait_s += waited
                self.waited_s += waited
        if raise_errors:
            self.raise_errors()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every pending job has ended; raise the oldest failure not yet raised."""
        for handle in self.pending():
            if not handle._done.wait(timeout):
                raise CheckpointError(f"{handle.name}: not committed within {timeout} s", step=handle.step)
        self.raise_errors()

    def raise_errors(self) -> None:
        with self._cond:
            self._raise_errors_locked()

    def _raise_errors_locked(self) -> None:
        while self._errors:
            error = self._errors.pop(0)
            handle = getattr(error, "handle", None)
            if handle is not None and handle.reported:
                continue
            if handle is not None:
                handle.reported = True
            raise error

    def _add_error(self, error: CheckpointError) -> None:
        with self._cond:
            self._errors.append(error)

    @property
    def capturing(self) -> frozenset:
        """Storage addresses of the live state that pending captures still read
        (computed when first asked after a change: see ``Part.pointers``)."""
        capturing = self._capturing
        if capturing is None:
            with self._cond:
                parts, generation = list(self._tracked), self._tracked_generation
            capturing = frozenset().union(*(p.pointers for p in parts))
            with self._cond:
                if generation == self._tracked_generation:    # else a newer change recomputes it
                    self._capturing = capturing
        return capturing

    def _track(self, part: Part) -> None:       # under self._cond
        self._tracked.append(part)
        self._tracked_generation += 1
        self._capturing = None

    def _untrack(self, part: Part) -> None:
        with self._cond:
            if part in self._tracked:
                self._tracked.remove(part)
            self._tracked_generation += 1
            self._capturing = None
            part.release_pointers()

    # ---------------------------------------------------------------- the capture thread

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this checkpointer is closed")

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lazyckpt-capture", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:          # idle: exit; the next submit starts a new thread
                    self._thread = None
                    self._cond.notify_all()
                    return
                job = self._jobs[0]
            run_job(job, self.resources, self.options, self._next_part)
            with self._cond:
                self._jobs.popleft()
                job.handle._done.set()
                self._cond.notify_all()
            if job.on_end is not None:
                try:
                    job.on_end(job)
                except Exception as exc:
                    log.warning("lazyckpt: %s: %s", job.handle.name, exc)
            del job

    def _next_part(self, job: Job, index: int) -> Optional[Part]:
        with self._cond:
            while index >= len(job.parts) and not job.sealed and not job.cancelled:
                self._cond.wait()
            return job.parts[index] if index < len(job.parts) else None

    # ---------------------------------------------------------------- closing

    def cancel_pending(self) -> None:
        with self._cond:
            for job in self._jobs:
                job.cancel()
                job.sealed = True
            self._cond.notify_all()

    def seal_all(self) -> None:
        """No part will come any more: an open job (a DeepSpeed tag) ends with
        the parts it has."""
        with self._cond:
            for job in self._jobs:
                job.sealed = True
            self._cond.notify_all()

    def close(self, cancel: bool = False, raise_errors: bool = True) -> None:
        """Drain (or cancel) pending jobs, stop the thread, remove the hooks and
        free the cache. Raises the oldest failure not yet raised."""
        if self._closed:
            return
        try:
            self.cancel_pending() if cancel else self.seal_all()
            for handle in self.pending():
                handle._done.wait()
        finally:
            with self._cond:
                self._closed = True
                thread = self._thread
                self._cond.notify_all()
            if thread is not None and thread is not threading.current_thread():
                thread.join()
            self._finalizer()           # hooks removed, pools stopped, cache freed
            _LIVE.discard(self)
        if raise_errors:
            self.raise_errors()

    @property
    def closed(self) -> bool:
        return self._closed

    def _at_exit(self) -> None:
        pending = [h for h in self.pending() if not h.done()]
        if pending:
            self.seal_all()
            if self.options.exit_policy == "drain":
                log.info("lazyckpt: interpreter exit: finishing %d pending save(s): %s", len(pending),
                         ", ".join(h.name for h in pending))
            else:
                self.cancel_pending()
            for handle in pending:
                handle._done.wait()
            lost = [h.name for h in pending if h.error is not None]
            if lost and self.options.exit_policy != "drain":
                message = (f"lazyckpt: interpreter exit with saves pending: {', '.join(lost)} lost "
                           f"(exit_policy='warn'; 'drain' would have waited for them)")
                warnings.warn(message, RuntimeWarning, stacklevel=1)
                log.warning("%s", message)
        # Join the capture thread too: a handle is done before that daemon thread
        # has dropped the job (freeing tensors, running its end callback), and
        # native torch code still running while the interpreter finalizes can
        # abort the process ("terminate called without an active exception",
        # seen once in CI with exit_policy="warn").
        self.close(raise_errors=False)


def _release(resources: Resources, barrier: CaptureBarrier) -> None:
    barrier.close()
    resources.close(wait=threading.current_thread() not in _pool_threads(resources))


def _pool_threads(resources: Resources) -> set:
    out = set()
    for pool in (resources.writers, resources.readers, resources.serializer):
        out |= set(getattr(pool, "_threads", ()))
    return out


def _drain_at_exit() -> None:
    for engine in list(_LIVE):
        try:
            engine._at_exit()
        except Exception as exc:            # never let one engine keep the others from draining
            log.error("lazyckpt: at interpreter exit: %s", exc)


# Runs in threading._shutdown, before concurrent.futures stops accepting work
# (its hook was registered first, and these run in reverse order).
try:
    threading._register_atexit(_drain_at_exit)      # type: ignore[attr-defined]
except AttributeError:                              # pragma: no cover (CPython < 3.9)
    import atexit
    atexit.register(_drain_at_exit)
