"""``replicated="auto"``: state identical on every rank is written once, found by content.

A DDP user who does not name the replicated keys writes N copies of the
model and optimizer (DCP deduplicates same-path plain tensors by itself).
This module finds the identical state, at the granularity of top-level
``str`` keys (the granularity of ``replicated=``), in two halves:

* **Learning** (every multi-rank save with ``"auto"``, the first one with
  ``replicated`` left unset; no extra I/O): each rank reports per top-level key a digest of
  its subtree -- the tree node, entry numbers included, devices left out,
  and each entry's kind, size and the block checksums the writer computes
  anyway -- and its bytes. The coordinator lists the keys whose digest is
  the same on every rank. Left unset, it warns once with the bytes
  ``replicated=`` would save per checkpoint. With ``"auto"`` the keys become
  the candidates of the next saves; the list travels in the commit's
  outcome, so every rank learns the same list at the same step.
* **Checking** (every ``"auto"`` save with candidates, on the capture
  thread before anything is captured): the candidates are walked as
  replicated keys (each entry assigned to one owning rank), but every rank
  keeps a view of its own copy. Each rank hashes its candidates' bytes
  (xxh3; CPU tensors in place, device tensors through one host-cache chunk)
  and reports them; the coordinator publishes the candidates that are
  candidates on every rank and hash the same everywhere. Every other
  candidate is written by each rank after all, and the deduplicated keys'
  entries get their owners from that agreed list (:meth:`assign_owners`),
  never from the walk's balance by each rank's own sizes. A key that stops being
  identical (a counter, a per-rank buffer) is therefore never lost: it is
  written per rank from that save on, and learned again if it converges.

Entry numbers are part of both digests, so a key is only deduplicated when
its entries have the same numbers on every rank (a remote entry names the
owner's entry by number). Keys holding DTensors or pickled objects are
never deduplicated (DTensors carry their own placement; hashing a pickle
would serialize it twice). The checking round is one store round trip per
save in the background; it makes each rank's capture start once every rank
has called ``save()`` for that step (DDP ranks are in lockstep anyway).
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any, Dict, List, Optional

import torch
import xxhash

from lazyckpt.state.providers import Source, _without_devices, referenced_entries
from .capture import DeviceCopier, as_numpy, hash_through_host

log = logging.getLogger("lazyckpt")


class AutoReplication:
    """What one Checkpointer learned about its ranks' identical state."""

    def __init__(self, mode: str):
        self.mode = mode                    # "auto" (deduplicate) or "hint" (warn once)
        #: "auto": the top-level keys found identical on every rank at the last commit.
        self.learned: List[str] = []
        #: The warning given (once), or None.
        self.advice: Optional[str] = None
        #: "hint": the first committed save is looked at, then no more digests are reported
        #: (they cost ~40 B per key per rank in the store; the advice is about the state's shape).
        self.hinting = True

    def candidates(self, state: Any) -> List[str]:
        """The keys the next save walks as replicated (those learned, in state order)."""
        if self.mode != "auto" or not self.learned or type(state) is not dict:
            return []
        learned = set(self.learned)
        return [k for k in state if type(k) is str and k in learned]

    # ---------------------------------------------------------------- digests

    @staticmethod
    def key_nodes(tree: Any, keys: Optional[List[Any]] = None) -> Dict[Any, Any]:
        """Top-level key -> (structure JSON, entry numbers), for a dict state: the
        ``str`` keys not holding DTensors, or (named ``replicated=``) exactly ``keys``."""
        out: Dict[Any, Any] = {}
        if not isinstance(tree, dict) or tree.get("$") != "dict":
            return out
        wanted = None if keys is None else {(type(k), k) for k in keys}
        for k, node in zip(tree["k"], tree["v"]):
            if wanted is not None:
                if (type(k), k) not in wanted:
                    continue
            elif type(k) is not str:
                continue
            text = json.dumps(_without_devices(node), sort_keys=True, separators=(",", ":"))
            if wanted is None and '"$":"dtensor"' in text:
                continue
            out[k] = (text, sorted(referenced_entries(node)))
        return out

    @staticmethod
    def commit_digests(nodes: Dict[str, Any], entries: List[Any]) -> Dict[str, List[Any]]:
        """Per key: [digest of structure + entries as written, bytes]. Keys with an
        entry another rank writes (``remote``) or with no bytes are left out."""
        out: Dict[str, List[Any]] = {}
        for k, (text, idxs) in nodes.items():
            h = xxhash.xxh3_64(text.encode())
            nbytes = 0
            for i in idxs:
                e = entries[i]
                if e.kind == "remote":
                    break
                sums = e.ref.get("checksums") if e.kind == "ref" else e.checksums
                h.update(f"{e.content_kind}:{e.size}:{sums};".encode())
                nbytes += e.size
            else:
                if nbytes:
                    out[k] = [h.hexdigest(), nbytes]
        return out

    @staticmethod
    def identical(done: Dict[int, Dict[str, Any]]) -> Dict[str, int]:
        """Coordinator: key -> bytes, for the keys whose digest every rank reported alike."""
        reports = [done[r].get("keys") or {} for r in sorted(done)]
        first = reports[0]
        return {k: d[1] for k, d in first.items() if all(r.get(k) == d for r in reports[1:])}

    # ---------------------------------------------------------------- checking

    @staticmethod
    def content_digests(nodes: Dict[Any, Any], candidates: List[Any], sources: List[Source],
                        copy_buffer: Any = None, events: Any = None,
                        skip_objects: bool = False) -> Dict[Any, Optional[str]]:
        """Per candidate: xxh3 of its structure and of this rank's own bytes, each
        entry's length included (None: not comparable -- a pickled object, a DTensor,
        a device tensor without a buffer). ``skip_objects``: pickled objects are left
        out of the digest instead (named ``replicated=`` keys: checked as far as
        possible; pickling on every rank would cost a second serialization).
        Device bytes are copied after ``events`` (save()'s, on the training stream)."""
        out: Dict[Any, Optional[str]] = {}
        copier = DeviceCopier(events)
        try:
            for k in candidates:
                if k not in nodes:
                    out[k] = None
                    continue
                text, idxs = nodes[k]
                h = xxhash.xxh3_64(text.encode())
                for i in idxs:
                    s = sources[i].own_copy
                    if skip_objects and s.deferred:
                        continue
                    # The length first: equal digests then mean equal entry sizes too,
                    # which the owners of deduplicated entries are balanced by.
                    h.update(b"%d;" % (s.length or 0))
                    if s.kind != "data" or s.deferred or not _hash_into(h, s.data, copy_buffer, copier):
                        h = None
                        break
                out[k] = None if h is None else h.hexdigest()
        finally:
            copier.synchronize()
        return out

    @staticmethod
    def verdict(done: Dict[int, Dict[str, Any]]) -> List[str]:
        """Coordinator: the candidates every rank walked alike and hashed alike."""
        reports = [done[r] for r in sorted(done)]
        cands = reports[0].get("cands")
        if any(r.get("cands") != cands for r in reports[1:]):
            return []                       # walked in different orders: entry numbers differ
        first = reports[0].get("d") or {}
        return [k for k in cands if first.get(k) is not None
                and all((r.get("d") or {}).get(k) == first[k] for r in reports[1:])]

    @staticmethod
    def assign_owners(nodes: Dict[str, Any], deduplicated: List[str], sources: List[Source],
                      rank: int, world_size: int) -> None:
        """Owners of the deduplicated keys' entries, the same on every rank; every
        other entry becomes this rank's own copy.

        The walk balanced owners over all the candidates by this rank's own
        sizes; a candidate that now differs in size between ranks (written per
        rank after all) would shift the owners of the entries after it
        differently on each rank, and nobody would write them. So the owners are
        balanced again over the agreed keys' entries only, in entry order: their
        sizes are part of the digests every rank agreed on."""
        keep = {i for k in deduplicated for i in nodes[k][1]}
        for i, s in enumerate(sources):
            if s.kind == "remote" and i not in keep:
                sources[i] = _with_tensors(s.own_copy, s)
        load = [0] * world_size
        for i in sorted(keep):
            own = sources[i].own_copy
            owner = min(range(world_size), key=load.__getitem__)
            load[owner] += max(1, own.length or 0)
            if owner == rank:
                sources[i] = _with_tensors(own, sources[i])
            else:
                sources[i] = _with_tensors(Source("remote", name=own.name, length=0, owner=owner, local=own),
                                           sources[i])

    # ---------------------------------------------------------------- outcome

    @property
    def reporting(self) -> bool:
        """Whether a commit report carries the per-key digests."""
        return self.mode == "auto" or self.hinting

    def learn(self, identical: Dict[str, int], deduplicated: List[str], world_size: int) -> Dict[str, Any]:
        """Coordinator, at commit: the outcome's addition (``"auto"``; ``"hinted"``), and the warning."""
        if self.mode == "auto":
            return {"auto": sorted(set(identical) | set(deduplicated))}
        if identical and self.advice is None:
            saved = sum(identical.values()) * (world_size - 1)
            self.advice = (f"lazyckpt: the keys {sorted(identical)} are identical on all {world_size} ranks and "
                           f"were written {world_size} times: replicated={sorted(identical)!r} or "
                           f"replicated='auto' would write {saved / 1e6:.1f} MB less per checkpoint")
            log.warning("%s", self.advice)
            warnings.warn(self.advice, stacklevel=1)
        return {"hinted": True}

    def learned_from(self, outcome: Dict[str, Any]) -> None:
        """Every rank, once its commit succeeded: the keys to try next (or: hinted)."""
        if self.mode == "auto" and isinstance(outcome.get("auto"), list):
            self.learned = [k for k in outcome["auto"] if type(k) is str]
        if outcome.get("hinted"):
            self.hinting = False


def _with_tensors(new: Source, old: Source) -> Source:
    """``new`` standing for ``old``'s entry: the walk appended the live tensors
    (whose version counters incremental saves read) to ``old``."""
    if new is not old and old.tensors and not new.tensors:
        new.tensors = old.tensors
    return new


def _hash_into(h: Any, data: Any, copy_buffer: Any, copier: DeviceCopier) -> bool:
    if isinstance(data, memoryview):
        h.update(data)
        return True
    if not isinstance(data, torch.Tensor):
        return False
    if data.device.type == "cpu":
        h.update(as_numpy(data))
        return True
    if copy_buffer is None:
        return False
    hash_through_host(h, data, copy_buffer, copier)
    return True
