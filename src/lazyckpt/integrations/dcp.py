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
  copy into a reused, page-aligned staging arena runs on a background thread
  while the next forward/backward runs. Call :meth:`wait_for_staging` (or
  :meth:`attach` an optimizer) before the optimizer modifies the state.
  Two arenas alternate, so staging save N+1 never overwrites the bytes save
  N is still uploading (wait for an upload before staging the one after).

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
import dataclasses
import io
import mmap
import os
import pickle
import threading
import uuid
from typing import Any, Dict, List, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan,
                                                  SavePlanner, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import api
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..fileio import fsync_dir, write_file_atomic

METADATA = ".metadata"
SUFFIX = ".lzc"


@dataclasses.dataclass(frozen=True)
class LazyStorageInfo:
    """Where one DCP item lives: a lazyckpt file of the checkpoint and its key."""
    relative_path: str
    key: str


def _item_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(map(str, index.offset))
    return f"{index.fqn}@{offset}#{index.index if index.index is not None else ''}"


# --------------------------------------------------------------------------- staging


class _Arena:
    """One page-aligned host buffer, reused while the staged layout fits."""

    def __init__(self) -> None:
        self.map: Optional[mmap.mmap] = None
        self.size = 0

    def ensure(self, nbytes: int) -> mmap.mmap:
        if self.map is None or self.size < nbytes:
            self.map = mmap.mmap(-1, max(nbytes, 4096), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.size = max(nbytes, 4096)
        return self.map


def _aligned(n: int) -> int:
    return (n + 4095) // 4096 * 4096


class _Stager:
    """Copies a state dict into the arena on a background thread.

    Returns at once with a future of the staged state dict; the structure is
    built on the caller's thread (cheap) and the bytes are copied in the
    background, overlapping the next forward/backward.
    """

    def __init__(self) -> None:
        self._arenas = [_Arena(), _Arena()]     # double-buffered: stage N+1 while N uploads
        self._turn = 0
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="lazyckpt-dcp-stage")
        self._pending: List[cf.Future] = []
        self._lock = threading.Lock()

    def stage(self, state_dict: Dict[str, Any]) -> cf.Future:
        from torch.distributed.tensor import DTensor
        leaves: List[tuple] = []

        def plan(value: Any) -> int:
            if isinstance(value, DTensor):
                return plan(value.to_local())
            if isinstance(value, torch.Tensor):
                return _aligned(value.numel() * value.element_size())
            if isinstance(value, dict):
                return sum(plan(v) for v in value.values())
            if isinstance(value, (list, tuple)):
                return sum(plan(v) for v in value)
            return 0
        arena = self._arenas[self._turn].ensure(plan(state_dict))
        self._turn ^= 1
        view = memoryview(arena)
        cursor = [0]

        def build(value: Any) -> Any:
            if isinstance(value, DTensor):
                local = build(value.to_local())
                return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                          shape=value.shape, stride=value.stride())
            if isinstance(value, torch.Tensor):
                nbytes = value.numel() * value.element_size()
                start = cursor[0]
                cursor[0] += _aligned(nbytes)
                if nbytes == 0:
                    return torch.empty(value.shape, dtype=value.dtype)
                staged = torch.frombuffer(view[start:start + nbytes], dtype=torch.uint8)
                staged = staged.view(value.dtype).view(value.shape)
                leaves.append((staged, value))
                return staged
            if isinstance(value, dict):
                return type(value)((k, build(v)) for k, v in value.items())
            if isinstance(value, list):
                return [build(v) for v in value]
            if isinstance(value, tuple):
                return tuple(build(v) for v in value)
            return value

        staged_dict = build(state_dict)
        event = None
        if torch.cuda.is_available() and any(src.is_cuda for _, src in leaves):
            event = torch.cuda.Event()
            event.record()

        def copy() -> Dict[str, Any]:
            stream = None
            for dst, src in leaves:
                if src.is_cuda:
                    if stream is None:
                        stream = torch.cuda.Stream(device=src.device)
                        stream.wait_event(event)
                    with torch.cuda.stream(stream):
                        dst.copy_(src.detach(), non_blocking=True)
                else:
                    # numpy memcpy: one thread, GIL released, no intra-op thread team.
                    dst.reshape(-1).view(torch.uint8).numpy()[:] = \
                        src.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            if stream is not None:
                stream.synchronize()
            return staged_dict

        future = self._pool.submit(copy)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]
        return future

    def wait(self) -> None:
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# --------------------------------------------------------------------------- writer


