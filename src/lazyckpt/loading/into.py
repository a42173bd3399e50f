"""Filling ``into=``: which tensors of the caller's state the checkpoint has
no value for (checked before anything is read), which ones a saved tensor
fills one to one as its bytes arrive (on the reader threads), and the final
in-place copy of the rest. The loader (loader.py) drives these; the rules of
what fills what are written once, in :func:`fill_into`."""

from __future__ import annotations

import ctypes
import functools
import json
from collections import Counter
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import torch

from lazyckpt.errors import CheckpointError, StateMismatchError
from lazyckpt.state.providers import LoadContext, _dtensor_type, dtype_from_name, tree_nodes


ABSENT = object()


def unfilled_tensors(into: Any, tree: Any, ctx: LoadContext, keys: Optional[list] = None) -> List[str]:
    """Paths ("a/b/c") of the tensors of ``into`` that ``tree`` holds no value
    for, following the rules of :func:`fill_into`; with ``keys``, only under
    the selected key paths."""
    return sorted("/".join(map(str, t)) or "<root>" for t in unfilled_trails(into, tree, ctx, keys))


def unfilled_trails(into: Any, tree: Any, ctx: LoadContext, keys: Optional[list] = None) -> List[tuple]:
    roots = [((), into, tree)]
    if keys is not None:
        roots = []
        for key in keys:
            dst, node = into, tree
            for part in key:
                if not isinstance(dst, dict) or part not in dst:
                    dst = ABSENT
                    break
                dst, node = dst[part], dict_children(node, ctx).get(part, ABSENT)
            if dst is not ABSENT:
                roots.append((tuple(key), dst, node))
    missing = []
    stack = list(roots)
    while stack:
        trail, dst, node = stack.pop()
        if isinstance(dst, torch.Tensor):
            if node is ABSENT:
                missing.append(trail)
        elif isinstance(dst, dict):
            if node is not ABSENT and not is_tag(node, "dict"):
                continue                        # replaced by the checkpoint's value
            children = dict_children(node, ctx) if node is not ABSENT else {}
            stack.extend((trail + (k,), v, children.get(k, ABSENT)) for k, v in dst.items())
        elif isinstance(dst, list):
            if node is not ABSENT and not is_tag(node, "seq"):
                continue
            items = node["v"] if node is not ABSENT and isinstance(node.get("v"), list) else []
            if node is not ABSENT and len(items) != len(dst):
                continue                        # fill_into replaces a list of another length
            stack.extend((trail + (i,), v, items[i] if i < len(items) else ABSENT) for i, v in enumerate(dst))
    return missing


def is_tag(node: Any, tag: str) -> bool:
    return isinstance(node, dict) and node.get("$") == tag


def dict_children(node: Any, ctx: LoadContext) -> Dict[Any, Any]:
    if not is_tag(node, "dict") or not isinstance(node.get("k"), list) or not isinstance(node.get("v"), list):
        return {}
    return {ctx.decode(k): v for k, v in zip(node["k"], node["v"])}


