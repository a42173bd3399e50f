"""A background writer of whole checkpoint files, for the integrations whose
frameworks hand over one file path per checkpoint (Lightning, the Hugging
Face Trainer).

``AsyncFileWriter`` is a thin face of the one save engine
(:mod:`lazyckpt.saving.engine`): ``save(state, path)`` walks the state on the
caller's thread and queues a :class:`~lazyckpt.saving.commit.FileCommit` job (a
leased hidden temporary next to ``path``, fsync, rename, directory fsync).
While a capture is pending a global optimizer step pre-hook and a forward
guard for modules whose persistent buffers are being captured (BatchNorm)
wait for it. It is local to the process: no collective, whatever
``torch.distributed`` says.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats.datafile import MAGIC
from lazyckpt.knobs import Options, resolve, resolve_for
from lazyckpt.loading.loader import _find_pickle, load_file
from lazyckpt.loading.request import KeySpec, LoadRequest, MapLocation
from lazyckpt.options import LazyckptDeprecationWarning, Persist
from lazyckpt.saving.capture import record_events
from lazyckpt.saving.commit import FileCommit
from lazyckpt.saving.engine import FilePart, SaveEngine, SaveHandle
from lazyckpt.saving.foreign_formats import check_file_format
from lazyckpt.saving.foreign import plan_layout
from lazyckpt.state.providers import flatten
from lazyckpt.storage.sidefiles import clean_sibling_temps
from lazyckpt.storage.stores import InvalidURLError, for_path

log = logging.getLogger("lazyckpt")

__all__ = ["AsyncFileWriter", "file_location", "file_writer_options", "is_lazyckpt_file", "persist_tier",
           "tier_options"]

_KEEPS_FILES = ("the framework decides where each checkpoint file goes and how many to keep "
                "(Lightning's ModelCheckpoint dirpath/save_top_k, the Trainer's output_dir/save_total_limit)")
#: What an integration that writes whole files cannot act on, and why:
#: accepted and ignored, these would promise what is not done.
WHOLE_FILE_REFUSED = {
    "incremental": "each checkpoint file must stand alone: the framework deletes older files itself "
                   "(save_top_k, save_total_limit), so a file cannot refer to bytes of an earlier one",
    "full_every": "it only applies to incremental saves, which whole framework files cannot be",
    "storage_options": "this integration writes to a local directory and has no persistent tier here (give "
                       "the persist option, lazyckpt.Persist(url, storage_options=...), to mirror it to an "
                       "object store)",
    "persist_bandwidth": "it caps the drain of a persistent tier, and none was asked for (the persist option: "
                         "lazyckpt.Persist(url, bandwidth=...))",
    "advise_mtbf": "the framework schedules the checkpoints; `lazyckpt advise` gives the interval from "
                   "the manifests",
    "persist_to": "it is a Checkpointer argument, and " + _KEEPS_FILES,
    "keep_last": "it is a Checkpointer argument, and " + _KEEPS_FILES,
    "replicas": "it is a Checkpointer argument (replicas are steps of a Checkpointer directory)",
    "replicated": "it is a Checkpointer argument (which keys every rank holds in a Checkpointer step)",
    "writer_lease": "it is a Checkpointer argument (one writer per Checkpointer directory)",
}


def file_writer_options(integration: str, knobs: Dict[str, Any], object_stores: bool = False,
                        persist: bool = False) -> Options:
    """The Options of an integration's :class:`AsyncFileWriter`, refusing (with the
    reason) every knob that such a writer would ignore. ``object_stores``: the
    integration writes ``s3://`` paths too, so ``storage_options`` is used;
    ``persist``: it has a persistent tier (``persist_bandwidth`` caps it)."""
    used = ({"storage_options"} if object_stores or persist else set()) | \
        ({"persist_bandwidth"} if persist else set())
    refused = {k: v for k, v in WHOLE_FILE_REFUSED.items() if k not in used}
    return resolve_for(integration, refused, **knobs)


#: The flat knobs of a whole-file integration's persistent tier -> their field of lazyckpt.Persist.
_PERSIST_FIELDS = {"persist_bandwidth": "bandwidth", "storage_options": "storage_options"}


def persist_tier(where: str, persist: Any, knobs: Dict[str, Any], *, new: str, old: str,
                 old_url: Optional[str] = None, moved: Tuple[str, ...] = ("persist_bandwidth",)) -> Optional[Persist]:
    """A whole-file integration's persistent tier as one :class:`lazyckpt.Persist`,
    or None: ``persist`` (an object store URL or a Persist, the keyword ``new``),
    else the old spellings -- ``old_url`` (the keyword ``old``) and, with a tier,
    the knobs named in ``moved`` (taken out of ``knobs``) -- each with a
    :class:`LazyckptDeprecationWarning` naming its new spelling. Without a tier the
    knobs stay, for :func:`file_writer_options` to refuse with the reason."""
    if old_url is not None:
        if persist is not None:
            raise TypeError(f"{where}: {old}= and {new}= were both given: {old}= is the old spelling; "
                            f"pass {new}= only")
        warnings.warn(f"{old}={old_url!r} is deprecated: use {new}={old_url!r} (or {new}=lazyckpt.Persist(url, "
                      f"bandwidth=..., storage_options=...))", LazyckptDeprecationWarning, stacklevel=3)
        persist, new = old_url, old
    if persist is None:
        return None
    if isinstance(persist, (str, os.PathLike)):
        url = os.fspath(persist)
        if not for_path(url).is_remote:
            raise ValueError(f"{new}={url!r}: expected an object store URL (s3://bucket/prefix): the persistent "
                             f"tier is where the checkpoints survive the loss of this node")
        persist = Persist(url)
    elif not isinstance(persist, Persist):
        raise TypeError(f"{where}: {new} must be an object store URL or lazyckpt.Persist(url, ...), "
                        f"got {type(persist).__name__}")
    if persist.keep is not None:
        raise ValueError(f"{where}: lazyckpt.Persist(keep=...) is not supported: the persistent tier mirrors "
                         f"the framework's files and their removals, and {_KEEPS_FILES}")
    fields: Dict[str, Any] = {}
    for knob in moved:
        if knobs.get(knob) is None:
            continue
        field = _PERSIST_FIELDS[knob]
        if getattr(persist, field) is not None:
            raise TypeError(f"{where}: {knob}= and lazyckpt.Persist({field}=...) were both given: {knob}= is the "
                            f"old spelling; give the Persist's {field} only")
        shown = "{...}" if knob == "storage_options" else repr(knobs[knob])      # it may hold credentials
        warnings.warn(f"{knob}={shown} is deprecated here: use lazyckpt.Persist(url, {field}={shown}) as the "
                      f"persistent tier", LazyckptDeprecationWarning, stacklevel=3)
        fields[field] = knobs.pop(knob)
    return dataclasses.replace(persist, **fields) if fields else persist


def tier_options(options: Options, persist: Persist) -> Options:
    """The Options of ``persist``'s uploads: the writer's, with the tier's own
    bandwidth cap and store settings where it has them."""
    changes: Dict[str, Any] = {}
    if persist.bandwidth is not None:
        changes["persist_bandwidth"] = float(persist.bandwidth)
    if persist.storage_options is not None:
        changes["storage_options"] = persist.storage_options
    return dataclasses.replace(options, **changes) if changes else options


def file_location(path: Any) -> str:
    """``path`` as a whole-file integration keys it: an absolute local path, or
    a normalized ``s3://`` URL. Any other URL is refused with the way out."""
    path = os.fspath(path)
    try:
        return for_path(path).normalize(path)
    except InvalidURLError as exc:
        raise NotImplementedError(f"{exc} (lazyckpt writes local or mounted file systems and s3:// object "
                                  f"stores; for other URLs use the framework's own checkpoint I/O)") from exc


