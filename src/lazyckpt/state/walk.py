"""The one walker of a footer's tree: every leaf with its state path, entry and
geometry, read from the footer only (no tensor bytes are read), and the key
spelling the command line, the loader's DTensor keys and the manifests use."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from lazyckpt.errors import CheckpointError
from .providers import LoadContext


DTYPE_SIZES: Dict[str, int] = {}

_SCALARS = (type(None), bool, int, float, str)


@dataclass
class Leaf:
    """One value of a checkpoint's state, as described by the footer."""
    path: Tuple[str, ...]             # display components (the library's entry naming: str(key))
    type: str                         # tensor, dtensor, numpy, bytes, pickle, value, unknown
    node: Any
    entry: Optional[int] = None       # index into the file's entries
    #: Decoded dict keys leading to the leaf, usable as ``lazyckpt.load(keys=[...])``;
    #: it stops at the first non-dict container (keys= selects dict entries only).
    select: Tuple[Any, ...] = ()
    #: True if every container on the way is a dict (``select`` reaches the leaf itself).
    selectable: bool = True

    @property
    def name(self) -> str:
        return "/".join(self.path) or "<root>"


def _key_value(node: Any) -> Tuple[bool, Any]:
    """A dict key node -> (decodable, value), without touching entries."""
    if isinstance(node, _SCALARS):
        return True, node
    if isinstance(node, dict):
        tag = node.get("$")
        if tag == "float" and node.get("v") in ("nan", "inf", "-inf"):
            return True, float(node["v"])
        if tag == "seq" and node.get("t") in ("tuple", "frozenset") and isinstance(node.get("v"), list):
            items = [_key_value(v) for v in node["v"]]
            if all(ok for ok, _ in items):
                values = [v for _, v in items]
                return True, tuple(values) if node["t"] == "tuple" else frozenset(values)
    return False, None


def _key_text(node: Any) -> str:
    ok, value = _key_value(node)
    if ok:
        return str(value)
    tag = node.get("$") if isinstance(node, dict) else None
    return f"<{tag or type(node).__name__} key>"


def walk(tree: Any) -> Iterator[Leaf]:
    """Every leaf of a footer tree, depth first, in the order the state was saved.

    Sequences whose items are all inline scalars (an optimizer's ``params``
    list, say) are reported as one ``value`` leaf.
    """
    stack: List[Tuple[Any, Tuple[str, ...], Tuple[Any, ...], bool]] = [(tree, (), (), True)]
    while stack:
        node, path, select, selectable = stack.pop()
        if isinstance(node, _SCALARS):
            yield Leaf(path, "value", node, select=select, selectable=selectable)
            continue
        if not isinstance(node, dict) or not isinstance(node.get("$"), str):
            yield Leaf(path, "unknown", node, select=select, selectable=selectable)
            continue
        tag = node["$"]
        if tag == "dict" and isinstance(node.get("k"), list) and isinstance(node.get("v"), list):
            children = []
            for k, v in zip(node["k"], node["v"]):
                ok, value = _key_value(k)
                if selectable and ok:
                    children.append((v, path + (_key_text(k),), select + (value,), True))
                else:
                    children.append((v, path + (_key_text(k),), select, False))
            if not children:
                yield Leaf(path, "value", node, select=select, selectable=selectable)
            stack.extend(reversed(children))
        elif tag == "seq" and isinstance(node.get("v"), list):
            items = node["v"]
            if not items or all(isinstance(v, _SCALARS) for v in items):
                yield Leaf(path, "value", node, select=select, selectable=selectable)
            else:
                stack.extend(reversed([(v, path + (str(i),), select, False) for i, v in enumerate(items)]))
        elif tag == "custom":
            stack.append((node.get("v"), path, select, False))
        elif tag in ("tensor", "numpy", "bytes", "pickle"):
            e = node.get("e")
            yield Leaf(path, tag, node, e if type(e) is int else None, select, selectable)
        elif tag == "dtensor":
            local = node.get("local")
            e = local.get("e") if isinstance(local, dict) else None
            yield Leaf(path, "dtensor", node, e if type(e) is int else None, select, selectable)
        elif tag in ("float", "complex", "torch"):
            yield Leaf(path, "value", node, select=select, selectable=selectable)
        else:
            yield Leaf(path, "unknown", node, select=select, selectable=selectable)


