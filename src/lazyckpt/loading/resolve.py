"""What a path designates: a ``.lzc`` file, a committed step directory, a
Checkpointer directory (its latest step), or the same on an object store
(``s3://``) -> the data files to look at (:class:`Target`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import MANIFEST, STEP_DIR
from lazyckpt.knobs import Options, resolve as resolve_options
from lazyckpt.storage.fileio import read_small_file
from lazyckpt.storage.layout import CheckpointDir
from lazyckpt.storage.s3 import ObjectURL, store_for
from lazyckpt.storage.s3layout import ObjectCheckpointDir, read_manifest as read_object_manifest
from lazyckpt.storage.stores import for_path, join as join_path


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
    if for_path(path).is_remote:               # objects and prefixes: no directories to stat
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
        return Target(path, "step", manifest_files(path, manifest), path, manifest)
    steps = committed_steps(path)
    if not steps:
        hint = ""
        if os.path.isfile(os.path.join(path, ".metadata")):
            hint = " (it looks like a torch.distributed.checkpoint directory: use `lazyckpt convert`)"
        raise CheckpointNotFoundError(f"{path}: no committed checkpoint in this directory{hint}", path=path)
    step_dir = CheckpointDir(path).step_path(steps[-1])
    manifest = read_manifest(step_dir)
    return Target(path, "directory", manifest_files(step_dir, manifest), step_dir, manifest, steps)


def manifest_files(step_dir: str, manifest: Dict[str, Any]) -> List[Tuple[Optional[int], str]]:
    return [(f["rank"], join_path(step_dir, f["name"]))
            for f in sorted(manifest["files"], key=lambda f: f["rank"])]




def object_dir(url: str, options: Options) -> Any:
    directory = ObjectCheckpointDir(url, options)
    directory.store.check()      # wrong credentials, a missing bucket: one clear error first
    return directory


def _resolve_url(path: str, options: Options) -> Target:
    """An object, a committed save prefix (``.../step_X/<save_id>`` or
    ``.../step_X``) or a Checkpointer directory prefix (-> its latest step)."""
    url = str(ObjectURL.parse(path))
    store, key = store_for(url, options.storage_options)
    store.check()
    if key and store.size(key) is not None:
        return Target(url, "file", [(None, url)])
    if store.size(f"{key}/{MANIFEST}" if key else MANIFEST) is not None:
        manifest = read_object_manifest(url, options)
        return Target(url, "step", manifest_files(url, manifest), url, manifest)
    u = ObjectURL.parse(url)
    m = STEP_DIR.match(u.name) if u.key else None
    if m is not None:                           # DIR/step_X: its committed save
        parent = ObjectURL(u.bucket, u.key.rpartition("/")[0])
        committed = object_dir(str(parent), options).committed()
        if int(m.group(1)) in committed:
            step_url = f"{url}/{committed[int(m.group(1))]}"
            manifest = read_object_manifest(step_url, options)
            return Target(url, "step", manifest_files(step_url, manifest), step_url, manifest)
    directory = object_dir(url, options)
    committed = directory.committed()
    if not committed:
        raise CheckpointNotFoundError(f"{url}: no checkpoint object, committed save or committed checkpoint "
                                      f"under this prefix", path=url)
    steps = sorted(committed)
    step_url = directory.save_url(steps[-1], committed[steps[-1]])
    manifest = read_object_manifest(step_url, options)
    return Target(url, "directory", manifest_files(step_url, manifest), step_url, manifest, steps)
