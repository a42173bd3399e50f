# Why one module of ~760 lines (a module above 600 lines says why): the providers together are
# the tree's tag set, the one list of what a file may ask the loader to build (anything else is
# refused); it is reviewed in one place. The walker is state/walk.py, the plan cache state/plancache.py.
"""State providers: turn each kind of state into tree nodes and byte sources,
and turn them back.

A save walks the user's nested state once, on the caller's thread, and asks
each provider in turn whether it handles the value. The walk is cheap: it
copies no tensor data. It produces

* a *tree*: a JSON-able description of the state in which every leaf is
  either a safe inline value or a reference to an entry, and
* a list of *sources*: the entries' bytes (tensor storages, numpy buffers,
  raw bytes, objects to pickle later), written by the I/O engine.

Loading walks the tree back. Only the tags below are understood, so a file
cannot make the loader run code; the one exception is the ``pickle`` tag,
which is refused unless the caller passes ``allow_pickle=True``.

Users add providers for their own types with :func:`register_provider`.
"""

from __future__ import annotations

import collections
import math
import sys
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch

from lazyckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError
from lazyckpt.formats.placement import describe

# --------------------------------------------------------------------------- sources


@dataclass
class Source:
    """The bytes of one entry, as known at save() time.

    ``data`` is a flat uint8 view of the memory to write: a tensor (CPU or
    CUDA) or a memoryview (numpy arrays, bytes); it is read lazily by the
    capture stage. ``make_bytes`` serializes an object
    in the background (its length is unknown until then).
    """
    kind: str                                   # "data", "pickle", "remote" or "ref"
    data: Any = None                            # flat uint8 tensor or memoryview, zero-copy
    make_bytes: Optional[Callable[[], bytes]] = None
    name: str = ""                              # state path, for error messages
    length: Optional[int] = None                # known up front for tensors
    owner: Optional[int] = None                 # "remote": the rank that writes it
    #: Tensor storages: every tensor of the state that uses it (for a DTensor
    #: shard, the DTensor), whose version counters an incremental checkpoint
    #: reads on the capture thread -- before the barrier, so as they were at
    #: save() -- and compares with the previous step's. Appending is all save()
    #: pays for it.
    tensors: List[Any] = field(default_factory=list)
    #: "ref": where an earlier step holds these bytes (format.Entry.ref).
    ref: Optional[Dict[str, Any]] = None
    #: "remote": this rank's own copy, which ``replicated="auto"`` writes after all
    #: when the ranks' copies turn out to differ (lazyckpt/saving/autorep.py).
    local: Optional["Source"] = None

    @property
    def deferred(self) -> bool:
        return self.make_bytes is not None

    @property
    def own_copy(self) -> "Source":
        """This rank's own bytes of the entry (a remote entry kept a view of them)."""
        return self.local if self.kind == "remote" and self.local is not None else self


def storage_bytes(storage: torch.UntypedStorage) -> bytes:
    if storage.nbytes() == 0:
        return b""
    return torch.empty((0,), dtype=torch.uint8).set_(storage).numpy().tobytes()


#: A 0-element uint8 tensor per device: new_empty(0) from it is ~2x cheaper than
#: torch.empty(..., device=), and the walk makes one flat view per storage.
_U8: Dict[torch.device, torch.Tensor] = {}


def _flat_bytes_of_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of all of ``t``'s storage (no copy)."""
    template = _U8.get(t.device)
    if template is None:
        template = _U8[t.device] = torch.empty((0,), dtype=torch.uint8, device=t.device)
    return template.new_empty(0).set_(t.untyped_storage())


# --------------------------------------------------------------------------- contexts


