"""Turning a checkpoint file back into state: key selection, parallel reads,
device placement (map_location) and in-place filling (into=)."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

from .errors import CheckpointError, MissingKeyError, StateMismatchError, UnsafeObjectError
from .knobs import Options
from .providers import LoadContext, referenced_entries
from .reader import CheckpointFile

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


def load_file(path: str, options: Options, pool: cf.ThreadPoolExecutor, *,
              map_location: MapLocation = None, keys: Optional[Iterable[KeySpec]] = None,
              into: Any = None, allow_pickle: bool = False) -> Any:
    f = CheckpointFile(path, options)
    storages: Dict[int, torch.UntypedStorage] = {}
    mapped: Dict[int, torch.UntypedStorage] = {}
    mapper = _storage_mapper(map_location)

    def entry_value(e: Any, kind: str = "data") -> torch.UntypedStorage:
        if type(e) is not int or e not in storages:
            raise ctx.corrupt(f"reference to unknown entry {e!r}")
        if f.entries[e].kind != kind:
            raise ctx.corrupt(f"entry {e} is {f.entries[e].kind!r}, expected {kind!r}")
        return storages[e]

    def storage(e: Any, location: str) -> torch.UntypedStorage:
        if e not in mapped:
            mapped[e] = mapper(entry_value(e), location)
        return mapped[e]

    ctx = LoadContext(entry_value=entry_value, storage=storage, allow_pickle=allow_pickle, path=path)
    tree = f.footer.tree
    if keys is not None:
        tree = select(tree, keys, ctx)
    if not allow_pickle:
        found = _find_pickle(tree, [])
        if found is not None:
            node, trail = found
            name = "/".join(trail) or "<root>"
            raise UnsafeObjectError(
                f"{path}: entry {name} is a pickled {node.get('type', 'object')}; unpickling runs "
                f"code from the file, so it is refused. Pass allow_pickle=True if you trust this file.",
                path=path, entry=name)
    needed = [e for e in referenced_entries(tree) if 0 <= e < len(f.entries)]
    storages.update(f.read_entries(needed, pool))
    state = ctx.decode(tree)
    if into is not None:
        return fill_into(into, state, path)
    return state


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
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise StateMismatchError(
                f"{path}: entry {trail or '<root>'} is {src.dtype} {tuple(src.shape)} in the checkpoint "
                f"but {dst.dtype} {tuple(dst.shape)} in into=", path=path, entry=trail)
        with torch.no_grad():
            dst.copy_(src)
        return dst
    return src
