"""The functional API: one checkpoint file, written synchronously."""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Dict, Iterable, Optional

from .checkpointer import MANIFEST, STEP_DIR, _check_metadata, load_step_dir
from .engine import Resources
from .errors import CheckpointError, CheckpointNotFoundError, CheckpointWriteError
from .fileio import fsync_dir
from .knobs import Options, resolve
from .loader import KeySpec, MapLocation, load_file
from .providers import flatten
from .writer import FileWriteJob

#: Host cache of the synchronous functional save (the Checkpointer's default is larger:
#: there a cache that holds the whole state lets the capture finish at memory speed).
SYNC_HOST_CACHE_BYTES = 128 << 20

_shared: Dict[Options, Resources] = {}
_shared_lock = threading.Lock()


def _resources(options: Options) -> Resources:
    """Process-wide caches and pools for the functional API, one set per distinct
    Options, created once and never torn down under a concurrent caller."""
    with _shared_lock:
        res = _shared.get(options)
        if res is None:
            res = _shared[options] = Resources(options)
        return res


def save(state: Any, path: str, *, metadata: Optional[Dict[str, Any]] = None,
         options: Optional[Options] = None, **knobs: Any) -> int:
    """Write ``state`` to the file ``path``; durable on return. Returns the file size.

    The file is written under a temporary name and renamed into place, so
    ``path`` holds either its old content or the complete new checkpoint.
    """
    path = os.fspath(path)
    if options is None and knobs.get("host_cache_bytes") is None \
            and "LAZYCKPT_HOST_CACHE_BYTES" not in os.environ:
        # A synchronous save gains nothing from capturing far ahead of the disk,
        # and a small cache measured faster here (BENCHMARKS.md): 91-94% of the raw
        # O_DIRECT ceiling with 128 MiB against 76-84% with 256 MiB-1 GiB.
        knobs["host_cache_bytes"] = SYNC_HOST_CACHE_BYTES
    opts = resolve(options, **knobs)
    metadata = _check_metadata(metadata)
    flat = flatten(state)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"{path}: directory {directory} does not exist", path=path)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    res = _resources(opts)
    with res.save_lock:         # one functional save at a time per cache
        job = FileWriteJob(tmp, flat.tree, flat.sources, metadata, opts, res.cache_for(flat.sources),
                           res.writers, res.serializer)
        try:
            stats = job.run()
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise       # ours already, or KeyboardInterrupt/SystemExit
            raise CheckpointWriteError(f"{path}: save failed: {type(exc).__name__}: {exc}",
                                       path=path) from exc
    fsync_dir(directory)
    return stats.file_bytes


def load(path: str, map_location: MapLocation = None, keys: Optional[Iterable[KeySpec]] = None,
         into: Any = None, allow_pickle: bool = False, *, options: Optional[Options] = None,
         **knobs: Any) -> Any:
    """Load a checkpoint file, a committed step directory, or the latest step of
    a Checkpointer directory.

    ``keys`` loads only those entries (a top-level key, or a tuple path into
    nested dicts) and reads only their bytes. ``into`` fills an existing state
    in place and returns it. ``map_location`` works as in ``torch.load``.
    Pickled objects are refused unless ``allow_pickle=True``.
    """
    path = os.fspath(path)
    opts = resolve(options, **knobs)
    kwargs = dict(map_location=map_location, keys=keys, into=into, allow_pickle=allow_pickle)
    pool = _resources(opts).readers
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, MANIFEST)):
            return load_step_dir(path, opts, pool, **kwargs)
        steps = sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(path)) if m
                       and os.path.isfile(os.path.join(path, m.group(0), MANIFEST)))
        if not steps:
            raise CheckpointNotFoundError(f"{path}: no committed checkpoint in this directory", path=path)
        return load_step_dir(os.path.join(path, f"step_{steps[-1]:010d}"), opts, pool, **kwargs)
    return load_file(path, opts, pool, **kwargs)
