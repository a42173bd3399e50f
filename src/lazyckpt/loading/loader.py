"""Turning a checkpoint file back into state: key selection, parallel reads,
device placement (map_location) and in-place filling (into=)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import math
import os
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from lazyckpt.errors import (CheckpointError, CheckpointNotFoundError, CheckpointReadError,
                             CorruptCheckpointError, MissingKeyError, StateMismatchError, UnsafeObjectError)
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats import placement
from lazyckpt.formats.names import MANIFEST, STEP_DIR
from lazyckpt.knobs import Options
from lazyckpt.state.providers import (LoadContext, _dtensor_type, dtype_from_name, referenced_entries,
                                      tensor_bytes_needed)
from lazyckpt.state.walk import dtensor_nodes, walk
from lazyckpt.storage.fileio import NotARegularFile, read_small_file
from lazyckpt.storage.layout import StepDir
from lazyckpt.storage.s3 import store_for
from lazyckpt.storage.s3layout import ObjectCheckpointDir, reading_object_step
from .reader import CheckpointFile, RefResolver, resolver_for

log = logging.getLogger("lazyckpt")

MapLocation = Union[None, str, torch.device, Dict[str, str], Callable[..., Any]]
KeySpec = Union[str, Tuple[Any, ...]]


def _normalize_keys(keys: Iterable[KeySpec]) -> list:
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    out = []
    for k in keys:
        out.append(tuple(k) if isinstance(k, tuple) else (k,))
        if not out[-1]:
            raise ValueError("an empty key path selects nothing")
    return out


def select(tree: Any, keys: Iterable[KeySpec], ctx: LoadContext) -> Any:
    """The part of ``tree`` reached by the key paths, keeping its nesting."""
    paths = _normalize_keys(keys)
    return _select(tree, paths, ctx, ())


def _select(node: Any, paths: list, ctx: LoadContext, trail: tuple) -> Any:
    if any(len(p) == 0 for p in paths):
        return node
    if not (isinstance(node, dict) and node.get("$") == "dict"):
        raise MissingKeyError(f"{ctx.path}: cannot select keys inside {'/'.join(map(str, trail)) or 'the root'}"
                              f", which is not a dict", path=ctx.path)
    decoded = [ctx.decode(k) for k in node["k"]]
    keep_k, keep_v = [], []
    for key, knode, vnode in zip(decoded, node["k"], node["v"]):
        below = [p[1:] for p in paths if p[0] == key]
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
            result = map_location(storage, location)
            return move(storage, location) if result is None else result
        raise TypeError(f"map_location must be None, a device, a dict or a callable, not "
                        f"{type(map_location).__name__}")
    return mapper


def load_file(path: str, options: Options, pool: cf.ThreadPoolExecutor, **kwargs: Any) -> Any:
    """Load one checkpoint file (written by a single rank)."""
    with _os_errors_as_read_errors(path), resolver_for(path, options) as refs:
        return load_tree(CheckpointFile(path, options, refs), None, pool, **kwargs)


def load_step_dir(path: str, options: Options, pool: cf.ThreadPoolExecutor, rank: Optional[int] = None,
                  **kwargs: Any) -> Any:
    """Load a committed step directory through its manifest.

    With several saving ranks, rank ``r`` loads the state of saving rank
    ``r % world_size`` (replicated entries and DTensor shards are gathered from
    whichever files hold them). ``rank`` defaults to this process's rank. The
    step is held (a shared lock on its manifest) while it is read, so that
    retention in another process does not delete it meanwhile; where it is
    deleted anyway, the error says so.
    """
    m = STEP_DIR.match(os.path.basename(path))
    step_dir = StepDir(path, int(m.group(1)) if m else None)
    with _os_errors_as_read_errors(path), step_dir.reading() as held, \
            RefResolver(os.path.dirname(os.path.abspath(path)), options) as refs:
        try:
            manifest_path = os.path.join(path, MANIFEST)
            try:
                raw = read_small_file(manifest_path, manifests.MAX_MANIFEST_BYTES)
            except NotARegularFile:
                raise CorruptCheckpointError(f"{manifest_path}: not a regular file",
                                             path=manifest_path) from None
            if raw is None:
                raise CheckpointNotFoundError(f"{path}: no committed checkpoint (no {MANIFEST})", path=path)
            manifest = manifests.parse(raw, manifest_path)
            if rank is None:
                rank = _current_rank()
            step = StepFiles(path, manifest, options, refs)
            return load_tree(step.file(rank % manifest["world_size"]), step, pool, **kwargs)
        except (CheckpointError, OSError) as exc:
            if not held.still_there():
                raise held.deleted() from exc
            raise


def load_step(url: str, manifest: Dict[str, Any], options: Options, pool: cf.ThreadPoolExecutor,
              rank: Optional[int] = None, **kwargs: Any) -> Any:
    """Load a committed step on an object store (its save prefix, and its
    parsed manifest or None to read it here): as :func:`load_step_dir`. The
    step is held by a reader lease (``tiers.reading_object_step``) while it is
    read, so that retention and prune elsewhere keep it; where it is deleted
    anyway (an expired lease, another tool) the error says so, as on a local
    directory, instead of reporting the vanished objects as damage."""
    with reading_object_step(url, options) as held:
        if manifest is None:
            manifest = held.manifest()
        elif not held.still_there():        # gone between the caller's read and our lease
            raise held.deleted()
        if rank is None:
            rank = _current_rank()
        try:
            step = StepFiles(url, manifest, options, None)
            return load_tree(step.file(rank % manifest["world_size"]), step, pool, **kwargs)
        except CheckpointError as exc:
            if not held.still_there():
                raise held.deleted() from exc
            raise


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


def load_tree(f: CheckpointFile, step: Optional["StepFiles"], pool: cf.ThreadPoolExecutor, *,
              map_location: MapLocation = None, keys: Optional[Iterable[KeySpec]] = None,
              into: Any = None, allow_pickle: bool = False, strict: bool = True) -> Any:
    """Rebuild the state described by ``f``'s tree. ``step`` resolves entries
    held by other ranks' files and DTensor shards (multi-rank checkpoints).
    With ``into``, every tensor of ``into`` (under ``keys``, if given) must get
    a value from the checkpoint: otherwise ``MissingKeyError`` is raised before
    anything is read or filled, unless ``strict=False`` (then a warning names
    what kept its old value)."""
    path = f.path
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
    if keys is not None:
        keys = _normalize_keys(keys)
    if step is not None and (into is not None or keys is not None):
        try:
            tree = _graft_missing(tree, f, step, into, keys, ctx, graft)
            if graft and into is not None:
                # A re-partitioned load: this rank's own saved keys that into= lacks
                # belong to another rank now; load into='s keys only.
                tree = _restrict(tree, into, ctx)
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
    if not allow_pickle:
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
    sliced = _plain_into_dtensor(tree, into) if into is not None else {}
    if graft:
        sliced = {i: t for i, t in sliced.items() if not _grafted_node(tree, i)}
    referenced = referenced_entries(tree, skip=set(sliced))
    needed = [e for e in referenced if 0 <= e < len(f.entries)]
    local = [e for e in needed if f.entries[e].kind != "remote"]
    # into=: a tensor filled one to one is copied as soon as its entry is read
    # and verified, on the reader threads, while later entries are still being
    # read (and, for device targets, its host-to-device copy with them).
    direct = _direct_fills(into, tree, ctx) if into is not None else {}
    filled: Dict[int, Any] = {}

    def fill_now(e: int, data: torch.UntypedStorage, kind: str) -> None:
        if e not in direct:
            return
        storages[e], kinds[e] = data, kind
        for node, target in direct[e]:
            sub = LoadContext(entry_value=entry_value, storage=storage, allow_pickle=allow_pickle, path=path)
            value = sub.decode(node)
            with torch.no_grad():
                target.copy_(value)
            filled[id(node)] = target
    kinds_of = {e: f.entries[e].content_kind for e in local}
    storages.update(f.read_entries(local, pool, (lambda e, d: fill_now(e, d, kinds_of[e])) if direct else None))
    kinds.update(kinds_of)
    remote: Dict[int, list] = {}
    for e in needed:
        if f.entries[e].kind == "remote":
            remote.setdefault(f.entries[e].rank, []).append(e)
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
        ctx.overrides[node_id] = _slice_loader(f, step, target, pool)
    try:
        state = ctx.decode(tree)
    finally:
        # ctx and these closures refer to each other: drop the read buffers now
        # rather than when the garbage collector finds the cycle.
        storages.clear()
        mapped.clear()
    if into is not None:
        filled = fill_into(into, state, path)
        if unfilled:
            message = (f"{path}: {len(unfilled)} tensor(s) of into= are not in the checkpoint and keep "
                       f"their values: {', '.join(unfilled[:20])}")
            warnings.warn(message, UserWarning, stacklevel=3)
            log.warning("lazyckpt: %s", message)
        return filled
    return state


_ABSENT = object()


def unfilled_tensors(into: Any, tree: Any, ctx: LoadContext, keys: Optional[list] = None) -> List[str]:
    """Paths ("a/b/c") of the tensors of ``into`` that ``tree`` holds no value
    for, following the rules of :func:`fill_into`; with ``keys``, only under
    the selected key paths."""
    return sorted("/".join(map(str, t)) or "<root>" for t in _unfilled_trails(into, tree, ctx, keys))


def _unfilled_trails(into: Any, tree: Any, ctx: LoadContext, keys: Optional[list] = None) -> List[tuple]:
    roots = [((), into, tree)]
    if keys is not None:
        roots = []
        for key in keys:
            dst, node = into, tree
            for part in key:
                if not isinstance(dst, dict) or part not in dst:
                    dst = _ABSENT
                    break
                dst, node = dst[part], _dict_children(node, ctx).get(part, _ABSENT)
            if dst is not _ABSENT:
                roots.append((tuple(key), dst, node))
    missing = []
    stack = list(roots)
    while stack:
        trail, dst, node = stack.pop()
        if isinstance(dst, torch.Tensor):
            if node is _ABSENT:
                missing.append(trail)
        elif isinstance(dst, dict):
            if node is not _ABSENT and not _is_tag(node, "dict"):
                continue                        # replaced by the checkpoint's value
            children = _dict_children(node, ctx) if node is not _ABSENT else {}
            stack.extend((trail + (k,), v, children.get(k, _ABSENT)) for k, v in dst.items())
        elif isinstance(dst, list):
            if node is not _ABSENT and not _is_tag(node, "seq"):
                continue
            items = node["v"] if node is not _ABSENT and isinstance(node.get("v"), list) else []
            if node is not _ABSENT and len(items) != len(dst):
                continue                        # fill_into replaces a list of another length
            stack.extend((trail + (i,), v, items[i] if i < len(items) else _ABSENT) for i, v in enumerate(dst))
    return missing


def _is_tag(node: Any, tag: str) -> bool:
    return isinstance(node, dict) and node.get("$") == tag


#: Entry ids of nodes grafted from another rank's tree start here (far above any real index).
GRAFT_BASE = 1 << 48


def _graft_missing(tree: Any, f: CheckpointFile, step: "StepFiles", into: Any, keys: Optional[list],
                   ctx: LoadContext, graft: Dict[int, Tuple[CheckpointFile, int]]) -> Any:
    """Any key from any rank: what ``into=`` or ``keys=`` asks for and this
    rank's saved tree lacks (state split by pipeline stage, re-partitioned)
    is looked up in the trees of the ranks that hold other keys (one per
    keyset of the manifest) and grafted in; its entries get ids from
    GRAFT_BASE, mapped in ``graft`` to (that rank's file, its entry)."""
    holders = [r for r in step.key_holders(f)]
    if not holders:
        return tree
    wanted = [tuple(k) for k in keys] if keys is not None else []
    if into is not None:
        wanted += _unfilled_trails(into, tree, ctx, keys)
    missing = [p for p in wanted if _lookup(tree, p, ctx) is _ABSENT]
    for rank in holders:
        if not missing:
            break
        other = step.file(rank)
        still = []
        for path in missing:
            grafted = _graft(tree, other.footer.tree, path, ctx, other, graft, {})
            if grafted is None:
                still.append(path)
            else:
                tree = grafted
        missing = still
    return tree


def _restrict(node: Any, dst: Any, ctx: LoadContext) -> Any:
    """``node`` without the dict keys ``dst`` does not have (recursively)."""
    if not (isinstance(dst, dict) and _is_tag(node, "dict")):
        return node
    keep_k, keep_v = [], []
    for k, v in zip(node["k"], node["v"]):
        key = ctx.decode(k)
        if key in dst:
            keep_k.append(k)
            keep_v.append(_restrict(v, dst[key], ctx))
    return dict(node, k=keep_k, v=keep_v)


def _lookup(node: Any, path: tuple, ctx: LoadContext) -> Any:
    for key in path:
        if _is_tag(node, "seq") and type(key) is int and isinstance(node.get("v"), list) \
                and 0 <= key < len(node["v"]):
            node = node["v"][key]
            continue
        node = _dict_children(node, ctx).get(key, _ABSENT) if _is_tag(node, "dict") else _ABSENT
        if node is _ABSENT:
            return _ABSENT
    return node


def _graft(node: Any, other_node: Any, path: tuple, ctx: LoadContext, other: CheckpointFile,
           graft: Dict[int, Tuple[CheckpointFile, int]], memo: Dict[int, int]) -> Any:
    """A copy of ``node`` with the first key of ``path`` it lacks (and all
    below it) taken from ``other_node``; None if ``other_node`` lacks it too."""
    if not path or not _is_tag(node, "dict") or not _is_tag(other_node, "dict"):
        return None
    theirs = {ctx.decode(k): (k, v) for k, v in zip(other_node["k"], other_node["v"])}
    key = path[0]
    if key not in theirs:
        return None
    out = dict(node, k=list(node["k"]), v=list(node["v"]))
    mine = [ctx.decode(k) for k in node["k"]]
    if key in mine:
        below = _graft(node["v"][mine.index(key)], theirs[key][1], path[1:], ctx, other, graft, memo)
        if below is None:
            return None
        out["v"][mine.index(key)] = below
    else:
        out["k"].append(theirs[key][0])
        out["v"].append(_remap_entries(theirs[key][1], other, graft, memo))
    return out


def _remap_entries(node: Any, other: CheckpointFile, graft: Dict[int, Tuple[CheckpointFile, int]],
                   memo: Dict[int, int]) -> Any:
    """A deep copy of ``node`` whose entry ids name ``other``'s entries through ``graft``
    (one id per entry: storages shared inside the subtree stay shared)."""
    if isinstance(node, list):
        return [_remap_entries(v, other, graft, memo) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _remap_entries(v, other, graft, memo) for k, v in node.items() if k != "e"}
    if "e" in node:
        e = node["e"]
        if type(e) is int:
            if e not in memo:
                memo[e] = GRAFT_BASE + len(graft)
                graft[memo[e]] = (other, e)
            e = memo[e]
        out["e"] = e
    return out


def _dict_children(node: Any, ctx: LoadContext) -> Dict[Any, Any]:
    if not _is_tag(node, "dict") or not isinstance(node.get("k"), list) or not isinstance(node.get("v"), list):
        return {}
    return {ctx.decode(k): v for k, v in zip(node["k"], node["v"])}


class StepFiles:
    """The data files of one committed step and its manifest's shard index."""

    def __init__(self, path: str, manifest: Dict[str, Any], options: Options,
                 refs: Optional[RefResolver] = None):
        self.path = path
        self.manifest = manifest
        self.options = options
        self.refs = refs
        self.world_size = manifest["world_size"]
        self._names = {f["rank"]: f["name"] for f in manifest["files"]}
        self._open: Dict[int, CheckpointFile] = {}
        self.shards = manifest.get("shards", {})
        if not isinstance(self.shards, dict):
            raise CorruptCheckpointError(f"{path}: manifest shard index is not an object", path=path)
        #: Placement-derived index (lazyckpt/placement.py): key -> global shape, dtype, layout.
        self.layouts = manifest.get("layouts", {})
        if not isinstance(self.layouts, dict):
            raise CorruptCheckpointError(f"{path}: manifest layouts are not an object", path=path)
        self._dtensor_nodes: Dict[int, Dict[str, Any]] = {}

    def key_holders(self, f: CheckpointFile) -> List[int]:
        """Ranks whose trees may hold keys ``f``'s lacks (one per other keyset)."""
        mine = next((r for r, g in self._open.items() if g is f), None)
        return manifests.keyset_representatives(self.manifest, mine) if mine is not None else []

    def file(self, rank: int) -> CheckpointFile:
        if rank not in self._names:
            raise CorruptCheckpointError(f"{self.path}: manifest lists no file of rank {rank}",
                                         path=self.path)
        if rank not in self._open:
            path = os.path.join(self.path, self._names[rank])
            try:
                f = CheckpointFile(path, self.options, self.refs)
            except CheckpointNotFoundError:
                # The step is committed, so a missing file is damage, not "no checkpoint".
                raise CorruptCheckpointError(f"{path}: data file of rank {rank} is missing",
                                             path=path) from None
            self._check_belongs(f, rank)
            self._open[rank] = f
        return self._open[rank]

    def _check_belongs(self, f: CheckpointFile, rank: int) -> None:
        """The file must be the one this manifest committed: same size, same save, same rank."""
        listed = next(x for x in self.manifest["files"] if x["rank"] == rank)
        if listed.get("bytes") is not None and listed["bytes"] != f.size:
            raise CorruptCheckpointError(f"{f.path}: {f.size} bytes, the manifest says {listed['bytes']}",
                                         path=f.path)
        mine = f.footer.metadata.get("lazyckpt")
        save_id = self.manifest.get("save_id")
        if save_id is not None and (not isinstance(mine, dict) or mine.get("save_id") != save_id
                                    or mine.get("rank") != rank):
            raise CorruptCheckpointError(f"{f.path}: belongs to another save or rank than this step's "
                                         f"manifest (file from another step, or swapped)", path=f.path)

    def dtensor_loader(self, into: Any, pool: cf.ThreadPoolExecutor, mapper) -> Callable:
        targets = _dtensor_targets(into)

        def load(node: Dict[str, Any], ctx: LoadContext) -> Any:
            key = json.dumps(list(ctx.trail))
            info = self.shard_info(key, ctx)
            if info is None:
                raise ctx.corrupt(f"no shard index for DTensor {key}")
            return self._assemble(info, node, targets.get(key), ctx, pool)
        return load

    def shard_info(self, key: str, ctx: LoadContext) -> Optional[Dict[str, Any]]:
        """Where the pieces of the DTensor at ``key`` are: the listed index
        (older manifests, non-world groups) or one derived from its layout."""
        info = self.shards.get(key)
        if info is None and key in self.layouts:
            return self._derived(key, ctx)
        return dict(info, key=key, derived=False) if isinstance(info, dict) else None

    def _derived(self, key: str, ctx: LoadContext) -> Dict[str, Any]:
        """A shard index entry computed from the tensor's layout: pieces with
        their geometry; the tensor node of each is looked up in its rank's
        footer only if the piece is needed (see _cover)."""
        info = self.layouts[key]
        shape = info.get("global_shape") if isinstance(info, dict) else None
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
                and placement.check(info.get("layout"), len(shape), self.world_size)):
            raise ctx.corrupt(f"bad layout for DTensor {key} in the manifest")
        return {"global_shape": shape, "dtype": info.get("dtype"), "key": key, "derived": True,
                "layout": info["layout"], "pieces": placement.pieces(shape, info["layout"])}

    def dtensor_node(self, rank: int, key: str, ctx: LoadContext) -> Dict[str, Any]:
        """The DTensor node at ``key`` in rank ``rank``'s own footer (checksummed,
        tied to this save and rank): what the manifest claims is checked against
        it. Index built once per file."""
        f = self.file(rank)
        if rank not in self._dtensor_nodes:
            self._dtensor_nodes[rank] = dtensor_nodes(f.footer.tree)
        node = self._dtensor_nodes[rank].get(key)
        if not isinstance(node, dict) or not isinstance(node.get("local"), dict):
            raise ctx.corrupt(f"rank {rank}'s file holds no piece of DTensor {key}, which the manifest says it wrote")
        return node

    def _assemble(self, info: Dict[str, Any], node: Dict[str, Any], target: Any, ctx: LoadContext,
                  pool: cf.ThreadPoolExecutor) -> Any:
        dtype = dtype_from_name(info["dtype"], ctx)
        global_shape = info["global_shape"]
        if not (isinstance(global_shape, list) and all(type(n) is int and n >= 0 for n in global_shape)):
            raise ctx.corrupt("bad global shape in the shard index")
        if not isinstance(info.get("pieces"), list):
            raise ctx.corrupt("shard index without pieces")
        if target is not None:
            from torch.distributed.tensor import DTensor
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            if list(target.shape) != global_shape or target.dtype != dtype:
                raise StateMismatchError(
                    f"{self.path}: DTensor {'/'.join(ctx.trail)} is {dtype} {tuple(global_shape)} in the "
                    f"checkpoint but {target.dtype} {tuple(target.shape)} in into=", path=self.path)
            shape, origin = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                  target.placements)
            pieces = self._cover(info, global_shape, list(shape), list(origin), dtype, ctx)
            local = torch.empty(list(shape), dtype=dtype, device=target.to_local().device)
            self._fill_region(local, list(origin), pieces, ctx, pool)
            return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                      shape=target.shape, stride=target.stride())
        # Everything is checked before the (possibly large) allocation.
        pieces = self._cover(info, global_shape, list(global_shape), [0] * len(global_shape), dtype, ctx)
        full = torch.empty(global_shape, dtype=dtype)
        self._fill_region(full, [0] * len(global_shape), pieces, ctx, pool)
        return full

    def _cover(self, info: Dict[str, Any], global_shape: list, shape: list, origin: list,
               dtype: torch.dtype, ctx: LoadContext) -> list:
        """The pieces overlapping the region [origin, origin+shape), after checking
        that they lie inside the tensor, have sound geometry, and cover the region
        exactly once (no hole would be left as uninitialized memory, no overlap
        could hide one)."""
        boxes, chosen = [], []
        derived = info.get("derived")   # pieces from a layout: their tensor nodes are looked up when needed
        for piece in info["pieces"]:
            if derived:
                piece = dict(piece)
                offsets, pshape = piece["offsets"], piece["shape"]
                lo = [max(o, r) for o, r in zip(offsets, origin)]
                hi = [min(o + n, r + m) for o, n, r, m in zip(offsets, pshape, origin, shape)]
                if not all(a < b for a, b in zip(lo, hi)):
                    continue
                own = self.dtensor_node(piece["rank"], info["key"], ctx)
                if own.get("layout") != info["layout"] or own.get("offsets") != offsets \
                        or own["local"].get("shape") != pshape or own.get("global_shape") != global_shape:
                    raise ctx.corrupt(f"the manifest's layout of {info['key']} puts rank {piece['rank']}'s piece "
                                      f"at {offsets} {pshape}; that rank's own file says otherwise")
                piece["tensor"] = own["local"]
            elif isinstance(piece, dict) and isinstance(piece.get("tensor"), dict) \
                    and type(piece.get("rank")) is int and 0 <= piece["rank"] < self.world_size:
                own = self.dtensor_node(piece["rank"], info["key"], ctx)
                if own["local"] != piece["tensor"] or own.get("offsets") != piece.get("offsets"):
                    raise ctx.corrupt(f"the manifest's piece of {info['key']} from rank {piece['rank']} differs "
                                      f"from that rank's own file")
            if not isinstance(piece, dict) or not isinstance(piece.get("tensor"), dict):
                raise ctx.corrupt("malformed piece in the shard index")
            offsets, t = piece.get("offsets"), piece["tensor"]
            pshape = t.get("shape")
            if not (isinstance(offsets, list) and isinstance(pshape, list)
                    and len(offsets) == len(pshape) == len(global_shape)
                    and all(type(x) is int and x >= 0 for x in offsets + pshape)
                    and all(o + n <= g for o, n, g in zip(offsets, pshape, global_shape))):
                raise ctx.corrupt("a shard piece lies outside the tensor or has a bad shape")
            if dtype_from_name(t.get("dtype"), ctx) != dtype or type(piece.get("rank")) is not int:
                raise ctx.corrupt("a shard piece has another dtype or no rank")
            f = self.file(piece["rank"])
            e = t.get("e")
            if type(e) is not int or not 0 <= e < len(f.entries) or f.entries[e].content_kind != "data":
                raise ctx.corrupt(f"shard of rank {piece['rank']} refers to a bad entry {e!r}")
            if tensor_bytes_needed(t, dtype, ctx) > f.entries[e].size:
                raise ctx.corrupt(f"shard of rank {piece['rank']} claims more bytes than its entry holds")
            lo = [max(o, r) for o, r in zip(offsets, origin)]
            hi = [min(o + n, r + m) for o, n, r, m in zip(offsets, pshape, origin, shape)]
            if all(a < b for a, b in zip(lo, hi)):
                boxes.append((lo, hi))
                chosen.append(piece)
        volume = math.prod(shape)
        covered = sum(math.prod(b - a for a, b in zip(lo, hi)) for lo, hi in boxes)
        overlap = any(all(max(a1, a2) < min(b1, b2) for a1, b1, a2, b2 in zip(l1, h1, l2, h2))
                      for i, (l1, h1) in enumerate(boxes) for (l2, h2) in boxes[i + 1:])
        if volume and (covered != volume or overlap):
            raise ctx.corrupt(f"the saved shards do not cover the needed region exactly "
                              f"({covered} of {volume} elements{', overlapping' if overlap else ''})")
        return chosen

    def _fill_region(self, out: torch.Tensor, origin: list, pieces: list, ctx: LoadContext,
                     pool: cf.ThreadPoolExecutor) -> None:
        """Copy into ``out`` (the global region starting at ``origin``) every
        piece (already checked by _cover), reading only the rows needed."""
        for piece in pieces:
            _copy_region(self.file(piece["rank"]), piece["tensor"], piece["offsets"], out, origin, ctx, pool)


