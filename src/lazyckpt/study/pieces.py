"""A committed step's tensors as *pieces* of their global shape, read box by
box: the reading layer under ``lazyckpt.diff`` (diffs.py) and
``lazyckpt.trajectory`` (trajectories.py); the overview is in __init__.py.

* :class:`StepView` opens a step (or a lone ``.lzc`` file), holds it (a read
  lock locally, a reader lease on an object store) and lists its leaves as
  :class:`TensorInfo`: a tensor is a list of :class:`Piece` -- boxes of its
  global shape, each a strided view into one entry of one data file (a plain
  tensor is one piece at the origin; a DTensor one piece per saved shard,
  found through the step's shard index, replicas counted once). Every piece
  carries its bytes' *identity* (run, step, save, rank, entry, checksums; an
  incremental ``"ref"`` entry names what it points at), so two steps that
  name the same bytes are known equal without reading them.
* :func:`boxes` cuts a box into sub-boxes whose storage span is at most a
  chunk in every piece involved; :class:`BoxReader` reads one (whole
  checksum blocks around it, verified, as every read of the library) and
  counts the bytes in a :class:`ReadCounter`.

Everything here is resolved from footers and manifests: no byte of data is
read before a caller asks for a box.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fnmatch
import functools
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from lazyckpt.loading.stepfiles import StepFiles, plain_tensor_entry
from lazyckpt.loading.reader import CheckpointFile, RefResolver, resolver_for
from lazyckpt.loading.resolve import resolve
from lazyckpt.state.providers import LoadContext, dtype_from_name
from lazyckpt.state.walk import walk
from lazyckpt.storage.stores import for_path
from .. import api
from ..errors import CheckpointNotFoundError
from ..knobs import Options, resolve as resolve_options


# --------------------------------------------------------------------------- counting reads


class ReadCounter:
    """Bytes read from storage (whole checksum blocks, as read), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        #: The largest single read: what one sub-box costs in memory on one side.
        self.largest_read = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1
            self.largest_read = max(self.largest_read, n)


# --------------------------------------------------------------------------- steps


@dataclass
class Piece:
    """One box of a tensor's global shape, as a strided view of one entry."""
    file: CheckpointFile
    entry: int
    node: Dict[str, Any]            # the tensor node: shape, stride, offset (in elements)
    offsets: List[int]              # where the box starts in the global tensor
    identity: Tuple[Any, ...]       # where its bytes physically are (see _identity)

    @property
    def shape(self) -> List[int]:
        return self.node["shape"]

    @property
    def block_bytes(self) -> int:
        """The checksum block of the file holding the bytes: the unit every read is made of."""
        e = self.file.entries[self.entry]
        return e.ref["block_bytes"] if e.kind == "ref" else self.file.footer.block_bytes

    @property
    def geometry(self) -> Tuple[Any, ...]:
        n = self.node
        return (tuple(n["shape"]), tuple(n["stride"]), n["offset"], tuple(self.offsets))


@dataclass
class TensorInfo:
    """One leaf of a step's state as the study sees it."""
    name: str
    type: str                        # tensor, dtensor, pickle, numpy, bytes, unknown
    dtype: Optional[torch.dtype] = None
    shape: Optional[List[int]] = None
    pieces: List[Piece] = field(default_factory=list)
    skip: Optional[str] = None       # why it cannot be compared
    note: Optional[str] = None

    @property
    def signature(self) -> Tuple[Any, ...]:
        """Equal signatures: the same values (the same bytes, read the same way)."""
        return (str(self.dtype), tuple(self.shape or ()),
                tuple(sorted((p.identity, p.geometry) for p in self.pieces)))

    @property
    def nbytes(self) -> int:
        if self.dtype is None or self.shape is None:
            return 0
        return math.prod(self.shape) * itemsize(self.dtype)


@functools.lru_cache(maxsize=None)
def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_AT_STEP = re.compile(r"^(.*)@(\d+)$")


