"""Incremental checkpoints: bytes that did not change are neither copied nor
written again.

A tensor storage that is unchanged since this checkpointer's previous
committed step becomes a ``"ref"`` entry (format version 2) pointing at the
file of the step that holds its bytes, with that range's checksums. Two
ways to tell "unchanged":

* ``"version"`` (``incremental=True``): the same storage object (still alive:
  held weakly), the same version counter of every tensor of the state that
  uses it, the same size and device. torch bumps a tensor's version on every
  in-place operation made through it -- optimizer updates included -- so this
  costs nothing. It cannot see writes that bypass the counter: through
  ``tensor.data`` (a tensor with its own counter), a numpy or DLPack view,
  custom kernels writing the memory directly. Use ``"content"`` there.
* ``"content"``: the bytes hash to the same block checksums as the previous
  step's entry at the same state path. Catches every change, at the cost of
  reading the whole state (on a GPU, a copy to the host) and hashing it, but
  still writes only what changed.

Rules that keep references safe:

* a reference points at the file that holds the bytes, never at another
  reference, so loading opens only files with data;
* it points only at a strictly older step, so superseding (a rollback, which
  removes steps >= the new one) can never leave one dangling;
* ``full_every=K`` makes every K-th save write everything, bounding how far
  back references reach;
* the index only ever holds the entries of the last committed step, and is
  updated once a step is committed on every rank (a failed save changes
  nothing).

Retention keeps every step a kept step refers to (layout.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

import torch
import xxhash

from . import format as fmt
from .capture import DeviceCopier, as_numpy, hash_through_host
from .providers import Source


@dataclass
class Location:
    """Where the bytes of one storage are: an entry of an earlier step's file."""
    step: int
    rank: int
    entry: int
    offset: int
    length: int
    block_bytes: int
    checksums: List[int]
    save_id: str

    def as_ref(self) -> Dict[str, Any]:
        return {"step": self.step, "rank": self.rank, "entry": self.entry, "offset": self.offset,
                "length": self.length, "block_bytes": self.block_bytes, "checksums": list(self.checksums),
                "save_id": self.save_id}


@dataclass
class _Known:
    location: Location
    storage: Any                # weakref to the storage (version mode)
    versions: Tuple[int, ...]
    device: str


def version_of(t: torch.Tensor) -> int:
    """A tensor's version counter; -1 where there is none (inference tensors),
    which never matches (incremental checkpoints then always write it)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _signature(s: Source) -> Tuple[Any, Tuple[int, ...]]:
    """(the storage, weakly; the version counters of the tensors using it)."""
    return weakref.ref(s.data.untyped_storage()), tuple(version_of(t) for t in s.tensors)


@dataclass
class Plan:
    """One save's decisions: which sources refer to earlier bytes."""
    originals: List[Source]                      # the sources as flattened
    refs: Dict[int, Location]                    # source index -> where its bytes are
    #: source index -> (storage weakref, versions), read on the capture thread
    signatures: Dict[int, Tuple[Any, Tuple[int, ...]]] = field(default_factory=dict)

    @property
    def referenced_steps(self) -> List[int]:
        return sorted({loc.step for loc in self.refs.values()})

    def apply(self, sources: List[Source]) -> None:
        for i, loc in self.refs.items():
            s = self.originals[i]
            sources[i] = Source("ref", name=s.name, length=0, ref=loc.as_ref())

    def drop_steps(self, steps: set) -> None:
        self.refs = {i: loc for i, loc in self.refs.items() if loc.step not in steps}


class IncrementalIndex:
    """What one rank's last committed step holds, to refer to its unchanged bytes."""

    def __init__(self, mode: str, full_every: int = 0):
        self.mode = mode                  # "version" or "content" (knobs.Options.incremental)
        self.full_every = full_every
        self._known: Dict[Any, _Known] = {}
        self._saves = 0

    def _key(self, plan: Plan, i: int) -> Any:
        if self.mode == "content":
            return plan.originals[i].name
        return id(plan.signatures[i][0]())

    def plan(self, sources: List[Source], step: int, copy_buffer: Any = None, events: Any = None) -> Plan:
        """Decide, on the capture thread, which sources are unchanged since the
        last committed step. It runs before the barrier lets training modify
        the state, so the version counters read here are those of save()."""
        plan = Plan(list(sources), {})
        for i, s in enumerate(sources):
            if s.kind == "data" and isinstance(s.data, torch.Tensor):
                plan.signatures[i] = _signature(s)
        self._saves += 1
        if self.full_every and (self._saves - 1) % self.full_every == 0:
            return plan                       # a full save: bounds the reach of references
        for i, (storage, versions) in plan.signatures.items():
            s = sources[i]
            known = self._known.get(self._key(plan, i))
            if known is None or known.location.step >= step or known.location.length != s.length:
                continue
            if self.mode == "version":
                same = (-1 not in versions and known.storage() is storage()
                        and known.versions == versions and known.device == str(s.data.device))
            else:
                same = _same_content(s.data, known.location, copy_buffer, events)
            if same:
                plan.refs[i] = known.location
        return plan

    def commit(self, plan: Plan, step: int, rank: int, save_id: str, entries: List[fmt.Entry],
               block_bytes: int) -> None:
        """The step is committed on every rank: it is now what later saves refer to."""
        known: Dict[Any, _Known] = {}
        for i, (storage, versions) in plan.signatures.items():
            s = plan.originals[i]
            loc = plan.refs.get(i)
            if loc is None:
                e = entries[i]
                if e.kind != "data":
                    continue
                loc = Location(step, rank, i, e.offset, e.length, block_bytes, list(e.checksums), save_id)
            known[self._key(plan, i)] = _Known(loc, storage, versions, str(s.data.device))
        self._known = known


def _same_content(data: torch.Tensor, loc: Location, copy_buffer: Any, events: Any = None) -> bool:
    """Whether ``data`` hashes to ``loc``'s block checksums (its file's block
    partition). CPU tensors are hashed in place; device tensors go through
    ``copy_buffer`` (a host chunk: (numpy view, tensor view)), copied after
    ``events`` (recorded in save(): the training stream's writes come first)."""
    spans = fmt.block_spans(loc.offset, loc.length, loc.block_bytes)
    if data.device.type == "cpu":
        host = as_numpy(data)
        for k, (lo, hi) in enumerate(spans):
            if fmt.checksum(host[lo - loc.offset:hi - loc.offset]) != loc.checksums[k]:
                return False
        return True
    if copy_buffer is None:
        return False
    copier = DeviceCopier(events)
    try:
        for k, (lo, hi) in enumerate(spans):
            digest = xxhash.xxh3_64()
            hash_through_host(digest, data[lo - loc.offset:hi - loc.offset], copy_buffer, copier)
            if digest.intdigest() != loc.checksums[k]:
                return False
        return True
    finally:
        copier.synchronize()


def referenced_steps(entries: List[fmt.Entry]) -> List[int]:
    return sorted({e.ref["step"] for e in entries if e.kind == "ref"})


def owned_bytes(entries: List[fmt.Entry]) -> int:
    return sum(e.length for e in entries if e.kind in ("data", "pickle"))