def _copy_region(f: CheckpointFile, t: Dict[str, Any], offsets: list, out: torch.Tensor, origin: list,
                 ctx: LoadContext, pool: cf.ThreadPoolExecutor) -> None:
    """Copy the part of saved tensor node ``t`` (placed at ``offsets`` in the
    global tensor) that overlaps ``out`` (the region starting at ``origin``),
    reading only the rows needed when ``t`` is row-major."""
    shape = t["shape"]
    lo = [max(o, r) for o, r in zip(offsets, origin)]
    hi = [min(o + n, r + m) for o, n, r, m in zip(offsets, shape, origin, out.shape)]
    if not all(a < b for a, b in zip(lo, hi)):
        return
    e = t["e"]
    dtype = dtype_from_name(t["dtype"], ctx)
    itemsize = torch.empty((), dtype=dtype).element_size()
    contiguous = torch.empty(shape, dtype=dtype, device="meta").stride()
    if out.dim() > 0 and list(contiguous) == t["stride"]:
        # Rows [lo0, hi0) of a row-major tensor are one contiguous byte range.
        row = math.prod(shape[1:]) * itemsize
        first, last = lo[0] - offsets[0], hi[0] - offsets[0]
        start = t["offset"] * itemsize + first * row
        data = f.read_range(e, start, start + (last - first) * row, pool)
        src = data.view(dtype).reshape([last - first] + list(shape[1:]))
        src = src[(slice(None),) + tuple(slice(a - o, b - o) for a, b, o in
                                          zip(lo[1:], hi[1:], offsets[1:]))]
    else:
        storage = f.read_entries([e], pool)[e]
        whole = torch.empty((0,), dtype=dtype).set_(storage, t["offset"], shape, t["stride"])
        src = whole[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
    dst = out[tuple(slice(a - r, b - r) for a, b, r in zip(lo, hi, origin))]
    dst.copy_(src)


def _plain_into_dtensor(tree: Any, into: Any) -> Dict[int, Any]:
    """id(tensor node) -> the DTensor of ``into`` at the same path, for plain saved tensors."""
    targets = _dtensor_targets(into)
    if not targets:
        return {}
    return {id(leaf.node): targets[key] for leaf in walk(tree)
            if leaf.type == "tensor" and (key := json.dumps(list(leaf.path))) in targets}


def plain_tensor_entry(f: CheckpointFile, step: Optional["StepFiles"], node: Dict[str, Any],
                       dtype: torch.dtype, ctx: LoadContext) -> Tuple[CheckpointFile, int]:
    """(the file holding a plain tensor node's bytes, the entry's index): ``f``,
    or another rank's file for a replicated entry, after checking that the
    entry is there and can hold the tensor."""
    e = node.get("e")
    if type(e) is not int or not 0 <= e < len(f.entries):
        raise ctx.corrupt(f"reference to unknown entry {e!r}")
    holder = f
    if f.entries[e].kind == "remote":
        if step is None:
            raise ctx.corrupt("refers to another rank's file; load the step directory")
        holder = step.file(f.entries[e].rank)
        if e >= len(holder.entries) or holder.entries[e].kind == "remote":
            raise ctx.corrupt(f"{holder.path} does not hold entry {e}")
    if holder.entries[e].content_kind != "data" or tensor_bytes_needed(node, dtype, ctx) > holder.entries[e].size:
        raise ctx.corrupt(f"entry {e} does not hold this tensor's bytes")
    return holder, e


def _slice_loader(f: CheckpointFile, step: Optional["StepFiles"], target: Any,
                  pool: cf.ThreadPoolExecutor) -> Callable[[Dict[str, Any], LoadContext], Any]:
    """Build this rank's shard of ``target`` from a plain saved tensor, reading its rows only."""
    def load(node: Dict[str, Any], ctx: LoadContext) -> Any:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        dtype = dtype_from_name(node.get("dtype"), ctx)
        shape = node.get("shape")
        if list(target.shape) != shape or target.dtype != dtype:
            raise StateMismatchError(
                f"{f.path}: entry {'/'.join(ctx.trail)} is {dtype} {tuple(shape or ())} in the checkpoint "
                f"but {target.dtype} {tuple(target.shape)} in into=", path=f.path, entry="/".join(ctx.trail))
        holder, _ = plain_tensor_entry(f, step, node, dtype, ctx)
        local_shape, origin = compute_local_shape_and_global_offset(target.shape, target.device_mesh,
                                                                    target.placements)
        local = torch.empty(list(local_shape), dtype=dtype, device=target.to_local().device)
        _copy_region(holder, node, [0] * len(shape), local, list(origin), ctx, pool)
        return DTensor.from_local(local, target.device_mesh, target.placements, run_check=False,
                                  shape=target.shape, stride=target.stride())
    return load


def _grafted_node(tree: Any, node_id: int) -> bool:
    return any(id(leaf.node) == node_id and type(leaf.node.get("e")) is int and leaf.node["e"] >= GRAFT_BASE
               for leaf in walk(tree))


def _direct_fills(into: Any, tree: Any, ctx: LoadContext) -> Dict[int, List[tuple]]:
    """The tensors of ``into`` that a plain tensor node fills one to one (the
    same path as :func:`fill_into` follows, the same dtype and shape, not a
    DTensor): entry -> [(node, target)]. Anything else is left to the full
    decode and ``fill_into``, which also raise the mismatches."""
    out: Dict[int, List[tuple]] = {}
    stack = [(into, tree)]
    while stack:
        dst, node = stack.pop()
        if not isinstance(node, dict):
            continue
        tag = node.get("$")
        if tag == "dict" and isinstance(dst, dict):
            keys, values = node.get("k"), node.get("v")
            if not isinstance(keys, list) or not isinstance(values, list) or len(keys) != len(values):
                continue
            for k, v in zip(keys, values):
                try:
                    key = ctx.decode(k)
                    if key in dst:
                        stack.append((dst[key], v))
                except (CheckpointError, TypeError):     # the full decode reports it
                    continue
        elif tag == "seq" and node.get("t") == "list" and isinstance(dst, list) \
                and isinstance(node.get("v"), list) and len(dst) == len(node["v"]):
            stack.extend(zip(dst, node["v"]))
        elif tag == "tensor" and type(node.get("e")) is int and isinstance(dst, torch.Tensor) \
                and not _is_dtensor(dst) and node.get("shape") == list(dst.shape):
            try:
                same_dtype = dtype_from_name(node.get("dtype"), ctx) == dst.dtype
            except CheckpointError:
                continue
            if same_dtype:
                out.setdefault(node["e"], []).append((node, dst))
    return out


def _dtensor_targets(into: Any) -> Dict[str, Any]:
    """DTensors in ``into`` by key path (as the loader names them)."""
    targets: Dict[str, Any] = {}
    DTensor = _dtensor_type()
    if DTensor is None or into is None:
        return targets
    stack = [(into, [])]
    while stack:
        value, trail = stack.pop()
        if isinstance(value, DTensor):
            targets[json.dumps(trail)] = value
        elif isinstance(value, dict):
            stack.extend((v, trail + [str(k)]) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, trail + [str(i)]) for i, v in enumerate(value))
    return targets


