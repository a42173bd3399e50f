"""Commit strategies: how the files of one job become a checkpoint.

* :class:`FileCommit` -- one file at a path (``lazyckpt.save``, Lightning, the
  HF Trainer, DCP's per-rank files), through the store's ``PendingFile``: a
  leased hidden sibling renamed over the path, or an object whose upload
  completes whole.
* :class:`StepCommit` -- one step of a Checkpointer directory, through the
  directory's ``PendingStep``: every rank writes its file into the save's
  temporary place (a directory, an object prefix); then (two-phase, through
  the rendezvous store, with several ranks) the coordinator writes the
  manifest and publishes it, then applies retention and writes ``latest``.
  What each rank wrote (references, dedup, digests) was decided by the job's
  planner (:mod:`lazyckpt.saving.planner`); the commit carries its report and
  makes the step visible. Where the bytes go and how a step becomes visible
  is the store's (``lazyckpt.storage.base``): no code here asks which store.

DeepSpeed's tag groups add their own strategy in
:mod:`lazyckpt.integrations.deepspeed`, on the same base.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Dict, Optional

from lazyckpt.distributed import RankInfo, agree, refuse
from lazyckpt.errors import CheckpointError, CheckpointWriteError
from lazyckpt.formats import datafile, manifest
from lazyckpt.lineage import Event
from lazyckpt.knobs import Options, resolve
from lazyckpt.retention import Policy, keeps_superseded
from lazyckpt.storage.base import Directory, Output, PendingFile, Store
from lazyckpt.storage.sidefiles import new_token
from .costs import merge
from .engine import CommitStrategy, FilePart, Job
from .planner import StepSavePlanner

log = logging.getLogger("lazyckpt")


class FileCommit(CommitStrategy):
    """One file at ``path``, on ``store`` (the caller's, looked up where the path
    entered: ``api``, the integrations). ``on_commit(handle)`` runs once it is
    durable (still on the job's thread: e.g. to move it into a directory being
    assembled). ``make_parents``: create missing parent directories (the
    frameworks' layouts) instead of refusing the save (``lazyckpt.save``)."""

    def __init__(self, store: Store, path: str, heartbeat_s: float, on_commit: Optional[Callable[[Any], None]] = None,
                 message: str = "checkpoint save failed", options: Optional[Options] = None,
                 make_parents: bool = True, before_publish: Optional[Callable[[str], None]] = None):
        self.store = store
        #: Called with the durable temporary's path just before it is published (Lightning:
        #: last.ckpt names the new file from the instant it becomes visible).
        self.before_publish = before_publish
        self.path = self.store.normalize(path)
        self.heartbeat_s = heartbeat_s
        self.on_commit = on_commit
        self.message = message
        self.options = options or resolve()
        self.make_parents = make_parents
        self._pending: Optional[PendingFile] = None
        if not make_parents:
            # A missing directory is refused here, on the caller's thread, before any
            # byte moves (a pending file creates nothing until it is written).
            self.store.pending_file(self.path, self.options)

    def part_path(self, job: Job, part: FilePart) -> str:
        self._pending = self.store.pending_file(self.path, self.options, self.make_parents, beside=part.final_path)
        lease = self._pending.hold(self.heartbeat_s)
        if lease is not None:
            job.leases.append(lease)
        return self._pending.path

    def part_output(self, path: str, options: Options, block_bytes: int) -> Output:
        return self.store.open_output(path, options, block_bytes)

    def commit(self, job: Job) -> None:
        if self.before_publish is not None:
            self.before_publish(self._pending.path)
        self._pending.publish()
        self._pending = None
        if self.on_commit is not None:
            self.on_commit(job.handle)

    def abort(self, job: Job, error: BaseException) -> None:
        if self._pending is not None:
            self._pending.discard()

    def failure_message(self, job: Job, cause: str) -> str:
        return f"{self.path}: {self.message}: {cause}"


class StepCommit(CommitStrategy):
    """One step of a Checkpointer directory, on one rank or several.

    ``call`` is this save's call number (the same on every rank); the
    temporary directory and the store keys are named after it, so a call
    refused on one rank fails that step only. The job's planner must be a
    :class:`~lazyckpt.saving.planner.StepPlanner`: its report rides in the
    commit round, and the manifest lists what it planned."""

    def __init__(self, layout: Directory, dist: RankInfo, step: int, call: int, *,
                 keep: Optional[Policy], metadata: Dict[str, Any], heartbeat_s: float,
                 line: Any = None, options: Optional[Options] = None, job: Any = None,
                 job_round: bool = False):
        self.layout = layout
        self.options = options or resolve()
        #: The Checkpointer's line of history (lazyckpt/tiers/line.py): numbers the commit.
        self.line = line
        #: This commit's seq (set by the coordinator at commit).
        self.seq: Optional[int] = None
        self.path = layout.path
        self.dist = dist
        self.step = step
        self.call = call
        #: The directory's retention policy (None: keep every step, superseded ones aside).
        self.keep = keep
        self.metadata = metadata            # the user's, as it goes into the manifest
        self.heartbeat_s = heartbeat_s
        self.key = f"c{call}"
        #: With replicas= (each node its own commit group): the job, which names the save
        #: (the same id on every node) and, with ``job_round``, holds the round between
        #: this node's prepared save and its commit point (lazyckpt/saving/jobcommit.py).
        self.job = job
        self.job_round = job is not None and job_round
        # Where the store fences displaced writers by save id (an object store), a save id
        # begins with its writer's fence id: the run's id with several ranks, else the lease's.
        fence = getattr(layout.writer, "fence", None)
        self.save_id = job.save_id(call) if job is not None else \
            f"{dist.run_id}-{self.key}" if dist.distributed else \
            f"{fence}-{uuid.uuid4().hex[:20]}" if fence else uuid.uuid4().hex
        #: Where this save is written until it is published (the store's PendingStep).
        self.pending = layout.pending(step, self.save_id,
                                      f"r{dist.run_id}-{self.key}" if dist.distributed else new_token())
        self.tmp = self.pending.path
        self._reported = False
        #: Every node voted for this save in the job-wide round (its outcome is the job's now).
        self._agreed = False
        #: (SaveCosts, save() start, the previous save) when the save costs are recorded
        #: (lazyckpt/saving/costs.py); the merged figures, once committed.
        self.costs: Optional[tuple] = None
        self.cost: Optional[Dict[str, Any]] = None

    @property
    def align_file_size(self) -> bool:
        """Several ranks: files padded to a multiple of 4 KiB (manifest ``file_bytes``)."""
        return self.dist.distributed

    def footer_metadata(self) -> Dict[str, Any]:
        """What every data file's footer carries: ties it to this save and rank."""
        d = self.dist
        return {"step": self.step, **self.metadata,
                "lazyckpt": {"save_id": self.save_id, "rank": d.rank, "world_size": d.world_size}}

    def begin(self, job: Job) -> None:
        """Where the save's place must be created first (a directory), only the
        coordinator creates it (one ``mkdir``, not N racing ones) and then
        publishes ``<key>/ready``; the other ranks wait for it (deadline:
        ``commit_timeout_s``) before they write into it. A call refused or
        failed on the coordinator publishes it failed
        (:func:`~lazyckpt.distributed.refuse`), so they fail at once."""
        d = self.dist
        if not self.pending.needs_create:
            return
        if not d.distributed or d.coordinator:
            self.pending.create()
            if d.distributed:
                ready = f"{self.key}/ready"
                d.publish(ready, {"ok": True})
                d.delete([ready], after=self.key)     # once every rank is past this call
            return
        ready = f"{self.key}/ready"
        value = d.wait_for([ready], "the coordinator's temporary directory", self.step)[ready]
        if not value.get("ok"):
            raise CheckpointError(f"step {self.step}: not committed: {value.get('error')}", step=self.step)

    def part_path(self, job: Job, part: FilePart) -> str:
        # The hold keeps cleanup (any process) off this save while it is written.
        job.leases.append(self.pending.hold(self.dist.rank, self.heartbeat_s))
        return self.pending.file_path(self.dist.rank)

    def part_output(self, path: str, options: Options, block_bytes: int) -> Output:
        return self.pending.open_output(path, options, block_bytes)

    def commit(self, job: Job) -> None:
        planner: StepSavePlanner = job.planner
        planner.check_references()
        (part,) = job.parts
        flat_shards = part.shards
        report: Dict[str, Any] = {"ok": True, "step": self.step, "bytes": part.stats.file_bytes,
                                  "digest": part.digest, "version": part.version,
                                  "references": planner.references}
        if self.costs is not None:
            recorder, t0, previous = self.costs
            report["cost"] = recorder.report(job, t0, previous)
        if not self.dist.distributed:
            report["shards"] = flat_shards or []
            self._reported = True
            self._commit({0: report}, planner)
            return
        report.update(planner.report(part))     # keyset, per-key digests, replicated sums, layouts
        if "layouts" not in report and flat_shards:
            # The store refuses large values (about 8 MiB): shard geometry travels
            # through a side file in the temporary directory instead.
            name = f".shards_{self.dist.rank:05d}.json"
            self.pending.put_side(name, json.dumps(flat_shards, separators=(",", ":")).encode())
            report["shards_file"] = name
        self._reported = True
        outcome = agree(self.dist, self.key, report, self.step, lambda done: self._commit(done, planner),
                        forget=[f"c{self.call - 1}/outcome"])
        planner.learned(outcome)

    def _commit(self, done: Dict[int, Dict[str, Any]], planner: StepSavePlanner) -> Optional[Dict[str, Any]]:
        """Coordinator: every rank's file is durable; write the manifest and rename.
        Returns what the outcome carries to every rank (the planner's: ``replicated="auto"``'s keys)."""
        steps = {v.get("step") for v in done.values()}
        if steps != {self.step}:
            raise CheckpointError(f"step {self.step}: the ranks saved different steps in this call "
                                  f"({sorted(map(str, steps))}); save() must be called with the same step "
                                  f"on every rank", step=self.step)
        planner.check(done)
        for v in done.values():
            name = v.pop("shards_file", None)
            if name is not None:
                v["shards"] = json.loads(self.pending.take_side(name))
        if self.line is not None:
            self.seq = self.line.next_seq()
        if self.costs is not None:
            self.cost = merge({r: v.pop("cost", None) for r, v in done.items()},
                              sum(v["bytes"] for v in done.values()))
        raw = manifest.build(self.step, done, self.save_id, {"step": self.step, **self.metadata},
                             planner.replicated, layouts=planner.layouts_index(done, self._footers()),
                             seq=self.seq, cost=self.cost)
        if self.job_round and self.seq is not None:
            # Phase one: durable and marked here, the line unchanged; no node commits
            # before every node is here (a crash from now on is decided at the next open).
            self.pending.prepare(raw, Event(self.step, self.save_id, self.seq), keeps_superseded(self.keep))
            self.job.prepared(self.call, self.step)
            self._agreed = True
        try:
            self._publish(raw)
        except (CheckpointError, OSError) as exc:
            if not self._agreed:
                raise
            # The other nodes commit what the job agreed on: discarding it here would leave
            # the nodes on two lines, which a restart resolves to a step older than both.
            error = CheckpointWriteError(
                f"{self.path}: step {self.step}: every node voted to commit it, but this node's commit "
                f"failed ({exc}); its prepared save is kept and is committed here when the job's "
                f"Checkpointers are next opened (collective) if any node committed it: close them and "
                f"open them again before the next save or load", path=self.path, step=self.step)
            error.committed = True      # type: ignore[attr-defined]
            raise error from exc
        return planner.outcome(done)

    def _footers(self) -> Callable[[int], Any]:
        """footer(rank): the footer of the file a rank of this save wrote (for the
        planner's DTensor layouts index)."""
        limit = self.options.max_footer_bytes

        def footer(rank: int) -> Any:
            path = self.pending.file_path(rank)
            return self.pending.read_ends(rank, self.options,
                                          lambda size, read: datafile.read_ends(size, read, path, limit)[1])
        return footer

    def _publish(self, raw: bytes) -> None:
        event = Event(self.step, self.save_id, self.seq) if self.seq is not None else None
        self.pending.publish(raw, event, keep_superseded=keeps_superseded(self.keep))

    def _refuse_unreported(self, error: BaseException) -> None:
        """A failed job: if this rank has not reported to the commit round, the
        others fail this step now, not at a deadline (the planner refuses its own
        round after the strategy's abort)."""
        if self.dist.distributed and not self._reported:
            refuse(self.dist, self.key, error)

    def abort(self, job: Job, error: BaseException) -> None:
        d = self.dist
        self._refuse_unreported(error)
        if not d.distributed or d.coordinator:
            if self._agreed:
                # Decided by the job: the next open's resolve_prepared finishes it (see _commit).
                log.warning("lazyckpt: %s: step %d was agreed by every node but not committed here; kept "
                            "prepared for the next open", self.path, self.step)
                return
            if self.job_round:
                self.job.refuse(self.call, error)   # the other nodes commit nothing of it either
            self.pending.discard()          # not published: nothing of this step may remain

    def after_commit(self, job: Job) -> None:
        # The engine ran the planner's committed() and the job's on_committed (the
        # tiers' enqueue, which holds the step from then on) before this retention.
        if not self.dist.coordinator:
            return
        if self.costs is not None:
            self.costs[0].committed(self.step, self.cost)
        self.layout.apply_retention(self.keep)
        # Superseding made the step just committed the newest one.
        self.layout.write_latest(self.step)
        self.layout.tidy()              # what needs another look, not a listing

    def failure_message(self, job: Job, cause: str) -> str:
        return f"{self.path}: checkpoint of step {self.step} failed: {cause}"
