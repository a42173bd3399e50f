"""``lazyckpt.diff``: two committed steps compared tensor by tensor, one row
per tensor (max |a-b|, ||a-b||, ||a-b||/||a||, cosine, fraction changed),
sorted by relative change. The overview is in study/__init__.py; the pieces it reads
are pieces.py's.

Each region where a piece of A meets a piece of B is compared sub-box by
sub-box (at most a chunk of storage per side), folded into float64
accumulators. A region both sides name as the same bytes (an incremental
reference) is unchanged: if every region of a tensor is such, nothing of it
is read; otherwise its referenced regions are read once, on the A side, for
``||a||`` and the cosine.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import MissingKeyError
from ..knobs import Options, resolve as resolve_options
from .pieces import (BoxReader, Piece, ReadCounter, StepView, TensorInfo, bounded_map, box_elements, boxes,
                           key_matches, key_patterns)

#: float64 statistics are folded over slices of this many elements (bounds the temporaries).
_SLICE = 1 << 18


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


def _diff_row(name: str, a: TensorInfo, b: TensorInfo, reader: BoxReader, limit_bytes: int) -> DiffRow:
    row = DiffRow(name, list(a.shape), str(a.dtype).replace("torch.", ""), note=a.note or b.note)
    acc = _DiffAcc()
    same_regions: List[Tuple[Piece, list, list]] = []
    read_any = False
    for pa in a.pieces:
        for pb in b.pieces:
            # A read is whole checksum blocks anyway: a sub-box smaller than one would read it again.
            limit = box_elements(limit_bytes, a.dtype, pa, pb)
            lo = [max(x, y) for x, y in zip(pa.offsets, pb.offsets)]
            hi = [min(x + n, y + m) for x, n, y, m in zip(pa.offsets, pa.shape, pb.offsets, pb.shape)]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            if pa.identity == pb.identity and pa.geometry == pb.geometry:
                same_regions.append((pa, lo, hi))
                continue
            read_any = True
            for sl, sh in boxes(lo, hi, [pa.node["stride"], pb.node["stride"]], limit):
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
        for sl, sh in boxes(lo, hi, [pa.node["stride"]], box_elements(limit_bytes, a.dtype, pa)):
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
    patterns = key_patterns(keys)
    counter = counter or ReadCounter()
    limit = chunk_bytes or options.chunk_bytes
    with StepView(a, options) as va, StepView(b, options, va.pool) as vb:
        cat_a, values_a = va.catalog()
        cat_b, values_b = vb.catalog()
        names = [n for n in cat_a if key_matches(n, patterns)] + [n for n in cat_b if n not in cat_a
                                                             and key_matches(n, patterns)]
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
        reader = BoxReader(va.pool, counter)
        with cf.ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="lazyckpt-diff") as ex:
            for name, row in zip([j[0] for j in jobs], bounded_map(
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


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


__all__ = ["diff", "DiffReport", "DiffRow"]
