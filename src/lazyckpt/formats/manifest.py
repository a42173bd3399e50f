"""The manifest of a committed step (docs/FORMAT.md §11.2): built by the
coordinator at commit, parsed and checked by every reader."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Dict, List, Optional

from lazyckpt.errors import CheckpointError, CorruptCheckpointError
from . import datafile as fmt
from .names import MAX_SEQ, MAX_STEP, MAX_WORLD, SAVE_ID, STEP_DIR, rank_filename

#: A reader refuses larger manifests (hostile-file guard); writers refuse to commit them.
MAX_MANIFEST_BYTES = 1 << 30


def shard_index(done: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """Merge every rank's DTensor shards into the manifest's global index:
    logical tensor (its key path as JSON) -> global shape, dtype, pieces."""
    index: Dict[str, Any] = {}
    for rank in sorted(done):
        for shard in done[rank].get("shards", []):
            key = json.dumps(shard["path"])
            local = shard["local"]
            entry = index.setdefault(key, {"global_shape": shard["global_shape"],
                                           "dtype": local["dtype"], "pieces": []})
            if entry["global_shape"] != shard["global_shape"]:
                raise CheckpointError(f"DTensor {key} has global shape {entry['global_shape']} on one rank "
                                      f"and {shard['global_shape']} on rank {rank}")
            entry["pieces"].append({"rank": rank, "offsets": shard["offsets"], "tensor": local})
    return index


def check_metadata(metadata: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """User metadata goes into the footer and manifest as JSON: refuse what would
    not round-trip, on the caller's thread rather than after the data is written."""
    metadata = dict(metadata or {})
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"metadata must be JSON-serializable: {exc}") from None
    if json.loads(text) != metadata:
        raise ValueError("metadata must round-trip through JSON (string keys, no tuples)")
    for reserved in ("step", "lazyckpt"):
        if reserved in metadata:
            raise ValueError(f"metadata key {reserved!r} is reserved (the Checkpointer records it)")
    return metadata


def build(step: int, done: Dict[int, Dict[str, Any]], save_id: str, metadata: Dict[str, Any],
          replicated: List[Any], layouts: Optional[Dict[str, Any]] = None, seq: Optional[int] = None,
          cost: Optional[Dict[str, Any]] = None) -> bytes:
    """The manifest's bytes, given every rank's report (``bytes``, ``shards``,
    ``version``, ``references``); ``seq``: the commit's place in the line of
    history (lazyckpt/lineage.py); ``cost``: what the save cost (lazyckpt/saving/costs.py)."""
    world = len(done)
    version = max(v.get("version", fmt.FORMAT_VERSION_1) for v in done.values())
    manifest: Dict[str, Any] = {
        "format_version": version, "step": step, "world_size": world,
        # Every rank's file is rank_<r>.lzc: only the sizes are listed, run-length
        # coded (FSDP ranks' files mostly have one size): O(distinct sizes), not O(ranks).
        "file_bytes": file_bytes_runs([done[r]["bytes"] for r in range(world)]),
        "created_unix": time.time(), "save_id": save_id, "metadata": metadata}
    if seq is not None:
        manifest["seq"] = seq
    if cost is not None:
        manifest["cost"] = cost
    index = shard_index(done)
    if index:
        manifest["shards"] = index
    if layouts:
        # Placement-derived: one entry per DTensor, whatever the number of ranks.
        manifest["layouts"] = layouts
    if replicated:
        manifest["replicated"] = [str(k) for k in replicated]
    keysets = group_keysets(done)
    if len(keysets) > 1:
        manifest["keysets"] = keysets
    references = sorted({s for v in done.values() for s in v.get("references", [])})
    if references:
        # Incremental: the earlier steps whose files hold some of this step's
        # bytes. Retention keeps them while this step is kept.
        manifest["references"] = references
    manifest["checksum"] = checksum(manifest)
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        # Never commit what the loader would refuse (and let retention delete the
        # previous, loadable step).
        raise CheckpointError(f"step {step}: the manifest would be {len(raw)} bytes, over the loader's "
                              f"limit of {MAX_MANIFEST_BYTES}", step=step)
    return raw