@dataclass
class SaveContext:
    rank: int = 0
    world_size: int = 1
    #: True while walking replicated state: its sources are spread over the ranks.
    replicated: bool = False
    #: Geometry of the DTensor shards this rank writes (for the global shard index).
    shards: List[Dict[str, Any]] = field(default_factory=list)
    sources: List[Source] = field(default_factory=list)
    _bytes_per_rank: List[int] = field(default_factory=list)
    _storage_ids: Dict[Tuple[str, int], int] = field(default_factory=dict)
    path: List[str] = field(default_factory=list)
    _active: set = field(default_factory=set)   # ids of containers being walked (cycle check)
    #: The wrapper whose local tensor is being walked (a DTensor): its version
    #: counter is the one in-place updates bump.
    outer: Any = None

    def add(self, source: Source) -> int:
        source.name = self.path_name()
        if self.replicated and self.world_size > 1:
            # Every rank walks the same replicated state in the same order, so entry
            # k is the same value everywhere: one rank writes it, the others record
            # which.
            # Spread the bytes evenly: each entry goes to the least-loaded rank so far
            # (deterministic: every rank computes the same assignment).
            if not self._bytes_per_rank:
                self._bytes_per_rank = [0] * self.world_size
            owner = min(range(self.world_size), key=self._bytes_per_rank.__getitem__)
            self._bytes_per_rank[owner] += max(1, source.length or 0)
            if owner != self.rank:
                source = Source("remote", name=source.name, length=0, owner=owner, local=source)
        self.sources.append(source)
        return len(self.sources) - 1

    def storage_entry(self, t: torch.Tensor) -> int:
        """Entry index of ``t``'s storage, written once however many tensors alias it."""
        storage = t.untyped_storage()
        key = (t.device, storage._cdata)         # a device object hashes faster than its str()
        if storage.nbytes() == 0:               # empty storages may share a null pointer
            key = (t.device, -len(self.sources) - 1)
        index = self._storage_ids.get(key)
        if index is None:
            flat = _flat_bytes_of_storage(t)
            index = self.add(Source("data", data=flat, length=flat.numel()))
            self._storage_ids[key] = index
        self.sources[index].tensors.append(self.outer if self.outer is not None else t)
        return index

    def path_name(self) -> str:
        return "/".join(self.path) or "<root>"

    def encode(self, value: Any, key: Any = None) -> Any:
        if key is not None:
            self.path.append(str(key))
        try:
            for provider in _registry.providers():
                if provider.handles(value):
                    return provider.save(value, self)
            raise CheckpointError(f"no provider for {type(value).__qualname__} at {self.path_name()}",
                                  entry=self.path_name())
        finally:
            if key is not None:
                self.path.pop()


class BytesNotReady(BaseException):
    """Raised by a decode that may only build views (``LoadContext.views_only``:
    the loader decoding a tree while its reads run) where a value needs its
    bytes, another file, a device copy or a user's ``from_state``: the loader
    then decodes the tree after the reads. A BaseException, so that
    :meth:`LoadContext.decode`, which turns a provider's every Exception into
    a corrupt-file error, lets it through."""


@dataclass
class LoadContext:
    entry_value: Callable[..., torch.UntypedStorage]            # entry, kind -> CPU bytes
    storage: Callable[[int, str], torch.UntypedStorage]         # entry, saved device -> mapped
    allow_pickle: bool
    path: str
    #: Builds a DTensor node's value from the global shard index (multi-rank loads).
    dtensor_loader: Optional[Callable[[Dict[str, Any], "LoadContext"], Any]] = None
    trail: List[str] = field(default_factory=list)
    #: id(node) -> what builds that node's value instead of its provider (the
    #: loader's rows-only path for plain tensors loaded into DTensors).
    overrides: Dict[int, Callable[[Dict[str, Any], "LoadContext"], Any]] = field(default_factory=dict)
    #: The storages' bytes may not have arrived: only views of them may be made
    #: (``storage`` gives them; ``entry_value`` raises :class:`BytesNotReady`).
    views_only: bool = False

    def corrupt(self, why: str) -> CorruptCheckpointError:
        name = "/".join(self.trail) or "<root>"
        return CorruptCheckpointError(f"{self.path}: corrupt entry {name}: {why}", path=self.path, entry=name)

    def decode(self, node: Any, key: Any = None) -> Any:
        if key is not None:
            self.trail.append(str(key))
        try:
            if node is None or isinstance(node, (bool, int, str)):
                return node
            if isinstance(node, float):
                return node
            if not isinstance(node, dict) or not isinstance(node.get("$"), str):
                raise self.corrupt(f"unexpected node {type(node).__name__}")
            if self.overrides and id(node) in self.overrides:
                return self.overrides[id(node)](node, self)
            provider = _registry.by_tag(node["$"])
            if provider is None:
                raise self.corrupt(f"unknown tag {node['$']!r}")
            return provider.load(node, self)
        except CheckpointError:
            raise
        except Exception as exc:   # anything a hostile node can provoke is a corrupt file
            raise self.corrupt(f"{type(exc).__name__}: {exc}") from None
        finally:
            if key is not None:
                self.trail.pop()


