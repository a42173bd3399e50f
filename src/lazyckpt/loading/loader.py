"""Turning a checkpoint back into state: the entry points (a path on any
store, a file, a committed step) and ``load_tree``,
which selects keys, refuses pickles, reads the entries in parallel, maps
devices (map_location) and fills ``into=``.

Its pieces live beside it: ``into.py`` (what ``into=`` gets and when),
``graft.py`` (keys held by other ranks' trees), ``stepfiles.py`` (a step's
files and the DTensor assembly from their pieces)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import logging
import os
import threading
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from lazyckpt.errors import (CheckpointError, CheckpointNotFoundError, CheckpointReadError,
                             CorruptCheckpointError, MapLocationError, MissingKeyError, UnsafeObjectError)
from lazyckpt.knobs import Options
from lazyckpt.state.providers import BytesNotReady, LoadContext, referenced_entries, tree_nodes
from lazyckpt.storage.fileio import a_load_ended
from lazyckpt.storage.base import Store
from .graft import graft_missing, grafted_node, restrict_to
from .into import byte_copy_plan, copy_bytes, direct_fills, fill_into, staged_entries, unfilled_tensors
from .reader import CheckpointFile, RefResolver, resolver_for
from .request import DEFAULT, KeySpec, LoadRequest, MapLocation  # noqa: F401  (KeySpec, MapLocation: re-exported)
from .stepfiles import StepFiles, plain_into_dtensor, slice_loader

log = logging.getLogger("lazyckpt")

def select(tree: Any, paths: Iterable[Tuple[Any, ...]], ctx: LoadContext) -> Any:
    """The part of ``tree`` reached by the key paths (``LoadRequest.keys``:
    normalized), keeping its nesting."""
    return _select(tree, list(paths), ctx, ())


def _select(node: Any, paths: list, ctx: LoadContext, trail: tuple) -> Any:
    if any(len(p) == 0 for p in paths):
        return node
    if not (isinstance(node, dict) and node.get("$") == "dict"):
        raise MissingKeyError(f"{ctx.path}: cannot select keys inside {'/'.join(map(str, trail)) or 'the root'}"
                              f", which is not a dict", path=ctx.path)
    decoded = [ctx.decode(k) for k in node["k"]]
    # Grouped once: a scan of every path per key was quadratic (1,000 keys of a
    # 2,000-key dict: 152 ms).
    by_first: Dict[Any, list] = {}
    for p in paths:
        by_first.setdefault(p[0], []).append(p[1:])
    keep_k, keep_v = [], []
    for key, knode, vnode in zip(decoded, node["k"], node["v"]):
        try:
            below = by_first.get(key)
        except TypeError:               # an unhashable key in the file: no path names it
            below = None
        if below:
            keep_k.append(knode)
            keep_v.append(_select(vnode, below, ctx, trail + (key,)))
    missing = {p[0] for p in paths} - set(decoded)
    if missing:
        where = "/".join(map(str, trail)) or "the root"
        raise MissingKeyError(f"{ctx.path}: no key {sorted(map(repr, missing))[0]} under {where}; "
                              f"it has {sorted(map(repr, decoded))[:10]}", path=ctx.path)
    out = dict(node)
    out["k"], out["v"] = keep_k, keep_v
    return out


def _find_pickle(node: Any, trail: list) -> Optional[tuple]:
    """First pickle node (and its path), to refuse before reading any bytes."""
    if not _has_pickle(node):
        return None                     # the common case, without a trail per node
    stack = [(node, trail)]
    while stack:
        n, t = stack.pop()
        if isinstance(n, dict):
            tag = n.get("$")
            if tag == "pickle":
                return n, t
            if tag == "dict" and isinstance(n.get("k"), list) and isinstance(n.get("v"), list):
                for k, v in zip(n["k"], n["v"]):
                    stack.append((v, t + [str(k if not isinstance(k, dict) else k.get("v", "?"))]))
                    stack.append((k, t))
            else:
                for key, v in n.items():
                    if isinstance(v, (dict, list)):
                        stack.append((v, t))
        elif isinstance(n, list):
            stack.extend((v, t + [str(i)]) for i, v in enumerate(n))
    return None


class _EarlyDecode:
    """Decodes a tree while its reads run (``CheckpointFile.read_entries``'s
    ``while_reading``): for 2,000 tensors, 21 ms of views that the main
    thread, otherwise only waiting, builds before the last read ends. Only
    views of CPU storages are made (``LoadContext.views_only``); a value that
    needs bytes stops it (:class:`BytesNotReady`), and so does any error,
    which the decode after the reads then raises in its place. Its state is
    used only once every read has ended verified."""

    def __init__(self, tree: Any, kinds: Dict[int, str], map_location: MapLocation, ctx: LoadContext):
        self.tree, self.kinds, self.ctx = tree, kinds, ctx
        # Where every storage stays the one read (the mapper returns it as is).
        self.all_to_cpu = isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cpu"
        self.cpu_stays = map_location is None
        self.done, self.state = False, None

    def run(self, storages: Dict[int, torch.UntypedStorage]) -> None:
        def not_ready(*_a: Any) -> Any:
            raise BytesNotReady()

        def storage(e: Any, location: str) -> torch.UntypedStorage:
            stays = self.all_to_cpu or self.cpu_stays and (location == "cpu" or location.startswith("cpu:"))
            if not stays or type(e) is not int or e not in storages or self.kinds.get(e) != "data":
                raise BytesNotReady()
            return storages[e]
        ctx = LoadContext(entry_value=not_ready, storage=storage, allow_pickle=self.ctx.allow_pickle,
                          path=self.ctx.path, dtensor_loader=not_ready, views_only=True)
        try:
            self.state, self.done = ctx.decode(self.tree), True
        except (BytesNotReady, Exception):
            self.state = None           # decoded again after the reads, where errors are raised


def _scan(tree: Any) -> Tuple[bool, bool, List[int]]:
    """(whether any node is a pickle node, whether any is a DTensor node, the
    entry of every node that names one, once per use) in one walk over the
    nodes :func:`tree_nodes` yields: :func:`_has_pickle`,
    :func:`referenced_entries` and :func:`staged_entries` walked them once
    each, with a generator and a prune call per node (2,000 tensors: 0.5
    against 1.0 ms before the first read, 1.6 with ``into=``).
    :func:`referenced_entries` leaves a DTensor's subtree out: where there is
    one, the caller asks it."""
    entries: List[int] = []
    pickle = dtensor = False
    stack = [tree]
    pop, push, add = stack.pop, stack.extend, entries.append
    while stack:
        n = pop()
        if isinstance(n, dict):
            tag = n.get("$")
            e = n.get("e")
            if type(e) is int:
                add(e)
            if tag == "tensor":
                continue
            if tag == "pickle":
                pickle = True
            elif tag == "dtensor":
                dtensor = True
            push(v for v in n.values() if isinstance(v, (dict, list)))
        elif isinstance(n, list):
            push(v for v in n if isinstance(v, (dict, list)))
    return pickle, dtensor, entries


def _has_pickle(node: Any) -> bool:
    """Whether any node of the tree is a pickle node (:func:`tree_nodes`: one
    pass, no path per node as :func:`_find_pickle` keeps for its message)."""
    return any(n.get("$") == "pickle" for n in tree_nodes(node))


class _CollectorHold:
    """Python's cyclic garbage collector held off from a load's start until its
    reads are submitted (:meth:`release`, from ``while_reading``) or the load
    ends. A footer of 2,000 entries is ~15,000 containers alive for the whole
    load: collected during its parse, they were promoted until a full
    collection of the process (~100 ms here, with torch's objects) fell inside
    every fourth or fifth load's front; held off, they die young (0 full
    collections in 40 loads, against 8). Holds nest across threads: the first
    turns the collector off if it was on, the last turns it back on."""

    _lock = threading.Lock()
    _holders = 0
    _turn_back_on = False

    def __init__(self) -> None:
        self.held = False

    def __enter__(self) -> "_CollectorHold":
        with _CollectorHold._lock:
            if _CollectorHold._holders == 0:
                _CollectorHold._turn_back_on = gc.isenabled()
                gc.disable()
            _CollectorHold._holders += 1
            self.held = True
        return self

    def release(self) -> None:
        with _CollectorHold._lock:
            if not self.held:
                return
            self.held = False
            _CollectorHold._holders -= 1
            if _CollectorHold._holders == 0 and _CollectorHold._turn_back_on:
                gc.enable()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _storage_mapper(map_location: MapLocation) -> Callable[[torch.UntypedStorage, str], torch.UntypedStorage]:
    def move(storage: torch.UntypedStorage, device: Any) -> torch.UntypedStorage:
        device = torch.device(device)
        if device.type == "cpu":
            return storage
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CheckpointError(f"the checkpoint holds tensors saved on {device} but CUDA is not "
                                  f"available; pass map_location='cpu'")
        flat = torch.empty((0,), dtype=torch.uint8).set_(storage)
        return flat.to(device).untyped_storage()

    def mapper(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        if map_location is None:
            return move(storage, location)
        if isinstance(map_location, (str, torch.device)):
            return move(storage, map_location)
        if isinstance(map_location, dict):
            return move(storage, map_location.get(location, location))
        if callable(map_location):
            # The caller's code: its failures are its own (MapLocationError), where any
            # other error of the decode is taken for a damaged file.
            try:
                result = map_location(storage, location)
            except Exception as exc:
                raise MapLocationError(f"the map_location callable raised {type(exc).__name__} for a storage "
                                       f"saved on {location!r}: {exc}") from exc
            if result is None:
                return move(storage, location)
            if isinstance(result, torch.TypedStorage):
                return result.untyped()
            if not isinstance(result, torch.UntypedStorage):
                raise MapLocationError(f"the map_location callable returned {type(result).__name__} for a "
                                       f"storage saved on {location!r}; it must return a storage (e.g. "
                                       f"storage.cuda(), or the storage it was given) or None to keep the "
                                       f"saved location")
            return result
        raise TypeError(f"map_location must be None, a device, a dict or a callable, not "
                        f"{type(map_location).__name__}")
    return mapper


def load_file(path: str, options: Options, pool: cf.ThreadPoolExecutor, store: Store,
              request: LoadRequest = DEFAULT) -> Any:
    """Load one checkpoint file (written by a single rank) on ``store`` (the
    caller's: looked up once, where the path entered), as ``request`` asks."""
    # A lone file inside DIR/step_X/ may refer to DIR's earlier steps (where the store holds references).
    refs = resolver_for(path, options) if store.holds_references else contextlib.nullcontext(None)
    with _CollectorHold() as collector, _os_errors_as_read_errors(path), refs as refs:
        return load_tree(CheckpointFile(path, options, refs, store=store), None, pool, request, collector)


def load_step(path: str, manifest: Optional[Dict[str, Any]], options: Options, pool: cf.ThreadPoolExecutor,
              rank: Optional[int] = None, *, store: Store, request: LoadRequest = DEFAULT) -> Any:
    """Load a committed step on ``store`` (its parsed manifest, or None to
    read it here, under the hold).

    With several saving ranks, rank ``r`` loads the state of saving rank
    ``r % world_size`` (replicated entries and DTensor shards are gathered from
    whichever files hold them). ``rank`` defaults to this process's rank. The
    step is held while it is read (``Store.reading_step``: a shared lock on
    its manifest, a reader lease on an object store), so that retention and
    prune in another process keep it; where it is deleted anyway (a file
    system without locks, an expired lease, another tool), the error says so
    instead of reporting the vanished files as damage."""
    with _CollectorHold() as collector, _os_errors_as_read_errors(path), \
            store.reading_step(path, options) as held, _references(store, held, options) as refs:
        try:
            if manifest is None:
                manifest = held.read_manifest()
            elif not held.still_there():        # gone between the caller's read and our hold
                raise held.deleted()
            if rank is None:
                rank = _current_rank()
            step = StepFiles(path, manifest, options, refs, store=store)
            return load_tree(step.file(rank % manifest["world_size"]), step, pool, request, collector)
        except (CheckpointError, OSError) as exc:
            if not held.still_there():
                raise held.deleted() from exc
            raise


def _references(store: Any, held: Any, options: Options) -> Any:
    """The resolver of a step's incremental references (its directory's earlier
    steps), where the store holds any."""
    if not store.holds_references:
        return contextlib.nullcontext(None)
    return RefResolver(os.path.dirname(os.path.abspath(held.path)), options)


def _current_rank() -> int:
    try:
        import torch.distributed as dist
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except ImportError:
        return 0


class _os_errors_as_read_errors:
    """Every OSError of a load reaches the caller as a CheckpointError subclass with the path."""

    def __init__(self, path: str):
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, CheckpointError) or not isinstance(exc, OSError):
            return False
        path = exc.filename or self.path
        if isinstance(exc, FileNotFoundError):
            raise CheckpointNotFoundError(f"{path}: {exc.strerror or exc}", path=path) from exc
        raise CheckpointReadError(f"{path}: read failed: {exc.strerror or exc}", path=path,
                                  errno_=exc.errno) from exc