def file_bytes_runs(sizes: List[int]) -> List[List[int]]:
    """``[[bytes, count], ...]``: the files' sizes in rank order, run-length coded."""
    runs: List[List[int]] = []
    for size in sizes:
        if runs and runs[-1][0] == size:
            runs[-1][1] += 1
        else:
            runs.append([size, 1])
    return runs


def _check_ranges(manifest: Dict[str, Any], path: str) -> None:
    """Every number and name the manifest gives that another structure must
    hold (an event key, a file name, a loop over ranks): in range, or the
    manifest is damaged (its checksum proves only that it was written so)."""
    def bad(field: str, why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: manifest field {field!r} {why}", path=path)

    step = manifest.get("step")
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise bad("step", f"is {step!r}, not an integer in 0..{MAX_STEP}")
    if "seq" in manifest and (type(manifest["seq"]) is not int or not 1 <= manifest["seq"] <= MAX_SEQ):
        raise bad("seq", f"is {manifest['seq']!r}, not an integer in 1..{MAX_SEQ}")
    if "save_id" in manifest and (not isinstance(manifest["save_id"], str)
                                  or not SAVE_ID.fullmatch(manifest["save_id"])):
        raise bad("save_id", f"is {manifest['save_id']!r}, not 1 to 128 of [A-Za-z0-9_.-]")
    world = manifest.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD:
        raise bad("world_size", f"is {world!r}, not an integer in 1..{MAX_WORLD}")
    runs = manifest.get("file_bytes")
    if isinstance(runs, list) and len(runs) > MAX_WORLD:
        raise bad("file_bytes", f"has {len(runs)} runs, more than world_size can have")
    for run in runs if isinstance(runs, list) else []:
        if isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run) and \
                not (0 <= run[0] < 1 << 63 and 1 <= run[1] <= MAX_WORLD):
            raise bad("file_bytes", f"has the run {run!r} (a size in 0..2^63-1, a count in 1..{MAX_WORLD})")
    for f in manifest.get("files") if isinstance(manifest.get("files"), list) else []:
        size = f.get("bytes") if isinstance(f, dict) else None
        if size is not None and (type(size) is not int or not 0 <= size < 1 << 63):
            raise bad("files", f"gives a file {size!r} bytes")


def _expand_files(manifest: Dict[str, Any], path: str) -> None:
    """A manifest with ``file_bytes`` (run-length sizes) gets the equivalent
    ``files`` list in memory, so every reader sees one shape."""
    runs = manifest.get("file_bytes")
    if "files" in manifest or runs is None:
        return
    world = manifest.get("world_size")
    if not isinstance(runs, list) or not all(
            isinstance(x, list) and len(x) == 2 and type(x[0]) is int and type(x[1]) is int
            and x[0] >= 0 and x[1] >= 1 for x in runs) or type(world) is not int or \
            sum(x[1] for x in runs) != world:
        raise CorruptCheckpointError(f"{path}: manifest file sizes do not describe its world_size",
                                     path=path)
    files, rank = [], 0
    for size, count in runs:
        for _ in range(count):
            files.append({"rank": rank, "name": rank_filename(rank), "bytes": size})
            rank += 1
    manifest["files"] = files


def keyset_digest(tree: Any) -> str:
    """A digest of the key paths a rank's tree holds (not their values, shapes
    or entries): equal on ranks that hold the same keys, such as the FSDP
    shards of one model, different on pipeline stages."""
    import hashlib
    paths = []
    stack = [(tree, "")]
    while stack:
        node, trail = stack.pop()
        if not isinstance(node, dict):
            continue
        if node.get("$") == "dict" and isinstance(node.get("k"), list) and isinstance(node.get("v"), list):
            for k, v in zip(node["k"], node["v"]):
                stack.append((v, trail + "/" + json.dumps(k, sort_keys=True, separators=(",", ":"))))
        elif node.get("$") == "seq" and isinstance(node.get("v"), list):
            for i, v in enumerate(node["v"]):
                stack.append((v, f"{trail}/[{i}]"))
        else:
            paths.append(trail)
    return hashlib.sha1("\n".join(sorted(paths)).encode()).hexdigest()[:16]


