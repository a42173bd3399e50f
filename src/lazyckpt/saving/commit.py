"""Commit strategies: how the files of one job become a checkpoint.

* :class:`FileCommit` -- one file at a path (``lazyckpt.save``, Lightning, the
  HF Trainer, DCP's per-rank files): written under a leased hidden sibling,
  fsynced, renamed over the path, directory fsynced.
* :class:`StepCommit` -- one step of a Checkpointer directory: every rank
  writes its file into one leased temporary directory; then (two-phase,
  through the store, with several ranks) the coordinator writes the manifest
  and renames the directory into place (``CheckpointDir.commit``), then applies
  retention and writes ``latest``. What each rank wrote (references, dedup,
  digests) was decided by the job's planner (:mod:`lazyckpt.saving.planner`);
  the commit carries its report and makes the step visible.

DeepSpeed's tag groups add their own strategy in
:mod:`lazyckpt.integrations.deepspeed`, on the same base.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any, Callable, Dict, Optional

from lazyckpt.distributed import RankInfo, agree, refuse
from lazyckpt.errors import CheckpointError
from lazyckpt.formats import datafile, manifest
from lazyckpt.formats.names import MANIFEST, rank_filename
from lazyckpt.history import Event
from lazyckpt.knobs import resolve
from lazyckpt.storage.fileio import fsync_dir, remove_quietly, write_file_atomic
from lazyckpt.storage.layout import CheckpointDir, new_token, remove_tree, sibling_temp
from lazyckpt.storage.s3 import store_for
from lazyckpt.storage.s3layout import LEASE_PREFIX, ObjectLease
from .costs import merge
from .engine import CommitStrategy, FilePart, Job

log = logging.getLogger("lazyckpt")


class FileCommit(CommitStrategy):
    """One file at ``path``. ``on_commit(handle)`` runs once it is durable (still
    on the job's thread: e.g. to move it into a directory being assembled)."""

    def __init__(self, path: str, heartbeat_s: float, on_commit: Optional[Callable[[Any], None]] = None,
                 message: str = "checkpoint save failed"):
        self.path = os.path.abspath(os.fspath(path))
        self.heartbeat_s = heartbeat_s
        self.on_commit = on_commit
        self.message = message
        self._tmp: Optional[str] = None

    def part_path(self, job: Job, part: FilePart) -> str:
        self._tmp = sibling_temp(part.final_path or self.path)
        os.makedirs(os.path.dirname(self._tmp), exist_ok=True)
        job.lease(self._tmp, self.heartbeat_s)
        return self._tmp

    def commit(self, job: Job) -> None:
        os.replace(self._tmp, self.path)
        self._tmp = None
        fsync_dir(os.path.dirname(self.path))
        if self.on_commit is not None:
            self.on_commit(job.handle)

    def abort(self, job: Job, error: BaseException) -> None:
        if self._tmp is not None:
            remove_quietly(self._tmp)

    def failure_message(self, job: Job, cause: str) -> str:
        return f"{self.path}: {self.message}: {cause}"


class ObjectCommit(CommitStrategy):
    """One file as one object at an ``s3://`` URL. No temporary name is
    needed: a multipart upload is invisible until completed, and completing
    it replaces the old object atomically; a failed one is aborted."""

    def __init__(self, url: str, message: str = "checkpoint save failed"):
        self.path = url
        self.message = message

    def part_path(self, job: Job, part: FilePart) -> str:
        return self.path

    def failure_message(self, job: Job, cause: str) -> str:
        return f"{self.path}: {self.message}: {cause}"


class StepCommit(CommitStrategy):
    """One step of a Checkpointer directory, on one rank or several.

    ``call`` is this save's call number (the same on every rank); the
    temporary directory and the store keys are named after it, so a call
    refused on one rank fails that step only. The job's planner must be a
    :class:`~lazyckpt.saving.planner.StepPlanner`: its report rides in the
    commit round, and the manifest lists what it planned."""

    def __init__(self, layout: CheckpointDir, dist: RankInfo, step: int, call: int, *,
                 keep_last: Optional[int], metadata: Dict[str, Any], heartbeat_s: float,
                 history: Any = None):
        self.layout = layout
        #: The Checkpointer's line of history (lazyckpt/history.py): numbers the commit.
        self.history = history
        #: This commit's seq (set by the coordinator at commit).
        self.seq: Optional[int] = None
        self.path = layout.path
        self.dist = dist
        self.step = step
        self.call = call
        self.keep_last = keep_last
        self.metadata = metadata            # the user's, as it goes into the manifest
        self.heartbeat_s = heartbeat_s
        self.key = f"c{call}"
        self.tmp = layout.temp_path(step, f"r{dist.run_id}-{self.key}" if dist.distributed else new_token())
        self.save_id = f"{dist.run_id}-{self.key}" if dist.distributed else uuid.uuid4().hex
        self._reported = False
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
        """Only the coordinator creates the temporary directory (one ``mkdir``,
        not N racing ones) and then publishes ``<key>/ready``; the other ranks
        wait for it (deadline: ``commit_timeout_s``) before they write into it.
        A call refused or failed on the coordinator publishes it failed
        (:func:`~lazyckpt.distributed.refuse`), so they fail at once."""
        d = self.dist
        if not d.distributed or d.coordinator:
            os.makedirs(self.tmp, exist_ok=False)
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
        path = os.path.join(self.tmp, rank_filename(self.dist.rank))
        job.lease(path, self.heartbeat_s)
        return path

    def commit(self, job: Job) -> None:
        planner = job.planner
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
            self._put_side(name, json.dumps(flat_shards, separators=(",", ":")).encode())
            report["shards_file"] = name
        self._reported = True
        outcome = agree(self.dist, self.key, report, self.step, lambda done: self._commit(done, planner),
                        forget=[f"c{self.call - 1}/outcome"])
        planner.learned(outcome)

    def _commit(self, done: Dict[int, Dict[str, Any]], planner: Any) -> Optional[Dict[str, Any]]:
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
                v["shards"] = json.loads(self._take_side(name))
        if self.history is not None:
            self.seq = self.history.next_seq()
        if self.costs is not None:
            self.cost = merge({r: v.pop("cost", None) for r, v in done.items()},
                              sum(v["bytes"] for v in done.values()))
        raw = manifest.build(self.step, done, self.save_id, {"step": self.step, **self.metadata},
                             planner.replicated, layouts=planner.layouts_index(done, self._footers()),
                             seq=self.seq, cost=self.cost)
        self._publish(raw)
        return planner.outcome(done)

    def _footers(self) -> Callable[[int], Any]:
        """footer(rank): the footer of the file a rank of this save wrote (for the
        planner's DTensor layouts index)."""
        options = getattr(self.layout, "options", None) or resolve()

        def footer(rank: int) -> Any:
            path = f"{self.tmp}/{rank_filename(rank)}"
            size, read, done_reading = self._reader(path)
            try:
                return datafile.read_ends(size, read, path, options.max_footer_bytes)[1]
            finally:
                done_reading()
        return footer

    # Where the step is assembled: a local temporary directory (here) or an
    # object-store prefix (ObjectStepCommit).

    def _reader(self, path: str):
        """(size, read(offset, n), close) of a file this save wrote."""
        fd = os.open(path, os.O_RDONLY)
        return os.fstat(fd).st_size, lambda offset, n: os.pread(fd, n, offset), lambda: os.close(fd)

    def _put_side(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.tmp, name), "wb") as f:
            f.write(data)

    def _take_side(self, name: str) -> bytes:
        with open(os.path.join(self.tmp, name), "rb") as f:
            data = f.read()
        os.unlink(os.path.join(self.tmp, name))
        return data

    def _publish(self, raw: bytes) -> None:
        write_file_atomic(os.path.join(self.tmp, MANIFEST), raw)
        fsync_dir(self.tmp)
        if self.history is not None:
            # Recorded before the renames: a crash in between leaves the record
            # saying the superseded steps are abandoned, never live.
            self.history.recorded(Event(self.step, self.save_id, self.seq))
        self.layout.commit(self.tmp, self.step, keep_superseded=self.keep_last is None)

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
            if os.path.isdir(self.tmp):     # not renamed: nothing of this step may remain
                remove_tree(self.tmp)

    def after_commit(self, job: Job) -> None:
        # The engine ran the planner's committed() and the job's on_committed (the
        # tiers' enqueue, which holds the step from then on) before this retention.
        if not self.dist.coordinator:
            return
        if self.costs is not None:
            self.costs[0].committed(self.step, self.cost)
        self.layout.apply_retention(self.keep_last)
        # Superseding made the step just committed the newest one.
        self.layout.write_latest(self.step)
        self.layout.clean_leftovers()

    def failure_message(self, job: Job, cause: str) -> str:
        return f"{self.path}: checkpoint of step {self.step} failed: {cause}"


