"""Inspection and maintenance of checkpoints: what the ``lazyckpt`` command
line is built on, usable from Python too.

* :func:`resolve` -- a ``.lzc`` file, a committed step directory or a
  Checkpointer directory (its latest step) -> the data files to look at;
* :func:`walk` -- every leaf of a file's tree with its state path, entry and
  geometry, read from the footer only (no tensor bytes are read);
* :func:`list_directory` -- committed steps and leftovers of a Checkpointer
  directory;
* :func:`verify` -- read every byte of every entry and check every checksum,
  continuing past damage to report all of it;
* :func:`prune` -- delete older committed steps (rename, fsync, then delete,
  as the library does), abandoned steps and the leftovers of dead saves.

Every one of them also takes an ``s3://`` URL (see :mod:`lazyckpt.storage.s3layout` for
the layout on an object store): a checkpoint object, a committed save prefix
(``.../step_XXXXXXXXXX/<save_id>``, or ``.../step_XXXXXXXXXX``), or a
Checkpointer directory prefix.

Everything here reads the on-disk format (docs/FORMAT.md) through the
library's own parsers (:class:`~lazyckpt.loading.reader.CheckpointFile`,
:func:`lazyckpt.formats.manifest.parse`) and the directory rules of
:mod:`lazyckpt.storage.layout`. Only :func:`prune` deletes anything.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import math
import mmap
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import datafile as fmt
from lazyckpt.formats import manifest as manifests
from lazyckpt.knobs import Options, resolve as resolve_options
from lazyckpt.saving.incremental import owned_bytes, referenced_steps
from lazyckpt.storage.fileio import anonymous_buffer, open_for_read, pread_into, read_small_file
from lazyckpt.storage.iomode import use_o_direct
from lazyckpt.storage.layout import LATEST, MANIFEST, CheckpointDir, remove_tree, step_dirname, tree_bytes
from lazyckpt.storage.s3 import ObjectURL, is_url, store_for
from .reader import CheckpointFile, RefResolver, resolver_for

# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    """What a user-given path designates."""
    path: str                               # as given (absolute)
    kind: str                               # "file", "step" or "directory"
    files: List[Tuple[Optional[int], str]]  # (rank or None for a lone file, path)
    step_dir: Optional[str] = None
    manifest: Optional[Dict[str, Any]] = None
    steps: List[int] = field(default_factory=list)   # committed steps ("directory" only)

    @property
    def step(self) -> Optional[int]:
        if self.manifest is not None and type(self.manifest.get("step")) is int:
            return self.manifest["step"]
        return None


def committed_steps(directory: str) -> List[int]:
    """Committed steps of a Checkpointer directory, oldest first (FORMAT.md §11.1)."""
    return CheckpointDir(directory).steps()


def read_manifest(step_dir: str) -> Dict[str, Any]:
    path = os.path.join(step_dir, MANIFEST)
    raw = read_small_file(path, manifests.MAX_MANIFEST_BYTES)
    if raw is None:
        raise CheckpointNotFoundError(f"{step_dir}: not a committed step (no {MANIFEST})", path=step_dir)
    return manifests.parse(raw, path)


def resolve(path: str, options: Optional[Options] = None) -> Target:
    """Resolve a file, a step directory or a Checkpointer directory (-> its latest
    step); or the same on an object store (an ``s3://`` URL)."""
    if is_url(path):
        return _resolve_url(path, options or resolve_options())
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{path}: no such file or directory", path=path)
    if os.path.isfile(path):
        return Target(path, "file", [(None, path)])
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a regular file or directory", path=path)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        manifest = read_manifest(path)
        return Target(path, "step", _manifest_files(path, manifest), path, manifest)
    steps = committed_steps(path)
    if not steps:
        hint = ""
        if os.path.isfile(os.path.join(path, ".metadata")):
            hint = " (it looks like a torch.distributed.checkpoint directory: use `lazyckpt convert`)"
        raise CheckpointNotFoundError(f"{path}: no committed checkpoint in this directory{hint}", path=path)
    step_dir = CheckpointDir(path).step_path(steps[-1])
    manifest = read_manifest(step_dir)
    return Target(path, "directory", _manifest_files(step_dir, manifest), step_dir, manifest, steps)


def _manifest_files(step_dir: str, manifest: Dict[str, Any]) -> List[Tuple[Optional[int], str]]:
    return [(f["rank"], _join(step_dir, f["name"]))
            for f in sorted(manifest["files"], key=lambda f: f["rank"])]


def _join(base: str, name: str) -> str:
    return f"{base}/{name}" if is_url(base) else os.path.join(base, name)


_STEP_NAME = re.compile(r"^step_(\d{10})$")


def _object_dir(url: str, options: Options) -> Any:
    from lazyckpt.storage.s3layout import ObjectCheckpointDir
    directory = ObjectCheckpointDir(url, options)
    directory.store.check()      # wrong credentials, a missing bucket: one clear error first
    return directory


def _resolve_url(path: str, options: Options) -> Target:
    """An object, a committed save prefix (``.../step_X/<save_id>`` or
    ``.../step_X``) or a Checkpointer directory prefix (-> its latest step)."""
    from lazyckpt.storage.s3layout import read_manifest as read_object_manifest
    url = str(ObjectURL.parse(path))
    store, key = store_for(url, options.storage_options)
    store.check()
    if key and store.size(key) is not None:
        return Target(url, "file", [(None, url)])
    if store.size(f"{key}/{MANIFEST}" if key else MANIFEST) is not None:
        manifest = read_object_manifest(url, options)
        return Target(url, "step", _manifest_files(url, manifest), url, manifest)
    u = ObjectURL.parse(url)
    m = _STEP_NAME.match(u.name) if u.key else None
    if m is not None:                           # DIR/step_X: its committed save
        parent = ObjectURL(u.bucket, u.key.rpartition("/")[0])
        committed = _object_dir(str(parent), options).committed()
        if int(m.group(1)) in committed:
            step_url = f"{url}/{committed[int(m.group(1))]}"
            manifest = read_object_manifest(step_url, options)
            return Target(url, "step", _manifest_files(step_url, manifest), step_url, manifest)
    directory = _object_dir(url, options)
    committed = directory.committed()
    if not committed:
        raise CheckpointNotFoundError(f"{url}: no checkpoint object, committed save or committed checkpoint "
                                      f"under this prefix", path=url)
    steps = sorted(committed)
    step_url = directory.save_url(steps[-1], committed[steps[-1]])
    manifest = read_object_manifest(step_url, options)
    return Target(url, "directory", _manifest_files(step_url, manifest), step_url, manifest, steps)


# --------------------------------------------------------------------------- tree walk

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


DTYPE_SIZES: Dict[str, int] = {}


def itemsize(dtype_name: str) -> Optional[int]:
    """Element size of a torch dtype name (as written in tensor nodes)."""
    if dtype_name not in DTYPE_SIZES:
        import torch
        value = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(value, torch.dtype):
            return None
        DTYPE_SIZES[dtype_name] = torch.empty((), dtype=value).element_size()
    return DTYPE_SIZES[dtype_name]


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


# --------------------------------------------------------------------------- inspect


def describe(path: str, options: Optional[Options] = None) -> Dict[str, Any]:
    """Everything ``lazyckpt inspect`` shows, as JSON-able data."""
    options = options or resolve_options()
    target = resolve(path, options)
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
        f = CheckpointFile(fpath, options)
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
    from lazyckpt.formats.placement import check, pieces
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


# --------------------------------------------------------------------------- listing


def list_directory(directory: str, lease_expiry_s: Optional[float] = None) -> Dict[str, Any]:
    """Committed steps (with size, commit time, world size) and leftovers of a
    Checkpointer directory. Reads only: nothing is removed or renamed.

    On an object store (an ``s3://`` prefix) a step's ``bytes`` are those of
    every object under its committed save prefix, ``mtime`` is when its
    manifest (the commit) was written, and the leftovers are the save
    prefixes without a manifest whose newest object is older than the lease
    expiry (younger ones may be a save in progress and are not listed)."""
    if is_url(directory):
        return _list_url(directory, lease_expiry_s)
    directory = os.path.abspath(os.fspath(directory))
    if not os.path.exists(directory):
        raise CheckpointNotFoundError(f"{directory}: no such directory", path=directory)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (use `lazyckpt inspect` for a file)",
                              path=directory)
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        raise CheckpointError(f"{directory}: this is one step directory; list its parent, or use "
                              f"`lazyckpt inspect`", path=directory)
    layout = CheckpointDir(directory, lease_expiry_s or resolve_options().lease_expiry_s)
    steps = []
    for step in layout.steps():
        path = layout.step_path(step)
        row: Dict[str, Any] = {"step": step, "name": os.path.basename(path), "bytes": tree_bytes(path)}
        try:
            manifest = read_manifest(path)
            row.update(world_size=manifest["world_size"], files=len(manifest["files"]),
                       created_unix=manifest.get("created_unix"), metadata=manifest.get("metadata"),
                       references=manifest.get("references", []))
        except CheckpointError as exc:
            row["error"] = str(exc)
        steps.append(row)
    leftovers = [{"name": lo.name, "kind": lo.kind, "bytes": lo.bytes, "step": lo.step,
                  "description": lo.describe()} for lo in layout.leftovers()]
    return {"directory": directory, "steps": steps, "leftovers": leftovers,
            "latest": steps[-1]["step"] if steps else None, "latest_file": layout.latest_file(),
            "bytes": sum(r["bytes"] for r in steps)}