class StepView:
    """A committed step (or a lone ``.lzc`` file) opened for reading pieces:
    footers and manifest parsed once, the step held (a read lock locally, a
    reader lease on an object store) until ``close()``."""

    def __init__(self, spec: str, options: Optional[Options] = None, pool: Any = None):
        self.options = options or resolve_options()
        self.pool = pool or api._resources(self.options).readers
        self._holds = contextlib.ExitStack()
        try:
            self._open(str(spec))
        except BaseException:
            self._holds.close()
            raise

    def _open(self, spec: str) -> None:
        m = _AT_STEP.match(spec)
        if m is not None:
            run, step = m.group(1), int(m.group(2))
            spec = _step_location(run, step, self.options)
        target = resolve(spec, self.options, store=for_path(spec))
        self.label = spec
        self.step_dir = target.step_dir
        self.step: Optional[int] = target.step
        self.refs: Optional[RefResolver] = None
        self.files: Dict[Optional[int], CheckpointFile] = {}
        self.step_files: Optional[StepFiles] = None
        store = target.store
        if target.step_dir is None:                       # a lone file
            if store.holds_references:
                self.refs = self._holds.enter_context(resolver_for(target.path, self.options))
            self.files[None] = CheckpointFile(target.path, self.options, self.refs, store=store)
            self.root = target.path
            return
        held = self._holds.enter_context(store.reading_step(target.step_dir, self.options, self.step))
        manifest = held.read_manifest()                   # again, under the hold
        self.root = held.directory
        if store.holds_references:
            self.refs = self._holds.enter_context(RefResolver(os.path.dirname(target.step_dir), self.options))
        self.step_files = StepFiles(target.step_dir, manifest, self.options, self.refs, store=store)
        for rank in range(manifest["world_size"]):
            self.files[rank] = self.step_files.file(rank)

    def close(self) -> None:
        self._holds.close()

    def __enter__(self) -> "StepView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ the catalog

    def catalog(self) -> Tuple[Dict[str, TensorInfo], int]:
        """(name -> TensorInfo for every non-value leaf, in state order; the
        number of Python values, which are not compared). The union over the
        ranks' trees (pipeline stages hold different keys); a plain tensor
        several ranks hold is rank 0's copy, as ``lazyckpt.load`` gives it."""
        out: Dict[str, TensorInfo] = {}
        values: Dict[str, bool] = {}
        own_copies: Dict[str, int] = {}
        for rank, f in self.files.items():
            for leaf in walk(f.footer.tree):
                name = leaf.name
                if leaf.type == "value":
                    values[name] = True
                    continue
                if leaf.type == "tensor" and type(leaf.node.get("e")) is int \
                        and 0 <= leaf.node["e"] < len(f.entries) and f.entries[leaf.node["e"]].kind != "remote":
                    own_copies[name] = own_copies.get(name, 0) + 1
                if name in out:
                    continue
                out[name] = self._info(f, rank, leaf)
        for name, n in own_copies.items():
            if n > 1 and out[name].type == "tensor" and out[name].skip is None:
                out[name].note = f"rank 0's value; {n} ranks saved their own copy"
        return out, len(values)

    def _info(self, f: CheckpointFile, rank: Optional[int], leaf: Any) -> TensorInfo:
        node = leaf.node
        info = TensorInfo(leaf.name, leaf.type)
        ctx = LoadContext(entry_value=None, storage=None, allow_pickle=False, path=f.path, trail=list(leaf.path))
        if leaf.type == "pickle":
            info.skip = f"pickled {node.get('type') or 'object'}: not compared (not read)"
            return info
        if leaf.type in ("numpy", "bytes", "unknown"):
            info.skip = f"{leaf.type} value: only tensors are compared"
            return info
        if leaf.type == "dtensor":
            info.dtype = dtype_from_name(node.get("dtype"), ctx)
            info.shape = node.get("global_shape")
        else:
            info.dtype = dtype_from_name(node.get("dtype"), ctx)
            info.shape = node.get("shape")
        if not (isinstance(info.shape, list) and all(type(n) is int and n >= 0 for n in info.shape)):
            raise ctx.corrupt("bad tensor shape")
        if info.dtype.is_complex:
            info.skip = f"complex dtype {str(info.dtype).replace('torch.', '')}: not compared"
            return info
        if leaf.type == "tensor" and node.get("e") is None:
            info.skip = "meta tensor: it holds no data"
            return info
        if leaf.type == "dtensor":
            if self.step_files is None:
                raise ctx.corrupt("a DTensor outside a step directory")
            key = json.dumps(list(leaf.path))
            shard = self.step_files.shard_info(key, ctx)
            if shard is None:
                raise ctx.corrupt(f"no shard index for DTensor {key}")
            if shard.get("dtype") != node.get("dtype") or shard.get("global_shape") != info.shape:
                raise ctx.corrupt(f"the shard index of {key} disagrees with its node")
            origin = [0] * len(info.shape)
            for p in self.step_files._cover(shard, info.shape, info.shape, origin, info.dtype, ctx):
                holder = self.step_files.file(p["rank"])
                info.pieces.append(self._piece(holder, p["tensor"]["e"], p["tensor"], list(p["offsets"])))
        else:
            holder, e = plain_tensor_entry(f, self.step_files, node, info.dtype, ctx)   # geometry checked
            info.pieces.append(self._piece(holder, e, node, [0] * len(info.shape)))
        return info

    def _piece(self, f: CheckpointFile, e: int, node: Dict[str, Any], offsets: List[int]) -> Piece:
        return Piece(f, e, node, offsets, self._identity(f, e))

    def _identity(self, f: CheckpointFile, e: int) -> Tuple[Any, ...]:
        """Where entry ``e`` of ``f`` has its bytes: (run, step, save, rank, entry,
        offset, length, checksums). An incremental "ref" names the file it
        points at, so A's data and B's reference to it compare equal; the
        checksums are part of it (a reference is trusted only if they agree,
        as the loader checks when it resolves one)."""
        entry = f.entries[e]
        meta = f.footer.metadata.get("lazyckpt")
        if entry.kind == "ref":
            r = entry.ref
            return (self.root, r["step"], r["save_id"], r["rank"], r["entry"], r["offset"], r["length"],
                    tuple(r["checksums"]))
        rank = meta.get("rank") if isinstance(meta, dict) else None
        save_id = meta.get("save_id") if isinstance(meta, dict) else None
        if save_id is None:                  # a lone file without identity: only itself
            return (os.path.realpath(f.path) if not f.store.is_remote else f.path, None, None, None, e,
                    entry.offset, entry.length, tuple(entry.checksums))
        return (self.root, f.step, save_id, rank, e, entry.offset, entry.length, tuple(entry.checksums))