def is_lazyckpt_file(path: str, options: Optional[Options] = None) -> bool:
    """True if ``path`` (a file or an object) starts with lazyckpt's magic."""
    try:
        return for_path(path).read_ends(path, options or resolve(),
                                        lambda size, read: size >= len(MAGIC) and read(0, len(MAGIC)) == MAGIC)
    except (OSError, CheckpointError):
        return False


class AsyncFileWriter:
    """Writes whole checkpoint files in the background, one at a time, in order.

    ``save(state, path)`` returns a :class:`~lazyckpt.SaveHandle` at once;
    ``on_commit(handle)`` runs in the background once the file is durable.
    Failures are raised once, at the next ``save()``, ``wait()``,
    ``raise_errors()`` or ``close()`` (or by ``handle.wait()``).
    """

    def __init__(self, *, guard_buffers: bool = True, options: Optional[Options] = None, **knobs: Any):
        self.options = resolve(options, **knobs)
        if self.options.queue_policy != "block":
            raise ValueError("AsyncFileWriter supports queue_policy='block' only: a framework that "
                             "asked for a checkpoint must not silently miss it")
        self._engine = SaveEngine(self.options, guard_buffers=guard_buffers)
        self._engine.barrier.guard_all_optimizers()
        self._cleaned: set = set()
        self._warned_pickles = False

    def save(self, state: Any, path: str, *, metadata: Optional[Dict[str, Any]] = None,
             on_commit: Optional[Callable[[SaveHandle], None]] = None,
             final_path: Optional[str] = None, file_format: str = "lazyckpt",
             before_publish: Optional[Callable[[str], None]] = None) -> SaveHandle:
        """Queue ``state`` (as it is now) for ``path``; return at once.
        ``final_path`` names where the checkpoint ends up if ``on_commit`` moves
        it (for ``pending()`` and ``wait()`` by path). ``before_publish(temporary)``
        runs once the file is durable under its temporary name, just before it is
        renamed into place. ``file_format``: "lazyckpt",
        "torch" (what ``torch.load`` reads) or "safetensors" (lazyckpt/saving/foreign_formats.py)."""
        self._engine.raise_errors()
        path = file_location(path)
        if check_file_format(file_format) != "lazyckpt":
            layout = plan_layout(state, file_format, metadata)
            part = layout.part(record_events(s.data for s in layout.sources))
            return self._submit(path, part, on_commit, final_path, before_publish)
        flat = flatten(state)
        self._warn_pickles(flat.tree, path)
        part = FilePart(flat, {"user": dict(metadata or {})}, record_events(s.data for s in flat.sources))
        return self._submit(path, part, on_commit, final_path, before_publish)

    def _submit(self, path: str, part: FilePart, on_commit: Optional[Callable[[SaveHandle], None]],
                final_path: Optional[str], before_publish: Optional[Callable[[str], None]] = None) -> SaveHandle:
        directory = os.path.dirname(path)
        store = for_path(path)
        if directory not in self._cleaned and not store.is_remote and os.path.isdir(directory):
            self._cleaned.add(directory)
            clean_sibling_temps(directory, self.options.lease_expiry_s)
        strategy = FileCommit(store, path, self.options.lease_heartbeat_s, on_commit=on_commit,
                              before_publish=before_publish)
        job = self._engine.submit(strategy, [part], name=path)
        job.handle.path = file_location(final_path) if final_path else path
        job.handle.file = path              # type: ignore[attr-defined]
        return job.handle

    def pending(self, path: Optional[str] = None) -> List[SaveHandle]:
        """Saves not yet finished (of ``path`` or below it, if given)."""
        out = self._engine.pending()
        if path is not None:
            path = file_location(path)
            out = [h for h in out if any(q == path or q.startswith(path + "/")
                                         for q in (h.path, getattr(h, "file", h.path)))]
        return out

    def capturing(self) -> bool:
        """Whether a pending save still reads the live state (cheap: for hooks on hot paths)."""
        return self._engine.capturing_anything()

    def wait_for_snapshot(self) -> None:
        """Block until every pending save has copied its data out of the live state."""
        self._engine.wait_for_snapshot(raise_errors=False)

    def wait(self, path: Optional[str] = None, raise_errors: bool = True) -> None:
        """Block until the pending saves (of ``path``, if given) are durable."""
        for handle in self.pending(path):
            handle._done.wait()
        if raise_errors:
            self.raise_errors()

    def raise_errors(self) -> None:
        """Raise the oldest failure not yet raised (here or by ``handle.wait()``)."""
        self._engine.raise_errors()

    def close(self, raise_errors: bool = True) -> None:
        """Drain every pending save, stop the thread, free the cache and remove the hooks."""
        self._engine.close(raise_errors=raise_errors)

    def load(self, path: str, map_location: MapLocation = None, keys: Optional[List[KeySpec]] = None,
             into: Any = None, allow_pickle: bool = False, strict: bool = True) -> Any:
        """Load a file this (or any) writer produced, waiting for its pending
        save; the options are ``lazyckpt.load``'s."""
        request = LoadRequest(map_location=map_location, keys=keys, into=into, allow_pickle=allow_pickle,
                              strict=strict)
        path = file_location(path)
        self.wait(path, raise_errors=False)
        store = for_path(path)
        if not store.exists(path, self.options) or (not store.is_remote and not os.path.isfile(path)):
            raise CheckpointNotFoundError(f"{path}: no such checkpoint file", path=path)
        return load_file(path, self.options, self._engine.resources.readers, store, request)

    def _warn_pickles(self, tree: Any, path: str) -> None:
        if self._warned_pickles:
            return
        found = _find_pickle(tree, [])
        if found is not None:
            self._warned_pickles = True
            node, trail = found
            log.warning("lazyckpt: %s: entry %s is a %s and is pickled; loading this checkpoint will need "
                        "allow_pickle=True (or weights_only=False). Logged once.", path,
                        "/".join(trail) or "<root>", node.get("type", "object"))
