"""Any key from any rank: what ``into=`` or ``keys=`` asks for and the loading
rank's own saved tree lacks (state split by pipeline stage, a re-partitioned
load) is grafted in from the trees of the ranks that hold other keys. The
grafted nodes get entry ids from ``GRAFT_BASE`` up, which the loader reads
from those ranks' files."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from lazyckpt.state.providers import LoadContext
from lazyckpt.state.walk import walk
from .into import ABSENT, dict_children, is_tag, unfilled_trails
from .reader import CheckpointFile
from .stepfiles import StepFiles


#: Entry ids of nodes grafted from another rank's tree start here (far above any real index).
GRAFT_BASE = 1 << 48


def graft_missing(tree: Any, f: CheckpointFile, step: "StepFiles", into: Any, keys: Optional[list],
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
        wanted += unfilled_trails(into, tree, ctx, keys)
    missing = [p for p in wanted if _lookup(tree, p, ctx) is ABSENT]
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


def restrict_to(node: Any, dst: Any, ctx: LoadContext) -> Any:
    """``node`` without the dict keys ``dst`` does not have (recursively)."""
    if not (isinstance(dst, dict) and is_tag(node, "dict")):
        return node
    keep_k, keep_v = [], []
    for k, v in zip(node["k"], node["v"]):
        key = ctx.decode(k)
        if key in dst:
            keep_k.append(k)
            keep_v.append(restrict_to(v, dst[key], ctx))
    return dict(node, k=keep_k, v=keep_v)


def _lookup(node: Any, path: tuple, ctx: LoadContext) -> Any:
    for key in path:
        if is_tag(node, "seq") and type(key) is int and isinstance(node.get("v"), list) \
                and 0 <= key < len(node["v"]):
            node = node["v"][key]
            continue
        node = dict_children(node, ctx).get(key, ABSENT) if is_tag(node, "dict") else ABSENT
        if node is ABSENT:
            return ABSENT
    return node


def _graft(node: Any, other_node: Any, path: tuple, ctx: LoadContext, other: CheckpointFile,
           graft: Dict[int, Tuple[CheckpointFile, int]], memo: Dict[int, int]) -> Any:
    """A copy of ``node`` with the first key of ``path`` it lacks (and all
    below it) taken from ``other_node``; None if ``other_node`` lacks it too."""
    if not path or not is_tag(node, "dict") or not is_tag(other_node, "dict"):
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


def grafted_node(tree: Any, node_id: int) -> bool:
    return any(id(leaf.node) == node_id and type(leaf.node.get("e")) is int and leaf.node["e"] >= GRAFT_BASE
               for leaf in walk(tree))
