"""Plans: the walk of a state, reused by the next save of the same structure.

A training loop saves the same structure again and again: the same keys, the
same parameters, only scalars (steps, learning rates) and tensor *values*
change. ``flatten()`` rediscovers all of it on the caller's thread each time
(a provider dispatch, a path and a node per value). :class:`PlanCache` keeps
the previous walk's *skeleton* -- per container its type and keys, per tensor
its geometry and entry index, per scalar nothing -- and splits the next save
of the same structure in two:

* on the caller's thread (``gather``, all that ``save()`` pays for): every
  container is checked against the skeleton (its exact type, its keys and
  their types, its length) and its values are copied into a tuple, and every
  leaf's type is checked (a tensor where a tensor was, a scalar where a
  scalar was). That is a *snapshot of the structure*: after ``save()``
  returns, the caller may change its dicts and lists as it likes. The
  tensors' geometry is not read here (1-2 us per tensor: the target is
  save() <= 2 ms for 1,000 tensors);
* on the capture thread (:meth:`PendingFlat.resolve`, before any byte is
  read): every tensor is checked against the geometry its node records
  (type, dtype, shape, stride, offset, device, requires_grad, layout and
  flags) and the storage-sharing pattern must be the same (tied weights stay
  tied, an untied one is a miss); scalars are encoded, containers get new
  nodes, tensor nodes are reused (they are equal by the check), and each
  source's flat view and length are taken from the current storage. Reading
  the geometry there is as exact as reading it in ``save()``: the capture
  contract already forbids changing the state's tensors in place (their
  metadata too: ``resize_``, ``set_``, ``requires_grad_``) before the snapshot, and the values
  themselves are read there too;
* a difference found on the capture thread is a miss there: the state as it
  was at ``save()`` is rebuilt from the snapshot (the same containers, the
  same leaf objects), walked in full, and planned again for the next save.
  Anything else -- a different type or key, a changed length, a value only a
  full walk handles (numpy, bytes, pickled objects, DTensors, custom
  providers, sets, non-str/int keys) -- is a miss on the caller's thread:
  the full walk runs there and its result is returned as is.

So a plan's result is, by construction, what ``flatten()`` would return for
the same state (tests/test_plan_cache.py compares them on mutated states,
and on states mutated after the gather). The plan holds no tensor or storage
between saves (no memory kept alive).
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .providers import (DictProvider, Flattened, ScalarProvider, SequenceProvider, Source, TensorProvider,
                        _flat_bytes_of_storage, _registry, _without_devices, flatten)

_SCALAR, _TENSOR, _DICT, _SEQ = 0, 1, 2, 3
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_TENSOR_TYPE_SET = frozenset(_TENSOR_TYPES)
_SCALAR_TYPE_SET = frozenset({type(None), bool, int, str, float})
_KEY_TYPES = frozenset({str, int})
_DICTS = (dict, collections.OrderedDict)
_SEQS = (list, tuple)
#: Types the plan walks itself; a provider registered for one of them makes every state a miss.
_OWN_TYPES = {dict, collections.OrderedDict, list, tuple, torch.Tensor, torch.nn.Parameter,
              type(None), bool, int, str, float}
_strided = torch.strided


class _Miss(Exception):
    """The state is not the planned structure: walk it in full."""


class _Uncacheable(Exception):
    """The state holds something only the full walk handles."""


def _geometry(t: torch.Tensor) -> Tuple[Any, ...]:
    """Everything a tensor's node and its provider's choice depend on, but its storage."""
    return (type(t), t.dtype, t.shape, t.stride(), t.storage_offset(), t.device, t.requires_grad,
            t.layout, t.is_conj(), t.is_neg(), t.is_quantized, t.is_nested)


class _Plan:
    def __init__(self, key: Any, skeleton: Any, sources: List[Source], nbytes: List[int], replicated: List[Any]):
        self.key = key
        self.skeleton = skeleton
        #: Per source: (kind, name, length, owner, bytes of its storage) -- descriptions only, no data
        #: (a "remote" source's length is 0: another rank writes it).
        self.sources = [(s.kind, s.name, s.length, s.owner, n) for s, n in zip(sources, nbytes)]
        self.replicated = replicated


class PlanCache:
    """One Checkpointer's last plan (one per rank: each rank has its own state).

    ``gather(state, ...)`` is what ``save()`` calls: a :class:`PendingFlat`
    (resolved on the capture thread) when the plan serves, else the full
    walk's :class:`Flattened`. ``flatten(state, ...)`` does both on this
    thread and returns what :func:`lazyckpt.state.providers.flatten` returns.
    ``hits``/``misses`` count how often the plan served a save, and ``last``
    says what the last call did: "hit", "miss" (a full walk, a new plan) or
    "uncacheable" (a full walk; the state cannot be planned). A difference
    found when resolving turns that save's hit into a miss (then ``last``
    changes on the capture thread, after ``save()`` returned).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.hits = 0
        self.misses = 0
        self.last = ""
        self._plan: Optional[_Plan] = None
        #: Saves to skip before planning again, after a state could not be planned
        #: (so a state that never can costs one extra walk now and then, not every save).
        self._backoff = 0
        self._skip = 0
        #: The capture thread resolves (and may replan) while the caller gathers the next save.
        self._lock = threading.Lock()

    def clear(self) -> None:
        self._plan = None

    def flatten(self, state: Any, rank: int = 0, world_size: int = 1, replicated: Any = ()) -> Flattened:
        flat = self.gather(state, rank, world_size, replicated)
        return flat.resolve() if isinstance(flat, PendingFlat) else flat

    def gather(self, state: Any, rank: int = 0, world_size: int = 1,
               replicated: Any = ()) -> Union[Flattened, "PendingFlat"]:
        replicated = list(replicated)
        if not self.enabled:
            self.last = "off"
            return flatten(state, rank, world_size, replicated)
        # The registry's list is replaced whenever a provider is registered: a new one may handle
        # some type differently, so the plan is only valid under the list it was made with.
        providers = _registry.providers()
        key = (rank, world_size, id(providers))
        plan = self._plan
        if plan is not None and plan.key == key and plan.replicated == replicated:
            tensors: List[torch.Tensor] = []
            try:
                snapshot = _gather(state, plan.skeleton, tensors)
            except Exception:       # _Miss, or anything odd: walk in full
                pass
            else:
                with self._lock:
                    self.hits += 1
                    self.last = "hit"
                return PendingFlat(self, plan, snapshot, tensors)
        with self._lock:
            if self._plan is plan:
                self._plan = None
            self.misses += 1
        return self._walk(state, key, providers, replicated)

    def _walk(self, state: Any, key: Any, providers: Any, replicated: List[Any]) -> Flattened:
        """The full walk, and a plan of it for the next save."""
        rank, world_size, _ = key
        flat = flatten(state, rank, world_size, replicated)
        if self._skip:
            self._skip -= 1
            self.last = "uncacheable"
            return flat
        if any(getattr(p, "cls", None) in _OWN_TYPES for p in providers):
            self.last = "uncacheable"
            return flat
        try:
            builder = _Builder(flat)
            skeleton = builder.top(state, replicated)
        except Exception:           # _Uncacheable, or anything odd: the full walk's result stands
            self._backoff = min(64, self._backoff * 2 or 1)
            self._skip = self._backoff
            self.last = "uncacheable"
            return flat
        self._backoff = 0
        with self._lock:
            # Else another walk planned meanwhile (the caller's, or a late miss of an older
            # save): either plan is checked in full before it serves, so keeping it is safe.
            if self._plan is None:
                self._plan = _Plan(key, skeleton, flat.sources, builder.nbytes, replicated)
        self.last = "miss"
        return flat

    def _missed_late(self, plan: _Plan, state: Any) -> Flattened:
        """A gathered save differed from its plan in what only the capture thread checks."""
        with self._lock:
            self.hits -= 1
            self.misses += 1
            if self._plan is plan:
                self._plan = None
        return self._walk(state, plan.key, _registry.providers(), plan.replicated)