def group_keysets(done: Dict[int, Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Ranks grouped by the keys they hold: [{"digest", "ranks": [[first, last], ...]}],
    O(groups + runs of ranks), not O(ranks x keys)."""
    groups: Dict[str, List[List[int]]] = {}
    for r in sorted(done):
        d = done[r].get("keyset")
        if not isinstance(d, str):
            return []
        runs = groups.setdefault(d, [])
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return [{"digest": d, "ranks": runs} for d, runs in groups.items()]


def keyset_representatives(manifest: Dict[str, Any], rank: int) -> List[int]:
    """One rank of every keyset other than ``rank``'s (the ranks whose trees
    may hold keys ``rank``'s tree lacks); [] when every rank holds the same keys."""
    sets = manifest.get("keysets")
    if not isinstance(sets, list):
        return []
    out = []
    for group in sets:
        runs = group.get("ranks") if isinstance(group, dict) else None
        if not isinstance(runs, list) or not all(isinstance(x, list) and len(x) == 2 and
                                                  all(type(v) is int for v in x) for x in runs) or not runs:
            continue
        if any(a <= rank <= b for a, b in runs):
            continue
        out.append(runs[0][0])
    return out


def parse(raw: bytes, path: str) -> Dict[str, Any]:
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path}: manifest larger than {MAX_MANIFEST_BYTES} bytes", path=path)
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError(f"{path}: manifest is not valid JSON", path=path) from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{path}: manifest is not a JSON object", path=path)
    version = manifest.get("format_version")
    sealed = manifest.pop("checksum", None) == checksum(manifest)
    if type(version) is not int and not sealed:
        # Missing or not a number, and the checksum fails: a damaged manifest (a byte flipped
        # in the key), not one from another lazyckpt -- a reader falls back from it, as from
        # any bad checksum. (Sealed with such a version, it is another format: refused below.)
        raise CorruptCheckpointError(f"{path}: manifest has no format version (file damaged)", path=path)
    fmt.check_version(version, path)
    if not sealed:
        raise CorruptCheckpointError(f"{path}: manifest checksum mismatch (file damaged)", path=path)
    _check_ranges(manifest, path)
    _expand_files(manifest, path)
    files = manifest.get("files")
    world = manifest.get("world_size")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("name"), str) and re.fullmatch(r"rank_\d{5}\.lzc", f["name"])
            and type(f.get("rank")) is int and f["name"] == rank_filename(f["rank"]) for f in files):
        raise CorruptCheckpointError(f"{path}: manifest lists no valid data files", path=path)
    if type(world) is not int or world != len(files) or \
            sorted(f["rank"] for f in files) != list(range(world)):
        raise CorruptCheckpointError(f"{path}: manifest world_size {world!r} does not match its files",
                                     path=path)
    refs, step = manifest.get("references", []), manifest.get("step")
    if not isinstance(refs, list) or (refs and type(step) is not int) or \
            not all(type(s) is int and 0 <= s < step for s in refs):
        raise CorruptCheckpointError(f"{path}: manifest references are not earlier steps", path=path)
    named = step_named_by(path)
    if named is not None and step != named:
        # A copy of another step restored under this name (a backup of step_2 as
        # step_1) must not load, list in verify, or be referred to as this step.
        raise CorruptCheckpointError(f"{path}: the directory is named for step {named}, but its manifest is "
                                     f"the manifest of step {step!r}; it is not step {named} (a copy of "
                                     f"another step restored under this name?)", path=path, step=named)
    return manifest


def step_named_by(path: str) -> Optional[int]:
    """The step a manifest's location names: ``.../step_X`` (a step directory),
    ``.../step_X/manifest.json``, or ``.../step_X/<save_id>/manifest.json`` on
    an object store; None for a manifest elsewhere (a step directory copied
    out under another name is read as whatever it holds)."""
    parts = str(path).replace("\\", "/").rstrip("/").split("/")
    if parts and parts[-1] == "manifest.json":
        parts.pop()
    if "://" in str(path) and len(parts) >= 2 and not STEP_DIR.match(parts[-1]):     # an object store's URL
        parts.pop()                     # the save id under the step's prefix
    m = STEP_DIR.match(parts[-1]) if parts else None
    return int(m.group(1)) if m else None


def references(manifest: Dict[str, Any]) -> List[int]:
    """The earlier steps a (parsed) manifest's step refers to."""
    return list(manifest.get("references", []))


def checksum(manifest: Dict[str, Any]) -> int:
    """xxh3-64 of the manifest's canonical JSON, without its own checksum field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return fmt.checksum(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