# --------------------------------------------------------------------------- providers


class Provider:
    """Handles one kind of state. Subclasses set ``tag`` and implement the three methods."""
    tag: str = ""

    def handles(self, value: Any) -> bool:
        raise NotImplementedError

    def save(self, value: Any, ctx: SaveContext) -> Any:
        """Return the tree node for ``value``; add byte sources to ``ctx``."""
        raise NotImplementedError

    def load(self, node: Dict[str, Any], ctx: LoadContext) -> Any:
        """Rebuild the value from its node. Must trust nothing in ``node``."""
        raise NotImplementedError


class ScalarProvider(Provider):
    """None, bool, int, str and floats: inline in the tree."""
    tag = "float"

    def handles(self, value: Any) -> bool:
        return value is None or type(value) in (bool, int, str, float)

    def save(self, value: Any, ctx: SaveContext) -> Any:
        if type(value) is float and not math.isfinite(value):
            return {"$": "float", "v": repr(value)}   # 'nan', 'inf', '-inf'
        return value

    def load(self, node, ctx):
        if node["v"] not in ("nan", "inf", "-inf"):
            raise ctx.corrupt(f"bad float {node['v']!r}")
        return float(node["v"])


class ComplexProvider(Provider):
    tag = "complex"

    def handles(self, value):
        return type(value) is complex

    def save(self, value, ctx):
        return {"$": "complex", "v": [repr(value.real), repr(value.imag)]}

    def load(self, node, ctx):
        re, im = node["v"]
        return complex(float(re), float(im))


class SequenceProvider(Provider):
    """list, tuple, set, frozenset."""
    tag = "seq"
    _types = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
    _back = {v: k for k, v in _types.items()}

    def handles(self, value):
        return type(value) in self._types

    def save(self, value, ctx):
        with _walking(ctx, value):
            items = [ctx.encode(v, i) for i, v in enumerate(value)]
        return {"$": "seq", "t": self._types[type(value)], "v": items}

    def load(self, node, ctx):
        cls = self._back[node["t"]]
        items = node["v"]
        if not isinstance(items, list):
            raise ctx.corrupt("sequence items are not a list")
        return cls(ctx.decode(v, i) for i, v in enumerate(items))


class DictProvider(Provider):
    """dict and OrderedDict; keys may be any safe value (optimizer states use ints)."""
    tag = "dict"

    def handles(self, value):
        return type(value) in (dict, collections.OrderedDict)

    def save(self, value, ctx):
        with _walking(ctx, value):
            keys = [ctx.encode(k) for k in value]
            values = [ctx.encode(v, k) for k, v in value.items()]
        node = {"$": "dict", "k": keys, "v": values}
        if type(value) is collections.OrderedDict:
            node["ordered"] = True
        return node

    def load(self, node, ctx):
        keys, values = node["k"], node["v"]
        if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(values):
            raise ctx.corrupt("dict keys and values do not match")
        out = collections.OrderedDict() if node.get("ordered") else {}
        for k, v in zip(keys, values):
            key = ctx.decode(k)
            out[key] = ctx.decode(v, key)
        return out


class TorchMetaProvider(Provider):
    """torch.Size, torch.dtype, torch.device."""
    tag = "torch"

    def handles(self, value):
        return type(value) in (torch.Size, torch.dtype, torch.device)

    def save(self, value, ctx):
        if type(value) is torch.Size:
            return {"$": "torch", "t": "size", "v": list(value)}
        if type(value) is torch.dtype:
            return {"$": "torch", "t": "dtype", "v": dtype_name(value)}
        return {"$": "torch", "t": "device", "v": str(value)}

    def load(self, node, ctx):
        kind, v = node["t"], node["v"]
        if kind == "size":
            if not isinstance(v, list) or not all(type(x) is int for x in v):
                raise ctx.corrupt("bad torch.Size")
            return torch.Size(v)
        if kind == "dtype":
            return dtype_from_name(v, ctx)
        if kind == "device":
            if not isinstance(v, str):
                raise ctx.corrupt("bad device")
            return torch.device(v)
        raise ctx.corrupt(f"unknown torch value kind {kind!r}")