class ObjectStepCommit(StepCommit):
    """One step of a Checkpointer on an object store (``Checkpointer("s3://...")``).

    Every rank uploads its file under the save's own prefix
    (``step_X/<save_id>/``; nothing there is visible yet); the coordinator
    then writes the manifest object -- the commit -- and ``latest`` after it.
    There is no rename: a failed save aborts its uploads and the coordinator
    deletes what was completed under its prefix."""

    def __init__(self, layout: Any, dist: RankInfo, step: int, call: int, **kwargs: Any):
        super().__init__(layout, dist, step, call, **kwargs)
        self.tmp = layout.save_url(step, self.save_id)

    def begin(self, job: Job) -> None:
        store, key = self._store()
        # The heartbeat keeps clean_leftovers (any process) off this save's prefix.
        job.leases.append(ObjectLease(store, f"{key}/{LEASE_PREFIX}{self.dist.rank:05d}", self.heartbeat_s))

    def part_path(self, job: Job, part: FilePart) -> str:
        return f"{self.tmp}/{rank_filename(self.dist.rank)}"

    def _store(self):
        return store_for(self.tmp, self.layout.options.storage_options)

    def _reader(self, path: str):
        store, key = store_for(path, self.layout.options.storage_options)

        def read(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            return bytes(buf[:store.read_into(key, memoryview(buf), offset)])
        return store.size(key) or 0, read, lambda: None

    def _put_side(self, name: str, data: bytes) -> None:
        store, key = self._store()
        store.put(f"{key}/{name}", data)

    def _take_side(self, name: str) -> bytes:
        store, key = self._store()
        data = store.get(f"{key}/{name}")
        if data is None:
            raise CheckpointError(f"{self.tmp}/{name}: a rank's shard report is missing", step=self.step)
        store.delete([f"{key}/{name}"])
        return data

    def _publish(self, raw: bytes) -> None:
        if self.seq is not None:
            # The event before the manifest: a second manifest of this step left
            # by a crash inside the supersede is told apart by seq.
            self.layout.put_event(Event(self.step, self.save_id, self.seq))
        self.layout.commit(self.step, self.save_id, raw)

    def abort(self, job: Job, error: BaseException) -> None:
        d = self.dist
        self._refuse_unreported(error)
        if not d.distributed or d.coordinator:
            store, key = self._store()
            try:
                if store.size(f"{key}/{MANIFEST}") is None:     # never delete a committed step
                    store.delete([o["Key"] for o in store.list(key + "/")])
            except CheckpointError as exc:      # the store may be what failed; prune cleans up later
                import logging
                logging.getLogger("lazyckpt").warning("lazyckpt: %s: could not remove a failed save: %s",
                                                      self.tmp, exc)