class PendingFlat:
    """A save gathered along a plan: the snapshot of its structure and its
    tensors (for the forward guard and the device events, which ``save()``
    needs at once); :meth:`resolve` makes its :class:`Flattened`."""

    shards: List[Dict[str, Any]] = []       # a plan never holds DTensor shards
    replicated_digest = ""                  # known once resolved

    def __init__(self, cache: PlanCache, plan: _Plan, snapshot: Any, tensors: List[torch.Tensor]):
        self.cache = cache
        self.plan = plan
        self.snapshot = snapshot
        self.tensors = tensors

    def live_tensors(self) -> List[torch.Tensor]:
        return self.tensors

    def resolve(self) -> Flattened:
        """Check the tensors and make the tree and the sources (on the capture thread)."""
        try:
            return _Resolve(self.plan).run(self.snapshot)
        except Exception:           # _Miss, or anything odd (a sparse tensor's stride()): walk in full
            return self.cache._missed_late(self.plan, _rebuild(self.snapshot, self.plan.skeleton))


def _container(kind: int, cls: type, keys: Any, node: Any, children: List[Any]) -> Any:
    """A container's skeleton, with where its tensors, scalars and containers sit."""
    tensor_at = tuple(i for i, c in enumerate(children) if c[0] == _TENSOR)
    scalar_at = tuple(i for i, c in enumerate(children) if c[0] == _SCALAR)
    nested_at = tuple((i, c) for i, c in enumerate(children) if c[0] in (_DICT, _SEQ))
    return (kind, cls, keys, node, children, tensor_at, scalar_at, nested_at, len(tensor_at) == len(children))