#: dtype -> name, device -> str: the walk asks once per tensor (str() is ~0.2 us each).
_DTYPE_NAMES: Dict[torch.dtype, str] = {}
_DEVICE_NAMES: Dict[torch.device, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device_name(device: torch.device) -> str:
    name = _DEVICE_NAMES.get(device)
    if name is None:
        name = _DEVICE_NAMES[device] = str(device)
    return name


_QUANTIZED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}
#: Every plain dtype this torch defines, by name (vars(): no lazy submodule imports).
_DTYPES = {name: value for name, value in vars(torch).items()
           if isinstance(value, torch.dtype) and name not in _QUANTIZED}


def dtype_from_name(name: Any, ctx: LoadContext) -> torch.dtype:
    value = _DTYPES.get(name) if isinstance(name, str) else None
    if value is None:
        raise ctx.corrupt(f"unknown dtype {name!r}")
    return value


_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


class TensorProvider(Provider):
    """Dense strided tensors of any dtype and device: written from their own
    memory (the whole storage, once per storage, so aliasing survives)."""
    tag = "tensor"

    def handles(self, value):
        return type(value) in _TENSOR_TYPES and value.layout == torch.strided \
            and not value.is_quantized and not value.is_nested

    def save(self, value: torch.Tensor, ctx):
        t = value.detach()
        if t.is_conj() or t.is_neg():
            # Lazy conj/neg bits are views with a flag; materialize them.
            t = t.resolve_conj().resolve_neg()
        device = t.device
        node = {"$": "tensor", "dtype": dtype_name(t.dtype), "shape": list(t.shape),
                "stride": list(t.stride()), "offset": t.storage_offset(),
                "device": _device_name(device)}
        if value.requires_grad:
            node["requires_grad"] = True
        if type(value) is torch.nn.Parameter:
            node["param"] = True
        node["e"] = None if device.type == "meta" else ctx.storage_entry(t)
        return node

    def load(self, node, ctx):
        # Per tensor, on the load's path after its last read (2,000 tensors:
        # 38 ms here before this was cut to one geometry check and no
        # throwaway tensor per call): keep it lean.
        dtype = dtype_from_name(node["dtype"], ctx)
        shape, stride, offset = _checked_geometry(node, ctx)
        if node["e"] is None:
            tensor = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        else:
            storage = ctx.storage(node["e"], str(node.get("device", "cpu")))
            needed = _bytes_reached(shape, stride, offset, dtype.itemsize)
            if needed > storage.nbytes():
                raise ctx.corrupt(f"tensor needs {needed} bytes, storage has {storage.nbytes()}")
            device = storage.device
            tensor = torch.empty(0, dtype=dtype) if device.type == "cpu" else \
                torch.empty((0,), dtype=dtype, device=device)
            tensor.set_(storage, offset, shape, stride)
        if node.get("param"):
            return torch.nn.Parameter(tensor, requires_grad=bool(node.get("requires_grad")))
        if node.get("requires_grad"):
            tensor.requires_grad_(True)
        return tensor


def tensor_bytes_needed(node: Dict[str, Any], dtype: torch.dtype, ctx: "LoadContext") -> int:
    """Bytes of storage a tensor node's geometry reaches (after checking it)."""
    return _bytes_reached(*_checked_geometry(node, ctx), dtype.itemsize)


def _checked_geometry(node: Dict[str, Any], ctx: "LoadContext") -> Tuple[list, list, int]:
    """A tensor node's (shape, stride, offset): lists of non-negative ints of
    one length and a non-negative int, or the file is corrupt."""
    shape, stride, offset = node.get("shape"), node.get("stride"), node.get("offset")
    if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
            and type(offset) is int and offset >= 0):
        raise ctx.corrupt("bad tensor geometry")
    for x in shape:
        if type(x) is not int or x < 0:
            raise ctx.corrupt("bad tensor geometry")
    for x in stride:
        if type(x) is not int or x < 0:
            raise ctx.corrupt("bad tensor geometry")
    return shape, stride, offset


