"""The save planner: what each rank writes, decided before any byte moves.

The engine runs a job's planner on the capture thread ahead of the writer,
as torch.distributed.checkpoint runs its ``SavePlanner`` ahead of its
``StorageWriter``; the commit strategy (:mod:`lazyckpt.saving.commit`) then only
makes the checkpoint visible, carrying the plan's report in its round.

:class:`StepPlanner` plans one step of a Checkpointer:

* **references** (incremental, :mod:`lazyckpt.saving.incremental`): unchanged
  storages of the last committed step become references; every step referred
  to is held with a read lock until this one is committed;
* **dedup** (``replicated="auto"``, :mod:`lazyckpt.saving.autorep`): the
  candidates every rank hashes alike, agreed in a store round of their own,
  and the owners of their entries;
* **digests** (several ranks): which keys this rank holds (its keyset), its
  DTensor layouts, its named replicated keys' bytes; the coordinator checks
  them and indexes the layouts at commit.

Call order, and which ranks call what (the engine's ``run_job`` and
``StepCommit``)::

  1) (every rank, capture thread, before the part's file is opened)
     plan(job, part, resources); with "auto" candidates: the round auto/c<call>
  2) the writer writes what the plan left in part.flat.sources
  3) (every rank, commit) check_references(); references; report(part) -> the round c<call>
  4) (coordinator, every rank's report in hand) check(done); layouts_index(done, footer);
     replicated -> the manifest; outcome(done) -> what every rank learns
  5) (every rank, the round agreed) learned(outcome)
  6) abort(job, error) after a failure | committed(job) once committed, before
     the strategy's after_commit
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch

from lazyckpt.distributed import RankInfo, agree, refuse
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import manifest
from lazyckpt.state.walk import dtensor_nodes, layouts_digest
from .autorep import AutoReplication
from .engine import FilePart, Job
from .incremental import IncrementalIndex, Plan

log = logging.getLogger("lazyckpt")


class SavePlanner:
    """What the engine asks of a job's planner (all optional; ``Job.planner``
    may be None). Runs on the thread running the job."""

    def plan(self, job: Job, part: FilePart, resources: Any) -> None:
        """Before ``part`` is written, on the capture thread (the state is as at
        save()): decide what each entry becomes (written, a reference, another
        rank's)."""

    def abort(self, job: Job, error: BaseException) -> None:
        """The job failed (after the strategy's ``abort``): release what the plan holds
        on other ranks (a round they wait in)."""

    def committed(self, job: Job) -> None:
        """The job committed (before the strategy's ``after_commit``): remember what
        the next plan builds on. Its errors are only logged."""


class StepSavePlanner(SavePlanner):
    """What a Checkpointer step's commit (``saving/commit.py`` ``StepCommit``)
    asks of its planner, in this order (the engine's calls as in
    :class:`SavePlanner`):

    1. ``plan(job, part, resources)``: before the part is written.
    2. ``check_references()``: every rank, first thing at commit.
    3. ``references``: the earlier steps this rank's file refers to, in its report.
    4. Several ranks only: ``report(part)``, merged into the rank's commit report.
    5. The coordinator, every rank's report in hand: ``check(done)``, then
       ``replicated`` and ``layouts_index(done, footer)`` for the manifest, and
       after it is published ``outcome(done)`` (what every rank learns).
    6. Several ranks: ``learned(outcome)`` on every rank.
    7. ``committed(job)``, or ``abort(job, error)`` on any failure.

    ``tests/test_planner_contract.py`` checks that the commit calls nothing
    this class does not declare."""

    #: The keys written once (as named, or ``"auto"``'s agreed candidates).
    replicated: List[Any] = []

    def check_references(self) -> None:
        raise NotImplementedError

    @property
    def references(self) -> List[int]:
        raise NotImplementedError

    def report(self, part: FilePart) -> Dict[str, Any]:
        raise NotImplementedError

    def check(self, done: Dict[int, Dict[str, Any]]) -> None:
        raise NotImplementedError

    def layouts_index(self, done: Dict[int, Dict[str, Any]], footer: Callable[[int], Any]) -> Dict[str, Any]:
        raise NotImplementedError

    def outcome(self, done: Dict[int, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        raise NotImplementedError

    def learned(self, outcome: Dict[str, Any]) -> None:
        raise NotImplementedError


class StepPlanner(StepSavePlanner):
    """What one rank writes for one step of a Checkpointer directory.

    ``call`` is this save's call number (the same on every rank; the store
    round of ``"auto"`` is named after it); ``save_id`` is the commit's, under
    which the incremental index records this step."""

    def __init__(self, layout: Any, dist: RankInfo, step: int, call: int, save_id: str, *,
                 replicated: List[Any], incremental: Optional[IncrementalIndex] = None,
                 auto: Optional[AutoReplication] = None):
        self.layout = layout                # where the steps referred to are
        self.dist = dist
        self.step = step
        self.key = f"c{call}"
        self.save_id = save_id
        #: The keys written once: as named, or (``"auto"``) the candidates every rank agreed on.
        self.replicated = replicated
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

    # ---------------------------------------------------------------- before writing

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
                held = job.holds.enter_context(self.layout.reading(step))
            except CheckpointNotFoundError:
                gone.add(step)          # deleted meanwhile (by hand): write those bytes again
                continue
            # Another writer may have re-saved that step since this index recorded it:
            # a reference to it would commit an unloadable step.
            wanted = plan.save_ids(step)
            found = _held_save_id(held)
            if wanted != {found}:
                log.warning("lazyckpt: %s: step %d is now another save (save id %s, not %s); step %d writes "
                            "those bytes in full instead of referring to them", self.layout.path, step, found,
                            ", ".join(sorted(wanted)), self.step)
                gone.add(step)
            else:
                self._held_references.append(held)
        plan.drop_steps(gone)
        plan.apply(sources)
        self._plan = plan

    def _check_candidates(self, part: FilePart, resources: Any) -> None:
        """``replicated="auto"``: deduplicate only the candidates every rank hashes
        alike (one store round, before anything is captured); every other
        candidate is written by each rank (lazyckpt/saving/autorep.py)."""
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

    # ---------------------------------------------------------------- at commit

    def check_references(self) -> None:
        """Every rank, first thing at commit: the steps this one refers to are still there."""
        for held in self._held_references:
            # Renamed away under its read lock: only another writer superseding it does
            # that. Fail the save rather than commit a step whose references dangle.
            if not held.still_there():
                raise CheckpointError(f"step {self.step}: step {held.step_dir.step}, which it refers to "
                                      f"(incremental), was replaced or deleted while it was written; another "
                                      f"writer on {self.layout.path}? Not committed", step=self.step)

    @property
    def references(self) -> List[int]:
        """The earlier steps this rank's file refers to (incremental)."""
        return self._plan.referenced_steps if self._plan else []

    def report(self, part: FilePart) -> Dict[str, Any]:
        """Several ranks: this rank's plan as its commit report carries it (its
        key set, ``"auto"``'s digests, the named replicated sums, and its DTensor
        pieces listed under ``layouts``)."""
        out: Dict[str, Any] = {"keyset": self._keyset}
        if self.auto is not None and self.auto.reporting:
            out["keys"] = AutoReplication.commit_digests(self._auto_nodes, part.entries)
        if self._replicated_sums is not None:
            out["replicated_sums"] = self._replicated_sums
        if self._layouts is not None:
            out["layouts"] = self._layouts
        return out

    def check(self, done: Dict[int, Dict[str, Any]]) -> None:
        """Coordinator: the ranks' plans fit together (what is written once is the same everywhere)."""
        self._check_replicated_values(done)
        if len({v["digest"] for v in done.values()}) > 1:
            raise CheckpointError(f"step {self.step}: the replicated keys {self.replicated} differ between "
                                  f"ranks; they cannot be written once", step=self.step)

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

    def layouts_index(self, done: Dict[int, Dict[str, Any]], footer: Callable[[int], Any]) -> Dict[str, Any]:
        """Coordinator: the manifest's placement-derived index, each distinct layout
        digest's DTensors read from ``footer(rank)`` of the first rank that
        reported it (O(groups x tensors), not O(ranks x tensors))."""
        first: Dict[str, int] = {}
        for r in sorted(done):
            digest = done[r].get("layouts")
            if isinstance(digest, str):
                first.setdefault(digest, r)
        layouts: Dict[str, Any] = {}
        for rank in first.values():
            for key, node in dtensor_nodes(footer(rank).tree).items():
                info = {"global_shape": node["global_shape"], "dtype": node["dtype"], "layout": node["layout"]}
                if layouts.setdefault(key, info) != info:
                    raise CheckpointError(f"step {self.step}: DTensor {key} has another layout on rank {rank} "
                                          f"than on an earlier rank", step=self.step)
        return layouts

    def outcome(self, done: Dict[int, Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        """Coordinator, once the manifest is published: what every rank learns from
        this commit's round (``replicated="auto"``'s keys), or None."""
        if self.auto is None or not self.dist.distributed:
            return None
        return self.auto.learn(AutoReplication.identical(done), self.replicated, self.dist.world_size)

    def learned(self, outcome: Dict[str, Any]) -> None:
        """Every rank, its commit round agreed: the keys the next saves try."""
        if self.auto is not None:
            self.auto.learned_from(outcome)

    # ---------------------------------------------------------------- after

    def abort(self, job: Job, error: BaseException) -> None:
        if self.dist.distributed and self.auto is not None and self.auto.mode == "auto" \
                and not self._auto_reported:
            refuse(self.dist, f"auto/{self.key}", error)    # the others fail their round now, not at a deadline

    def committed(self, job: Job) -> None:
        if self.incremental is not None:
            (part,) = job.parts
            self.incremental.commit(self._plan, self.step, self.dist.rank, self.save_id, part.entries,
                                    part.block_bytes)


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