def _list_url(url: str, lease_expiry_s: Optional[float] = None) -> Dict[str, Any]:
    from lazyckpt.storage.s3layout import read_manifest as read_object_manifest
    options = resolve_options()
    url = str(ObjectURL.parse(url))
    directory = _object_dir(url, options)
    store, key = directory.store, directory.prefix
    if key and store.size(key) is not None:
        raise CheckpointError(f"{url}: this is one checkpoint object, not a directory (use `lazyckpt inspect`)",
                              path=url)
    if store.size(f"{key}/{MANIFEST}" if key else MANIFEST) is not None \
            or (key and _STEP_NAME.match(key.rsplit("/", 1)[-1])):
        raise CheckpointError(f"{url}: this is one step; list the prefix above its step_* prefix, "
                              f"or use `lazyckpt inspect`", path=url)
    committed = directory.committed()
    # One listing for the sizes and commit times of every save prefix.
    sizes: Dict[str, int] = {}
    mtimes: Dict[str, float] = {}
    base = f"{key}/" if key else ""
    found = False
    for obj in store.list(base):
        found = True
        rel = obj["Key"][len(base):]
        parts = rel.split("/")
        if len(parts) < 3:
            continue
        save = "/".join(parts[:2])
        sizes[save] = sizes.get(save, 0) + int(obj["Size"])
        if len(parts) == 3 and parts[2] == MANIFEST:
            mtimes[save] = obj["LastModified"].timestamp()
    if key and not found:
        raise CheckpointNotFoundError(f"{url}: no such prefix (no object under it)", path=url)
    steps = []
    for step in sorted(committed):
        name = f"{step_dirname(step)}/{committed[step]}"
        step_url = directory.save_url(step, committed[step])
        row: Dict[str, Any] = {"step": step, "name": name, "url": step_url, "bytes": sizes.get(name, 0),
                               "mtime": mtimes.get(name)}
        try:
            manifest = read_object_manifest(step_url, options)
            row.update(world_size=manifest["world_size"], files=len(manifest["files"]),
                       created_unix=manifest.get("created_unix"), metadata=manifest.get("metadata"),
                       references=manifest.get("references", []))
        except CheckpointError as exc:
            row["error"] = str(exc)
        steps.append(row)
    leftovers = []
    for prefix, nbytes, age in sorted(directory.leftovers(lease_expiry_s)):
        name = prefix[len(base):].rstrip("/")
        m = _STEP_NAME.match(name.split("/")[0])
        leftovers.append({"name": name, "kind": "interrupted-save", "bytes": nbytes,
                          "step": int(m.group(1)) if m else None, "url": store.url(prefix.rstrip("/")),
                          "age_s": age,
                          "description": f"interrupted save: no {MANIFEST}, last written {age:.0f} s ago"})
    raw = store.get(f"{base}{LATEST}", 64)
    try:
        latest_file: Optional[int] = int(raw.decode().strip()) if raw is not None else None
    except (UnicodeDecodeError, ValueError):
        latest_file = None
    return {"directory": url, "steps": steps, "leftovers": leftovers,
            "latest": steps[-1]["step"] if steps else None, "latest_file": latest_file,
            "bytes": sum(r["bytes"] for r in steps)}


