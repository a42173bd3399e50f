"""Studying a run from its checkpoints: ``diff`` two committed steps, follow a
statistic of each tensor over every kept step (``trajectory``).

Both read pieces of tensors, never whole states:

* A tensor is a list of *pieces*: boxes of its global shape, each a strided
  view into one entry of one data file (a plain tensor is one piece at the
  origin; a DTensor saved by FSDP2 / tensor parallel is one piece per saved
  shard, found through the step's shard index, replicas counted once). So a
  step of 2 ranks compares with a step of 1 or 4 by global region, no tensor
  is ever assembled.
* Each box (the intersection of a piece of A with a piece of B, for a diff)
  is cut into sub-boxes whose bytes span at most ``chunk_bytes`` in each
  piece's storage; one sub-box is read at a time (whole checksum blocks
  around it, each verified, as every read of the library), its statistics
  folded into float64 accumulators, and the buffer dropped. Memory per
  worker: the checksum blocks around one sub-box per side (about two chunks
  per side) plus float64 slices of ``_SLICE`` elements, whatever the model.
* Bytes already identical by construction are not read: where both sides of
  a region name the same bytes (an incremental step's ``"ref"`` entry to the
  other step's data, or both to a third step's, the same save of the same
  run) with the same geometry, the region is unchanged. A tensor whose every
  region is such is reported unchanged with zero bytes read; in a
  ``trajectory`` its statistic is computed once and reused for every step
  that refers to the same bytes. (A tensor only partly referenced reads its
  referenced regions once, on the A side, for ``||a||`` and the cosine.)

What is compared: tensors (``torch.Tensor`` and DTensor leaves). Pickled
objects, numpy arrays, ``bytes``, meta and complex tensors get a row that says
why they were skipped, never a silent gap; Python values (scalars, strings)
are counted in ``values_not_compared``. Keys or shapes that disagree give a
skipped row naming both sides. Everything is resolved from the footers
before the first byte of data is read, so a missing or damaged step fails
the whole call (``CheckpointNotFoundError`` / ``CorruptCheckpointError``)
instead of returning a partial answer.

A step is named by a path as ``lazyckpt inspect`` takes it (a ``.lzc`` file,
a step directory, a Checkpointer directory: its latest step; local or
``s3://``), or ``RUN@STEP`` for a given committed step of a run.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fnmatch
import json
import math
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from lazyckpt.formats.names import step_dirname
from lazyckpt.loading.loader import StepFiles, plain_tensor_entry
from lazyckpt.loading.reader import CheckpointFile, RefResolver, resolver_for
from lazyckpt.loading.resolve import resolve
from lazyckpt.state.providers import LoadContext, dtype_from_name
from lazyckpt.state.walk import walk
from lazyckpt.storage.layout import CheckpointDir, StepDir
from lazyckpt.storage.s3 import is_url
from lazyckpt.storage.s3layout import ObjectCheckpointDir, reading_object_step
from . import api
from .errors import CheckpointNotFoundError, MissingKeyError
from .history import Event, History, line
from .knobs import Options, resolve as resolve_options

#: float64 statistics are folded over slices of this many elements (bounds the temporaries).
_SLICE = 1 << 18

#: Statistics ``trajectory`` computes chunk by chunk (a callable gets the whole tensor instead).
STATS = ("norm", "mean", "std", "absmax", "min", "max", "rms")


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
class _Piece:
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
    pieces: List[_Piece] = field(default_factory=list)
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
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
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
        target = resolve(spec, self.options)
        self.label = spec
        self.step_dir = target.step_dir
        self.step: Optional[int] = target.step
        self.refs: Optional[RefResolver] = None
        self.files: Dict[Optional[int], CheckpointFile] = {}
        self.step_files: Optional[StepFiles] = None
        if target.step_dir is None:                       # a lone file
            if not is_url(target.path):
                self.refs = self._holds.enter_context(resolver_for(target.path, self.options))
            self.files[None] = CheckpointFile(target.path, self.options, self.refs)
            self.root = target.path
            return
        manifest = target.manifest
        if is_url(target.step_dir):
            held = self._holds.enter_context(reading_object_step(target.step_dir, self.options))
            manifest = held.manifest()                    # again, under the lease
            self.root = target.step_dir.rsplit("/", 2)[0]
        else:
            self._holds.enter_context(StepDir(target.step_dir, self.step).reading())
            self.root = os.path.realpath(os.path.dirname(target.step_dir))
            self.refs = self._holds.enter_context(RefResolver(os.path.dirname(target.step_dir), self.options))
        self.step_files = StepFiles(target.step_dir, manifest, self.options, self.refs)
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

    def _piece(self, f: CheckpointFile, e: int, node: Dict[str, Any], offsets: List[int]) -> _Piece:
        return _Piece(f, e, node, offsets, self._identity(f, e))

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
            return (os.path.realpath(f.path) if not is_url(f.path) else f.path, None, None, None, e,
                    entry.offset, entry.length, tuple(entry.checksums))
        return (self.root, f.step, save_id, rank, e, entry.offset, entry.length, tuple(entry.checksums))


def _step_location(run: str, step: int, options: Options) -> str:
    """``RUN@STEP`` -> that committed step's directory or save prefix."""
    if is_url(run):
        return ObjectCheckpointDir(run, options).step_path(step)     # CheckpointNotFoundError if absent
    run = os.path.abspath(run)
    if not os.path.isdir(run):
        raise CheckpointNotFoundError(f"{run}: no such Checkpointer directory", path=run)
    steps = CheckpointDir(run).steps()
    if step not in steps:
        shown = ", ".join(map(str, steps[-10:])) or "none"
        raise CheckpointNotFoundError(f"{run}: no committed step {step} (committed: {shown})", path=run, step=step)
    return os.path.join(run, step_dirname(step))