def fill_into(dst: Any, src: Any, path: str, trail: str = "") -> Any:
    """Copy ``src`` into ``dst`` in place where both hold tensors; return what
    the slot should hold afterwards (``dst`` itself where it was reused)."""
    if isinstance(dst, dict) and isinstance(src, dict):
        for key, value in src.items():
            where = f"{trail}/{key}" if trail else str(key)
            dst[key] = fill_into(dst[key], value, path, where) if key in dst else value
        return dst
    if isinstance(dst, list) and isinstance(src, list) and len(dst) == len(src):
        for i, value in enumerate(src):
            dst[i] = fill_into(dst[i], value, path, f"{trail}/{i}")
        return dst
    if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
        if src is dst:                  # filled as its bytes arrived (_direct_fills)
            return dst
        if _is_dtensor(dst) and _is_dtensor(src):
            with torch.no_grad():
                dst.to_local().copy_(src.to_local())
            return dst
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise StateMismatchError(
                f"{path}: entry {trail or '<root>'} is {src.dtype} {tuple(src.shape)} in the checkpoint "
                f"but {dst.dtype} {tuple(dst.shape)} in into=", path=path, entry=trail)
        with torch.no_grad():
            dst.copy_(src)
        return dst
    return src


def _is_dtensor(value: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(value, cls)


def load_url(url: str, options: Options, pool: cf.ThreadPoolExecutor, rank: Optional[int] = None,
             **kwargs: Any) -> Any:
    """Load an object (one checkpoint file), a committed save prefix (with its
    manifest), or the latest step of an object-store checkpoint directory."""
    store, key = store_for(url, options.storage_options)
    if key and store.size(key) is not None:
        return load_file(url, options, pool, **kwargs)
    if store.size(f"{key}/{MANIFEST}" if key else MANIFEST) is not None:
        return load_step(url, None, options, pool, rank, **kwargs)     # its manifest: read under the lease
    directory = ObjectCheckpointDir(url, options)
    latest = directory.latest()
    if latest is None:
        raise CheckpointNotFoundError(f"{url}: no checkpoint object and no committed step here", path=url)
    step_url = directory.step_path(latest)
    return load_step(step_url, None, options, pool, rank, **kwargs)
