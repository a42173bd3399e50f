"""DCP checkpoint directories, read side: the one unpickler of DCP's
``.metadata`` (one allow-list, used by ``lazyckpt convert`` and by
:class:`LazyStorageReader`), and the ``StorageReader`` of directories written
by :class:`lazyckpt.integrations.dcp.LazyStorageWriter` (``.lzc`` files, or
DCP's own ``.distcp`` layout with ``file_format="dcp"``) and by DCP's
``FileSystemWriter``, whose records' CRC-32s it checks (docs/FORMAT.md §13.3).

It lives in the core, not in ``integrations/``, because ``lazyckpt convert``
reads such directories and the core never imports an integration.
:class:`LazyStorageInfo` is pickled into ``.metadata`` as
``lazyckpt.integrations.dcp.LazyStorageInfo`` (its former home, a
re-export now), so that older lazyckpt versions read new files too; the
unpickler maps that path, and ``lazyckpt.interop.dcp.LazyStorageInfo`` (this
module's name before it was ``dcp_source``, which some files name), here.
torch.distributed.checkpoint ships with torch: no optional dependency.
"""

from __future__ import annotations

import dataclasses
import io
import mmap
import os
import pickle
import uuid
from typing import Any, Dict, List, Union

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from lazyckpt import api
from lazyckpt.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, UnsafeObjectError,
                             WrongReaderError)
from lazyckpt.formats.datafile import ALIGNMENT, align_up
from lazyckpt.knobs import resolve
from lazyckpt.storage.stores import for_path
from .zipcheck import check_torch_zip

METADATA = ".metadata"
SUFFIX = ".lzc"


@dataclasses.dataclass(frozen=True)
class LazyStorageInfo:
    """Where one DCP item lives: a lazyckpt file of the checkpoint and its key."""
    relative_path: str
    key: str

    # DCP's default reader (FileSystemReader) takes every storage entry for its own
    # _StorageInfo and first asks it for the byte range of the item in its file
    # (offset, length, then transform_descriptors): there, instead of an AttributeError
    # from inside torch, the error says which reader reads this checkpoint.
    @property
    def offset(self) -> Any:
        raise self._wrong_reader("offset")

    @property
    def length(self) -> Any:
        raise self._wrong_reader("length")

    @property
    def transform_descriptors(self) -> Any:
        raise self._wrong_reader("transform_descriptors")

    def _wrong_reader(self, field: str) -> WrongReaderError:
        return DCPReaderError(
            f"{self.relative_path}: this DCP checkpoint was written by lazyckpt's LazyStorageWriter in "
            f"lazyckpt's file format, which DCP's default reader (FileSystemReader) cannot read (it asked "
            f"for the {field!r} of a DCP data file). Load it with dcp.load(state_dict, storage_reader="
            f"lazyckpt.integrations.dcp.LazyStorageReader(path)), or write checkpoints that plain dcp.load "
            f"reads with LazyStorageWriter(path, file_format=\"dcp\")", path=self.relative_path)


class DCPReaderError(WrongReaderError, AttributeError):
    """DCP's default reader asked a :class:`LazyStorageInfo` for a field of its own
    ``_StorageInfo``; an AttributeError too, so ``hasattr`` probes see a missing field."""


# Pickled (into .metadata, and between ranks by DCP's planning) under its former home,
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
    # Megatron's saves keep every rank's plan in the metadata (all_local_plans), to reuse it.
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},              # looks up a torch.layout by name
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},    # storage_meta.checkpoint_id
}
#: LazyStorageInfo's module paths in files on disk: the one every release writes (its former home,
#: its __module__ now) and this module's old name, lazyckpt.interop.dcp (files written
#: during the move, before that; a module of that name re-exports it for plain pickle).
_INFO_PATHS = {("lazyckpt.integrations.dcp", "LazyStorageInfo"), ("lazyckpt.interop.dcp", "LazyStorageInfo"),
               (__name__, "LazyStorageInfo")}