class _Builder:
    """Derives the skeleton of ``state`` from the tree the full walk made of it."""

    def __init__(self, flat: Flattened):
        self.flat = flat
        self.used = [False] * len(flat.sources)
        self.nbytes = [0] * len(flat.sources)
        self.storages: Dict[int, int] = {}      # storage -> entry (non-empty storages)

    def top(self, state: Any, replicated: List[Any]) -> Any:
        if self.flat.shards:
            raise _Uncacheable
        for s in self.flat.sources:
            if s.kind not in ("data", "remote") or s.make_bytes is not None or s.ref is not None \
                    or (s.kind == "data" and not isinstance(s.data, torch.Tensor)):
                raise _Uncacheable
        skeleton = self.build(state, self.flat.tree)
        if replicated and (skeleton[0] != _DICT or not all(k in skeleton[2] for k in replicated)):
            raise _Uncacheable
        if not all(self.used):
            raise _Uncacheable              # a source no tensor of the skeleton accounts for
        return skeleton

    def build(self, value: Any, node: Any) -> Any:
        cls = type(value)
        if value is None or cls in (bool, int, str, float):
            return (_SCALAR,)
        if cls in _TENSOR_TYPES:
            return self.tensor(value, node)
        if cls in _DICTS:
            keys = tuple(value)
            if not set(map(type, keys)) <= _KEY_TYPES or not isinstance(node, dict) \
                    or node.get("$") != DictProvider.tag or node["k"] != list(keys):
                raise _Uncacheable
            children = [self.build(v, n) for v, n in zip(value.values(), node["v"])]
            return _container(_DICT, cls, keys, node, children)
        if cls in _SEQS:
            if not isinstance(node, dict) or node.get("$") != SequenceProvider.tag or len(node["v"]) != len(value):
                raise _Uncacheable
            children = [self.build(v, n) for v, n in zip(value, node["v"])]
            return _container(_SEQ, cls, len(value), node, children)
        raise _Uncacheable

    def tensor(self, t: torch.Tensor, node: Any) -> Any:
        if not isinstance(node, dict) or node.get("$") != TensorProvider.tag or type(node.get("e")) is not int:
            raise _Uncacheable              # a meta tensor, or another provider's node
        geometry = _geometry(t)
        if t.layout != _strided or t.is_conj() or t.is_neg() or t.is_quantized or t.is_nested:
            raise _Uncacheable              # the walk made a temporary (resolve_conj) or another node
        e = node["e"]
        source = self.flat.sources[e]
        storage = t.untyped_storage()
        if source.kind == "data" and (source.data.untyped_storage()._cdata != storage._cdata
                                      or source.length != storage.nbytes()):
            raise _Uncacheable              # the entry is not this tensor's storage as it is now
        if storage.nbytes():
            if self.storages.setdefault(storage._cdata, e) != e:
                raise _Uncacheable
        elif self.used[e]:
            raise _Uncacheable              # empty storages get one entry per tensor
        self.used[e] = True
        self.nbytes[e] = storage.nbytes()
        return (_TENSOR, geometry, node, e)