def direct_fills(into: Any, tree: Any, ctx: LoadContext) -> Dict[int, List[tuple]]:
    """The tensors of ``into`` that a plain tensor node fills one to one (the
    same path as :func:`fill_into` follows, the same dtype and shape, not a
    DTensor): entry -> [(node, target)]. Anything else is left to the full
    decode and ``fill_into``, which also raise the mismatches."""
    out: Dict[int, List[tuple]] = {}
    stack = [(into, tree)]
    DTensor = _dtensor_type() or ()     # isinstance(x, ()) is False
    dtypes: Dict[str, torch.dtype] = {}     # by name: checked once each
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
                and not isinstance(dst, DTensor) and node.get("shape") == list(dst.shape):
            name = node.get("dtype")
            dtype = dtypes.get(name) if type(name) is str else None
            if dtype is None:
                try:
                    dtype = dtype_from_name(name, ctx)
                except CheckpointError:
                    continue
                if type(name) is str:
                    dtypes[name] = dtype
            if dtype == dst.dtype:
                out.setdefault(node["e"], []).append((node, dst))
    return out


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def byte_copy_plan(fills: List[tuple]) -> Optional[List[Tuple[Any, torch.Tensor, int, int]]]:
    """An entry's fills of :func:`direct_fills` as one copy of bytes each,
    where every one is: a saved tensor contiguous in its entry into a plain,
    contiguous, strided CPU tensor of ``into`` (no subclass, no conj/neg bit):
    [(node, target, first byte in the entry, bytes)], else None.
    :func:`copy_bytes` does them without building a tensor per entry (a
    decode and ``copy_`` per tensor, on the readers, cost more than the copy
    for 2,000 tensors of 64 KiB, and serialized them on the GIL); the rest go
    through the decode. Made as the entry arrives, off the reads' start."""
    plan = []
    for node, target in fills:
        if type(target) not in _PLAIN or target.device.type != "cpu" or target.layout is not torch.strided \
                or target.is_quantized or not target.is_contiguous() or target.is_conj() or target.is_neg():
            return None
        shape, stride, offset = node.get("shape"), node.get("stride"), node.get("offset")
        if type(offset) is not int or offset < 0 or type(shape) is not list \
                or stride != _contiguous_strides(tuple(shape)):
            return None
        size = target.element_size()
        plan.append((node, target, offset * size, target.numel() * size))
    return plan


@functools.lru_cache(maxsize=256)
def _contiguous_strides(shape: Tuple[int, ...]) -> List[int]:
    """The strides of a contiguous tensor of ``shape`` (a model has few
    shapes: cached, off each entry's arrival; callers only compare it)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


def copy_bytes(data: torch.UntypedStorage, plan: List[Tuple[Any, torch.Tensor, int, int]]) -> bool:
    """Copy an entry's bytes into the targets of its :func:`byte_copy_plan`
    (memmove: the GIL released, no tensor built); False, with nothing copied,
    where the entry is too short for one of them (the decode then reports it)."""
    nbytes = data.nbytes()
    for _node, _t, start, n in plan:
        if start + n > nbytes:
            return False
    base = data.data_ptr()
    for _node, target, start, n in plan:
        if n:
            ctypes.memmove(target.data_ptr(), base + start, n)
        # As copy_ would: autograd sees the tensor was written.
        torch.autograd.graph.increment_version(target)
    return True


def staged_entries(tree: Any, direct: Dict[int, List[tuple]], uses: Optional[Iterable[int]] = None) -> Set[int]:
    """The entries of ``direct`` (:func:`direct_fills`) that nothing in ``tree``
    uses but those fills: once copied into ``into=`` their bytes are not
    read again, so the reader may read them into buffers it reuses.
    ``uses``: the entry of every node of ``tree`` that names one (as
    :func:`tree_nodes` yields them), where the caller has it already."""
    if uses is None:
        uses = (n["e"] for n in tree_nodes(tree) if type(n.get("e")) is int)
    count = Counter(uses)
    return {e for e, fills in direct.items() if count[e] == len(fills)}


def dtensor_targets(into: Any) -> Dict[str, Any]:
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
        if src is dst:                  # filled as its bytes arrived (direct_fills)
            return dst
        if is_dtensor(dst) and is_dtensor(src):
            with torch.no_grad():
                dst.to_local().copy_(src.to_local())
            return dst
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise StateMismatchError(
                f"{path}: entry {trail or '<root>'} is {src.dtype} {tuple(src.shape)} in the checkpoint "
                f"but {dst.dtype} {tuple(dst.shape)} in into=; into= must hold tensors of the saved shapes "
                f"and dtypes (build the model with the same configuration as the saved one), or load "
                f"without into= and convert", path=path, entry=trail)
        with torch.no_grad():
            dst.copy_(src)
        return dst
    return src


def is_dtensor(value: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(value, cls)
