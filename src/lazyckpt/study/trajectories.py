"""``lazyckpt.trajectory`` (``lazyckpt trajectory``): a statistic of each
selected tensor over every kept step of a run, local or ``s3://``, with the
persistent tier's steps. The overview is in study/__init__.py; the pieces it reads
are pieces.py's.

Each distinct tensor (steps that refer to the same bytes share one) is read
box by box by ``workers`` threads, and only the statistic asked for is
folded, in float64 where it sums: the cost per element is one conversion and
one dot product for a norm, not every statistic at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import sys
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from lazyckpt.storage.stores import for_path
from ..errors import CheckpointNotFoundError, MissingKeyError
from ..lineage import Event, line
from ..tiers.line import Line
from ..knobs import Options, resolve as resolve_options
from .pieces import (BoxReader, ReadCounter, StepView, TensorInfo, bounded_map, box_elements, boxes,
                           key_matches, key_patterns)

#: Statistics ``trajectory`` computes chunk by chunk (a callable gets the whole tensor instead).
STATS = ("norm", "mean", "std", "absmax", "min", "max", "rms")

#: Sums are folded in float64 over slices of this many elements: 2 MiB of
#: temporaries per worker, long enough that the Python per slice is noise
#: (measured: 256 Ki to 1 Mi elements cost about the same per element, 32 Ki
#: about 1.5x).
_SLICE = 1 << 18

#: Statistics that only order values: compared in the tensor's own dtype, which
#: is exact (rounding to float64 is monotonic) and needs no float64 copy.
_EXTREMES = ("min", "max", "absmax")


class _StatAcc:
    """One statistic of a tensor, folded box by box; only what that statistic
    needs is computed: a float64 sum of squares (norm, rms), a float64 sum
    (mean), per-slice n, mean and M2 merged as Chan et al. (std: no
    cancellation from a sum of squares), or the extremes (min, max, absmax)."""

    def __init__(self, stat: str) -> None:
        self.stat = stat
        self.n = 0
        self.total = 0.0                 # sum, or sum of squares
        self.mean = self.m2 = 0.0        # std
        self.min, self.max = math.inf, -math.inf
        self.nan = False                 # a NaN among the extremes (Python's min() would drop it)
        self._buf: Optional[torch.Tensor] = None

    def add(self, t: torch.Tensor) -> None:
        f = t.reshape(-1)
        if not f.numel():
            return
        if self.stat in _EXTREMES:
            lo, hi = torch.aminmax(f.to(torch.uint8) if f.dtype == torch.bool else f)
            lo, hi = float(lo), float(hi)
            if math.isnan(lo) or math.isnan(hi):
                self.nan = True
            else:
                self.min, self.max = min(self.min, lo), max(self.max, hi)
            self.n += f.numel()
            return
        if self._buf is None or self._buf.numel() < min(f.numel(), _SLICE):
            # One float64 slice, reused: a fresh one per slice (``.double()``) costs
            # more than the arithmetic (page faults of a new 2 MiB allocation).
            self._buf = torch.empty(min(f.numel(), _SLICE), dtype=torch.float64)
        for i in range(0, f.numel(), _SLICE):
            part = f[i:i + _SLICE]
            n = part.numel()
            x = self._buf[:n]
            x.copy_(part)
            if self.stat == "mean":
                self.total += float(x.sum())
            elif self.stat == "std":
                mean = float(x.mean())
                d = x.sub_(mean)
                m2 = float(torch.dot(d, d))
                delta = mean - self.mean
                total = self.n + n
                self.m2 += m2 + delta * delta * self.n * n / total
                self.mean += delta * n / total
            else:                                           # norm, rms
                self.total += float(torch.dot(x, x))
            self.n += n

    def value(self) -> float:
        stat = self.stat
        if self.nan and stat in _EXTREMES:
            return float("nan")
        if stat == "norm":
            return math.sqrt(self.total)
        if not self.n:
            return float("nan")
        if stat == "mean":
            return self.total / self.n
        if stat == "std":          # as torch.std: unbiased (correction=1)
            return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else float("nan")
        if stat == "rms":
            return math.sqrt(self.total / self.n)
        if stat == "min":
            return self.min
        if stat == "max":
            return self.max
        if stat == "absmax":
            return max(abs(self.min), abs(self.max))
        raise ValueError(stat)


def run_steps(run: str, persist_to: Optional[str] = None, options: Optional[Options] = None,
              wanted: Optional[List[int]] = None) -> List[Tuple[int, str, str]]:
    """Every kept committed step of a run, oldest first, as (step, tier,
    location): the local directory's steps and, with ``persist_to`` (the
    persistent tier's ``s3://`` URL), that tier's, on the one line of history
    (a save abandoned by a rollback is not one). A step on both tiers is read
    from the local one. ``run`` may itself be an ``s3://`` prefix. ``wanted``:
    only those steps, each looked up by itself in a local directory (a few
    ``stat`` calls: a range costs what it holds, not what the run does);
    elsewhere one listing still finds them."""
    options = options or resolve_options()
    store = for_path(run)
    run = store.normalize(run)
    if store.is_remote:
        if persist_to is not None:      # policy: a persistent tier backs a local directory
            raise ValueError("persist_to= is the persistent tier of a local run directory; "
                             f"{run} is itself on an object store")
    elif not os.path.isdir(run):        # nothing to stat on a remote store
        raise CheckpointNotFoundError(f"{run}: no such Checkpointer directory", path=run)
    store.check(run, options)
    layout = store.checkpoint_dir(run, options)
    if persist_to is None:
        tier = "object store" if store.is_remote else "local"
        if wanted is not None and not store.is_remote:
            found = [layout.locate_step(s) for s in wanted]
            if all(found):
                return [(s, tier, path) for s, path in sorted(found)]
        return [(s, tier, path) for s, path in sorted(layout.step_paths().items())]
    tier_store = for_path(persist_to)
    tier_store.check(persist_to, options)
    remote_dir = tier_store.checkpoint_dir(persist_to, options)
    history = Line(layout, remote_dir)
    local = history.local_saves()
    remote, remote_events = remote_dir.listing()
    if not remote and not remote_events:
        _refuse_a_replicas_run_tier(tier_store, persist_to, options)
    events = history.local_events() + remote_events + [Event(s, sid, None) for s, sid in remote.items()]
    out = []
    for step, sid in line(events):
        if step in local and local[step].save_id in (sid, None):
            out.append((step, "local", layout.step_path(step)))
        elif remote.get(step) == sid:
            out.append((step, "persistent", remote_dir.save_path(step, sid)))
    return out


def _refuse_a_replicas_run_tier(tier_store: Any, persist_to: str, options: Options) -> None:
    """With replicas=, each node persists under ``persist_to/node_NNNNN``
    (checkpointer.py): the URL the Checkpointer was given holds no step itself,
    and reading it as the tier would silently leave every persisted step out.
    The nodes are numbered from 0 without gaps, so the probe stops at the first
    node without a step (or after the few a message shows)."""
    nodes = []
    while len(nodes) < 5:
        node = tier_store.join(persist_to.rstrip("/"), f"node_{len(nodes):05d}")
        if not tier_store.checkpoint_dir(node, options).step_paths():
            break
        nodes.append(node)
    if nodes:
        shown = ", ".join(nodes[:4]) + (", ..." if len(nodes) > 4 else "")
        raise ValueError(f"persist_to={persist_to} holds the per-node tiers of a replicas= run; pass the one of "
                         f"this directory's node: {shown}")


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
        patterns = key_patterns(keys)
        wanted = sorted(set(int(s) for s in steps)) if steps is not None else None
        located = run_steps(run, persist_to, options, wanted)
        if wanted is not None:
            have = {s for s, _, _ in located}
            missing = [s for s in wanted if s not in have]
            if missing:
                raise CheckpointNotFoundError(f"{run}: no kept step {missing[0]} (kept: "
                                              f"{', '.join(str(s) for s in sorted(have)[-10:]) or 'none'})",
                                              path=run, step=missing[0])
            wanted_steps = set(wanted)      # once (built per step, it cost located x wanted)
            located = [x for x in located if x[0] in wanted_steps]
        if not located:
            raise CheckpointNotFoundError(f"{run}: no committed step", path=run)
        self.steps = [(s, tier) for s, tier, _ in located]
        #: (step, tier, where) of every step read: a step directory or save prefix.
        self.locations = list(located)
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
                    if not key_matches(name, patterns):
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
        reader = BoxReader(self.pool, self.counter)
        if isinstance(self.fn, str):
            acc = _StatAcc(self.fn)
            for p in info.pieces:
                for lo, hi in boxes(list(p.offsets), [o + n for o, n in zip(p.offsets, p.shape)],
                                    [p.node["stride"]], box_elements(self.limit, info.dtype, p)):
                    acc.add(reader.box(p, info.dtype, lo, hi))
            return acc.value()
        whole = torch.empty(info.shape, dtype=info.dtype)
        for p in info.pieces:
            for lo, hi in boxes(list(p.offsets), [o + n for o, n in zip(p.offsets, p.shape)],
                                [p.node["stride"]], box_elements(self.limit, info.dtype, p)):
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
            bar = _progress_bar(self.progress, sum(i.nbytes for i in unique), "trajectory")
            results: Dict[int, Any] = {}
            with cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="lazyckpt-history") as ex:
                def measure(info: TensorInfo) -> Any:
                    value = self._measure(info)
                    if bar is not None:
                        bar.update(info.nbytes)
                    return value
                computed = bounded_map(ex, measure, unique, 2 * self.workers)
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

    def numel(self) -> Dict[str, int]:
        """key -> its number of elements (at its latest step): what tells a counter from a tensor."""
        return {name: math.prod(info.shape or ()) for _, name, info in self.tasks}

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


__all__ = ["trajectory", "run_steps", "Trajectory", "STATS"]