# --------------------------------------------------------------------------- verify


@dataclass
class Problem:
    file: str
    what: str                    # "entry", "file", "tree", "manifest"
    message: str
    entry: Optional[str] = None  # entry name (state path)
    index: Optional[int] = None
    offsets: List[int] = field(default_factory=list)   # damaged block offsets

    def to_json(self) -> Dict[str, Any]:
        doc = {"file": self.file, "what": self.what, "message": self.message}
        if self.entry is not None:
            doc["entry"] = self.entry
        if self.index is not None:
            doc["index"] = self.index
        if self.offsets:
            doc["offsets"] = self.offsets
        return doc


@dataclass
class VerifyReport:
    target: Target
    files: int = 0
    entries: int = 0
    bytes_checked: int = 0
    blocks_checked: int = 0
    problems: List[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> Dict[str, Any]:
        return {"path": self.target.path, "ok": self.ok, "files": self.files, "entries": self.entries,
                "bytes_checked": self.bytes_checked, "blocks_checked": self.blocks_checked,
                "problems": [p.to_json() for p in self.problems]}


def _aligned_buffer(n: int) -> mmap.mmap:
    return anonymous_buffer(max(fmt.ALIGNMENT, fmt.align_up(n)))


def verify(path: str, options: Optional[Options] = None,
           progress: Optional[Callable[[int], None]] = None,
           on_total: Optional[Callable[[int], None]] = None) -> VerifyReport:
    """Read every entry of every data file and check every checksum.

    Unlike a load, it does not stop at the first damaged block: every damaged
    entry (with the offsets of its damaged blocks), every file whose footer or
    header is unusable and every inconsistency between the tree, the entries
    and the manifest is reported. ``progress(n)`` is called with the bytes
    checked since the last call; ``on_total(n)`` once with the total.
    """
    options = options or resolve_options()
    target = resolve(path, options)
    report = VerifyReport(target)
    # Object stores hold no incremental steps (references name local step
    # directories): a "ref" entry there is reported as unresolvable.
    with (contextlib.nullcontext(None) if is_url(target.path)
          else resolver_for(target.files[0][1], options)) as refs:
        _verify(target, report, options, refs, progress, on_total)
    return report


def _verify(target: Target, report: VerifyReport, options: Options, refs: Optional[RefResolver],
            progress: Optional[Callable[[int], None]], on_total: Optional[Callable[[int], None]]) -> None:
    opened: Dict[Optional[int], CheckpointFile] = {}
    for rank, fpath in target.files:
        try:
            opened[rank] = CheckpointFile(fpath, options, refs)
        except CheckpointError as exc:
            report.problems.append(Problem(fpath, "file", str(exc)))
        report.files += 1
    if target.manifest is not None:
        for f in target.manifest["files"]:
            fpath = _join(target.step_dir, f["name"])
            cf_ = opened.get(f["rank"])
            if cf_ is not None and type(f.get("bytes")) is int and f["bytes"] != cf_.size:
                report.problems.append(Problem(fpath, "manifest", f"{fpath}: manifest says {f['bytes']} bytes, "
                                               f"the file has {cf_.size}"))
    if on_total is not None:
        on_total(sum(e.size for f in opened.values() for e in f.entries if e.kind != "remote"))
    threads = max(1, options.reader_threads)
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="lazyckpt-verify") as pool:
        for rank, f in opened.items():
            _check_tree(f, opened, rank, report)
            _verify_file(f, options, pool, threads, report, progress)
            # Incremental: the ranges this file refers to, in the earlier steps' files.
            referred: Dict[str, Tuple[CheckpointFile, List[int]]] = {}
            for i, e in enumerate(f.entries):
                if e.kind != "ref":
                    continue
                try:
                    other, j = f.resolve(i)
                except CheckpointError as exc:
                    report.problems.append(Problem(f.path, "entry", str(exc), e.name, i))
                    continue
                referred.setdefault(other.path, (other, []))[1].append(j)
            for other, indices in referred.values():
                _verify_file(other, options, pool, threads, report, progress, indices, f)