def load_tree(f: CheckpointFile, step: Optional["StepFiles"], pool: cf.ThreadPoolExecutor,
              request: LoadRequest = DEFAULT, collector: Optional[_CollectorHold] = None) -> Any:
    """Rebuild the state described by ``f``'s tree, as ``request`` asks
    (its fields, checked when it was built). ``step`` resolves entries
    held by other ranks' files and DTensor shards (multi-rank checkpoints).
    With ``into``, every tensor of ``into`` (under ``keys``, if given) must get
    a value from the checkpoint: otherwise ``MissingKeyError`` is raised before
    anything is read or filled, unless ``strict=False`` (then a warning names
    what kept its old value). ``collector``: released once the reads are
    submitted."""
    path = f.path
    map_location, keys, into = request.map_location, request.keys, request.into
    allow_pickle, strict = request.allow_pickle, request.strict
    storages: Dict[int, torch.UntypedStorage] = {}
    kinds: Dict[int, str] = {}
    mapped: Dict[int, torch.UntypedStorage] = {}
    mapper = _storage_mapper(map_location)

    def entry_value(e: Any, kind: str = "data") -> torch.UntypedStorage:
        if type(e) is not int or e not in storages:
            raise ctx.corrupt(f"reference to unknown entry {e!r}")
        if kinds[e] != kind:
            raise ctx.corrupt(f"entry {e} is {kinds[e]!r}, expected {kind!r}")
        return storages[e]

    def storage(e: Any, location: str) -> torch.UntypedStorage:
        if e not in mapped:
            mapped[e] = mapper(entry_value(e), location)
        return mapped[e]

    ctx = LoadContext(entry_value=entry_value, storage=storage, allow_pickle=allow_pickle, path=path)
    tree = f.footer.tree
    graft: Dict[int, Tuple[CheckpointFile, int]] = {}
    if step is not None and (into is not None or keys is not None):
        try:
            tree = graft_missing(tree, f, step, into, keys, ctx, graft)
            if graft and into is not None:
                # A re-partitioned load: this rank's own saved keys that into= lacks
                # belong to another rank now; load into='s keys only.
                tree = restrict_to(tree, into, ctx)
        except CheckpointError:
            raise
        except Exception as exc:     # a hostile tree
            raise ctx.corrupt(f"{type(exc).__name__} while looking up keys on other ranks: {exc}") from None
    if keys is not None:
        try:
            tree = select(tree, keys, ctx)
        except CheckpointError:
            raise
        except Exception as exc:     # a hostile tree
            raise ctx.corrupt(f"{type(exc).__name__} while selecting keys: {exc}") from None
    unfilled: List[str] = []
    if into is not None:
        try:
            unfilled = unfilled_tensors(into, tree, ctx, keys)
        except CheckpointError:
            raise
        except Exception as exc:     # a hostile tree
            raise ctx.corrupt(f"{type(exc).__name__} while matching into=: {exc}") from None
        if unfilled and strict:
            shown = ", ".join(unfilled[:20]) + (f", ... ({len(unfilled)} in all)" if len(unfilled) > 20 else "")
            raise MissingKeyError(f"{path}: the checkpoint has no value for {len(unfilled)} tensor(s) of "
                                  f"into=: {shown}; nothing was loaded (pass strict=False to load the "
                                  f"rest and keep these as they are)", path=path, missing=unfilled)
    pickled, dtensors, uses = _scan(tree)
    if not allow_pickle and pickled:
        found = _find_pickle(tree, [])
        if found is not None:
            node, trail = found
            name = "/".join(trail) or "<root>"
            raise UnsafeObjectError(
                f"{path}: entry {name} is a pickled {node.get('type', 'object')}; unpickling runs "
                f"code from the file, so it is refused. Pass allow_pickle=True if you trust this file.",
                path=path, entry=name)
    # Plain saved tensors loaded into DTensors of into= (a checkpoint from one
    # process resumed sharded): each rank reads only its own rows of them.
    sliced = plain_into_dtensor(tree, into) if into is not None else {}
    if graft:
        sliced = {i: t for i, t in sliced.items() if not grafted_node(tree, i)}
    referenced = referenced_entries(tree, skip=set(sliced)) if dtensors or sliced else set(uses)
    entries = f.entries
    needed = [e for e in referenced if 0 <= e < len(entries)]
    local: List[int] = []
    remote: Dict[int, list] = {}
    for e in needed:
        if entries[e].kind == "remote":
            remote.setdefault(entries[e].rank, []).append(e)
        else:
            local.append(e)
    # into=: a tensor filled one to one is copied as soon as its entry is read
    # and verified, on the reader threads, while later entries are still being
    # read (and, for device targets, its host-to-device copy with them).
    direct = direct_fills(into, tree, ctx) if into is not None else {}
    filled: Dict[int, Any] = {}

    def fill_now(e: int, data: torch.UntypedStorage, kind: str) -> None:
        if e not in direct:
            return
        plan = byte_copy_plan(direct[e]) if kind == "data" else None
        if plan is not None and copy_bytes(data, plan):
            for node, target, _start, _n in plan:
                filled[id(node)] = target
            if e not in staged:
                storages[e], kinds[e] = data, kind
            return
        storages[e], kinds[e] = data, kind
        for node, target in direct[e]:
            sub = LoadContext(entry_value=entry_value, storage=storage, allow_pickle=allow_pickle, path=path)
            value = sub.decode(node)
            with torch.no_grad():
                target.copy_(value)
            filled[id(node)] = target
        if e in staged:
            del storages[e]             # a reused buffer: the next run's bytes go there
    kinds_of: Dict[int, str] = {}

    def note_kinds() -> None:
        # What each entry read holds. fill_now needs it as entries arrive; a load
        # without into= only once its reads are submitted (while_reading).
        if not kinds_of:
            kinds_of.update((e, entries[e].content_kind) for e in local)
            kinds.update(kinds_of)
    if direct:
        note_kinds()
    staged = staged_entries(tree, direct, uses) if direct else set()
    # A plain load decodes its tree while its reads run (tensor nodes only build
    # views of storages whose bytes arrive later); its state is returned only
    # once every read is verified, and anything that needs bytes sends the load
    # back to decoding after the reads (BytesNotReady).
    early = _EarlyDecode(tree, kinds_of, map_location, ctx) \
        if into is None and not graft and not sliced else None

    def while_reading(out: Dict[int, torch.UntypedStorage]) -> None:
        if collector is not None:
            collector.release()
        note_kinds()
        if early is not None:
            early.run(out)
    storages.update(f.read_entries(local, pool, (lambda e, d: fill_now(e, d, kinds_of[e])) if direct else None,
                                   staged=staged, while_reading=while_reading))
    staged = set()                      # the other files' reads below return what they read
    note_kinds()
    if remote and step is None:
        raise CorruptCheckpointError(f"{path}: refers to other ranks' files; load the step directory",
                                     path=path)
    for rank, indices in remote.items():
        other = step.file(rank)
        for e in indices:
            if e >= len(other.entries) or other.entries[e].kind == "remote":
                raise CorruptCheckpointError(f"{other.path}: does not hold entry {e} that "
                                             f"{path} says it holds", path=other.path, entry=str(e))
            kinds[e] = other.entries[e].content_kind
        storages.update(other.read_entries(indices, pool, (lambda e, d, o=other: fill_now(
            e, d, o.entries[e].content_kind)) if direct else None))
    # Entries of keys grafted from other ranks' trees (pipeline stages).
    by_holder: Dict[int, Tuple[CheckpointFile, List[Tuple[int, int]]]] = {}
    for syn in sorted(e for e in referenced if e in graft):
        other, e = graft[syn]
        holder = other
        if other.entries[e].kind == "remote":
            holder = step.file(other.entries[e].rank)
            if e >= len(holder.entries) or holder.entries[e].kind == "remote":
                raise CorruptCheckpointError(f"{holder.path}: does not hold entry {e} that {other.path} "
                                             f"says it holds", path=holder.path, entry=str(e))
        by_holder.setdefault(id(holder), (holder, []))[1].append((syn, e))
    for holder, pairs in by_holder.values():
        to_syn: Dict[int, List[int]] = {}
        for syn, e in pairs:
            to_syn.setdefault(e, []).append(syn)

        def arrived(e: int, data: torch.UntypedStorage, holder: CheckpointFile = holder,
                    to_syn: Dict[int, List[int]] = to_syn) -> None:
            for syn in to_syn[e]:
                fill_now(syn, data, holder.entries[e].content_kind)
        got = holder.read_entries(list(to_syn), pool, arrived if direct else None)
        for e, syns in to_syn.items():
            for syn in syns:
                storages[syn], kinds[syn] = got[e], holder.entries[e].content_kind
    for node_id, target in filled.items():
        ctx.overrides[node_id] = lambda node, c, target=target: target
    if step is not None:
        ctx.dtensor_loader = step.dtensor_loader(into, pool, mapper)
    for node_id, target in sliced.items():
        ctx.overrides[node_id] = slice_loader(f, step, target, pool)
    try:
        state = early.state if early is not None and early.done and not remote else ctx.decode(tree)
    finally:
        # ctx and these closures refer to each other: drop the read buffers now
        # rather than when the garbage collector finds the cycle.
        storages.clear()
        mapped.clear()
        a_load_ended()                  # later loads' buffers may ask for huge pages (fileio.read_buffer)
    if into is not None:
        filled = fill_into(into, state, path)
        if unfilled:
            message = (f"{path}: {len(unfilled)} tensor(s) of into= are not in the checkpoint and keep "
                       f"their values: {', '.join(unfilled[:20])}")
            warnings.warn(message, UserWarning, stacklevel=3)
            log.warning("lazyckpt: %s", message)
        return filled
    return state


def load_path(path: str, store: Store, options: Options, pool: cf.ThreadPoolExecutor, rank: Optional[int] = None,
              *, request: LoadRequest = DEFAULT) -> Any:
    """Load what ``path`` designates on ``store`` (``Store.locate``): one data
    file, a committed step, or the latest step of a Checkpointer directory,
    as ``request`` asks."""
    for attempt in range(3):
        located = store.locate(path, options)
        if located.kind == "file":
            return load_file(located.path, options, pool, store, request)
        try:
            return load_step(located.step_path, None, options, pool, rank, store=store,
                             request=request)   # its manifest: read under the hold
        except CheckpointNotFoundError:
            # The latest step, read from where its commit left it before the rename, moved
            # under its name meanwhile: found again there.
            if not located.moving or attempt == 2:
                raise
    raise AssertionError("unreachable")
