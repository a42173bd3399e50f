"""Commit strategies: how the files of one job become a checkpoint.

* :class:`FileCommit` -- one file at a path (``lazyckpt.save``, Lightning, the
  HF Trainer, DCP's per-rank files): written under a leased hidden sibling,
  fsynced, renamed over the path, directory fsynced.
* :class:`StepCommit` -- one step of a Checkpointer directory: every rank
  writes its file into one leased temporary directory; then (two-phase,
  through the store, with several ranks) the coordinator writes the manifest
  and renames the directory into place (``CheckpointDir.commit``), then applies
  retention and writes ``latest``.

DeepSpeed's tag groups add their own strategy in
:mod:`lazyckpt.integrations.deepspeed`, on the same base.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from lazyckpt.distributed import RankInfo, agree, refuse
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import datafile, manifest
from lazyckpt.formats.names import MANIFEST, rank_filename
from lazyckpt.history import Event
from lazyckpt.knobs import resolve
from lazyckpt.state.walk import dtensor_nodes, layouts_digest
from lazyckpt.storage.fileio import fsync_dir, remove_quietly, write_file_atomic
from lazyckpt.storage.layout import CheckpointDir, StepDir, new_token, remove_tree, sibling_temp
from lazyckpt.storage.s3 import store_for
from lazyckpt.storage.s3layout import LEASE_PREFIX, ObjectLease
from .autorep import AutoReplication
from .costs import merge
from .engine import CommitStrategy, FilePart, Job
from .incremental import IncrementalIndex, Plan

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
    refused on one rank fails that step only."""

    def __init__(self, layout: CheckpointDir, dist: RankInfo, step: int, call: int, *,
                 keep_last: Optional[int], replicated: List[Any], metadata: Dict[str, Any],
                 heartbeat_s: float, incremental: Optional[IncrementalIndex] = None,
                 auto: Optional[AutoReplication] = None, history: Any = None):
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
        self.replicated = replicated
        self.metadata = metadata            # the user's, as it goes into the manifest
        self.heartbeat_s = heartbeat_s
        self.key = f"c{call}"
        self.tmp = layout.temp_path(step, f"r{dist.run_id}-{self.key}" if dist.distributed else new_token())
        self.save_id = f"{dist.run_id}-{self.key}" if dist.distributed else uuid.uuid4().hex
        self._reported = False
        self.incremental = incremental
        self._plan: Optional[Plan] = None
        self._held_references: List[Any] = []     # read locks of the steps referred to, checked at commit
        self._keyset: Optional[str] = None
        self._layouts: Optional[str] = None
        #: replicated unset or "auto" (several ranks): identical keys found by content.
        self.auto = auto
        self._auto_nodes: Dict[str, Any] = {}
        self._auto_reported = False
        #: Named replicated keys (several ranks): repr(key) -> xxh3 of this rank's bytes.
        self._replicated_sums: Optional[Dict[str, Optional[str]]] = None
        #: Called with (handle, self) once the step is committed (the persistent tier's enqueue).
        self.on_committed: Optional[Callable[[Any, "StepCommit"], None]] = None
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

    def plan(self, job: Job, part: FilePart, resources: Any) -> None:
        """Incremental: refer to the unchanged storages of the last committed step,
        holding a read lock on every step referred to until this one is
        committed (so no prune anywhere deletes it in between)."""
        if self.dist.distributed:
            # Which keys this rank holds (a digest): ranks that hold different keys
            # (pipeline stages) are found by loaders through the manifest's keysets.
            self._keyset = manifest.keyset_digest(part.flat.tree)
            # DTensor layouts (a digest): the coordinator reads them from one footer
            # per distinct digest instead of a listed piece per tensor per rank.
            self._layouts = layouts_digest(part.flat.tree, self.dist.world_size)
            if self.auto is not None and self.auto.reporting:
                self._auto_nodes = AutoReplication.key_nodes(part.flat.tree)
                if self.auto.mode == "auto":
                    self._check_candidates(part, resources)
            elif self.auto is None and self.replicated:
                self._replicated_sums = self._hash_named_replicated(part, resources)
        if self.incremental is None:
            return
        sources = part.flat.sources
        if self.incremental.mode == "content":
            with _device_buffer(resources, sources) as buffer:
                plan = self.incremental.plan(sources, self.step, buffer, part.events)
        else:
            plan = self.incremental.plan(sources, self.step)
        gone = set()
        self._held_references = []
        for step in plan.referenced_steps:
            try:
                held = job.holds.enter_context(StepDir(self.layout.step_path(step), step).reading())
            except CheckpointNotFoundError:
                gone.add(step)          # deleted meanwhile (by hand): write those bytes again
                continue
            # Another writer may have re-saved that step since this index recorded it
            # (issue 22 case 6): a reference to it would commit an unloadable step.
            wanted = plan.save_ids(step)
            found = _held_save_id(held)
            if wanted != {found}:
                log.warning("lazyckpt: %s: step %d is now another save (save id %s, not %s); step %d writes "
                            "those bytes in full instead of referring to them", self.path, step, found,
                            ", ".join(sorted(wanted)), self.step)
                gone.add(step)
            else:
                self._held_references.append(held)
        plan.drop_steps(gone)
        plan.apply(sources)
        self._plan = plan

    def _refuse_unreported(self, error: BaseException) -> None:
        """A failed job: the rounds this rank has not reported to fail at once on the others."""
        if not self.dist.distributed:
            return
        if not self._reported:
            refuse(self.dist, self.key, error)      # the others fail this step now, not at a deadline
        if self.auto is not None and self.auto.mode == "auto" and not self._auto_reported:
            refuse(self.dist, f"auto/{self.key}", error)

    def _check_candidates(self, part: FilePart, resources: Any) -> None:
        """``replicated="auto"``: deduplicate only the candidates every rank hashes
        alike (one store round, before anything is captured); every other
        candidate is written by each rank (lazyckpt/autorep.py)."""
        sources, candidates = part.flat.sources, list(self.replicated)
        with _device_buffer(resources, [s.own_copy for s in sources]) as buffer:
            digests = AutoReplication.content_digests(self._auto_nodes, candidates, sources, buffer, part.events)
        self._auto_reported = True
        outcome = agree(self.dist, f"auto/{self.key}", {"ok": True, "cands": candidates, "d": digests},
                        self.step, lambda done: {"dedup": AutoReplication.verdict(done)})
        dedup = [k for k in outcome.get("dedup", []) if k in self._auto_nodes]
        AutoReplication.assign_owners(self._auto_nodes, dedup, sources, self.dist.rank, self.dist.world_size)
        if dedup != candidates:
            log.info("lazyckpt: step %d: %s differ between ranks and are written by each rank",
                     self.step, sorted(set(candidates) - set(dedup)))
        self.replicated = dedup
        part.digest = json.dumps(dedup)     # the same on every rank, whatever each one walked

    def _hash_named_replicated(self, part: FilePart, resources: Any) -> Dict[str, Optional[str]]:
        """Named ``replicated=`` keys: xxh3 of this rank's own bytes of each key (the
        entries it does not write included), on the capture thread before anything
        is captured, so as the state was at save(). Reported at commit, where the
        coordinator compares them (:meth:`_check_replicated_values`). Keyed by
        ``repr`` (JSON keys are strings; ``1`` and ``"1"`` stay apart)."""
        sources = part.flat.sources
        nodes = AutoReplication.key_nodes(part.flat.tree, self.replicated)
        with _device_buffer(resources, [s.own_copy for s in sources]) as buffer:
            digests = AutoReplication.content_digests(nodes, self.replicated, sources, buffer, part.events,
                                                      skip_objects=True)
        return {repr(k): d for k, d in digests.items()}

    def _check_replicated_values(self, done: Dict[int, Dict[str, Any]]) -> None:
        """Coordinator: named replicated keys must hold the same bytes on every rank;
        each entry is written by one rank, so a difference would load as a mix of
        the ranks' values. Names each differing key and which ranks agree."""
        reports = {r: v.get("replicated_sums") for r, v in done.items()}
        if any(not isinstance(sums, dict) for sums in reports.values()):
            return
        differing = []
        for key in sorted({k for sums in reports.values() for k in sums}):
            groups: Dict[Any, List[int]] = {}
            for r in sorted(reports):
                if key in reports[r] and reports[r][key] is None:
                    break               # not comparable on that rank (a device without a host buffer)
                groups.setdefault(reports[r].get(key, "absent"), []).append(r)
            else:
                if len(groups) > 1:
                    shown = [_ranks(g) for g in sorted(groups.values(), key=len, reverse=True)[:4]]
                    more = f" | {len(groups) - 4} more groups" if len(groups) > 4 else ""
                    differing.append(f"{key} ({' | '.join(shown)}{more})")
        if differing:
            raise CheckpointError(
                f"step {self.step}: the replicated keys {', '.join(differing)} hold different values on "
                f"different ranks (ranks separated by '|' differ); each entry of a replicated key is written by "
                f"one rank only, so this step would load a mix of the ranks' values. Leave per-rank keys out of "
                f"replicated= (DDP with broadcast_buffers=False keeps per-rank BatchNorm statistics) or use "
                f"replicated='auto'", step=self.step)

    def part_path(self, job: Job, part: FilePart) -> str:
        path = os.path.join(self.tmp, rank_filename(self.dist.rank))
        job.lease(path, self.heartbeat_s)
        return path

    def commit(self, job: Job) -> None:
        for held in self._held_references:
            # Renamed away under its read lock: only another writer superseding it does
            # that. Fail the save rather than commit a step whose references dangle.
            if not held.still_there():
                raise CheckpointError(f"step {self.step}: step {held.step_dir.step}, which it refers to "
                                      f"(incremental), was replaced or deleted while it was written; another "
                                      f"writer on {self.path}? Not committed", step=self.step)
        (part,) = job.parts
        flat_shards = part.shards
        report: Dict[str, Any] = {"ok": True, "step": self.step, "bytes": part.stats.file_bytes,
                                  "digest": part.digest, "version": part.version,
                                  "references": self._plan.referenced_steps if self._plan else []}
        if self.costs is not None:
            recorder, t0, previous = self.costs
            report["cost"] = recorder.report(job, t0, previous)
        if not self.dist.distributed:
            report["shards"] = flat_shards or []
            self._reported = True
            self._commit({0: report})
            return
        report["keyset"] = self._keyset
        if self.auto is not None and self.auto.reporting:
            report["keys"] = AutoReplication.commit_digests(self._auto_nodes, part.entries)
        if self._replicated_sums is not None:
            report["replicated_sums"] = self._replicated_sums
        if self._layouts is not None:
            report["layouts"] = self._layouts
        elif flat_shards:
            # The store refuses large values (about 8 MiB): shard geometry travels
            # through a side file in the temporary directory instead.
            name = f".shards_{self.dist.rank:05d}.json"
            self._put_side(name, json.dumps(flat_shards, separators=(",", ":")).encode())
            report["shards_file"] = name
        self._reported = True
        outcome = agree(self.dist, self.key, report, self.step, self._commit,
                        forget=[f"c{self.call - 1}/outcome"])
        if self.auto is not None:
            self.auto.learned_from(outcome)

    def _commit(self, done: Dict[int, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Coordinator: every rank's file is durable; write the manifest and rename.
        Returns what the outcome carries to every rank (``replicated="auto"``'s keys)."""
        steps = {v.get("step") for v in done.values()}
        if steps != {self.step}:
            raise CheckpointError(f"step {self.step}: the ranks saved different steps in this call "
                                  f"({sorted(map(str, steps))}); save() must be called with the same step "
                                  f"on every rank", step=self.step)
        self._check_replicated_values(done)
        if len({v["digest"] for v in done.values()}) > 1:
            raise CheckpointError(f"step {self.step}: the replicated keys {self.replicated} differ between "
                                  f"ranks; they cannot be written once", step=self.step)
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
                             self.replicated, layouts=self._collect_layouts(done), seq=self.seq, cost=self.cost)
        self._publish(raw)
        if self.auto is None or not self.dist.distributed:
            return None
        return self.auto.learn(AutoReplication.identical(done), self.replicated, self.dist.world_size)

    def _collect_layouts(self, done: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        """The placement-derived index: each distinct layout digest's DTensors,
        read from the footer of the first rank that reported it (O(groups x
        tensors), not O(ranks x tensors))."""
        first: Dict[str, int] = {}
        for r in sorted(done):
            digest = done[r].get("layouts")
            if isinstance(digest, str):
                first.setdefault(digest, r)
        options = getattr(self.layout, "options", None) or resolve()
        layouts: Dict[str, Any] = {}
        for rank in first.values():
            path = f"{self.tmp}/{rank_filename(rank)}"
            size, read, done_reading = self._reader(path)
            try:
                _, footer = datafile.read_ends(size, read, path, options.max_footer_bytes)
            finally:
                done_reading()
            for key, node in dtensor_nodes(footer.tree).items():
                info = {"global_shape": node["global_shape"], "dtype": node["dtype"], "layout": node["layout"]}
                if layouts.setdefault(key, info) != info:
                    raise CheckpointError(f"step {self.step}: DTensor {key} has another layout on rank {rank} "
                                          f"than on an earlier rank", step=self.step)
        return layouts

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

    def abort(self, job: Job, error: BaseException) -> None:
        d = self.dist
        self._refuse_unreported(error)
        if not d.distributed or d.coordinator:
            if os.path.isdir(self.tmp):     # not renamed: nothing of this step may remain
                remove_tree(self.tmp)

    def after_commit(self, job: Job) -> None:
        if self.incremental is not None:
            (part,) = job.parts
            self.incremental.commit(self._plan, self.step, self.dist.rank, self.save_id, part.entries,
                                    part.block_bytes)
        if self.on_committed is not None:
            # Before retention: the persistent tier's drain holds the step from here on.
            self.on_committed(job.handle, self)
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


def _ranks(ranks: List[int]) -> str:
    """"rank 3" / "ranks 0-2, 5": short even for many ranks."""
    spans: List[List[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans[:8])
    if len(spans) > 8:
        text += ", ..."
    return ("rank " if len(ranks) == 1 else "ranks ") + text


def _held_save_id(held: Any) -> Optional[str]:
    """The save id in the manifest whose read lock is ``held`` (the file locked,
    not whatever the path names now); None if unreadable."""
    try:
        size = min(os.fstat(held.fd).st_size, manifest.MAX_MANIFEST_BYTES + 1)
        raw = os.pread(held.fd, size, 0)
        return manifest.parse(raw, held.manifest).get("save_id")
    except (OSError, CheckpointError):
        return None


@contextlib.contextmanager
def _device_buffer(resources: Any, sources: List[Any]) -> Iterator[Any]:
    """One host-cache chunk to hash device bytes through (numpy view, tensor
    view), or None when every source is on the host."""
    if not any(isinstance(s.data, torch.Tensor) and s.data.is_cuda for s in sources):
        yield None
        return
    cache = resources.cache_for(sources)
    chunk = cache.acquire(lambda: False)
    try:
        yield np.frombuffer(cache.chunk_memory(chunk), dtype=np.uint8), cache.chunk_tensor(chunk)
    finally:
        cache.release(chunk)


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
