"""Checkpointer: a directory of committed checkpoints, saved asynchronously.

A thin public class over the save engine (:mod:`lazyckpt.saving.engine`: queue,
capture thread, barrier, errors), the step-directory commit
(:class:`lazyckpt.saving.commit.StepCommit`, two-phase across ranks) and the
directory layout (:mod:`lazyckpt.storage.layout`: names, listing, ``latest``,
retention, leftovers, leases). See docs/FORMAT.md §11 for the layout.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from lazyckpt.formats.manifest import check_metadata
from lazyckpt.loading.joblatest import JobLatest
from lazyckpt.loading.loader import load_step
from lazyckpt.loading.request import KeySpec, LoadRequest, MapLocation
from lazyckpt.loading.restore import RestoreHandle
from lazyckpt.loading.verify import verify
from lazyckpt.saving.capture import record_events
from lazyckpt.saving.commit import StepCommit
from lazyckpt.saving.engine import FilePart, Job, SaveEngine, SaveHandle
from lazyckpt.saving.jobcommit import resolve_prepared
from lazyckpt.saving.planner import StepPlanner
from lazyckpt.state.plancache import PlanCache
from lazyckpt.storage.base import WriterLease
from lazyckpt.tiers.line import Line
from lazyckpt.tiers.replicas import restore as restore_replicas
from .distributed import depart, refuse
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError
from .lineage import abandoned
from .builder import assemble
from .options import IO, Distributed, Incremental, LazyckptDeprecationWarning, Persist, Replicas, settle
from .schedule import SaveSchedule
from . import retention

log = logging.getLogger("lazyckpt")


class Checkpointer:
    """Saves checkpoints of a training run into ``directory``, asynchronously.

    ``save()`` returns at once: it walks the state (no data copied) and queues
    it. A background thread copies the state's bytes into a bounded host
    cache (``host_cache_bytes``: an int or "2GiB"; default: sized to the first
    state), writer threads flush it to disk, and the checkpoint is committed
    (fsync, rename) when complete. ``attach(optimizer)`` makes every
    ``optimizer.step()`` wait until the pending captures have copied their
    data; with ``IO(guard_buffers=True)`` (default) a training-mode forward of
    a module whose persistent buffers are being captured (BatchNorm) waits
    too. See docs/ARCHITECTURE.md for the contract.

    The options come in groups (lazyckpt/options.py): ``keep`` (retention: an
    int or a policy), ``interval``/``preemption`` (when to save:
    ``should_save(step)``), ``persist=Persist(url, ...)`` (a persistent tier),
    ``replicas=Replicas(k, ...)`` (copies on partner nodes),
    ``incremental=Incremental(...)``, ``distributed=Distributed(...)``,
    ``io=IO(...)``. The old flat keywords (``keep_last=``, ``persist_to=``,
    ``writer_threads=``, ...) still work, each with a DeprecationWarning naming
    its new spelling; any other keyword is a TypeError.

    With ``incremental=True`` (= ``"content"``; ``Incremental(full_every=)``) a
    tensor whose bytes are unchanged since the previous committed step (block
    checksums compared at save time; ``"version-counters"`` trusts torch's
    counters instead and misses fused optimizers and more) is not written
    again: the new step refers to the earlier bytes, and retention keeps every
    step a kept step refers to (see lazyckpt/saving/incremental.py).

    Steps form one line of history: saving step S supersedes every committed
    step >= S (a run resumed from an older step abandons the newer ones; they
    are deleted under a ``keep`` policy, kept aside as ``.abandoned-*`` with
    ``keep=None``), so the latest step is always the most recently committed one.

    Under torch.distributed (an initialized default group) creating it and
    every ``save()`` are collective: each rank writes its own file and the
    step commits when all have (``Distributed(commit_timeout=)`` bounds the
    wait for a dead rank). ``Distributed(identical_keys=)`` names top-level
    keys identical on every rank (DDP), written once; ``"auto"`` finds them by
    content (keys whose bytes agree on every rank are written once, the others
    per rank, checked at every save); left unset, the first commit warns if it
    finds identical keys, with the bytes naming them would save.
    ``Distributed(process_group=False)`` makes it local to this process.
    """

    def __init__(self, directory: Union[str, "os.PathLike[str]"], *, keep: Any = None,
                 host_cache_bytes: Union[None, int, str] = None, interval: Any = None, preemption: Any = False,
                 persist: Union[None, str, Persist] = None, replicas: Union[None, int, Replicas] = None,
                 incremental: Union[bool, str, Incremental] = False, distributed: Optional[Distributed] = None,
                 io: Optional[IO] = None, **deprecated: Any):
        # The arguments checked and in their groups (lazyckpt/options.py; the old flat spellings
        # warn there, naming their new one), what it is made of (lazyckpt/builder.py); then it
        # opens the directory.
        groups = settle(keep=keep, host_cache_bytes=host_cache_bytes, interval=interval,
                        preemption=preemption, persist=persist, replicas=replicas, incremental=incremental,
                        distributed=distributed, io=io, deprecated=deprecated, stacklevel=3)
        parts = assemble(directory, groups)
        #: The retention policy (lazyckpt.retention; None: keep every step).
        self.keep = parts.keep
        self.options = parts.options
        #: The store the directory is on (its one lookup: the tiers and loads get it from here).
        self.store = parts.store
        #: Whether this directory is itself on an object store (no local tier).
        self.on_object_store = parts.on_object_store
        self.directory = parts.directory
        self.layout = parts.layout
        #: Top-level keys identical on every rank (DDP): each entry written by one rank.
        #: "auto": found by content (lazyckpt/saving/autorep.py); unset: a warning names them.
        self.replicated: Any = parts.replicated
        #: Replicas on partner nodes (lazyckpt/tiers/replicas.py): the directory is node-local and
        #: each node's ranks commit their own steps in it (the node is the commit group).
        self.topology = parts.topology
        self._dist = parts.dist
        self._replicas = parts.replicas
        if self._replicas is not None:
            self._replicas.abandoned = self._abandoned_locally
        #: Every node's save commits only once every node has it prepared (saving/jobcommit.py).
        self._job = parts.job
        self._auto = parts.auto
        self._calls = 0
        #: The last save's walk, reused while the state keeps its structure (lazyckpt/state/plancache.py).
        self._plans = PlanCache()
        #: Incremental checkpoints: what this rank's last committed step holds.
        self._incremental = parts.incremental
        self._engine = parts.engine
        #: What each save cost the training, recorded in its manifest (lazyckpt/saving/costs.py).
        self._costs = parts.costs
        #: The persistent tier committed steps drain to (persist=), or None.
        self.persistent = parts.persistent
        #: The line of history (lazyckpt/tiers/line.py): numbers commits, tells live from abandoned
        #: saves across the local record, the manifests and the persistent tier's events.
        self.line = parts.line
        #: One writer per directory: the lease is taken by the first save() (a Checkpointer
        #: that only loads never needs it), held by the commit group's coordinator.
        self._takeover = groups.distributed.takeover
        self._writer: Optional[WriterLease] = None
        #: Where the last load() read from: {"step", "tier", "path"}.
        self.loaded_from: Optional[Dict[str, Any]] = None
        if self._dist.coordinator:
            # A commit a crash interrupted is finished first (its record is its commit point;
            # a commit in progress elsewhere finishes its own), then only what is provably
            # dead (leases expired) is removed: never another process's live save.
            self.layout.recover(wait=False)
        #: The latest step as the coordinator found it at open, for every rank (an object
        #: store under torch.distributed: one lookup for the job, loading/joblatest.py).
        self._latest_at_open = JobLatest(self.layout, self._dist, shared=self.on_object_store)
        if self._replicas is not None:
            # Collective: a save a crash left prepared on some node is committed on every
            # node if any node committed it, else discarded on every node.
            self._job.high = resolve_prepared(self.layout, self.topology.local_rank, self._replicas.group,
                                              self.line)
        if self._dist.coordinator:
            self.layout.start_tidy()
        #: The latest local step re-enqueued for the persistent tier at start (its upload
        #: failed or never ran before the last run ended), or None.
        self.resumed_drain: Optional[SaveHandle] = None
        #: The restored step replicated anew after a load() that brought a lost node back, or None.
        self.restored_replication: Optional[SaveHandle] = None
        if self.persistent is not None:
            # The outbox's durable copy is the local record (docs/RELIABILITY.md).
            self.persistent.local_events = self.line.local_events
            self.persistent.local_events_above = self.line.local_events_above
            self.persistent.abandoned = self._abandoned_locally
            if self._replicas is None:
                self._resume_drain()
            elif self._dist.coordinator:
                self.persistent.open_outbox()
        #: When to save (lazyckpt/schedule.py): interval= and preemption= (signal handlers installed
        #: last, once nothing above can fail). Every rank of the job saves the same step: under
        #: replicas= the world, not this node's commit group, agrees.
        self._schedule = SaveSchedule(groups.interval, groups.preemption,
                                      dist=self._replicas.world if self._replicas is not None else self._dist)

    # ------------------------------------------------------------------ saving

    def save(self, state: Any, step: int, metadata: Optional[Dict[str, Any]] = None) -> SaveHandle:
        """Queue a checkpoint of ``state`` as it is now; return at once.

        The checkpoint holds the values ``state`` had at this call, provided
        nothing modifies its tensors in place -- their values or their metadata
        (``resize_``, ``set_``, ``requires_grad_``) -- before ``wait_for_snapshot()``
        returns (``attach(optimizer)`` calls it before every step; the forward
        guard covers persistent buffers). Python objects that are pickled must
        not be mutated before then either. With several ranks, a call refused
        here (bad argument, an earlier failure raised) fails this step on
        every rank at once; the next call commits normally.
        """
        t0 = time.perf_counter()
        call = self._calls
        self._calls += 1                 # every call, accepted or refused: the same on every rank
        self._latest_at_open.forget()    # this job commits from now on
        job_round = False
        try:
            self._check_open()
            self._engine.raise_errors()
            if type(step) is not int or not 0 <= step < 10 ** 10:
                raise ValueError(f"step must be an int in [0, 1e10), got {step!r}")
            # Whether this save may supersede a committed step on some node: then no node
            # commits it before every node has it prepared (lazyckpt/saving/jobcommit.py).
            job_round = self._job is not None and self._job.needs_round(step)
            self._hold_writer_lease()
            metadata = self._schedule.annotate(check_metadata(metadata))
            # A policy ranking steps by a metric this save lacks: refused now, not in the background.
            retention.check_metadata(metadata, self._retention_policies())
            replicated = self._replicated_keys(state)
            # A hit leaves the tensors' checks to the capture thread (lazyckpt/state/plancache.py).
            flat = self._plans.gather(state, self._dist.rank, self._dist.world_size, replicated)
            strategy = StepCommit(self.layout, self._dist, step, call, keep=self.keep, metadata=metadata,
                                  heartbeat_s=self.options.lease_heartbeat_s, line=self.line,
                                  options=self.options, job=self._job, job_round=job_round)
            planner = StepPlanner(self.layout, self._dist, step, call, strategy.save_id, replicated=replicated,
                                  incremental=self._incremental, auto=self._auto)
            strategy.costs = (self._costs, t0, self._costs.last)
            part = FilePart(flat, strategy.footer_metadata(),
                            record_events(flat.live_tensors()))
            drain = self._drain if self.persistent is not None or self._replicas is not None else None
            drain = self._fed_to_schedule(drain)
            job = self._engine.submit(strategy, [part], name=f"step {step}", step=step, t0=t0, planner=planner,
                                      on_committed=drain)
            self._costs.queued(step, job.handle, t0)
            preempted_save = self._schedule.saved(step)
        except BaseException as exc:
            if job_round:
                self._job.refuse(call, exc)
            if self._dist.distributed:
                refuse(self._dist, f"c{call}", exc)
                if self.replicated == "auto":       # its check round before the capture, too
                    refuse(self._dist, f"auto/c{call}", exc)
            raise
        job.handle.persistent = self.on_object_store
        if preempted_save:
            self._wait_preempted(job.handle)
        return job.handle

    def _hold_writer_lease(self) -> None:
        """Take the directory's writer lease at the first save, check it at every
        later one (a takeover by another Checkpointer fails this save, and the
        commit of any save already queued). Released by close(), or once this
        Checkpointer is collected and its pending saves are done (the engine's
        lifetime). On an object store the lease is an object (storage.s3leases.ObjectWriterLease)."""
        if not self._dist.coordinator:
            return
        if self._writer is not None:
            self._writer.check()
            return
        self._writer = self.layout.acquire_writer(self.options.lease_heartbeat_s, self.options.lease_expiry_s,
                                                  takeover=self._takeover, fence=self._dist.run_id or None)
        self.layout.writer = self._writer
        weakref.finalize(self, _release_when_idle, self._engine, self._writer)

    def _replicated_keys(self, state: Any) -> List[Any]:
        if self.replicated != "auto":
            return self.replicated
        return self._auto.candidates(state) if self._auto is not None else []

    def _drain(self, job: Job) -> None:
        """A step just committed (before local retention, so the tiers hold it from here on)."""
        handle, strategy = job.handle, job.strategy
        if self._replicas is not None:
            self._replicas.enqueue(handle, strategy.step, strategy.call, self.layout.step_path(strategy.step),
                                  reading=self.layout.reading(strategy.step))
        if self.persistent is not None:
            self.persistent.enqueue(handle, strategy.step, strategy.call, strategy.save_id,
                                    self.layout.step_path(strategy.step), strategy.seq,
                                    reading=self.layout.reading(strategy.step))

    def _abandoned_locally(self, step: int, save_id: str) -> bool:
        """Whether a later commit superseded that save here (the local record says
        so before the commit's renames): a tier sending it drops it, quietly."""
        record = self.line.record
        return record is not None and (step, save_id) in abandoned(record.read()[1])

    def _resume_drain(self) -> None:
        """A restart publishes the commit events the persistent tier never got
        (the outbox: the local record's events above the store's largest seq, in
        seq order), then retries the upload of the latest live local step when
        the persistent tier lacks that save (its upload failed, or the process
        died first). Every rank enqueues it (call -1: any new save supersedes it).
        One listing of the store for both; none when the two tiers' indexes say
        where the newest save is (on the store, or only here)."""
        newest = self.line.newest_save()
        if newest is not None and newest[0] in (None, newest[1]):     # (None: no local step to send)
            if self._dist.coordinator:
                self.persistent.open_outbox()       # (from the index and the record, when they tell)
            return
        if newest is not None and newest[1] is None:
            # The newest save is the local tail and the store holds no copy of it (its
            # upload was cut after its event): the indexes tell, no listing.
            if self._dist.coordinator:
                self.persistent.open_outbox()
            step, save_id, seq = newest[0].step, newest[0].save_id, newest[0].seq
        else:
            try:
                live, local, remote, listing = self.line.line_and_listing()
            except CheckpointError as exc:
                log.warning("lazyckpt: %s: cannot tell whether the latest step is persisted (%s)",
                            self.persistent.url, exc)
                return
            if self._dist.coordinator and listing is not None:     # (else the drain's first publish lists it)
                # Before anything newer (the upload below, any save): a reader of the store
                # alone learns every rollback this directory committed.
                self.persistent.open_outbox(listing)
            if not live:
                return
            step, save_id = live[-1]
            if step not in local or local[step].save_id != save_id or remote.get(step) == save_id:
                return
            seq = local[step].seq
        if not self._dist.distributed:
            # Damaged at rest since it was committed: never replace a good copy there with it.
            try:
                report = verify(self.layout.step_path(step), self.options, store=self.store)
            except CheckpointNotFoundError as exc:
                # A commit in progress in another process (a rollback moving the steps it
                # superseded aside: the name still holds the old save) or a step deleted
                # meanwhile: that process uploads its own commit; this open has nothing to send.
                log.info("lazyckpt: step %d is not uploaded again at open: %s", step, exc)
                return
            if not report.ok:
                log.warning("lazyckpt: step %d is not on the persistent tier %s and its local copy is damaged "
                            "(%s); it is not uploaded", step, self.persistent.url, report.problems[0].message)
                return
        handle = self._committed_handle(step)
        log.info("lazyckpt: step %d is not on the persistent tier %s; uploading it again", step,
                 self.persistent.url)
        try:
            self.persistent.enqueue(handle, step, -1, save_id, self.layout.step_path(step), seq,
                                    reading=self.layout.reading(step))
        except CheckpointError as exc:
            log.warning("lazyckpt: step %d cannot be held for its upload: %s", step, exc)
            return
        self.resumed_drain = handle

    def _committed_handle(self, step: int) -> SaveHandle:
        """A handle for a step committed earlier (by this run or a previous one)
        that a tier sends again: its tier states say how that went."""
        handle = SaveHandle(f"step {step}", step=step, path=self.layout.step_path(step))
        handle._done.set()
        return handle

    def wait_for_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until every pending save has copied its data out of the live state."""
        self._engine.wait_for_snapshot(timeout)

    def wait(self, timeout: Optional[float] = None, *, freed: bool = False) -> None:
        """Block until every pending save is committed and durable -- and, with
        ``persist_to``, on the persistent tier (or superseded there by a newer
        step); raise the first failure. The steps retention dropped are out of
        the listing by then (renamed aside, durably) but their bytes are freed
        in the background; ``freed=True`` also waits for that (the disk space
        is back). ``close()`` always does."""
        t0 = time.monotonic()
        self._engine.wait(timeout)
        if self._replicas is not None:
            self._replicas.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))
        if self.persistent is not None:
            self.persistent.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - t0)))
        if self.persistent is not None or self._replicas is not None:
            self._retain_drained()
        if freed and not self.layout.wait_for_frees(
                None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))):
            raise CheckpointError(f"{self.directory}: the steps retention deleted were not freed within "
                                  f"{timeout} s; wait again, or without freed=True", path=self.directory)

    def _retain_drained(self) -> None:
        """Local retention skipped steps still waiting for the persistent tier
        or for their replicas; once drained (and no save is running) it catches up."""
        if self._dist.coordinator and self.keep is not None and not self._engine.pending():
            self.layout.apply_retention(self.keep)

    def _retention_policies(self) -> List[Any]:
        """(the argument that set it, the policy) of each tier's retention."""
        out: List[Any] = [("keep", self.keep)]
        if self.persistent is not None:
            out.append(("Persist(keep)", self.persistent.keep))
        return out

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Call ``wait_for_snapshot()`` before every ``optimizer.step()`` (removed on close).
        The first optimizer attached also times the iterations, for the save costs
        recorded in the manifests (lazyckpt/saving/costs.py, ``lazyckpt advise``)."""
        self._engine.barrier.attach(optimizer, after_wait=self._costs.clock_for(self._engine))

    # ------------------------------------------------------------------ when to save

    def should_save(self, step: int) -> bool:
        """Whether to save ``step`` now (ask at every step boundary, on every rank):
        True when ``interval=`` says so, or once a preemption signal arrived (then
        ``preempted`` is True and the ``save()`` of this step blocks until the step
        is committed -- and persisted, with a persistent tier -- bounded by the grace).
        The pattern::

            if ckpt.should_save(step):
                ckpt.save(state, step)
            if ckpt.preempted:
                break

        Under torch.distributed it is collective (one small round through the commit
        store) when preemption= is on or the interval is a clock (seconds, "auto"),
        so that every rank saves the same step; with ``Every(steps=)`` alone it is local."""
        self._check_open()
        return self._schedule.should_save(step)

    @property
    def history(self) -> Line:
        """Deprecated: :attr:`line` (the line of history, ``lazyckpt.tiers.line.Line``)."""
        warnings.warn("Checkpointer.history is deprecated: use Checkpointer.line", LazyckptDeprecationWarning,
                      stacklevel=2)
        return self.line

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal arrived (``preemption=``): the loop should stop
        after this step's save. Under torch.distributed, set on every rank by the same
        ``should_save`` call (the signal may reach one rank only)."""
        return self._schedule.preempted

    def _wait_preempted(self, handle: SaveHandle) -> None:
        """The preempted save: committed (and persisted) before save() returns, bounded by
        the grace; a failure is raised, a save still running at the grace's end is left
        to close() with a warning. Then the user's own handler of the signal runs."""
        try:
            left = self._schedule.grace_left()
            deadline = None if left is None else time.monotonic() + left
            if not handle._done.wait(left):
                log.warning("lazyckpt: preempted: step %s not committed within the grace (%.0f s); "
                            "close() goes on waiting for it", handle.step, self._schedule.preemption.grace)
                return
            handle.wait()                   # its failure, if it failed
            if self.persistent is not None and handle.persist_state is not None:    # (queued for it at commit)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    handle.wait(left, persisted=True)
                except CheckpointError:
                    if handle.persist_state != "pending":
                        raise
                    log.warning("lazyckpt: preempted: step %s committed here but not on the persistent "
                                "tier %s within the grace", handle.step, self.persistent.url)
            log.info("lazyckpt: preempted: step %s committed%s", handle.step,
                     " and persisted" if self.persistent is not None else "")
        finally:
            self._schedule.chain()

    def _fed_to_schedule(self, drain: Any) -> Any:
        """The job's on_committed: with interval="auto", the committed save's merged cost
        (lazyckpt/saving/costs.py, the coordinator's) goes to the schedule first."""
        if not self._schedule.wants_costs:
            return drain
        schedule = self._schedule

        def committed(job: Job) -> None:
            schedule.observe(job.strategy.step, job.strategy.cost)
            if drain is not None:
                drain(job)
        return committed

    def _check_open(self) -> None:
        if self._engine.closed:
            raise CheckpointError(f"{self.directory}: checkpointer is closed", path=self.directory)

    # ------------------------------------------------------------------ listing

    def steps(self) -> List[int]:
        """Committed steps, oldest first (the order they were committed in)."""
        return self.layout.steps()

    def latest_step(self) -> Optional[int]:
        """The most recently committed step, or None."""
        return self.layout.latest()

    def step_path(self, step: int) -> str:
        return self.layout.step_path(step)

    def clean_leftovers(self) -> List[str]:
        """Remove what interrupted saves and deletes left behind, once provably
        dead (their lease expired); never a save in progress, never data."""
        return self.layout.clean_leftovers()

    # ------------------------------------------------------------------ loading

    def load(self, step: Optional[int] = None, map_location: MapLocation = None,
             keys: Optional[List[KeySpec]] = None, into: Any = None, allow_pickle: bool = False,
             strict: bool = True) -> Any:
        """Load a committed checkpoint (the latest when ``step`` is None). With
        ``into``, every tensor of ``into`` must be filled unless ``strict=False``.

        With ``persist_to``, the newest step on either tier is loaded, from the
        local tier when it holds that step intact, else from the persistent
        one (a replaced node, a corrupt or partial local copy); an older step
        is tried only when neither tier can give the newer one. ``loaded_from``
        says which step and tier were read."""
        request = LoadRequest(map_location=map_location, keys=keys, into=into, allow_pickle=allow_pickle,
                              strict=strict)
        return self._load_request(step, request)

    def _load_request(self, step: Optional[int], request: LoadRequest) -> Any:
        self._check_open()
        try:
            return self._load(step, request)
        except CheckpointNotFoundError:
            if not self._latest_at_open.used:
                raise
            # The step found at open went without a commit since (pruned by another process).
            self._latest_at_open.forget()
            return self._load(step, request)

    def _load(self, step: Optional[int], request: LoadRequest) -> Any:
        where = None
        if self._replicas is not None:
            # Collective: a node that lost its directory gets its files back from partners.
            where = self._restore_from_replicas(step)
            step = where["step"]
            if where.pop("replicate_again", False):
                self._replicate_again(step)
        errors = []
        for step_, tier, path in self._candidates(step):
            try:
                try:
                    state = self._load_from(tier, path, request)
                except CheckpointNotFoundError:
                    if tier != "local" or path == self.layout.step_path(step_):
                        raise
                    # Read from where its commit left it before the rename (another process's
                    # commit in progress): renamed in meanwhile, it is read under its name.
                    path = self.layout.step_path(step_)
                    state = self._load_from(tier, path, request)
            except (CorruptCheckpointError, CheckpointNotFoundError, CheckpointReadError) as exc:
                if self.persistent is None:
                    raise
                log.warning("lazyckpt: step %d on the %s tier cannot be loaded (%s); trying the next copy",
                            step_, tier, exc)
                errors.append(exc)
                continue
            self.loaded_from = {"step": step_, "tier": tier, "path": path}
            if where is not None and where["tier"] == "replica" and tier == "local":
                self.loaded_from.update(tier="replica", from_rank=where["from_rank"])
            if self.persistent is not None:
                log.info("lazyckpt: loaded step %d from the %s tier (%s)", step_, tier, path)
            return state
        if errors:
            raise errors[-1]
        raise CheckpointNotFoundError(f"{self.directory}: no committed checkpoint"
                                      + (f" of step {step}" if step is not None else ""), path=self.directory)

    def _restore_from_replicas(self, step: Optional[int]) -> Dict[str, Any]:
        self._replicas.wait()
        persisted: List[int] = []
        if self.persistent is not None:
            try:
                live, _local, remote, _listing = self.line.line_and_listing()
                persisted = sorted(s for s, sid in live if remote.get(s) == sid)
            except CheckpointError as exc:
                log.warning("lazyckpt: the persistent tier %s cannot be listed: %s", self.persistent.url, exc)
        return restore_replicas(self.directory, self.layout, self.topology, self._replicas.k,
                                self._replicas.group, step, persisted, self.line)

    def _replicate_again(self, step: int) -> None:
        """After a restore that brought a lost node back: the replicas that node held
        for its partners were lost with it, so the step is replicated anew (in the
        background, on every rank: the restore decided it for all of them). Without
        this, k=1 would not survive the loss of the partner next."""
        handle = self._committed_handle(step)
        # call -1: the next save (call >= 0) supersedes this round if it is still queued.
        self._replicas.enqueue(handle, step, -1, self.layout.step_path(step), reading=self.layout.reading(step))
        self.restored_replication = handle

    def replica_stats(self) -> Dict[str, Any]:
        """The replica tier: what this rank holds for its partners (bounded:
        the last complete step of each source rank), and failed rounds."""
        if self._replicas is None:
            return {}
        r = self._replicas
        return {"node": self.topology.node, "partners": self.topology.partners(r.k),
                "holds": r.holds(), "held_bytes": r.held_bytes,
                "failed_rounds": r.failed_rounds}

    def _load_from(self, tier: str, path: str, request: LoadRequest) -> Any:
        pool = self._engine.resources.readers
        # Any tier, any store: the manifest is read under the step's hold. The persistent tier's
        # steps are read with its own store settings (Persist(url, storage_options=...)).
        if tier == "persistent":
            store, options = self.persistent.store, self.persistent.options
        else:
            store, options = self.store, self.options
        return load_step(path, None, options, pool, self._dist.rank, store=store, request=request)

    def _candidates(self, step: Optional[int]) -> Iterable[Any]:
        """(step, tier, path) to try, best first: newest step first, local before persistent."""
        if self.persistent is None:
            # One tier: its steps are one line by construction (committing S removes every step >= S).
            found = self._latest_at_open.locate(step)
            if found is False:
                found = self.layout.locate_step(step)   # the index: no listing
            tier = "local" if not self.on_object_store else "object store"
            return [] if found is None else [(found[0], tier, found[1])]
        return self.line.candidates(step)      # the choice among two tiers' copies: the tier's

    def load_async(self, step: Optional[int] = None, map_location: MapLocation = None,
                   keys: Optional[List[KeySpec]] = None, into: Any = None, allow_pickle: bool = False,
                   strict: bool = True) -> RestoreHandle:
        """``load()`` on a background thread (the step is chosen now): returns a
        :class:`RestoreHandle`; ``handle.wait()`` is the barrier before first use
        (``handle.attach(optimizer)``, ``handle.guard(model)`` make it a hook)."""
        request = LoadRequest(map_location=map_location, keys=keys, into=into, allow_pickle=allow_pickle,
                              strict=strict)
        step = self._step_to_load(step)
        return RestoreHandle(lambda: self._load_request(step, request),
                             f"{self.directory} step {step}")

    def _step_to_load(self, step: Optional[int]) -> int:
        self._check_open()
        if step is None:
            first = next(iter(self._candidates(None)), None)
            step = first[0] if first is not None else None
            if step is None:
                raise CheckpointNotFoundError(f"{self.directory}: no committed checkpoint",
                                              path=self.directory)
        return step

    # ------------------------------------------------------------------ closing

    def close(self, cancel: bool = False) -> None:
        """Drain pending saves (or cancel them with ``cancel=True``), stop every
        thread, release the cache. Raises the first unreported failure.

        Collective on several ranks, as opening is: rank 0 returns once every
        rank's close is done with the job's store, which its process may host
        (bounded by ``commit_timeout_s``, 10 s when cancelled; a rank that never
        closes costs a warning, see ``distributed.depart``)."""
        try:
            self._engine.close(cancel=cancel)
            if self._replicas is not None and not cancel:
                self._replicas.wait()
        finally:
            # The writer lease is released whatever the tiers raise (a failed upload is
            # reported here): else this process could never open the directory again.
            try:
                if self.persistent is not None:
                    self.persistent.close(cancel=cancel)
                if not cancel and (self.persistent is not None or self._replicas is not None):
                    self._retain_drained()
            finally:
                try:
                    if not cancel:
                        self.layout.wait_for_frees()    # a tidy directory after a clean close
                    if self._writer is not None:
                        self._writer.release()
                    self.layout.close()
                finally:
                    # Collective, as opening is: rank 0 stays until every rank is done with the
                    # store its process may host (distributed.depart). A cancelled close (an
                    # exception) waits less for ranks that may be gone.
                    # The widest group: under replicas= the world, not this node's group.
                    widest = self._replicas.world if self._replicas is not None else self._dist
                    depart(widest, bound_s=10.0 if cancel else None)
                    # Last: the signal handlers restored, then the user's own handler of a
                    # preemption signal not yet passed on (it may end the process).
                    self._schedule.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(cancel=exc_type is not None)


def _release_when_idle(engine: SaveEngine, writer: WriterLease) -> None:
    """A Checkpointer collected without close(): its writer lease goes now if
    no save of it is pending, else once the last one is done (the engine lives
    until then), so that no second writer starts under a save still committing."""
    if engine.pending():
        weakref.finalize(engine, writer.release)
    else:
        writer.release()