def _verify_file(f: CheckpointFile, options: Options, pool: cf.ThreadPoolExecutor, threads: int,
                 report: VerifyReport, progress: Optional[Callable[[int], None]],
                 only: Optional[List[int]] = None, referrer: Optional[CheckpointFile] = None) -> None:
    """Check every block of ``f``'s entries (or of the entries ``only``, those a
    later step's ``referrer`` refers to)."""
    block = f.footer.block_bytes
    jobs: List[Tuple[int, int, int]] = []          # (entry index, lo, hi)
    for i, e in enumerate(f.entries):
        if e.kind in ("remote", "ref") or (only is not None and i not in only):
            continue
        report.entries += 1
        jobs.extend((i, lo, hi) for lo, hi in fmt.block_spans(e.offset, e.length, block))
    damaged: Dict[int, List[int]] = {}
    errors: Dict[int, str] = {}
    remote = is_url(f.path)
    if remote:
        # An object: ranged GETs of exactly the block (no page padding, no fd).
        source = f._open_input()
        fd = -1

        def read(view: memoryview, lo: int, n: int) -> int:
            return source.read_into(view[:n], lo)
    else:
        try:
            fd, _direct = open_for_read(f.path, use_o_direct(f.path, "read", options.o_direct, threads))
        except OSError as exc:
            report.problems.append(Problem(f.path, "file", f"{f.path}: cannot open: {exc.strerror or exc}"))
            return

        def read(view: memoryview, lo: int, n: int) -> int:
            return pread_into(fd, view[:fmt.align_up(n)], lo, f.path)

    def check(job: Tuple[int, int, int]) -> Tuple[int, int, int, Optional[str]]:
        i, lo, hi = job
        e = f.entries[i]
        buf = _aligned_buffer(hi - lo)
        view = memoryview(buf)
        try:
            got = read(view, lo, hi - lo)
            if got < hi - lo:
                return i, lo, hi, f"truncated: {got} of {hi - lo} bytes at offset {lo}"
            k = lo // block - e.offset // block
            if fmt.checksum(view[:hi - lo]) != e.checksums[k]:
                return i, lo, hi, "checksum mismatch"
            return i, lo, hi, None
        except OSError as exc:
            return i, lo, hi, f"read error: {exc.strerror or exc}"
        except CheckpointError as exc:          # an object store's error (after its retries)
            return i, lo, hi, f"read error: {exc}"
        finally:
            view.release()
            buf.close()

    try:
        # At most 2 blocks per thread in flight: memory stays bounded by the block size.
        window = 2 * threads
        for start in range(0, len(jobs), window):
            for i, lo, hi, error in pool.map(check, jobs[start:start + window]):
                report.blocks_checked += 1
                report.bytes_checked += hi - lo
                if error is not None:
                    damaged.setdefault(i, []).append(lo)
                    errors.setdefault(i, error)
                if progress is not None:
                    progress(hi - lo)
    finally:
        if remote:
            source.close()
        else:
            os.close(fd)
    users: Dict[int, List[str]] = {}
    if damaged:
        for leaf in walk(f.footer.tree):
            if leaf.entry in damaged:
                users.setdefault(leaf.entry, []).append(leaf.name)
    for i in sorted(damaged):
        e = f.entries[i]
        others = [n for n in users.get(i, []) if n != e.name]
        also = f" (also used by {', '.join(others[:4])}{', ...' if len(others) > 4 else ''})" if others else ""
        if referrer is not None:
            also += f" (referred to by step {referrer.step}, {referrer.path})"
        report.problems.append(Problem(
            f.path, "entry", f"{f.path}: entry {i} {e.name!r}{also}: {errors[i]} in {len(damaged[i])} of "
            f"{len(e.checksums)} block(s), at file offset(s) {', '.join(map(str, damaged[i][:8]))}"
            f"{', ...' if len(damaged[i]) > 8 else ''}", e.name, i, damaged[i]))