def value_text(node: Any, limit: int = 60) -> str:
    """A short rendering of an inline value node."""
    def render(n: Any) -> str:
        if isinstance(n, _SCALARS):
            return repr(n)
        if isinstance(n, dict):
            tag = n.get("$")
            if tag == "float":
                return f"float({n.get('v')!r})"
            if tag == "complex" and isinstance(n.get("v"), list):
                return "complex(" + ", ".join(map(str, n["v"])) + ")"
            if tag == "torch":
                t, v = n.get("t"), n.get("v")
                return {"size": f"torch.Size({v})", "dtype": f"torch.{v}", "device": f"device({v!r})"}.get(
                    t, f"torch {t}")
            if tag == "seq" and isinstance(n.get("v"), list):
                items = ", ".join(render(v) for v in n["v"][:20]) + (", ..." if len(n["v"]) > 20 else "")
                kind = n.get("t")
                if kind == "tuple":
                    return f"({items}{',' if len(n['v']) == 1 else ''})"
                if kind in ("set", "frozenset"):
                    return f"{kind}({{{items}}})" if n["v"] else f"{kind}()"
                return f"[{items}]"
            if tag == "dict":
                return "{}"
        return f"<{type(n).__name__}>"
    text = render(node)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def itemsize(dtype_name: str) -> Optional[int]:
    """Element size of a torch dtype name (as written in tensor nodes); None
    for anything else, a damaged footer's list or dict included."""
    if not isinstance(dtype_name, str):
        return None
    if dtype_name not in DTYPE_SIZES:
        value = getattr(torch, dtype_name, None)
        if not isinstance(value, torch.dtype):
            return None
        DTYPE_SIZES[dtype_name] = torch.empty((), dtype=value).element_size()
    return DTYPE_SIZES[dtype_name]


def dtensor_nodes(tree: Any) -> Dict[str, Dict[str, Any]]:
    """Every DTensor node of a tree by its key path as the loader names it
    (``json.dumps`` of the str() of each key), without decoding any value."""
    ctx = LoadContext(entry_value=None, storage=None, allow_pickle=False, path="")
    out: Dict[str, Dict[str, Any]] = {}
    stack = [(tree, [])]
    while stack:
        node, trail = stack.pop()
        if not isinstance(node, dict):
            continue
        tag = node.get("$")
        if tag == "dtensor":
            out[json.dumps(trail)] = node
        elif tag == "dict" and isinstance(node.get("k"), list) and isinstance(node.get("v"), list):
            for k, v in zip(node["k"], node["v"]):
                try:
                    stack.append((v, trail + [str(ctx.decode(k))]))
                except CheckpointError:
                    continue
        elif tag == "seq" and isinstance(node.get("v"), list):
            stack.extend((v, trail + [str(i)]) for i, v in enumerate(node["v"]))
    return out


def layouts_digest(tree: Any, world_size: int) -> Optional[str]:
    """A digest of a rank's DTensor layouts (key, global shape, dtype, layout),
    or None when it has no DTensors or one cannot be derived from its layout
    (then the rank lists its pieces explicitly). Mesh ranks are global
    ranks: derivation also needs the checkpointer's group to be the world."""
    nodes = dtensor_nodes(tree)
    if not nodes or any(not isinstance(n.get("layout"), dict) for n in nodes.values()):
        return None
    try:
        import torch.distributed as dist
        if dist.get_world_size() != world_size:
            return None
    except (ImportError, RuntimeError, ValueError):
        return None
    doc = sorted((k, n["global_shape"], n["dtype"], n["layout"]) for k, n in nodes.items())
    return hashlib.sha1(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