class LazyStorageWriter(StorageWriter):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that writes lazyckpt files.

    Call order (DCP): 1) (all ranks) ``set_up_storage_writer``, 2) (all)
    ``prepare_local_plan``, 3) (coordinator) ``prepare_global_plan``,
    4) (all) ``write_data``, 5) (coordinator) ``finish``.
    """

    # AsyncStager protocol: stage() returns a future; the user synchronizes.
    _synchronize_after_execute = False

    def __init__(self, path: Union[str, os.PathLike], **knobs: Any):
        super().__init__()
        self.path = os.fspath(path)
        self.knobs = knobs
        self.rank: Optional[int] = None
        self.use_collectives = True
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        self._stager: Optional[_Stager] = None
        self._hooks: list = []

    # -- AsyncStager
    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: Dict[str, Any]) -> Any:
        if self._stager is None:
            self._stager = _Stager()
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        self.wait_for_staging()

    def wait_for_staging(self) -> None:
        """Block until every staged copy is complete (state may then be modified)."""
        if self._stager is not None:
            self._stager.wait()

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Wait for staging before every ``optimizer.step()``."""
        self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self.wait_for_staging()))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # -- StorageWriter
    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=f"__{self.rank}")
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return [plan if plan.storage_data is not None else dataclasses.replace(plan, storage_data=f"__{i}")
                for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = f"{plan.storage_data}{SUFFIX}"
        state: Dict[str, Any] = {}
        results: List[WriteResult] = []
        for item in plan.items:
            data = planner.resolve_data(item)
            key = _item_key(item.index)
            if item.type == WriteItemType.BYTE_IO:
                payload = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                state[key] = payload
                size = len(payload)
            else:
                tensor = data.detach()
                if tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                state[key] = tensor
                size = tensor.numel() * tensor.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data=LazyStorageInfo(name, key)))
        api.save(state, os.path.join(self.path, name), **self.knobs)    # durable on return
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        storage = {}
        for per_rank in results:
            storage.update({r.index: r.storage_data for r in per_rank})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        name = METADATA if self.use_collectives or self.rank is None else f"__{self.rank}{METADATA}"
        # Commit last, atomically: DCP treats a directory with .metadata as complete.
        write_file_atomic(os.path.join(self.path, name), pickle.dumps(metadata))
        fsync_dir(self.path)

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


# --------------------------------------------------------------------------- reader


_ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,       # every class there is plain data
    "lazyckpt.integrations.dcp": {"LazyStorageInfo"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},              # looks up a torch.layout by name
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata with an allow-list: plain data classes only."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, set())
        if module in _ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CorruptCheckpointError(f"DCP metadata refers to {module}.{name}, which is not plain "
                                     f"checkpoint metadata; refusing to unpickle it")


class LazyStorageReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`LazyStorageWriter`."""

    def __init__(self, path: Union[str, os.PathLike], **knobs: Any):
        super().__init__()
        self.path = os.fspath(path)
        self.knobs = knobs
        self.storage_data: Dict[MetadataIndex, LazyStorageInfo] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA if rank is None else f"__{rank}{METADATA}"
        path = os.path.join(self.path, name)
        if rank is not None and not os.path.exists(path):
            path = os.path.join(self.path, METADATA)
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.path}: no committed DCP checkpoint (no {METADATA})",
                                          path=self.path) from None
        except CheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{path}: unreadable DCP metadata: {exc}", path=path) from None
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path}: not DCP metadata", path=path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data or {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        by_file: Dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if not isinstance(info, LazyStorageInfo) or "/" in info.relative_path \
                    or info.relative_path.startswith("."):
                raise CorruptCheckpointError(f"{self.path}: no valid storage entry for {item.storage_index}",
                                             path=self.path)
            by_file.setdefault(info.relative_path, []).append((item, info.key))
        for name, items in by_file.items():
            # Reads only the entries this rank's plan needs, checksums verified.
            state = api.load(os.path.join(self.path, name), keys=sorted({k for _, k in items}),
                             **self.knobs)
            for item, key in items:
                value = state[key]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(value))
                    continue
                src = value
                for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    src = src.narrow(dim, offset, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != src.size():
                    raise CorruptCheckpointError(f"{name}: {key} has size {tuple(src.size())}, the plan "
                                                 f"expects {tuple(target.size())}", path=self.path)
                target.copy_(src)
                planner.commit_tensor(item, target)
        future: Future = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
