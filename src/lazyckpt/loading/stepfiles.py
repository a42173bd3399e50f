"""A committed step's data files, opened on demand and checked against the
manifest that committed them, and the DTensor assembly from their pieces:
a DTensor is built (or this rank's shard of one in ``into=``) from the
regions of the saved pieces that overlap it, after checking that they cover
it exactly once; a plain saved tensor loaded into a DTensor of ``into=``
reads only this rank's rows (:func:`slice_loader`)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from lazyckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats import placement
from lazyckpt.knobs import Options
from lazyckpt.state.providers import LoadContext, dtype_from_name, tensor_bytes_needed
from lazyckpt.state.walk import dtensor_nodes, walk
from lazyckpt.storage.base import Store
from .into import dtensor_targets
from .reader import CheckpointFile, RefResolver


class StepFiles:
    """The data files of one committed step and its manifest's shard index."""

    def __init__(self, path: str, manifest: Dict[str, Any], options: Options,
                 refs: Optional[RefResolver] = None, *, store: Store):
        self.path = path
        self.store = store
        self.manifest = manifest
        self.options = options
        self.refs = refs
        self.world_size = manifest["world_size"]
        self._names = {f["rank"]: f["name"] for f in manifest["files"]}
        self._open: Dict[int, CheckpointFile] = {}
        self.shards = manifest.get("shards", {})
        if not isinstance(self.shards, dict):
            raise CorruptCheckpointError(f"{path}: manifest shard index is not an object", path=path)
        #: Placement-derived index (lazyckpt/formats/placement.py): key -> global shape, dtype, layout.
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
                f = CheckpointFile(path, self.options, self.refs, store=self.store)
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
        targets = dtensor_targets(into)

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


def plain_into_dtensor(tree: Any, into: Any) -> Dict[int, Any]:
    """id(tensor node) -> the DTensor of ``into`` at the same path, for plain saved tensors."""
    targets = dtensor_targets(into)
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


def slice_loader(f: CheckpointFile, step: Optional["StepFiles"], target: Any,
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
