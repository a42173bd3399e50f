"""DCP checkpoint directories, read side: the one unpickler of DCP's
``.metadata`` (one allow-list, used by ``lazyckpt convert`` and by
:class:`LazyStorageReader`), and the ``StorageReader`` of directories written
by :class:`lazyckpt.integrations.dcp.LazyStorageWriter` (``.lzc`` files).

It lives in the core, not in ``integrations/``, because ``lazyckpt convert``
reads such directories and the core never imports an integration.
:class:`LazyStorageInfo` is pickled into ``.metadata`` as
``lazyckpt.integrations.dcp.LazyStorageInfo`` (its home before issue 23, a
re-export now), so that older lazyckpt versions read new files too; the
unpickler maps that path, and this module's, here.
torch.distributed.checkpoint ships with torch: no optional dependency.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import uuid
from typing import Any, Dict, List, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lazyckpt import api
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsafeObjectError
from lazyckpt.knobs import resolve
from lazyckpt.storage.stores import for_path

METADATA = ".metadata"
SUFFIX = ".lzc"


@dataclasses.dataclass(frozen=True)
class LazyStorageInfo:
    """Where one DCP item lives: a lazyckpt file of the checkpoint and its key."""
    relative_path: str
    key: str


# Pickled (into .metadata, and between ranks by DCP's planning) under its home until issue 23,
# lazyckpt.integrations.dcp, which re-exports it: the lazyckpt versions before the move can
# unpickle only that path (their allow-list names it, and they have no lazyckpt.interop), so
# new files must keep naming it for them to read. pickle imports that module when it writes
# (it checks the name leads back to this class); the writer, LazyStorageWriter, lives there.
LazyStorageInfo.__module__ = "lazyckpt.integrations.dcp"


#: The one allow-list of DCP metadata: plain data classes only (``None``: every class of the module).
ALLOWED = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix", "SerializationFormat"},
    "torch.distributed.checkpoint._extension": None,
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},              # looks up a torch.layout by name
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},    # storage_meta.checkpoint_id
}
#: LazyStorageInfo's module paths in files on disk: the one every release writes (its home until
#: issue 23, its __module__ now) and this module's (files written during the move, before that).
_INFO_PATHS = {("lazyckpt.integrations.dcp", "LazyStorageInfo"), (__name__, "LazyStorageInfo")}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` with the allow-list: plain data classes only. The one
    unpickler of DCP metadata (``lazyckpt convert`` and :class:`LazyStorageReader`)."""

    def __init__(self, f: Any, path: str):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INFO_PATHS:
            return LazyStorageInfo
        allowed = ALLOWED.get(module, set())
        if module in ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeObjectError(f"{self.path}: DCP metadata refers to {module}.{name}, which is not plain "
                                f"checkpoint metadata; pass allow_pickle (--allow-pickle) only if you trust "
                                f"this checkpoint", path=self.path)


class LazyStorageReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`LazyStorageWriter`."""

    def __init__(self, path: Union[str, os.PathLike], **knobs: Any):
        super().__init__()
        self.path = os.fspath(path)
        self.knobs = knobs
        self.options = resolve(None, **knobs)
        self.storage_data: Dict[MetadataIndex, LazyStorageInfo] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        store = for_path(self.path)
        names = [METADATA] if rank is None else [f"__{rank}{METADATA}", METADATA]
        for name in names:          # a no-collectives save wrote one metadata per rank
            path = store.join(self.path, name)
            try:
                raw = store.read_whole(path, self.options, self.options.max_footer_bytes)
                break
            except CheckpointNotFoundError:
                continue
        else:
            raise CheckpointNotFoundError(f"{self.path}: no committed DCP checkpoint (no {METADATA})",
                                          path=self.path)
        try:
            metadata = MetadataUnpickler(io.BytesIO(raw), path).load()
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
            state = api.load(for_path(self.path).join(self.path, name), keys=sorted({k for _, k in items}),
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