def check_memo(data: bytes, path: str) -> None:
    """Refuse a pickle whose memo indices are beyond its size before unpickling it:
    the C unpickler sizes its memo table to the largest index put, so a 5 KB file
    putting at index 10^9 costs gigabytes and tens of seconds. Each put takes at
    least two bytes, so an index of a valid pickle is below its length."""
    import pickletools
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and not (type(arg) is int and 0 <= arg < len(data)):
                raise CorruptCheckpointError(f"{path}: damaged DCP metadata: a pickle memo index {arg!r} "
                                             f"beyond its {len(data)} bytes", path=path)
    except CorruptCheckpointError:
        raise
    except Exception as exc:            # pickletools' ValueError for an unknown or cut opcode
        raise CorruptCheckpointError(f"{path}: unreadable DCP metadata: {exc}", path=path) from None


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` with the allow-list: plain data classes only. The one
    unpickler of DCP metadata (``lazyckpt convert`` and :class:`LazyStorageReader`)."""

    def __init__(self, f: Any, path: str):
        super().__init__(f)
        self.file = f
        self.path = path

    def load(self) -> Any:
        data = self.file.read()
        check_memo(data, self.path)
        pickle.Unpickler.__init__(self, io.BytesIO(data))
        return super().load()

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


class StorageTransformsError(CheckpointError):
    """The checkpoint was written with DCP storage transforms (compression,
    extensions), which :class:`LazyStorageReader` does not apply."""


class LazyStorageReader(StorageReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`LazyStorageWriter`
    (either file format) and by DCP's ``FileSystemWriter`` (untransformed), on a
    local path or an ``s3://`` URL; DCP's metadata unpickled with the allow-list."""

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
        if not store.is_remote and os.path.isfile(self.path):
            raise CheckpointError(f"{self.path} is a file, not a DCP checkpoint directory; a lazyckpt file is "
                                  f"read with lazyckpt.load({self.path!r}) (into=state_dict to fill it in "
                                  f"place)", path=self.path)
        names = [METADATA] if rank is None else [f"__{rank}{METADATA}", METADATA]
        for name in names:          # a no-collectives save wrote one metadata per rank
            path = store.join(self.path, name)
            try:
                raw = store.read_whole(path, self.options, self.options.max_footer_bytes)
                break
            except CheckpointNotFoundError:
                continue
        else:
            hint = ""
            if not store.is_remote and os.path.isdir(self.path) \
                    and any(n.startswith("step_") for n in os.listdir(self.path)):
                hint = (f"; it is a lazyckpt Checkpointer directory: load it with lazyckpt.load({self.path!r}) "
                        f"or lazyckpt.Checkpointer(...).load()")
            raise CheckpointNotFoundError(f"{self.path}: no committed DCP checkpoint (no {METADATA}){hint}",
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
        # Checked here, not in read_metadata: DCP's loader replaces an error of
        # read_metadata by an AssertionError holding only its text, while one raised
        # here reaches the caller as itself (inside DCP's CheckpointException).
        check_metadata(metadata, os.path.join(self.path, METADATA))
        self.storage_data = metadata.storage_data or {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        lazy: Dict[str, list] = {}
        spans: Dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if not isinstance(info, (LazyStorageInfo, _StorageInfo)) or "/" in info.relative_path \
                    or info.relative_path.startswith("."):
                raise CorruptCheckpointError(f"{self.path}: no valid storage entry for {item.storage_index}",
                                             path=self.path)
            if isinstance(info, LazyStorageInfo):
                lazy.setdefault(info.relative_path, []).append((item, info.key))
            else:       # DCP's own layout (LazyStorageWriter(file_format="dcp"), FileSystemWriter)
                spans.setdefault(info.relative_path, []).append((item, info))
        for name, items in lazy.items():
            # Reads only the entries this rank's plan needs, checksums verified.
            state = api.load(for_path(self.path).join(self.path, name), keys=sorted({k for _, k in items}),
                             **self.knobs)
            for item, key in items:
                _deliver(planner, item, state[key], name, key, self.path)
        for name, entries in spans.items():
            self._read_spans(name, entries, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _read_spans(self, name: str, entries: List[tuple], planner: LoadPlanner) -> None:
        """Items of a DCP data file: each one's (offset, length) run, a ``torch.save``
        zip for a tensor (its records' CRC-32s checked here: ``torch.load`` does not;
        ``weights_only``: no code runs), raw bytes for a ``BYTE_IO`` item."""
        if entries and any(getattr(info, "transform_descriptors", None) for _, info in entries):
            raise StorageTransformsError(f"{self.path}/{name}: written with DCP storage transforms "
                                  f"(compression, extensions), which this reader does not apply; read it "
                                  f"with DCP's FileSystemReader", path=self.path)
        store = for_path(self.path)
        file_path = store.join(self.path, name)
        size = store.read_ends(file_path, self.options, lambda size, read: size)
        # Every span against the file before anything is allocated or mapped for it:
        # the lengths come from the metadata, which may claim anything.
        for item, info in entries:
            offset, length = info.offset, info.length
            if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 \
                    or offset + length > size:
                raise CorruptCheckpointError(f"{self.path}/{name}: the metadata places "
                                             f"{item.storage_index.fqn} at bytes {offset!r}+{length!r}, outside "
                                             f"the file ({size} bytes)", path=self.path)
        source = store.open_input(file_path, self.options, threads=1)
        try:
            for item, info in sorted(entries, key=lambda e: e[1].offset):
                start = info.offset // ALIGNMENT * ALIGNMENT    # aligned: the input may bypass the page cache
                end = align_up(info.offset + info.length)
                buf = mmap.mmap(-1, max(end - start, ALIGNMENT))
                try:
                    with memoryview(buf) as view:
                        got = source.read_into(view[:end - start], start)
                    if got < info.offset + info.length - start:
                        raise CorruptCheckpointError(f"{self.path}/{name}: truncated: {item.storage_index} "
                                                     f"ends at byte {info.offset + info.length}",
                                                     path=self.path)
                    raw = buf[info.offset - start:info.offset - start + info.length]
                finally:
                    buf.close()
                if item.type == LoadItemType.BYTE_IO:
                    value: Any = raw
                else:
                    try:
                        check_torch_zip(raw, f"{self.path}/{name}")
                        value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
                    except Exception as exc:
                        raise CorruptCheckpointError(f"{self.path}/{name}: {item.storage_index.fqn}: "
                                                     f"unreadable tensor record: {exc}", path=self.path) from None
                _deliver(planner, item, value, name, item.storage_index.fqn, self.path)
        finally:
            source.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))



def _ints(value: Any) -> bool:
    """A shape or offsets: non-negative ints that fit a torch.Size (int64)."""
    return isinstance(value, (tuple, list)) and all(type(v) is int and 0 <= v < 2**62 for v in value)


def _brief(value: Any) -> str:
    """repr() of a value a damaged pickle made, which may itself fail (a dataclass
    rebuilt without the fields its repr names)."""
    try:
        return repr(value)[:200]
    except Exception:               # noqa: BLE001 - any repr that fails is named by its type
        return f"<{type(value).__name__}>"


def check_metadata(metadata: Metadata, path: str) -> None:
    """DCP metadata as its writers make it, checked before DCP's planner sees it
    (which would fail on a damaged one with AssertionError, ValueError, TypeError
    or IndexError): names are strings; a tensor's dtype a torch.dtype, its size
    non-negative ints; its chunks lie within it, as many dimensions, their
    volumes summing to its own; every chunk and byte item has a storage entry
    naming a file of the checkpoint, at a non-negative int offset and length."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: damaged DCP metadata: {what}", path=path)

    # A damaged pickle can rebuild these classes without some of their fields: getattr.
    items, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(items, dict):
        raise bad("state_dict_metadata is not a dict")
    if storage is not None and not isinstance(storage, dict):
        raise bad("storage_data is not a dict")
    storage = storage or {}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str) \
                or not (getattr(index, "offset", None) is None or _ints(index.offset)):
            raise bad(f"storage key {_brief(index)}")
        relative = getattr(info, "relative_path", None)
        if isinstance(info, LazyStorageInfo):
            fields_ok = isinstance(getattr(info, "key", None), str)
        elif isinstance(info, _StorageInfo):
            offset, length = getattr(info, "offset", None), getattr(info, "length", None)
            fields_ok = type(offset) is int and type(length) is int and offset >= 0 and length >= 0 \
                and isinstance(getattr(info, "transform_descriptors", ()), (list, tuple, type(None)))
        else:
            fields_ok = False
        if not fields_ok or not isinstance(relative, str) or not relative or "/" in relative \
                or "\0" in relative or relative.startswith("."):
            raise bad(f"storage entry of {index.fqn!r}: {_brief(info)}")
    for fqn, meta in items.items():
        if not isinstance(fqn, str):
            raise bad(f"key {_brief(fqn)} is not a string")
        if isinstance(meta, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise bad(f"{fqn!r} has no storage entry")
            continue
        if not isinstance(meta, TensorStorageMetadata):
            raise bad(f"{fqn!r}: {type(meta).__name__} is not tensor or bytes metadata")
        size, chunks = getattr(meta, "size", None), getattr(meta, "chunks", None)
        dtype = getattr(getattr(meta, "properties", None), "dtype", None)
        if not isinstance(dtype, torch.dtype) or not _ints(size) or not isinstance(chunks, list):
            raise bad(f"{fqn!r}: dtype {_brief(dtype)}, size {_brief(size)}")
        volume = 0
        for chunk in chunks:
            offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
            if not (_ints(offsets) and _ints(sizes) and len(offsets) == len(sizes) == len(size)
                    and all(o + n <= d for o, n, d in zip(offsets, sizes, size))):
                raise bad(f"{fqn!r}: a chunk at {_brief(offsets)} of {_brief(sizes)} does not lie within "
                          f"{_brief(size)}")
            if MetadataIndex(fqn, offsets) not in storage:
                raise bad(f"{fqn!r}: the chunk at {tuple(offsets)} has no storage entry")
            n = 1
            for d in sizes:
                n *= d
            volume += n
        whole = 1
        for d in size:
            whole *= d
        if volume != whole:
            raise bad(f"{fqn!r}: its chunks hold {volume} elements, its size {tuple(size)} {whole}")


def _deliver(planner: LoadPlanner, item: Any, value: Any, name: str, key: str, path: str) -> None:
    """Hand one read item to DCP's planner: bytes as they are, a tensor narrowed
    to the item's piece of it and copied into the planner's target."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(value))
        return
    src = value
    for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        src = src.narrow(dim, offset, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != src.size():
        raise CorruptCheckpointError(f"{name}: {key} has size {tuple(src.size())}, the plan "
                                     f"expects {tuple(target.size())}", path=path)
    target.copy_(src)
    planner.commit_tensor(item, target)


