"""Incremental checkpoints: bytes that did not change are neither copied nor
written again.

A tensor storage that is unchanged since this checkpointer's previous
committed step becomes a ``"ref"`` entry (format version 2) pointing at the
file of the step that holds its bytes, with that range's checksums. Two
ways to tell "unchanged":

* ``"content"`` (``incremental=True``, the default mode): the bytes, read at
  save time, hash to the same block checksums (xxh3-64, the ones the writer
  computed when it wrote them) as the previous step's entry at the same state
  path. Sound for every writer: whatever changed a byte changes a checksum
  (up to a 64-bit hash collision per block). CPU tensors are hashed in place;
  device tensors go through a host chunk (on-device hashing is future work).
  To keep it cheap, a digest of 1024 evenly spaced 16-byte windows of every
  tensor (:func:`_sample_digest`) is kept per step: a sample that differs
  proves a change without hashing the rest, so full training pays about
  16 KiB of hashing per tensor and writes as usual; a sample that matches is
  never trusted alone -- the whole tensor is hashed (so a tensor changed in
  few places, missed by the sample, is hashed and then written). Unchanged
  tensors are hashed in full (that read replaces their copy and write).
* ``"version-counters"`` (opt-in; ``"version"`` is its old name): the same
  storage object (still alive: held weakly), the same version counter of
  every tensor of the state that uses it, the same size and device. Free, but
  torch does NOT bump the counter for many in-place writers, and every write
  it misses is saved as the previous step's stale bytes, silently. Measured
  on torch 2.13, it misses: optimizers built with ``fused=True`` (Adam,
  AdamW, SGD, Adagrad: weights and moments; the HF Trainer's default is a
  fused AdamW); BatchNorm's ``running_mean``/``running_var`` in a
  training-mode forward; ``dist.broadcast``/``dist.all_reduce`` and other
  collectives; writes through ``tensor.data`` (its own counter), numpy or
  DLPack views; custom (C++/CUDA/Triton) kernels; other processes (shared
  memory); ``load(into=)`` of a DTensor (filled through its local tensor,
  while the DTensor's counter is compared). Use it only for states written
  solely by ordinary autograd-visible in-place ops.

Rules that keep references safe:

* a reference points at the file that holds the bytes, never at another
  reference, so loading opens only files with data;
* it points only at a strictly older step, so superseding (a rollback, which
  removes steps >= the new one) can never leave one dangling;
* before it is written, the referred-to step's manifest must still carry the
  save id the reference names (lazyckpt/saving/planner.py ``StepPlanner.plan``):
  another writer may have re-saved that step; its bytes are then written in
  full instead;
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
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import xxhash

from lazyckpt.formats import datafile as fmt
from lazyckpt.state.providers import Source
from .capture import DeviceCopier, as_numpy, hash_through_host


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
    storage: Any                # weakref to the storage (version-counters mode)
    versions: Tuple[int, ...]
    device: str
    sample: Optional[int] = None    # content mode: _sample_digest of the bytes at that save


#: The sample digest's windows: 1024 windows of 16 bytes, evenly spaced (many
#: positions: a sparsely changed tensor -- the AdamW moments of an embedding
#: whose untouched rows stay 0 -- is more likely to show its change).
SAMPLE_WINDOWS = 1024
SAMPLE_WINDOW_BYTES = 16


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
    #: content mode: source index -> _sample_digest of its bytes at save time
    samples: Dict[int, Optional[int]] = field(default_factory=dict)

    @property
    def referenced_steps(self) -> List[int]:
        return sorted({loc.step for loc in self.refs.values()})

    def apply(self, sources: List[Source]) -> None:
        for i, loc in self.refs.items():
            s = self.originals[i]
            sources[i] = Source("ref", name=s.name, length=0, ref=loc.as_ref())

    def save_ids(self, step: int) -> set:
        """The save ids this plan's references to ``step`` name (one, normally)."""
        return {loc.save_id for loc in self.refs.values() if loc.step == step}

    def drop_steps(self, steps: set) -> None:
        self.refs = {i: loc for i, loc in self.refs.items() if loc.step not in steps}


class IncrementalIndex:
    """What one rank's last committed step holds, to refer to its unchanged bytes."""

    def __init__(self, mode: str, full_every: int = 0):
        self.mode = mode                  # "content" or "version-counters" (knobs.Options.incremental)
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
        content = self.mode == "content"
        if content:
            # Every save, full ones included: the next save compares against them.
            for i in plan.signatures:
                plan.samples[i] = _sample_digest(sources[i].data, copy_buffer, events)
        self._saves += 1
        if self.full_every and (self._saves - 1) % self.full_every == 0:
            return plan                       # a full save: bounds the reach of references
        for i, (storage, versions) in plan.signatures.items():
            s = sources[i]
            known = self._known.get(self._key(plan, i))
            if known is None or known.location.step >= step or known.location.length != s.length:
                continue
            if not content:
                same = (-1 not in versions and known.storage() is storage()
                        and known.versions == versions and known.device == str(s.data.device))
            elif known.sample is not None and known.sample != plan.samples[i]:
                same = False        # a differing sample proves a change: no need to hash the rest
            else:                   # a matching sample proves nothing: hash all of it
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
            known[self._key(plan, i)] = _Known(loc, storage, versions, str(s.data.device), plan.samples.get(i))
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


def _sample_digest(data: torch.Tensor, copy_buffer: Any, events: Any = None) -> Optional[int]:
    """xxh3-64 of SAMPLE_WINDOWS evenly spaced windows of a flat uint8 tensor
    (all of it when shorter): a cheap test that proves a change when it
    differs and proves nothing when it matches. Device tensors: the first
    window's bytes only, through ``copy_buffer`` (None without one)."""
    n = data.numel()
    window = SAMPLE_WINDOWS * SAMPLE_WINDOW_BYTES
    if data.device.type == "cpu":
        host = as_numpy(data)
        if n <= window:
            return fmt.checksum(host)
        stride = (n - SAMPLE_WINDOW_BYTES) // (SAMPLE_WINDOWS - 1)
        windows = np.lib.stride_tricks.as_strided(host, (SAMPLE_WINDOWS, SAMPLE_WINDOW_BYTES), (stride, 1),
                                                  writeable=False)
        return fmt.checksum(np.ascontiguousarray(windows))
    if copy_buffer is None:
        return None
    copier = DeviceCopier(events)
    try:
        digest = xxhash.xxh3_64()
        hash_through_host(digest, data[:window], copy_buffer, copier)
        return digest.intdigest()
    finally:
        copier.synchronize()


def referenced_steps(entries: List[fmt.Entry]) -> List[int]:
    return sorted({e.ref["step"] for e in entries if e.kind == "ref"})


def owned_bytes(entries: List[fmt.Entry]) -> int:
    return sum(e.length for e in entries if e.kind in ("data", "pickle"))