# --------------------------------------------------------------------------- reading boxes


def _span(lo: Sequence[int], hi: Sequence[int], stride: Sequence[int]) -> int:
    """Elements of storage a box's strided view reaches, first to last."""
    return sum((h - l - 1) * s for l, h, s in zip(lo, hi, stride)) + 1


def _boxes(lo: List[int], hi: List[int], strides: List[Sequence[int]], limit: int) -> Iterator[Tuple[list, list]]:
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
        yield from _boxes(sub_lo, sub_hi, strides, limit)


class _Reader:
    """Reads boxes of pieces (verified), counting the bytes."""

    def __init__(self, pool: Any, counter: ReadCounter):
        self.pool = pool
        self.counter = counter

    def box(self, piece: _Piece, dtype: torch.dtype, lo: List[int], hi: List[int]) -> torch.Tensor:
        node = piece.node
        stride, size = node["stride"], _itemsize(dtype)
        rel_lo = [a - o for a, o in zip(lo, piece.offsets)]
        rel_hi = [b - o for b, o in zip(hi, piece.offsets)]
        first = node["offset"] + sum(a * s for a, s in zip(rel_lo, stride))
        span = _span(rel_lo, rel_hi, stride)
        raw = self._bytes(piece, first * size, (first + span) * size)
        typed = raw.view(dtype)
        return typed.as_strided([b - a for a, b in zip(lo, hi)], stride, typed.storage_offset())

    def _bytes(self, piece: _Piece, start: int, end: int) -> torch.Tensor:
        f, j = piece.file, piece.entry
        if f.entries[j].kind == "ref":
            f, j = f.resolve(j)
        e, block = f.entries[j], f.footer.block_bytes
        # What read_range reads: the whole checksum blocks around the range.
        lo = max(e.offset, (e.offset + start) // block * block)
        hi = min(e.offset + e.length, -(-(e.offset + end) // block) * block)
        self.counter.add(max(0, hi - lo))
        return f.read_range(j, start, end, self.pool)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


# --------------------------------------------------------------------------- diff


@dataclass
class DiffRow:
    """One tensor of a diff. ``skipped`` (a reason) rows have no statistics."""
    key: str
    shape: Optional[List[int]] = None
    dtype: Optional[str] = None
    max_abs_diff: Optional[float] = None
    norm_diff: Optional[float] = None           # ||a - b||
    rel_change: Optional[float] = None          # ||a - b|| / ||a|| (0 when equal; inf when a = 0 != b)
    cosine: Optional[float] = None              # 1.0 when equal; None when one side is 0 and they differ
    frac_changed: Optional[float] = None
    numel: Optional[int] = None
    changed: Optional[int] = None
    by_reference: bool = False                  # unchanged because both name the same bytes: not read
    skipped: Optional[str] = None
    note: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        doc = {k: _json_number(v) for k, v in self.__dict__.items()}
        return {k: v for k, v in doc.items() if v is not None and v is not False or k in ("key",)}


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


@dataclass
class DiffReport:
    a: str
    b: str
    rows: List[DiffRow]
    bytes_read: int
    #: Bytes the compared tensors hold on each side: what loading both whole would read.
    tensor_bytes: int
    values_not_compared: int

    @property
    def compared(self) -> List[DiffRow]:
        return [r for r in self.rows if r.skipped is None]

    @property
    def skipped(self) -> List[DiffRow]:
        return [r for r in self.rows if r.skipped is not None]

    def to_json(self) -> Dict[str, Any]:
        return {"a": self.a, "b": self.b, "bytes_read": self.bytes_read, "tensor_bytes": self.tensor_bytes,
                "values_not_compared": self.values_not_compared, "compared": len(self.compared),
                "skipped": len(self.skipped), "rows": [r.to_json() for r in self.rows]}


class _DiffAcc:
    def __init__(self) -> None:
        self.n = self.changed = 0
        self.max_abs = 0.0
        self.sq_d = self.sq_a = self.sq_b = self.dot = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        fa, fb = _flat(a), _flat(b)
        floating = a.dtype.is_floating_point
        for i in range(0, fa.numel(), _SLICE):
            ra, rb = fa[i:i + _SLICE], fb[i:i + _SLICE]
            ne = ra != rb
            if floating:
                ne &= ~(ra.isnan() & rb.isnan())
            self.changed += int(ne.sum())
            x, y = ra.to(torch.float64), rb.to(torch.float64)
            d = x - y
            if d.numel():
                m = float(d.abs().max())
                if math.isnan(m) or m > self.max_abs:      # NaN sticks (NaN > x is False)
                    self.max_abs = m
            self.sq_d += float(torch.dot(d, d))
            self.sq_a += float(torch.dot(x, x))
            self.sq_b += float(torch.dot(y, y))
            self.dot += float(torch.dot(x, y))
            self.n += ra.numel()

    def add_same(self, a: torch.Tensor) -> None:
        """A region both sides hold as the same bytes: b = a."""
        fa = _flat(a)
        for i in range(0, fa.numel(), _SLICE):
            x = fa[i:i + _SLICE].to(torch.float64)
            s = float(torch.dot(x, x))
            self.sq_a += s
            self.sq_b += s
            self.dot += s
            self.n += x.numel()


def _diff_row(name: str, a: TensorInfo, b: TensorInfo, reader: _Reader, limit_bytes: int) -> DiffRow:
    row = DiffRow(name, list(a.shape), str(a.dtype).replace("torch.", ""), note=a.note or b.note)
    acc = _DiffAcc()
    same_regions: List[Tuple[_Piece, list, list]] = []
    read_any = False
    for pa in a.pieces:
        for pb in b.pieces:
            # A read is whole checksum blocks anyway: a sub-box smaller than one would read it again.
            limit = _limit(limit_bytes, a.dtype, pa, pb)
            lo = [max(x, y) for x, y in zip(pa.offsets, pb.offsets)]
            hi = [min(x + n, y + m) for x, n, y, m in zip(pa.offsets, pa.shape, pb.offsets, pb.shape)]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            if pa.identity == pb.identity and pa.geometry == pb.geometry:
                same_regions.append((pa, lo, hi))
                continue
            read_any = True
            for sl, sh in _boxes(lo, hi, [pa.node["stride"], pb.node["stride"]], limit):
                acc.add(reader.box(pa, a.dtype, sl, sh), reader.box(pb, b.dtype, sl, sh))
    numel = math.prod(a.shape)
    row.numel = numel
    if not read_any:
        # Every region names the same bytes on both sides: unchanged, nothing read.
        row.by_reference = numel > 0 and bool(same_regions)
        row.max_abs_diff = row.norm_diff = row.rel_change = row.frac_changed = 0.0
        row.changed, row.cosine = 0, 1.0
        return row
    for pa, lo, hi in same_regions:
        for sl, sh in _boxes(lo, hi, [pa.node["stride"]], _limit(limit_bytes, a.dtype, pa)):
            acc.add_same(reader.box(pa, a.dtype, sl, sh))
    row.changed = acc.changed
    row.frac_changed = acc.changed / numel if numel else 0.0
    row.max_abs_diff = acc.max_abs
    row.norm_diff = math.sqrt(acc.sq_d) if acc.sq_d == acc.sq_d else float("nan")
    norm_a, norm_b = math.sqrt(acc.sq_a), math.sqrt(acc.sq_b)
    if acc.changed == 0:
        row.max_abs_diff = row.norm_diff = row.rel_change = 0.0
        row.cosine = 1.0
    else:
        row.rel_change = row.norm_diff / norm_a if norm_a > 0 else float("inf")
        row.cosine = max(-1.0, min(1.0, acc.dot / (norm_a * norm_b))) if norm_a > 0 and norm_b > 0 else None
    return row


def _limit(limit_bytes: int, dtype: torch.dtype, *pieces: _Piece) -> int:
    """Elements per sub-box: ``limit_bytes``, or one checksum block where that is larger."""
    return max(1, max([limit_bytes] + [p.block_bytes for p in pieces]) // _itemsize(dtype))


def _match(name: str, keys: Optional[Sequence[str]]) -> bool:
    return keys is None or any(fnmatch.fnmatchcase(name, k) for k in keys)


def _key_patterns(keys: Union[None, str, Sequence[str]]) -> Optional[List[str]]:
    if keys is None:
        return None
    if isinstance(keys, str):
        keys = [keys]
    out = [str(k) for k in keys]
    if not out:
        raise ValueError("keys= is empty: pass None to compare every tensor")
    return out


def _sort_key(row: DiffRow) -> Tuple[int, float, str]:
    if row.skipped is not None:
        return (1, 0.0, row.key)
    rel = row.rel_change
    rel = math.inf if rel is None or math.isnan(rel) else rel
    return (0, -rel, row.key)


def diff(a: str, b: str, *, keys: Union[None, str, Sequence[str]] = None, top: Optional[int] = None,
         workers: int = 2, chunk_bytes: Optional[int] = None, counter: Optional[ReadCounter] = None,
         options: Optional[Options] = None, **knobs: Any) -> DiffReport:
    """Compare two committed steps (of one run or of two; local or ``s3://``;
    any world size on either side) tensor by tensor, reading pieces.

    ``a``/``b``: a ``.lzc`` file, a step directory, a Checkpointer directory
    (its latest step), or ``RUN@STEP``. ``keys``: glob(s) on the ``/``-joined
    state path (``model/layers.*.weight``). Rows are sorted by relative change,
    largest first, then the skipped rows (always all of them: ``top`` keeps the
    first ``top`` compared rows only). ``counter`` (a ReadCounter) counts the
    bytes read. Raises ``CheckpointNotFoundError`` for a missing step and
    ``MissingKeyError`` when ``keys`` matches nothing on either side."""
    options = resolve_options(options, **knobs)
    patterns = _key_patterns(keys)
    counter = counter or ReadCounter()
    limit = chunk_bytes or options.chunk_bytes
    with StepView(a, options) as va, StepView(b, options, va.pool) as vb:
        cat_a, values_a = va.catalog()
        cat_b, values_b = vb.catalog()
        names = [n for n in cat_a if _match(n, patterns)] + [n for n in cat_b if n not in cat_a
                                                             and _match(n, patterns)]
        if not names:
            shown = ", ".join(list(cat_a)[:8])
            raise MissingKeyError(f"no tensor of {va.label} or {vb.label} matches {patterns} "
                                  f"(some names: {shown})", path=va.label)
        rows: Dict[str, DiffRow] = {}
        jobs: List[Tuple[str, TensorInfo, TensorInfo]] = []
        tensor_bytes = 0
        for name in names:
            ia, ib = cat_a.get(name), cat_b.get(name)
            reason = _why_not_comparable(ia, ib, va.label, vb.label)
            if reason is not None:
                info = ia or ib
                rows[name] = DiffRow(name, info.shape, str(info.dtype).replace("torch.", "") if info.dtype else None,
                                     skipped=reason)
            else:
                jobs.append((name, ia, ib))
                tensor_bytes += ia.nbytes + ib.nbytes
        reader = _Reader(va.pool, counter)
        with cf.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="lazyckpt-diff") as ex:
            for name, row in zip([j[0] for j in jobs], _bounded_map(
                    ex, lambda job: _diff_row(job[0], job[1], job[2], reader, limit), jobs, 2 * max(1, workers))):
                rows[name] = row
    ordered = sorted((rows[n] for n in names), key=_sort_key)
    if top is not None:
        if top < 0:
            raise ValueError(f"top must be >= 0, got {top}")
        ordered = [r for r in ordered if r.skipped is None][:top] + [r for r in ordered if r.skipped is not None]
    return DiffReport(va.label, vb.label, ordered, counter.bytes_read, tensor_bytes,
                      max(values_a, values_b))


def _why_not_comparable(a: Optional[TensorInfo], b: Optional[TensorInfo], la: str, lb: str) -> Optional[str]:
    if a is None:
        return f"only in B ({lb})"
    if b is None:
        return f"only in A ({la})"
    if a.skip is not None or b.skip is not None:
        return a.skip if a.skip is not None else f"{b.skip} (in B)"
    if a.shape != b.shape:
        return f"shape differs: {a.shape} in A, {b.shape} in B"
    if a.dtype != b.dtype:
        return (f"dtype differs: {str(a.dtype).replace('torch.', '')} in A, "
                f"{str(b.dtype).replace('torch.', '')} in B")
    return None


def _bounded_map(ex: cf.Executor, fn: Callable[[Any], Any], items: Iterable[Any], window: int) -> Iterator[Any]:
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


# --------------------------------------------------------------------------- trajectory


class _StatAcc:
    """n, mean and M2 merged slice by slice (Chan et al.), min, max, sum of squares."""

    def __init__(self) -> None:
        self.n = 0
        self.mean = self.m2 = self.sq = 0.0
        self.min, self.max = math.inf, -math.inf
        self.nan = False

    def add(self, t: torch.Tensor) -> None:
        f = _flat(t)
        for i in range(0, f.numel(), _SLICE):
            x = f[i:i + _SLICE].to(torch.float64)
            n = x.numel()
            if not n:
                continue
            mean = float(x.mean())
            m2 = float(torch.dot(x - mean, x - mean))
            delta = mean - self.mean
            total = self.n + n
            self.m2 += m2 + delta * delta * self.n * n / total
            self.mean += delta * n / total
            self.n = total
            self.sq += float(torch.dot(x, x))
            lo, hi = float(x.min()), float(x.max())
            if math.isnan(lo) or math.isnan(hi):
                self.nan = True
            else:
                self.min, self.max = min(self.min, lo), max(self.max, hi)

    def value(self, stat: str) -> float:
        if self.nan and stat in ("min", "max", "absmax"):
            return float("nan")
        if stat == "norm":
            return math.sqrt(self.sq)
        if not self.n:
            return float("nan")
        if stat == "mean":
            return self.mean
        if stat == "std":          # as torch.std: unbiased (correction=1)
            return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else float("nan")
        if stat == "rms":
            return math.sqrt(self.sq / self.n)
        if stat == "min":
            return self.min
        if stat == "max":
            return self.max
        if stat == "absmax":
            return max(abs(self.min), abs(self.max))
        raise ValueError(stat)


def run_steps(run: str, persist_to: Optional[str] = None,
              options: Optional[Options] = None) -> List[Tuple[int, str, str]]:
    """Every kept committed step of a run, oldest first, as (step, tier,
    location): the local directory's steps and, with ``persist_to`` (the
    persistent tier's ``s3://`` URL), that tier's, on the one line of history
    (a save abandoned by a rollback is not one). A step on both tiers is read
    from the local one. ``run`` may itself be an ``s3://`` prefix."""
    options = options or resolve_options()
    if is_url(run):
        if persist_to is not None:
            raise ValueError("persist_to= is the persistent tier of a local run directory; "
                             f"{run} is itself on an object store")
        directory = ObjectCheckpointDir(run, options)
        directory.store.check()
        committed = directory.committed()
        return [(s, "object store", directory.save_url(s, committed[s])) for s in sorted(committed)]
    run = os.path.abspath(run)
    if not os.path.isdir(run):
        raise CheckpointNotFoundError(f"{run}: no such Checkpointer directory", path=run)
    layout = CheckpointDir(run)
    if persist_to is None:
        return [(s, "local", layout.step_path(s)) for s in layout.steps()]
    remote_dir = ObjectCheckpointDir(persist_to, options)
    remote_dir.store.check()
    history = History(layout, remote_dir)
    local = history.local_saves()
    remote, remote_events = remote_dir.listing()
    events = history.local_events() + remote_events + [Event(s, sid, None) for s, sid in remote.items()]
    out = []
    for step, sid in line(events):
        if step in local and local[step].save_id in (sid, None):
            out.append((step, "local", layout.step_path(step)))
        elif remote.get(step) == sid:
            out.append((step, "persistent", remote_dir.save_url(step, sid)))
    return out


class Trajectory:
    """``(step, key, value)`` for every tensor matching ``keys`` in every kept
    step of a run (see :func:`trajectory`). Iterating computes the values, in
    (step, state order); ``skipped`` lists (step, key, why) of the leaves that
    match but cannot be measured; ``counter.bytes_read`` the bytes read."""

    def __init__(self, run: str, keys: Union[None, str, Sequence[str]], fn: Union[str, Callable[[torch.Tensor], Any]],
                 steps: Optional[Iterable[int]], persist_to: Optional[str], workers: int,
                 chunk_bytes: Optional[int], progress: Optional[bool], options: Options):
        if isinstance(fn, str):
            if fn not in STATS:
                raise ValueError(f"unknown statistic {fn!r}; one of {', '.join(STATS)}, or a callable")
        elif not callable(fn):
            raise TypeError(f"fn must be a statistic name or a callable, not {type(fn).__name__}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.fn, self.workers, self.options = fn, workers, options
        self.limit = chunk_bytes or options.chunk_bytes
        self.progress = progress
        self.counter = ReadCounter()
        patterns = _key_patterns(keys)
        located = run_steps(run, persist_to, options)
        if steps is not None:
            wanted = sorted(set(int(s) for s in steps))
            have = {s for s, _, _ in located}
            missing = [s for s in wanted if s not in have]
            if missing:
                raise CheckpointNotFoundError(f"{run}: no kept step {missing[0]} (kept: "
                                              f"{', '.join(str(s) for s in sorted(have)[-10:]) or 'none'})",
                                              path=run, step=missing[0])
            located = [x for x in located if x[0] in set(wanted)]
        if not located:
            raise CheckpointNotFoundError(f"{run}: no committed step", path=run)
        self.steps = [(s, tier) for s, tier, _ in located]
        self.skipped: List[Tuple[int, str, str]] = []
        self.tasks: List[Tuple[int, str, TensorInfo]] = []
        self._views: List[StepView] = []
        pool = None
        try:
            # Every footer before any data: a damaged step fails the call, not its row.
            for step, tier, where in located:
                view = StepView(where, options, pool)
                pool = view.pool
                self._views.append(view)
                catalog, _ = view.catalog()
                for name, info in catalog.items():
                    if not _match(name, patterns):
                        continue
                    if info.skip is not None:
                        self.skipped.append((step, name, info.skip))
                    else:
                        self.tasks.append((step, name, info))
        except BaseException:
            self.close()
            raise
        if not self.tasks and not self.skipped:
            self.close()
            raise MissingKeyError(f"{run}: no tensor matches {patterns} in any of its {len(located)} steps",
                                  path=run)
        self.pool = pool
        self.keys = list(dict.fromkeys(name for _, name, _ in self.tasks))

    def close(self) -> None:
        for view in self._views:
            view.close()
        self._views = []

    def __enter__(self) -> "Trajectory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _measure(self, info: TensorInfo) -> Any:
        reader = _Reader(self.pool, self.counter)
        if isinstance(self.fn, str):
            acc = _StatAcc()
            for p in info.pieces:
                for lo, hi in _boxes(list(p.offsets), [o + n for o, n in zip(p.offsets, p.shape)],
                                     [p.node["stride"]], _limit(self.limit, info.dtype, p)):
                    acc.add(reader.box(p, info.dtype, lo, hi))
            return acc.value(self.fn)
        whole = torch.empty(info.shape, dtype=info.dtype)
        for p in info.pieces:
            for lo, hi in _boxes(list(p.offsets), [o + n for o, n in zip(p.offsets, p.shape)],
                                 [p.node["stride"]], _limit(self.limit, info.dtype, p)):
                whole[tuple(slice(a, b) for a, b in zip(lo, hi))] = reader.box(p, info.dtype, lo, hi)
        value = self.fn(whole)
        return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value

    def __iter__(self) -> Iterator[Tuple[int, str, Any]]:
        try:
            # One measure per distinct signature: steps that refer to the same bytes
            # (incremental references) share it, computed once.
            first: Dict[Any, int] = {}
            order: List[Tuple[int, str, Any]] = []
            unique: List[TensorInfo] = []
            for step, name, info in self.tasks:
                sig = info.signature
                if sig not in first:
                    first[sig] = len(unique)
                    unique.append(info)
                order.append((step, name, first[sig]))
            bar = _progress_bar(self.progress, sum(i.nbytes for i in unique), "history")
            results: Dict[int, Any] = {}
            with cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="lazyckpt-history") as ex:
                def measure(info: TensorInfo) -> Any:
                    value = self._measure(info)
                    if bar is not None:
                        bar.update(info.nbytes)
                    return value
                computed = _bounded_map(ex, measure, unique, 2 * self.workers)
                try:
                    for step, name, u in order:
                        while u not in results:
                            results[len(results)] = next(computed)
                        yield step, name, results[u]
                finally:
                    computed.close()
                    if bar is not None:
                        bar.close()
        finally:
            self.close()

    def table(self) -> Dict[str, Dict[int, Any]]:
        """key -> {step: value}, everything computed."""
        out: Dict[str, Dict[int, Any]] = {}
        for step, key, value in self:
            out.setdefault(key, {})[step] = value
        return out


def trajectory(run: str, keys: Union[None, str, Sequence[str]] = None,
               fn: Union[str, Callable[[torch.Tensor], Any]] = "norm", *, steps: Optional[Iterable[int]] = None,
               persist_to: Optional[str] = None, workers: int = 4, chunk_bytes: Optional[int] = None,
               progress: Optional[bool] = False, options: Optional[Options] = None, **knobs: Any) -> Trajectory:
    """A statistic of every tensor matching ``keys`` (globs on the ``/``-joined
    state path) over every kept step of ``run`` (a Checkpointer directory, or an
    ``s3://`` one; with ``persist_to``, the persistent tier's steps too).

    ``fn``: one of :data:`STATS` (``norm``, ``mean``, ``std`` -- unbiased, as
    ``torch.std`` --, ``absmax``, ``min``, ``max``, ``rms``), computed chunk by
    chunk in float64; or a callable that gets each whole tensor (then memory is
    one tensor per worker). ``workers`` tensors (of any steps) are read in
    parallel. ``progress``: a tqdm bar on stderr (True; None: when stderr is a
    terminal; needs the ``cli`` extra). Iterate the result for ``(step, key,
    value)``; ``.table()`` gives ``{key: {step: value}}``. Every footer is read
    first: a missing or damaged step raises before any value is yielded."""
    options = resolve_options(options, **knobs)
    return Trajectory(run, keys, fn, steps, persist_to, workers, chunk_bytes, progress, options)


class _Bar:
    def __init__(self, bar: Any):
        self.bar = bar
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(enabled: Optional[bool], total: int, desc: str) -> Optional[_Bar]:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError("a progress bar needs tqdm: pip install 'lazyckpt[cli]' (or pass progress=False)") \
            from None
    return _Bar(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                     leave=False, dynamic_ncols=True))


__all__ = ["diff", "trajectory", "run_steps", "DiffReport", "DiffRow", "Trajectory", "ReadCounter", "StepView",
           "STATS"]
