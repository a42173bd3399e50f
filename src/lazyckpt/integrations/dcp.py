"""torch.distributed.checkpoint (DCP) storage through lazyckpt.

DCP keeps doing what it is good at -- planning, deduplication, resharding
(FSDP2 / torchtitan state dicts) -- and lazyckpt moves the bytes:

* :class:`LazyStorageWriter` writes each rank's items into one lazyckpt file
  (``__<rank>.lzc``: O_DIRECT, several writer threads, per-block checksums,
  fsynced) and the coordinator commits DCP's ``.metadata`` last, through a
  temporary name and a rename, so a crash never leaves a checkpoint that DCP
  would load half-written.
* :class:`LazyStorageReader` reads only the entries a rank's load plan needs,
  verifies their checksums, and unpickles DCP's metadata with an allow-list
  (DCP's own reader uses unrestricted pickle).
* The writer is also an ``AsyncStager``: ``dcp.async_save`` calls
  :meth:`LazyStorageWriter.stage`, which returns at once with a future; the
  copy into a reused, page-aligned (pinned under CUDA) staging buffer runs on
  lazyckpt's save engine while the next forward/backward runs. Call
  :meth:`wait_for_staging` (or :meth:`attach` an optimizer) before the
  optimizer modifies the state; a training-mode forward of a module whose
  buffers are being staged waits by itself. Staging buffers count in
  ``host_cache_bytes`` and are reused only once the write that reads them is
  durable: ``stage()`` waits for that when none is free.

Usage::

    writer = LazyStorageWriter("ckpt/step100")
    writer.attach(optimizer)                     # optional: barrier before optimizer.step()
    response = dcp.async_save(state_dict, storage_writer=writer)
    ...
    response.upload_completion.result()          # durable
    dcp.load(state_dict, storage_reader=LazyStorageReader("ckpt/step100"))
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import dataclasses
import io
import os
import pickle
import threading
import uuid
from typing import Any, Dict, List, Optional, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from lazyckpt.interop.dcp_source import METADATA, SUFFIX, LazyStorageInfo, LazyStorageReader
from lazyckpt.knobs import resolve_for
from lazyckpt.saving.capture import record_events
from lazyckpt.saving.commit import FileCommit
from lazyckpt.saving.dcp_file import DISTCP_SUFFIX, DcpFileLayout
from lazyckpt.saving.engine import CopyPart, FilePart, NoCommit, SaveEngine, run_now
from lazyckpt.saving.hostcache import StagingArenas
from lazyckpt.state.providers import flatten
from lazyckpt.storage.fileio import remove_quietly
from lazyckpt.storage.stores import for_path

# The reader lives in the core (lazyckpt.interop.dcp_source: `lazyckpt convert` reads these directories);
# both are importable here. LazyStorageInfo stays importable here: .metadata files pickle
# it under this module's path (those written by older versions, and new ones: its __module__
# names this module, see lazyckpt.interop.dcp_source, so that older lazyckpt versions read them).
__all__ = ["LazyStorageWriter", "LazyStorageReader", "LazyStorageInfo"]

_DELETES_ITS_OWN = ("DCP (and torchtitan's keep_latest_k) delete old checkpoint directories themselves, "
                    "so a checkpoint cannot refer to bytes of an earlier one")
#: What a DCP writer cannot act on, and why: accepted and ignored,
#: these would promise what is not done.
DCP_REFUSED = {
    "incremental": "each DCP checkpoint_id must stand alone: " + _DELETES_ITS_OWN,
    "full_every": "it only applies to incremental saves: " + _DELETES_ITS_OWN,
    "persist_bandwidth": "it caps the drain of a persistent tier (persist_to=), which a DCP writer "
                         "does not have; write to the s3:// URL directly",
    "advise_mtbf": "the training loop schedules DCP saves; `lazyckpt advise` gives the interval",
    "persist_to": "it is a Checkpointer argument; a DCP writer writes where checkpoint_id says "
                  "(an s3:// URL included)",
    "keep_last": "it is a Checkpointer argument; DCP's callers keep or delete checkpoint directories",
    "replicas": "it is a Checkpointer argument (replicas are steps of a Checkpointer directory)",
    "replicated": "it is a Checkpointer argument; DCP's planner already deduplicates replicated items",
    "writer_lease": "it is a Checkpointer argument (one writer per Checkpointer directory)",
}

#: What write_data writes: lazyckpt's files, or DCP's own (read by DCP without lazyckpt).
FILE_FORMATS = ("lazyckpt", "dcp")

#: stage() waits at most this long for a staging buffer (an earlier save's write to end).
_STAGING_WAIT_S = 600.0


def _item_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(map(str, index.offset))
    return f"{index.fqn}@{offset}#{index.index if index.index is not None else ''}"


# --------------------------------------------------------------------------- writer


class LazyStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that writes lazyckpt files.

    Call order (DCP): 1) (all ranks) ``set_up_storage_writer``, 2) (all)
    ``prepare_local_plan``, 3) (coordinator) ``prepare_global_plan``,
    4) (all) ``write_data``, 5) (coordinator) ``finish``.

    Staging (``dcp.async_save``): ``stage()`` takes a staging buffer (page-
    aligned, pinned under CUDA) and queues the copy on lazyckpt's save engine;
    it returns a future at once. Buffers come out of ``host_cache_bytes``
    together with the write cache (0: sized at the first save to two states),
    and a buffer is reused only after the write that reads it is durable: a
    save that finds none free waits in ``stage()`` for the oldest write.
    """

    # AsyncStager protocol: stage() returns a future; the user synchronizes.
    _synchronize_after_execute = False

    def __init__(self, path: Union[str, os.PathLike], *, file_format: str = "lazyckpt", **knobs: Any):
        super().__init__()
        if file_format not in FILE_FORMATS:
            raise ValueError(f"{type(self).__name__}: file_format={file_format!r}: expected one of "
                             f"{', '.join(map(repr, FILE_FORMATS))}")
        self.path = os.fspath(path)
        #: "lazyckpt": one lazyckpt file per rank (LazyStorageReader reads it); "dcp": DCP's own
        #: ``__<rank>_0.distcp`` files, which DCP's FileSystemReader (plain ``dcp.load``,
        #: torchtitan) reads without lazyckpt, LazyStorageReader too.
        self.file_format = file_format
        self.knobs = knobs
        self.options = resolve_for(type(self).__name__, DCP_REFUSED, **knobs)
        self.rank: Optional[int] = None
        self.use_collectives = True
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        # DCP runs each async save on a thread of its own, where it calls reset(),
        # write_data() and finish() in turn: the path of that save is per thread.
        self._local = threading.local()
        self._engine: Optional[SaveEngine] = None
        self._arenas: Optional[StagingArenas] = None
        self._write_cache_bytes = 0
        self._lock = threading.Lock()

    # -- the engine, its write cache and the staging budget
    def _get_engine(self) -> SaveEngine:
        with self._lock:
            if self._engine is None:
                budget = self.options.host_cache_bytes
                self._write_cache_bytes = max(2 * 4096, min(64 << 20, budget // 8) // 4096 * 4096) \
                    if budget else 64 << 20
                self._engine = SaveEngine(self.options, guard_buffers=True)
                self._engine.resources.fixed_cache_bytes = self._write_cache_bytes
            return self._engine

    def _get_arenas(self, state_bytes: int) -> StagingArenas:
        """The staging buffers' budget: what host_cache_bytes leaves after the write
        cache, or (automatic) two states, within a quarter of the machine's memory."""
        self._get_engine()
        with self._lock:
            if self._arenas is None:
                budget = self.options.host_cache_bytes
                self._arenas = StagingArenas(
                    budget - self._write_cache_bytes if budget else
                    max(state_bytes, min(2 * state_bytes, _quarter_ram() - self._write_cache_bytes)))
            return self._arenas

    @property
    def peak_staging_bytes(self) -> int:
        """The most host memory staging and writing held at once (arenas + write cache)."""
        return (self._arenas.peak_bytes if self._arenas is not None else 0) + self._write_cache_bytes

    # -- AsyncStager
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Dict[str, Any]) -> cf.Future:
        """Queue a copy of ``state_dict`` into a staging buffer; a future of the
        staged state dict (same structure, host tensors)."""
        from torch.distributed.tensor import DTensor

        def local(value: Any) -> Any:
            return value.to_local() if isinstance(value, DTensor) else value

        def plan(value: Any) -> int:
            value = local(value)
            if isinstance(value, torch.Tensor):
                return _aligned(value.numel() * value.element_size())
            if isinstance(value, dict):
                return sum(plan(v) for v in value.values())
            if isinstance(value, (list, tuple)):
                return sum(plan(v) for v in value)
            return 0
        nbytes = plan(state_dict)
        engine = self._get_engine()
        engine.raise_errors()
        arenas = self._get_arenas(nbytes)
        arena = arenas.acquire(nbytes, _STAGING_WAIT_S) if nbytes else None
        base = arena.buffer.tensor if arena is not None else None
        pairs: List[tuple] = []
        cursor = [0]

        def build(value: Any) -> Any:
            if isinstance(value, DTensor):
                staged = build(value.to_local())
                return DTensor.from_local(staged, value.device_mesh, value.placements, run_check=False,
                                          shape=value.shape, stride=value.stride())
            if isinstance(value, torch.Tensor):
                n = value.numel() * value.element_size()
                start = cursor[0]
                cursor[0] += _aligned(n)
                if n == 0:
                    return torch.empty(value.shape, dtype=value.dtype)
                staged = base[start:start + n].view(value.dtype).view(value.shape)
                pairs.append((staged, value.detach()))
                return staged
            if isinstance(value, dict):
                return type(value)((k, build(v)) for k, v in value.items())
            if isinstance(value, list):
                return [build(v) for v in value]
            if isinstance(value, tuple):
                return tuple(build(v) for v in value)
            return copy.deepcopy(value)         # a later mutation by the caller must not leak in

        staged_dict = build(state_dict)
        future: cf.Future = cf.Future()

        def on_end(job: Any) -> None:
            if job.handle.error is not None:
                job.handle.reported = True      # delivered through DCP's future, once
                if arena is not None:
                    arenas.release(arena)
                future.set_exception(job.handle.error)
            else:
                future.set_result(staged_dict)
        part = CopyPart(pairs, record_events(src for _, src in pairs))
        engine.submit(NoCommit(), [part], name=f"DCP staging of {self._current_path()}", on_end=on_end)
        return future

    def synchronize_staging(self) -> None:
        self.wait_for_staging()

    def wait_for_staging(self) -> None:
        """Block until every staged copy is complete (state may then be modified)."""
        if self._engine is not None:
            self._engine.wait_for_snapshot()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait for staging before every ``optimizer.step()``."""
        self._get_engine().barrier.attach(optimizer)

    def close(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            arenas, self._arenas = self._arenas, None
        if engine is not None:
            engine.close()
        if arenas is not None:
            arenas.close()

    # -- StorageWriter
    def _current_path(self) -> str:
        return getattr(self._local, "path", self.path)

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = self._local.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The store is resolved here, before a byte moves: a malformed URL fails
        # every rank's plan rather than one rank's write. Directories are made by
        # the writes (a local path); an object store has none to make.
        for_path(self._current_path())
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=f"__{self.rank}")
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return [plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=f"__{i}")
                for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Write this rank's items into one file (durable on return), then give
        its staging buffer back."""
        dcp_file = self.file_format == "dcp"
        name = f"{plan.storage_data}_0{DISTCP_SUFFIX}" if dcp_file else f"{plan.storage_data}{SUFFIX}"
        state: Dict[str, Any] = {}
        sized: List[tuple] = []
        pointers = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = _item_key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                state[key] = payload
                size = len(payload)
            else:
                tensor = data.detach()
                pointers.append(tensor.data_ptr())
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                state[key] = tensor
                size = tensor.numel() * tensor.element_size()
            sized.append((item.index, key, size))
        engine = self._get_engine()
        try:
            path = self._current_path()
            store = for_path(path)
            strategy = FileCommit(store, store.join(path, name), self.options.lease_heartbeat_s,
                                  options=self.options)
            if dcp_file:
                layout = DcpFileLayout(list(state.items()))
                part = layout.part(record_events(s.data for s in layout.sources))
            else:
                part = FilePart(flatten(state), {})
            run_now(strategy, [part], engine.resources, self.options, name=strategy.path)
        finally:
            self._release_staging(planner, pointers)
        results = [WriteResult(index=index, size_in_bytes=size,
                               storage_data=_StorageInfo(name, *layout.spans[key]) if dcp_file
                               else LazyStorageInfo(name, key))
                   for index, key, size in sized]
        future: Future = Future()
        future.set_result(results)
        return future

    def _release_staging(self, planner: SavePlanner, pointers: List[int]) -> None:
        """The write of a staged state is over: its buffer may be reused."""
        if self._arenas is None:
            return
        staged = getattr(planner, "state_dict", None)
        if isinstance(staged, dict):
            stack = list(staged.values())
            while stack:
                value = stack.pop()
                if isinstance(value, torch.Tensor):
                    value = value.to_local() if hasattr(value, "to_local") else value
                    pointers.append(value.data_ptr())
                elif isinstance(value, dict):
                    stack.extend(value.values())
                elif isinstance(value, (list, tuple)):
                    stack.extend(value)
        released = set()
        for pointer in pointers:
            arena = self._arenas.owner_of(pointer)
            if arena is not None and id(arena) not in released:
                released.add(id(arena))
                self._arenas.release(arena)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        storage = {}
        for per_rank in results:
            storage.update({r.index: r.storage_data for r in per_rank})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        name = METADATA if self.use_collectives or self.rank is None else f"__{self.rank}{METADATA}"
        # Commit last, in one piece, on the checkpoint's own store (an s3:// checkpoint
        # is whole on the bucket): DCP treats a directory with .metadata as complete.
        path = self._current_path()
        store = for_path(path)
        target = store.join(path, name)
        try:
            store.write_whole(target, pickle.dumps(metadata), self.options)
        except OSError:
            # The directory's fsync can fail after the rename put .metadata in place: the
            # checkpoint would then load while dcp.save raises. Taken back, so the error
            # and the directory agree (no checkpoint; saving again makes one).
            if not store.is_remote:
                remove_quietly(target)
            raise

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self._current_path(), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _aligned(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def _quarter_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30
