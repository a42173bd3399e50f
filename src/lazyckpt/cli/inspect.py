"""What ``lazyckpt ls`` and ``lazyckpt inspect`` show: the committed steps and
leftovers of a Checkpointer directory (:func:`list_directory`), every leaf of a
checkpoint with its entry and geometry (:func:`describe`), read from the
footers only."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Callable, Dict, List, Optional

from lazyckpt.errors import CheckpointError
from lazyckpt.formats import datafile as fmt
from lazyckpt.formats.placement import check, pieces
from lazyckpt.knobs import Options, resolve as resolve_options
from lazyckpt.loading.reader import CheckpointFile
from lazyckpt.loading.resolve import resolve
from lazyckpt.saving.incremental import owned_bytes, referenced_steps
from lazyckpt.state.walk import Leaf, itemsize, value_text, walk
from lazyckpt.storage.stores import for_path


def leaf_info(leaf: Leaf, entries: List[fmt.Entry]) -> Dict[str, Any]:
    """A JSON-able description of a leaf (dtype, shape, bytes, entry)."""
    n = leaf.node
    info: Dict[str, Any] = {"path": leaf.name, "type": leaf.type}
    if leaf.type == "tensor":
        info.update(dtype=n.get("dtype"), shape=n.get("shape"), device=n.get("device", "cpu"))
        size = itemsize(n.get("dtype"))
        if size is not None and isinstance(n.get("shape"), list):
            info["bytes"] = math.prod(n["shape"]) * size
        if n.get("stride") is not None:
            info["stride"] = n.get("stride")
            info["storage_offset"] = n.get("offset")
        if n.get("param"):
            info["parameter"] = True
        if n.get("requires_grad"):
            info["requires_grad"] = True
    elif leaf.type == "dtensor":
        local = n.get("local") if isinstance(n.get("local"), dict) else {}
        info.update(dtype=n.get("dtype"), shape=n.get("global_shape"), local_shape=n.get("local_shape"),
                    offsets=n.get("offsets"))
        size = itemsize(n.get("dtype"))
        if size is not None and isinstance(n.get("local_shape"), list):
            info["bytes"] = math.prod(n["local_shape"]) * size
        if not local:
            info["note"] = "replica written by another rank"
    elif leaf.type == "numpy":
        info.update(dtype=n.get("dtype"))
        if n.get("t") == "array":
            info["shape"] = n.get("shape")
        else:
            info["value"] = n.get("v")
    elif leaf.type == "pickle":
        info["object_type"] = n.get("type")
    elif leaf.type == "value":
        info["value"] = value_text(n)
    elif leaf.type == "unknown":
        info["value"] = value_text(n)
    if leaf.entry is not None:
        info["entry"] = leaf.entry
        if 0 <= leaf.entry < len(entries):
            e = entries[leaf.entry]
            info["entry_bytes"] = e.length
            if e.kind == "remote":
                info["held_by_rank"] = e.rank
            if leaf.type in ("bytes", "pickle", "numpy") and "bytes" not in info:
                info["bytes"] = e.length
    return info


def describe(path: str, options: Optional[Options] = None) -> Dict[str, Any]:
    """Everything ``lazyckpt inspect`` shows, as JSON-able data."""
    options = options or resolve_options()
    target = resolve(path, options, all_steps=True, store=for_path(path))
    out: Dict[str, Any] = {"path": target.path, "kind": target.kind}
    if target.step_dir is not None:
        out["step_dir"] = target.step_dir
    if target.kind == "directory":
        out["committed_steps"] = target.steps
    m = target.manifest
    if m is not None:
        out.update(step=m.get("step"), world_size=m.get("world_size"), format_version=m.get("format_version"),
                   created_unix=m.get("created_unix"), metadata=m.get("metadata"),
                   references=m.get("references", []))
        if m.get("replicated"):
            out["replicated"] = m["replicated"]
        shards = m.get("shards") or {}
        if isinstance(shards, dict) and shards:
            out["shards"] = [_shard_info(k, v) for k, v in shards.items()]
        layouts = m.get("layouts") or {}
        if isinstance(layouts, dict) and layouts:
            # Placement-derived: the pieces are computed, their entries are in each rank's footer.
            out.setdefault("shards", []).extend(_layout_info(k, v, m.get("world_size")) for k, v in layouts.items())
    else:
        out["world_size"] = 1
    files = []
    for rank, fpath in target.files:
        f = CheckpointFile(fpath, options, store=target.store)
        leaves = [leaf_info(leaf, f.entries) for leaf in walk(f.footer.tree)]
        doc = {"rank": rank, "path": fpath, "bytes": f.size, "format_version": f.version,
               "block_bytes": f.footer.block_bytes, "metadata": f.footer.metadata,
               "entry_count": len(f.entries),
               "data_bytes": sum(e.length for e in f.entries),
               # Incremental: bytes this file holds, and what it refers to in earlier steps.
               "owned_bytes": owned_bytes(f.entries),
               "referenced_bytes": sum(e.size for e in f.entries if e.kind == "ref"),
               "references": referenced_steps(f.entries),
               "entries": [dict(index=i, **e.to_json(), checksum_blocks=len(e.checksums))
                           for i, e in enumerate(f.entries)],
               "leaves": leaves}
        for e in doc["entries"]:
            del e["checksums"]
        if m is not None:
            listed = {x["rank"]: x.get("bytes") for x in m["files"]}
            if listed.get(rank) is not None and listed[rank] != f.size:
                doc["size_mismatch"] = {"manifest": listed[rank], "actual": f.size}
        files.append(doc)
    out["files"] = files
    if "format_version" not in out or out["format_version"] is None:
        out["format_version"] = files[0]["format_version"] if files else None
    if m is None and files:
        out["metadata"] = files[0]["metadata"]
    return out


def _layout_info(key: str, info: Any, world_size: Any) -> Dict[str, Any]:
    try:
        path = "/".join(json.loads(key))
    except (ValueError, TypeError):
        path = key
    shape = info.get("global_shape") if isinstance(info, dict) else None
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape) and type(world_size) is int
            and check(info.get("layout"), len(shape), world_size)):
        return {"path": path, "pieces": [], "layout": "invalid"}
    return {"path": path, "global_shape": shape, "dtype": info.get("dtype"), "layout": info["layout"],
            "pieces": [dict(p, entry=None) for p in pieces(shape, info["layout"])]}


def _shard_info(key: str, info: Any) -> Dict[str, Any]:
    try:
        path = "/".join(json.loads(key))
    except (ValueError, TypeError):
        path = key
    pieces = []
    if isinstance(info, dict):
        for p in info.get("pieces", []) if isinstance(info.get("pieces"), list) else []:
            t = p.get("tensor") if isinstance(p, dict) and isinstance(p.get("tensor"), dict) else {}
            pieces.append({"rank": p.get("rank") if isinstance(p, dict) else None,
                           "offsets": p.get("offsets") if isinstance(p, dict) else None,
                           "shape": t.get("shape"), "entry": t.get("e")})
        return {"path": path, "global_shape": info.get("global_shape"), "dtype": info.get("dtype"),
                "pieces": pieces}
    return {"path": path, "pieces": pieces}


def list_directory(directory: str, lease_expiry_s: Optional[float] = None) -> Dict[str, Any]:
    """Committed steps (with size, commit time, world size) and leftovers of a
    Checkpointer directory, on any store. Reads only: nothing is removed or
    renamed.

    On an object store (an ``s3://`` prefix) a step's ``bytes`` are those of
    every object under its committed save prefix, ``mtime`` is when its
    manifest (the commit) was written, and the leftovers are the save
    prefixes without a manifest whose newest object is older than the lease
    expiry (younger ones may be a save in progress and are not listed)."""
    options = resolve_options()
    if lease_expiry_s is not None:
        options = dataclasses.replace(options, lease_expiry_s=lease_expiry_s)
    store = for_path(directory)
    located = store.locate(directory, options, empty_ok=True)
    if located.kind == "file":
        raise CheckpointError(f"{located.path}: not a directory but one checkpoint file (use `lazyckpt inspect` "
                              f"for a file)", path=located.path)
    if located.kind == "step":
        raise CheckpointError(f"{located.path}: this is one step directory; list its parent, or use "
                              f"`lazyckpt inspect`", path=located.path)
    layout = store.checkpoint_dir(located.path, options)
    steps = []
    for record in layout.step_records():
        row: Dict[str, Any] = {"step": record.step, "name": record.name, "bytes": record.bytes}
        if store.is_remote:             # a URL is not its name below the directory's
            row.update(url=record.path, mtime=record.mtime)
        _add_manifest(row, lambda: store.read_manifest(record.path, options))
        steps.append(row)
    leftovers = []
    for lo in layout.leftovers():
        row = {"name": lo.name, "kind": lo.kind, "bytes": lo.bytes, "step": lo.step, "description": lo.describe()}
        if lo.path is not None:
            row["url"] = lo.path
        if lo.age_s is not None:
            row["age_s"] = lo.age_s
        leftovers.append(row)
    return {"directory": located.path, "steps": steps, "leftovers": leftovers,
            "latest": steps[-1]["step"] if steps else None, "latest_file": layout.latest_file(),
            "bytes": sum(r["bytes"] for r in steps)}


def _add_manifest(row: Dict[str, Any], read: Callable[[], Dict[str, Any]]) -> None:
    """What ``lazyckpt list`` shows of a step's manifest (local or on a store),
    or why it could not be read."""
    try:
        manifest = read()
        row.update(world_size=manifest["world_size"], files=len(manifest["files"]),
                   created_unix=manifest.get("created_unix"), metadata=manifest.get("metadata"),
                   references=manifest.get("references", []))
    except CheckpointError as exc:
        row["error"] = str(exc)


def format_time(unix: Any) -> str:
    if not isinstance(unix, (int, float)) or isinstance(unix, bool):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