def _gather(value: Any, sk: Any, tensors: List[torch.Tensor]) -> Any:
    """On the caller's thread: check one container against its skeleton and
    snapshot it as ``(its values, the snapshots of its containers)``; raises
    _Miss at the first difference. Appends the tensors met to ``tensors``."""
    if type(value) is not sk[1]:
        raise _Miss
    if sk[0] == _DICT:
        keys = tuple(value)
        # Types too: 1 == True == 1.0, but only str and int keys were planned.
        if keys != sk[2] or not _KEY_TYPES.issuperset(map(type, keys)):
            raise _Miss
        values = tuple(value.values())
    else:
        values = tuple(value)
        if len(values) != sk[2]:
            raise _Miss
    if sk[8]:                               # only tensors (a module's state_dict, an AdamW slot)
        if not _TENSOR_TYPE_SET.issuperset(map(type, values)):
            raise _Miss
        tensors.extend(values)
        return (values, ())
    for i in sk[5]:
        t = values[i]
        if type(t) not in _TENSOR_TYPE_SET:
            raise _Miss
        tensors.append(t)
    for i in sk[6]:
        if type(values[i]) not in _SCALAR_TYPE_SET:
            raise _Miss
    return (values, [_gather(values[i], c, tensors) for i, c in sk[7]])


def _rebuild(snapshot: Any, sk: Any) -> Any:
    """The state as it was gathered: the same container types and keys, the same leaf objects."""
    values, subs = snapshot
    if subs:
        values = list(values)
        for (i, c), sub in zip(sk[7], subs):
            values[i] = _rebuild(sub, c)
    return sk[1](zip(sk[2], values)) if sk[0] == _DICT else sk[1](values)


class _Resolve:
    """On the capture thread: a gathered snapshot made into a Flattened along
    its plan; raises _Miss at the first difference."""

    def __init__(self, plan: _Plan):
        self.plan = plan
        n = len(plan.sources)
        self.sources: List[Optional[Source]] = [None] * n
        self.entry_storage: List[Optional[int]] = [None] * n
        self.storage_entry: Dict[int, int] = {}
        self.filled = 0
        self.scalar = ScalarProvider.save.__get__(_registry.by_tag(ScalarProvider.tag))

    def run(self, snapshot: Any) -> Flattened:
        plan = self.plan
        sk = plan.skeleton
        if not plan.replicated:
            tree = self.encode(snapshot, sk)
            digest = ""
        else:
            # The full walk's order: the replicated keys first (their entries come first).
            values, subs = snapshot
            children = sk[4]
            sub_at = {i: sub for (i, _), sub in zip(sk[7], subs)}
            at = {k: i for i, k in enumerate(sk[2])}
            nodes = {k: self.value(values[at[k]], children[at[k]], sub_at.get(at[k])) for k in plan.replicated}
            digest = hashlib.sha256(json.dumps(_without_devices([nodes[k] for k in plan.replicated]),
                                               sort_keys=True).encode()).hexdigest()
            tree = dict(sk[3])
            tree["v"] = [nodes[k] if k in nodes else self.value(values[i], children[i], sub_at.get(i))
                         for i, k in enumerate(sk[2])]
        if self.filled != len(self.sources):
            raise _Miss
        return Flattened(tree, self.sources, [], digest)

    def value(self, value: Any, sk: Any, sub: Any) -> Any:
        kind = sk[0]
        if kind == _TENSOR:
            return self.tensor(value, sk)
        if kind == _SCALAR:
            return self.scalar(value, None)
        return self.encode(sub, sk)

    def encode(self, snapshot: Any, sk: Any) -> Any:
        values, subs = snapshot
        node = dict(sk[3])
        subs = iter(subs)
        node["v"] = [self.tensor(v, c) if c[0] == _TENSOR else self.scalar(v, None) if c[0] == _SCALAR
                     else self.encode(next(subs), c) for v, c in zip(values, sk[4])]
        return node

    def tensor(self, t: Any, sk: Any) -> Any:
        if _geometry(t) != sk[1]:
            raise _Miss
        e = sk[3]
        storage = t.untyped_storage()
        cdata = storage._cdata
        source = self.sources[e]
        if source is None:
            kind, name, length, owner, nbytes = self.plan.sources[e]
            if storage.nbytes() != nbytes:          # the replicated owners follow the lengths too
                raise _Miss
            if nbytes:
                # The same storages must be shared as when planned (tied weights stay tied).
                if self.storage_entry.setdefault(cdata, e) != e:
                    raise _Miss
                self.entry_storage[e] = cdata
            if kind == "data":
                source = Source("data", _flat_bytes_of_storage(t), None, name, length)
            else:
                flat = _flat_bytes_of_storage(t)
                source = Source(kind, None, None, name, length, owner,
                                local=Source("data", flat, None, name, flat.numel()))
            self.sources[e] = source
            self.filled += 1
        elif self.entry_storage[e] != cdata or not self.plan.sources[e][4]:
            raise _Miss
        # The version counter the incremental mode reads is shared with the walk's detach().
        source.tensors.append(t)
        return sk[2]