_KNOWN_TAGS = {"float", "complex", "seq", "dict", "torch", "tensor", "numpy", "bytes", "pickle", "custom",
               "dtensor"}


def _check_tree(f: CheckpointFile, opened: Dict[Optional[int], CheckpointFile], rank: Optional[int],
                report: VerifyReport) -> None:
    """Structural checks a load would make: references, kinds, geometry."""
    def problem(leaf: Leaf, why: str) -> None:
        report.problems.append(Problem(f.path, "tree", f"{f.path}: {leaf.name}: {why}", leaf.name, leaf.entry))

    entries = f.entries
    for leaf in walk(f.footer.tree):
        if leaf.type == "unknown":
            tag = leaf.node.get("$") if isinstance(leaf.node, dict) else None
            problem(leaf, f"unknown node {tag!r}" if tag else "malformed node")
            continue
        node = leaf.node
        if leaf.type == "tensor" and node.get("e") is None:
            continue                              # meta tensor
        if leaf.type == "dtensor" and node.get("local") is None:
            continue
        if leaf.type not in ("tensor", "dtensor", "numpy", "bytes", "pickle") or \
                (leaf.type == "numpy" and node.get("t") != "array"):
            continue
        e = leaf.entry
        if e is None or not 0 <= e < len(entries):
            problem(leaf, f"refers to a missing entry {e!r}")
            continue
        entry = entries[e]
        if entry.kind == "remote":
            other = opened.get(entry.rank)
            if other is None:
                if report.target.kind != "file" and entry.rank not in opened:
                    problem(leaf, f"entry {e} is held by rank {entry.rank}, whose file is missing or "
                                  f"unreadable")
                continue
            if e >= len(other.entries) or other.entries[e].kind == "remote":
                problem(leaf, f"entry {e} should be in rank {entry.rank}'s file, which does not hold it")
                continue
            entry = other.entries[e]
        expected_kind = "pickle" if leaf.type == "pickle" else "data"
        if entry.content_kind != expected_kind:
            problem(leaf, f"entry {e} is {entry.kind!r}, expected {expected_kind!r}")
            continue
        if leaf.type in ("tensor", "dtensor"):
            t = node if leaf.type == "tensor" else node.get("local")
            size = itemsize(t.get("dtype")) if isinstance(t, dict) else None
            shape, stride, offset = (t.get("shape"), t.get("stride"), t.get("offset")) if isinstance(t, dict) \
                else (None, None, None)
            if size is None:
                problem(leaf, f"unknown dtype {t.get('dtype') if isinstance(t, dict) else None!r}")
            elif not (_ints(shape) and _ints(stride) and len(shape) == len(stride) and type(offset) is int
                      and offset >= 0 and all(x >= 0 for x in shape + stride)):
                problem(leaf, "bad tensor geometry")
            else:
                needed = 0 if any(s == 0 for s in shape) else \
                    (offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * size
                if needed > entry.size:
                    problem(leaf, f"tensor needs {needed} bytes, entry {e} has {entry.size}")
        elif leaf.type == "numpy":
            try:
                import numpy as np
                dtype = np.dtype(node.get("dtype"))
                shape = node.get("shape")
                if not _ints(shape) or math.prod(shape) * dtype.itemsize != entry.size:
                    problem(leaf, f"array of {node.get('dtype')} {shape} does not match entry {e} "
                                  f"({entry.size} bytes)")
            except (TypeError, ValueError):
                problem(leaf, f"bad numpy dtype {node.get('dtype')!r}")


def _ints(v: Any) -> bool:
    return isinstance(v, list) and all(type(x) is int for x in v)


# --------------------------------------------------------------------------- prune


@dataclass
class PruneAction:
    name: str
    what: str          # "step" or a Leftover kind
    bytes: int
    step: Optional[int] = None
    done: bool = False
    error: Optional[str] = None


def prune(directory: str, keep: int, dry_run: bool = False, force: bool = False) -> Dict[str, Any]:
    """Delete every committed step but the ``keep`` newest, abandoned steps, and
    the leftovers of interrupted saves and deletes. Saves in progress (their
    lease is held or fresh) are kept; ``force`` also removes those whose lease
    is not held by anyone, however fresh. A step being read is kept."""
    if type(keep) is not int or keep < 1:
        raise ValueError(f"--keep must be at least 1, got {keep}")
    if is_url(directory):
        return _prune_url(directory, keep, dry_run)
    listing = list_directory(directory)
    directory = listing["directory"]
    layout = CheckpointDir(directory, 0.0 if force else resolve_options().lease_expiry_s)
    rows = {r["step"]: r for r in listing["steps"]}
    doomed, referred = layout.retention_plan(keep)       # newest first; referred-to steps stay
    actions: List[PruneAction] = [PruneAction(rows[s]["name"], "step", rows[s]["bytes"], s)
                                  for s in doomed if s in rows]
    kept_leftovers = []
    for leftover in layout.leftovers():
        lo = {"name": leftover.name, "kind": leftover.kind, "bytes": leftover.bytes,
              "description": leftover.describe()}
        if not (leftover.removable or leftover.kind == "abandoned"):
            kept_leftovers.append(lo)
            continue
        actions.append(PruneAction(leftover.name, leftover.kind, leftover.bytes))
    if not dry_run and doomed:
        # The library's own retention: newest first, a step being read stays and
        # so does every step it refers to.
        deleted, _kept = layout.retire_old(keep)
        for action in actions:
            if action.what == "step":
                action.done = action.step in deleted
                if not action.done:
                    action.error = "being read by another process, or referred to by one; kept"
    for action in actions:
        if dry_run or action.what == "step":
            continue
        try:
            remove_tree(os.path.join(directory, action.name))
            action.done = True
        except FileNotFoundError:
            action.done = True               # removed concurrently: the outcome wanted
        except OSError as exc:
            action.error = f"{exc.strerror or exc}"
    kept = sorted(set(rows) - {a.step for a in actions if a.what == "step" and (a.done or dry_run)})
    return {"directory": directory, "kept": kept, "kept_for_references": referred, "dry_run": dry_run,
            "actions": [a.__dict__ for a in actions], "kept_leftovers": kept_leftovers,
            "freed_bytes": sum(a.bytes for a in actions if a.done)}


def _prune_url(url: str, keep: int, dry_run: bool) -> Dict[str, Any]:
    """``prune`` on an object store: older committed steps (each one's manifest
    first, then its data) and the leftovers older than the lease expiry. A
    step with a live reader lease is kept, as a locked one is locally; there
    are no references (incremental steps are local only), and ``force`` has
    nothing to act on (it never deletes a step being read, here or locally)."""
    listing = _list_url(url)
    url = listing["directory"]
    directory = _object_dir(url, resolve_options())
    rows = {r["step"]: r for r in listing["steps"]}
    doomed = sorted(rows)[:-keep]
    actions: List[PruneAction] = [PruneAction(rows[s]["name"], "step", rows[s]["bytes"], s) for s in doomed]
    left = [PruneAction(lo["name"], lo["kind"], lo["bytes"], lo["step"]) for lo in listing["leftovers"]]
    actions += left
    if not dry_run:
        for action in actions[:len(doomed)]:
            try:
                if directory.delete_step(action.step) or action.step not in directory.committed():
                    action.done = True                  # (or deleted concurrently: the outcome wanted)
                else:
                    action.error = "being read by another process (a live reader lease); kept"
            except CheckpointError as exc:
                action.error = str(exc)
        if doomed:
            try:
                directory.prune_events()        # the history events of deleted steps (FORMAT.md §11.10)
            except CheckpointError as exc:
                import logging
                logging.getLogger("lazyckpt").warning("lazyckpt: %s: pruning history events failed: %s", url, exc)
        if left:
            # The library's own cleanup (it lists again: what was written to
            # since our listing is young again and stays).
            try:
                removed = {u.rstrip("/") for u in directory.clean_leftovers()}
            except CheckpointError as exc:
                removed = set()
                for action in left:
                    action.error = str(exc)
            base = f"{directory.prefix}/" if directory.prefix else ""
            for action in left:
                if action.error is not None:
                    continue
                if directory.store.url(f"{base}{action.name}") in removed \
                        or next(iter(directory.store.list(f"{base}{action.name}/")), None) is None:
                    action.done = True          # removed (by us, or concurrently: the outcome wanted)
                else:
                    action.error = "written to since it was listed (a save may be in progress); kept"
    kept = sorted(set(rows) - {a.step for a in actions if a.what == "step" and (a.done or dry_run)})
    return {"directory": url, "kept": kept, "kept_for_references": [], "dry_run": dry_run,
            "actions": [a.__dict__ for a in actions], "kept_leftovers": [],
            "freed_bytes": sum(a.bytes for a in actions if a.done)}


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