def _bytes_reached(shape: list, stride: list, offset: int, itemsize: int) -> int:
    if 0 in shape:
        return 0
    return (offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * itemsize


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


_NUMPY_KINDS = "biufcmMUS"   # numeric, bool, datetime, fixed-size strings: no objects


class NumpyProvider(Provider):
    """numpy arrays and scalars of plain dtypes (object/structured ones are pickled)."""
    tag = "numpy"

    def handles(self, value):
        if isinstance(value, np.ndarray) and type(value) is np.ndarray:
            return value.dtype.kind in _NUMPY_KINDS and value.dtype.fields is None
        return isinstance(value, np.generic) and value.dtype.kind in _NUMPY_KINDS \
            and value.dtype.fields is None

    def save(self, value, ctx):
        if isinstance(value, np.generic):
            # Through a 0-d array: an empty np.str_ has itemsize 0 but tobytes() of 4.
            scalar = np.asarray(value)
            node = {"$": "numpy", "t": "scalar", "dtype": scalar.dtype.str, "v": scalar.tobytes().hex()}
            if isinstance(value, (np.str_, np.bytes_)):
                # A str/bytes whose trailing NULs its fixed-width bytes cannot
                # tell from padding: its length says where it ends. (value[:] is
                # the whole str; numpy's str() and item() strip the NULs.)
                whole = value[:]
                if whole[-1:] in ("\0", b"\0"):
                    node["len"] = len(whole)
            return node
        array = value if value.flags.c_contiguous else np.ascontiguousarray(value)
        flat = memoryview(array.reshape(-1).view(np.uint8)) if array.size else memoryview(b"")
        index = ctx.add(Source("data", data=flat, length=array.nbytes))
        return {"$": "numpy", "t": "array", "dtype": array.dtype.str, "shape": list(value.shape), "e": index}

    def load(self, node, ctx):
        dtype = np.dtype(node["dtype"]) if isinstance(node["dtype"], str) else None
        if dtype is None or dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
            raise ctx.corrupt(f"unsupported numpy dtype {node['dtype']!r}")
        if node["t"] not in ("scalar", "array"):
            raise ctx.corrupt(f"unknown numpy value kind {node['t']!r}")
        if node["t"] == "scalar":
            raw = bytes.fromhex(node["v"])
            if len(raw) != dtype.itemsize:
                raise ctx.corrupt("numpy scalar has the wrong size")
            if "len" in node:
                return _string_of_length(raw, dtype, node["len"], ctx)
            return np.frombuffer(raw, dtype=dtype)[0]
        shape = node["shape"]
        if not _int_list(shape) or any(s < 0 for s in shape):
            raise ctx.corrupt("bad array shape")
        storage = ctx.entry_value(node["e"])
        expected = math.prod(shape) * dtype.itemsize
        if storage.nbytes() != expected:
            raise ctx.corrupt(f"array needs {expected} bytes, entry has {storage.nbytes()}")
        if expected == 0:
            return np.empty(shape, dtype=dtype)
        flat = torch.empty((0,), dtype=torch.uint8).set_(storage).numpy()
        return flat.view(dtype).reshape(shape)


def _string_of_length(raw: bytes, dtype: np.dtype, length: Any, ctx) -> Any:
    """An np.str_/np.bytes_ scalar of exactly `length` characters: its first
    `length` characters, trailing NULs kept; the rest must be padding."""
    if dtype.kind not in "US":
        raise ctx.corrupt(f"'len' given for a numpy {dtype.str} scalar")
    if dtype.kind == "S":
        units = np.frombuffer(raw, dtype=np.uint8)
    else:
        units = np.frombuffer(raw, dtype=np.dtype(np.uint32).newbyteorder(dtype.byteorder))
    if type(length) is not int or not 0 <= length <= len(units) or units[length:].any():
        raise ctx.corrupt(f"numpy string scalar length {length!r} does not fit its {dtype.str} bytes")
    if dtype.kind == "S":
        return np.bytes_(raw[:length])
    try:
        return np.str_("".join(map(chr, units[:length].tolist())))
    except ValueError as exc:                    # a code point above U+10FFFF
        raise ctx.corrupt(f"numpy string scalar: {exc}") from None


class BytesProvider(Provider):
    """bytes and bytearray: raw entries, never encoded."""
    tag = "bytes"

    def handles(self, value):
        return type(value) in (bytes, bytearray)

    def save(self, value, ctx):
        index = ctx.add(Source("data", data=memoryview(value).cast("B"), length=len(value)))
        return {"$": "bytes", "mutable": type(value) is bytearray, "e": index}

    def load(self, node, ctx):
        data = storage_bytes(ctx.entry_value(node["e"]))
        return bytearray(data) if node.get("mutable") else data


class PickleProvider(Provider):
    """Anything else: pickled in the background at save, refused at load unless
    the caller opts in with ``allow_pickle=True``."""
    tag = "pickle"

    def handles(self, value):
        return True

    def save(self, value, ctx):
        cls = type(value)
        name = ctx.path_name()
        kind = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"

        def make_bytes(obj=value):
            try:
                return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                # pickle's own message names neither the entry nor a way out.
                raise TypeError(
                    f"entry {name}: a {kind} cannot be saved: "
                    f"lazyckpt stores tensors, dicts, lists, tuples, scalars, strings, bytes and numpy arrays "
                    f"as they are and pickles anything else, and pickling this one failed "
                    f"({type(exc).__name__}: {exc}). Remove it from the state, or save what rebuilds it "
                    f"(its state_dict(), a list of its items)") from exc
        index = ctx.add(Source("pickle", make_bytes=make_bytes))
        return {"$": "pickle", "type": f"{cls.__module__}.{cls.__qualname__}", "e": index}

    def load(self, node, ctx):
        if not ctx.allow_pickle:
            name = "/".join(ctx.trail) or "<root>"
            raise UnsafeObjectError(
                f"{ctx.path}: entry {name} is a pickled {node.get('type', 'object')}; unpickling runs "
                f"code from the file, so it is refused. Pass allow_pickle=True if you trust this file.",
                path=ctx.path, entry=name)
        payload = storage_bytes(ctx.entry_value(node["e"], "pickle"))
        try:
            return pickle.loads(payload)
        except Exception as exc:
            raise ctx.corrupt(f"unpickling failed: {type(exc).__name__}: {exc}") from exc


def _dtensor_type() -> Optional[type]:
    """DTensor, if anything imported it. Nothing can be a DTensor before that,
    and importing torch.distributed.tensor costs ~1.3 s of CPU (measured: it
    was most of a cold 1.27 GB load's CPU time), so the check never imports it."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


class DTensorProvider(Provider):
    """A shard of a larger logical tensor (FSDP2, tensor parallel).

    The node records the global shape and this rank's offsets in it; the
    local bytes are an ordinary tensor node. Where the tensor is replicated
    over a mesh dimension, only the rank at coordinate 0 of that dimension
    writes it (written once, not once per replica). Loading builds the piece
    a target DTensor (from ``into=``) needs, reading only overlapping rows of
    the saved shards, whatever the saving world size was; without a target it
    assembles the full tensor.
    """
    tag = "dtensor"

    def handles(self, value):
        cls = _dtensor_type()
        return cls is not None and isinstance(value, cls)

    def save(self, value, ctx):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        mesh, placements = value.device_mesh, value.placements
        for p in placements:
            if not isinstance(p, (Shard, Replicate)):
                raise CheckpointError(f"DTensor at {ctx.path_name()} has placement {p}; reduce it "
                                      f"(redistribute to Shard/Replicate) before saving",
                                      entry=ctx.path_name())
        if ctx.replicated:
            raise CheckpointError(f"DTensor at {ctx.path_name()} is sharded state: do not list its key "
                                  f"in replicated= (replicated DTensors are detected)", entry=ctx.path_name())
        local_shape, offsets = compute_local_shape_and_global_offset(value.shape, mesh, placements)
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        writer = all(c == 0 for c, p in zip(coordinate, placements) if isinstance(p, Replicate))
        node = {"$": "dtensor", "dtype": dtype_name(value.dtype), "global_shape": list(value.shape),
                "offsets": [int(o) for o in offsets], "local_shape": [int(n) for n in local_shape],
                "local": None}
        layout = describe(value)
        if layout is not None:      # loaders derive every rank's piece from it (lazyckpt/formats/placement.py)
            node["layout"] = layout
        if value.requires_grad:
            node["requires_grad"] = True
        if writer:
            local = value.to_local()
            was = ctx.replicated, ctx.outer
            ctx.replicated = False          # a shard is this rank's own data
            # In-place updates of a DTensor bump its own version counter, not its
            # local tensor's (they run below autograd): that is the one to compare.
            ctx.outer = value
            try:
                node["local"] = ctx.encode(local.detach())
            finally:
                ctx.replicated, ctx.outer = was
            ctx.shards.append({"path": list(ctx.path), "global_shape": node["global_shape"],
                               "offsets": node["offsets"], "local": node["local"]})
        return node

    def load(self, node, ctx):
        if ctx.dtensor_loader is None:
            raise ctx.corrupt("a DTensor shard can only be loaded from a committed step directory")
        return ctx.dtensor_loader(node, ctx)


class CustomProvider(Provider):
    """A user type turned into safe state by user-supplied functions."""
    tag = "custom"

    def __init__(self, cls: type, name: str, to_state: Callable[[Any], Any],
                 from_state: Callable[[Any], Any]):
        self.cls, self.name, self.to_state, self.from_state = cls, name, to_state, from_state

    def handles(self, value):
        return type(value) is self.cls

    def save(self, value, ctx):
        return {"$": "custom", "name": self.name, "v": ctx.encode(self.to_state(value))}

    def load(self, node, ctx):
        if ctx.views_only:
            raise BytesNotReady()           # a user's from_state may read tensors' values
        return self.from_state(ctx.decode(node["v"]))


class _CustomDispatch(Provider):
    """Load-side dispatcher for the 'custom' tag: finds the provider by name."""
    tag = "custom"

    def load(self, node, ctx):
        provider = _registry.custom.get(node["name"]) if isinstance(node.get("name"), str) else None
        if provider is None:
            raise CheckpointError(
                f"{ctx.path}: entry {'/'.join(ctx.trail) or '<root>'} was saved by the provider "
                f"{node.get('name')!r}; register it with lazyckpt.register_provider before loading",
                path=ctx.path)
        return provider.load(node, ctx)


class _Walking:
    def __init__(self, ctx: SaveContext, value: Any):
        self.ctx, self.key = ctx, id(value)

    def __enter__(self):
        if self.key in self.ctx._active:
            raise CheckpointError(f"state contains a reference cycle at {self.ctx.path_name()}",
                                  entry=self.ctx.path_name())
        self.ctx._active.add(self.key)

    def __exit__(self, *exc):
        self.ctx._active.discard(self.key)


_walking = _Walking


class _Registry:
    def __init__(self) -> None:
        self.custom: Dict[str, CustomProvider] = {}
        self.builtin: List[Provider] = [ScalarProvider(), TensorProvider(), DictProvider(),
                                        DTensorProvider(),
                                        SequenceProvider(), TorchMetaProvider(), NumpyProvider(),
                                        BytesProvider(), ComplexProvider(), PickleProvider()]
        self._tags: Dict[str, Provider] = {p.tag: p for p in self.builtin}
        self._tags["custom"] = _CustomDispatch()
        self._ordered: List[Provider] = list(self.builtin)

    def providers(self) -> List[Provider]:
        return self._ordered

    def by_tag(self, tag: str) -> Optional[Provider]:
        return self._tags.get(tag)

    def register(self, provider: CustomProvider) -> None:
        self.custom[provider.name] = provider
        # User providers take precedence over the built-in ones (and over pickle).
        self._ordered = [p for p in self._ordered if not (isinstance(p, CustomProvider)
                                                          and p.name == provider.name)]
        self._ordered.insert(0, provider)


_registry = _Registry()


def register_provider(cls: type, to_state: Callable[[Any], Any], from_state: Callable[[Any], Any],
                      name: Optional[str] = None) -> None:
    """Save instances of ``cls`` as ``to_state(obj)`` (any state lazyckpt can
    save: tensors, containers, scalars) and rebuild them with
    ``from_state(state)``. ``name`` (default ``module.qualname``) is stored in
    the file; register the same name before loading. This keeps such objects
    out of pickle, so they load without ``allow_pickle``."""
    name = name or f"{cls.__module__}.{cls.__qualname__}"
    _registry.register(CustomProvider(cls, name, to_state, from_state))


def _without_devices(node: Any) -> Any:
    """Replicas live on different devices (cuda:0, cuda:1): compare without them."""
    if isinstance(node, dict):
        return {k: _without_devices(v) for k, v in node.items() if k != "device"}
    if isinstance(node, list):
        return [_without_devices(v) for v in node]
    return node


@dataclass
class Flattened:
    tree: Any
    sources: List[Source]
    shards: List[Dict[str, Any]]
    #: Digest of the replicated part of the tree: must agree across ranks.
    replicated_digest: str = ""

    def live_tensors(self) -> List[Any]:
        """The tensors of the live state this walk reads (for the device events and
        the forward guard): a remote entry's own copy too, which
        ``replicated="auto"`` may write after all."""
        return [d for d in (s.own_copy.data for s in self.sources) if isinstance(d, torch.Tensor)]


def flatten(state: Any, rank: int = 0, world_size: int = 1,
            replicated: Iterable[Any] = ()) -> Flattened:
    """Walk ``state`` (on the caller's thread; no data is copied).

    ``replicated`` names top-level keys whose values are identical on every
    rank (DDP): they are walked first, so their entries have the same indices
    on every rank, and each entry is written by one rank only.
    """
    ctx = SaveContext(rank=rank, world_size=world_size)
    replicated = list(replicated)
    if not replicated:
        return Flattened(ctx.encode(state), ctx.sources, ctx.shards)
    if type(state) not in (dict, collections.OrderedDict):
        raise CheckpointError("replicated= needs the state to be a dict of top-level keys")
    missing = [k for k in replicated if k not in state]
    if missing:
        raise CheckpointError(f"replicated keys {missing} are not in the state")
    nodes = {}
    ctx.replicated = True
    for key in replicated:
        nodes[key] = ctx.encode(state[key], key)
    ctx.replicated = False
    import hashlib
    import json
    digest = hashlib.sha256(json.dumps(_without_devices([nodes[k] for k in replicated]),
                                       sort_keys=True).encode()).hexdigest()
    with _walking(ctx, state):
        keys = [ctx.encode(k) for k in state]
        values = [nodes[k] if k in nodes else ctx.encode(v, k) for k, v in state.items()]
    tree = {"$": "dict", "k": keys, "v": values}
    if type(state) is collections.OrderedDict:
        tree["ordered"] = True
    return Flattened(tree, ctx.sources, ctx.shards, digest)


def tree_nodes(tree: Any, prune: Optional[Callable[[Dict[str, Any]], bool]] = None) -> Iterator[Dict[str, Any]]:
    """The node dicts of a tree (as a decode would reach them), pushing only
    containers and never looking inside a tensor node, which is decoded
    without decoding anything in it (2,000 tensors: ~1 ms, against 10 ms for
    a walk that pushed every int of every shape). A node for which
    ``prune(node)`` is true is neither yielded nor entered."""
    stack = [tree]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            if prune is not None and prune(n):
                continue
            yield n
            if n.get("$") != "tensor":
                stack.extend(v for v in n.values() if isinstance(v, (dict, list)))
        elif isinstance(n, list):
            stack.extend(v for v in n if isinstance(v, (dict, list)))


def referenced_entries(node: Any, out: Optional[set] = None, skip: Optional[set] = None) -> set:
    """Indices of the entries a (sub)tree needs, to read only those bytes
    (nodes whose id is in ``skip`` are read otherwise; a DTensor is read
    through the shard index, not this rank's entry)."""
    out = set() if out is None else out
    for n in tree_nodes(node, lambda n: n.get("$") == "dtensor" or bool(skip) and id(n) in skip):
        e = n.get("e")
        if type(e) is int:
            out.add(e)
    return out
