"""The functional API: one checkpoint file, written synchronously."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Iterable, Optional

from lazyckpt.formats.manifest import check_metadata
from lazyckpt.loading.loader import load_path
from lazyckpt.loading.request import KeySpec, LoadRequest, MapLocation, refuse_misspelled
from lazyckpt.loading.restore import RestoreHandle
from lazyckpt.saving.commit import FileCommit
from lazyckpt.saving.engine import FilePart, run_now
from lazyckpt.saving.foreign_formats import check_file_format
from lazyckpt.saving.foreign import plan_layout
from lazyckpt.saving.resources import Resources
from lazyckpt.state.providers import flatten
from lazyckpt.storage.stores import for_path
from .errors import CheckpointNotFoundError, CheckpointWriteError
from .knobs import Options, resolve

#: Host cache of the synchronous functional save (the Checkpointer's default is larger:
#: there a cache that holds the whole state lets the capture finish at memory speed).
SYNC_HOST_CACHE_BYTES = 128 << 20

_shared: Dict[Options, Resources] = {}
_shared_lock = threading.Lock()


def _forget_in_child() -> None:
    """After a fork: the parent's pools have no threads here (a job submitted to one
    would wait forever) and its lock may be held; the child builds its own."""
    global _shared_lock
    _shared.clear()
    _shared_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _resources(options: Options) -> Resources:
    """Process-wide caches and pools for the functional API, one set per distinct
    Options, created once and never torn down under a concurrent caller; the
    pools' threads end after a second idle (lazyckpt.keptpools), so a process
    that has stopped saving and loading keeps none of them."""
    with _shared_lock:
        res = _shared.get(options)
        if res is None:
            res = _shared[options] = Resources(options, kept=True)
        return res


def save(state: Any, path: str, *, metadata: Optional[Dict[str, Any]] = None,
         options: Optional[Options] = None, file_format: str = "lazyckpt", **knobs: Any) -> int:
    """Write ``state`` to the file ``path``; durable on return. Returns the file size.

    ``file_format="torch"`` writes the zip ``torch.save`` writes (``torch.load``
    reads it); ``"safetensors"`` a safetensors file of a flat dict of tensors
    (``metadata``: its str-to-str ``__metadata__``). See lazyckpt/saving/foreign_formats.py.

    The file is written under a temporary name and renamed into place, so
    ``path`` holds either its old content or the complete new checkpoint.
    Modifying the state's tensors from another thread during the call makes
    the file hold a mix of old and new values.
    """
    path = os.fspath(path)
    if options is None and knobs.get("host_cache_bytes") is None \
            and "LAZYCKPT_HOST_CACHE_BYTES" not in os.environ:
        # A synchronous save gains nothing from capturing far ahead of the disk,
        # and a small cache measured faster here (BENCHMARKS.md): 91-94% of the raw
        # O_DIRECT ceiling with 128 MiB against 76-84% with 256 MiB-1 GiB.
        knobs["host_cache_bytes"] = SYNC_HOST_CACHE_BYTES
    opts = resolve(options, **knobs)
    if check_file_format(file_format) != "lazyckpt":
        part = plan_layout(state, file_format, metadata).part()
    else:
        part = FilePart(flatten(state), check_metadata(metadata))
    store = for_path(path)
    if not store.is_remote and os.path.isdir(path):
        # Else the rename of the finished file over it fails (IsADirectoryError).
        raise CheckpointWriteError(
            f"{path} is a directory; lazyckpt.save writes one file: give a file path (e.g. "
            f"{os.path.join(path, 'checkpoint.lzc')}), or use lazyckpt.Checkpointer({path!r}) for a directory "
            f"of numbered steps", path=path)
    store.check(path, opts)     # credentials, a bucket: one clear error first
    strategy = FileCommit(store, path, opts.lease_heartbeat_s, message="save failed", options=opts, make_parents=False)
    handle = run_now(strategy, [part], _resources(opts), opts, name=path)
    return handle.bytes


def load(path: str, map_location: MapLocation = None, keys: Optional[Iterable[KeySpec]] = None,
         into: Any = None, allow_pickle: bool = False, strict: bool = True, *,
         options: Optional[Options] = None, **knobs: Any) -> Any:
    """Load a checkpoint file, a committed step directory, or the latest step of
    a Checkpointer directory.

    ``keys`` loads only those entries (a top-level key, or a tuple path into
    nested dicts) and reads only their bytes. ``into`` fills an existing state
    in place and returns it; every tensor of ``into`` (under ``keys``) must get
    a value, else ``MissingKeyError`` lists what the checkpoint lacks and
    nothing is filled (``strict=False`` fills what it can and warns).
    ``map_location`` works as in ``torch.load``. Pickled objects are refused
    unless ``allow_pickle=True``.
    """
    refuse_misspelled(knobs, "lazyckpt.load")
    request = LoadRequest(map_location=map_location, keys=keys, into=into, allow_pickle=allow_pickle,
                          strict=strict)
    path = os.fspath(path)
    return _load(path, request, resolve(options, **knobs))


def _load(path: str, request: LoadRequest, opts: Options) -> Any:
    return load_path(path, for_path(path), opts, _resources(opts).readers, request=request)


def load_async(path: str, map_location: MapLocation = None, keys: Optional[Iterable[KeySpec]] = None,
               into: Any = None, allow_pickle: bool = False, strict: bool = True, *,
               options: Optional[Options] = None, **knobs: Any) -> RestoreHandle:
    """``load()`` on a background thread: returns a :class:`RestoreHandle` at
    once; ``handle.wait()`` returns the state (or raises). With ``into``, do
    not use its tensors before the barrier (``handle.attach(optimizer)`` and
    ``handle.guard(model)`` install it as hooks). A path that does not exist
    is refused here, and so are arguments of a wrong type or value; every
    other error surfaces at the barrier."""
    refuse_misspelled(knobs, "lazyckpt.load_async")
    request = LoadRequest(map_location=map_location, keys=keys, into=into, allow_pickle=allow_pickle,
                          strict=strict)
    path = os.fspath(path)
    if not for_path(path).is_remote and not os.path.exists(path):     # a remote path costs a request: checked at the barrier
        raise CheckpointNotFoundError(f"{path}: no such file or directory", path=path)
    opts = resolve(options, **knobs)
    return RestoreHandle(lambda: _load(path, request, opts), path)