def _step_location(run: str, step: int, options: Options) -> str:
    """``RUN@STEP`` -> that committed step's directory or save prefix."""
    store = for_path(run)
    run = store.normalize(run)
    if not store.is_remote and not os.path.isdir(run):     # nothing to stat on a remote store
        raise CheckpointNotFoundError(f"{run}: no such Checkpointer directory", path=run)
    store.check(run, options)
    layout = store.checkpoint_dir(run, options)
    found = layout.locate_step(step)        # a few stat calls on a local directory, not a listing
    if found is not None:
        return found[1]
    paths = layout.step_paths()             # (for the message)
    if step not in paths:
        shown = ", ".join(map(str, sorted(paths)[-10:])) or "none"
        raise CheckpointNotFoundError(f"{run}: no committed step {step} (committed: {shown})", path=run, step=step)
    return paths[step]


# --------------------------------------------------------------------------- reading boxes


def _span(lo: Sequence[int], hi: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of storage a box's strided view reaches, first to last."""
    return sum((h - l - 1) * s for l, h, s in zip(lo, hi, stride)) + 1


def boxes(lo: List[int], hi: List[int], strides: List[Sequence[int]], limit: int) -> Iterator[Tuple[list, list]]:
    """Sub-boxes of [lo, hi) whose volume and storage span in every layout of
    ``strides`` are at most ``limit`` elements (a single element always passes),
    in row-major order. Cut along the dimension with the largest stride first:
    a row-major tensor is cut into runs of whole rows, a transposed one into
    runs of whole columns, each one contiguous read."""
    extents = [h - l for l, h in zip(lo, hi)]
    if any(n == 0 for n in extents):
        return
    volume = math.prod(extents)
    if volume <= limit and all(_span(lo, hi, s) <= limit for s in strides):
        yield lo, hi
        return
    dims = [d for d in range(len(lo)) if extents[d] > 1]
    d = max(dims, key=lambda i: (max(s[i] for s in strides), extents[i]))
    step_stride = max(s[d] for s in strides)
    rest_hi = list(hi)
    rest_hi[d] = lo[d] + 1
    rest = max(_span(lo, rest_hi, s) for s in strides)
    k_vol = max(1, limit // (volume // extents[d]))
    k_span = (limit - rest) // step_stride + 1 if step_stride and rest <= limit else 1 if step_stride else extents[d]
    k = max(1, min(k_vol, k_span, extents[d] - 1 if extents[d] > 1 else 1))
    for a in range(lo[d], hi[d], k):
        sub_lo, sub_hi = list(lo), list(hi)
        sub_lo[d], sub_hi[d] = a, min(a + k, hi[d])
        yield from boxes(sub_lo, sub_hi, strides, limit)


class BoxReader:
    """Reads boxes of pieces (verified), counting the bytes."""

    def __init__(self, pool: Any, counter: ReadCounter):
        self.pool = pool
        self.counter = counter

    def box(self, piece: Piece, dtype: torch.dtype, lo: List[int], hi: List[int]) -> torch.Tensor:
        node = piece.node
        stride, size = node["stride"], itemsize(dtype)
        rel_lo = [a - o for a, o in zip(lo, piece.offsets)]
        rel_hi = [b - o for b, o in zip(hi, piece.offsets)]
        first = node["offset"] + sum(a * s for a, s in zip(rel_lo, stride))
        span = _span(rel_lo, rel_hi, stride)
        raw = self._bytes(piece, first * size, (first + span) * size)
        typed = raw.view(dtype)
        return typed.as_strided([b - a for a, b in zip(lo, hi)], stride, typed.storage_offset())

    def _bytes(self, piece: Piece, start: int, end: int) -> torch.Tensor:
        f, j = piece.file, piece.entry
        if f.entries[j].kind == "ref":
            f, j = f.resolve(j)
        e, block = f.entries[j], f.footer.block_bytes
        # What read_range reads: the whole checksum blocks around the range.
        lo = max(e.offset, (e.offset + start) // block * block)
        hi = min(e.offset + e.length, -(-(e.offset + end) // block) * block)
        self.counter.add(max(0, hi - lo))
        return f.read_range(j, start, end, self.pool)


def box_elements(limit_bytes: int, dtype: torch.dtype, *pieces: Piece) -> int:
    """Elements per sub-box: ``limit_bytes``, or one checksum block where that is larger."""
    return max(1, max([limit_bytes] + [p.block_bytes for p in pieces]) // itemsize(dtype))


def key_matches(name: str, keys: Optional[Sequence[str]]) -> bool:
    return keys is None or any(fnmatch.fnmatchcase(name, k) for k in keys)


def key_patterns(keys: Union[None, str, Sequence[str]]) -> Optional[List[str]]:
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    out = [str(k) for k in keys]
    if not out:
        raise ValueError("keys= is empty: pass None to compare every tensor")
    return out


def bounded_map(ex: cf.Executor, fn: Callable[[Any], Any], items: Iterable[Any], window: int) -> Iterator[Any]:
    """``ex.map`` in order, with at most ``window`` tasks submitted ahead
    (``Executor.map`` submits everything at once). Pending tasks are
    cancelled if the consumer stops early or a task fails."""
    pending: List[cf.Future] = []
    it = iter(items)
    try:
        for item in it:
            pending.append(ex.submit(fn, item))
            if len(pending) >= window:
                yield pending.pop(0).result()
        while pending:
            yield pending.pop(0).result()
    finally:
        for job in pending:
            job.cancel()


__all__ = ["ReadCounter", "Piece", "TensorInfo", "StepView", "BoxReader", "boxes", "box_elements", "itemsize",
           "key_patterns", "key_matches", "bounded_map"]
