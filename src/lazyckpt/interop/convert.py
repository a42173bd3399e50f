"""Converting checkpoints between lazyckpt, torch.save, safetensors and
torch.distributed.checkpoint (DCP, as a source).

How much memory each direction needs is decided by the formats:

* **safetensors -> anything**: the file is memory-mapped and every tensor is
  a zero-copy view of the mapping, read page by page as the writer consumes
  it (file-backed pages the kernel can drop), so nothing forces the whole
  checkpoint into anonymous memory. Writing safetensors reads tensors one by
  one (``safe_open(...).get_tensor``).
* **anything -> safetensors**: streamed. The header (names, dtypes, shapes,
  offsets) is computed first from the source's metadata, then the tensors are
  written in order, read in batches of at most ``batch_bytes``: from lazyckpt
  with ``lazyckpt.load(keys=...)`` (only those entries are read), from
  safetensors one tensor at a time.
* **torch.save -> anything**: ``torch.load(mmap=True, weights_only=True)``
  maps the storages of a zip-format file without reading them, so tensors are
  paged in lazily; the pickled structure itself is materialized. Files in
  the legacy (pre-1.6, non-zip) format are loaded whole.
* **anything -> torch.save**: ``torch.save`` pickles one object, so the whole
  state is materialized in memory first (unavoidable with that format).
* **DCP -> anything**: the state is read whole with DCP's own reader in
  no-dist mode (the same path as ``dcp_to_torch_save``) and then written.
  DCP's metadata file is unpickled with an allow-list of plain metadata
  classes, and non-tensor items with ``torch.load(weights_only=True)``,
  unless ``allow_pickle``.
* **anything -> lazyckpt**: ``lazyckpt.save`` writes from the tensors'
  memory through its bounded host cache; memory is what the source needs.

safetensors holds a flat mapping of names to tensors: nested state is
flattened with ``.`` between keys (``model.layers.0.weight``) and values
that are not tensors are left out (reported as skipped).
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import io
import json
import math
import mmap
import os
import pickle
import re
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from lazyckpt import api
from lazyckpt.errors import (CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                             UnsafeObjectError)
from lazyckpt.formats.names import MANIFEST, STEP_DIR
from lazyckpt.knobs import resolve as resolve_options
from lazyckpt.loading.reader import CheckpointFile
from lazyckpt.loading.resolve import resolve as resolve_target
from lazyckpt.state.walk import walk
from lazyckpt.storage.fileio import fsync_dir, remove_quietly
from lazyckpt.storage.layout import sibling_temp

FORMATS = ("lazyckpt", "torch", "safetensors", "dcp")
EXTENSIONS = {".lzc": "lazyckpt", ".pt": "torch", ".pth": "torch", ".bin": "torch", ".ckpt": "torch",
              ".tar": "torch", ".safetensors": "safetensors"}
WRITABLE = ("lazyckpt", "torch", "safetensors")

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec).
_ST_CODES: Dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}
_ST_DTYPES: Dict[str, torch.dtype] = {code: getattr(torch, name) for name, code in _ST_CODES.items()
                                      if isinstance(getattr(torch, name, None), torch.dtype)}
MAX_ST_HEADER = 100 << 20          # what the safetensors library itself accepts


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- detection


def detect(path: str, override: Optional[str] = None, *, source: bool) -> str:
    """The format of ``path``: ``override`` if given, else (for an existing
    source) its content, else its extension."""
    if override:
        if override not in FORMATS:
            raise CheckpointError(f"unknown format {override!r}; choose from {', '.join(FORMATS)}")
        return override
    if source and os.path.isdir(path):
        if os.path.isfile(os.path.join(path, ".metadata")):
            return "dcp"
        if os.path.isfile(os.path.join(path, MANIFEST)) or any(
                STEP_DIR.match(n) for n in os.listdir(path)):
            return "lazyckpt"
        raise CheckpointError(f"{path}: a directory that is neither a lazyckpt checkpoint directory nor a "
                              f"DCP checkpoint (no .metadata); pass --from")
    if source and os.path.isfile(path):
        with open(path, "rb") as f:
            head = f.read(16)
        if head[:8] == b"LAZYCKPT":
            return "lazyckpt"
        if head[:4] == b"PK\x03\x04":
            return "torch"                       # torch.save's zip format
        if len(head) >= 9 and head[8:9] == b"{":
            n = struct.unpack("<Q", head[:8])[0]
            if 0 < n <= min(MAX_ST_HEADER, os.path.getsize(path) - 8):
                return "safetensors"
        if head[:1] == b"\x80":
            return "torch"                       # a pickle (legacy torch.save format)
    ext = os.path.splitext(path)[1].lower()
    if ext in EXTENSIONS:
        return EXTENSIONS[ext]
    what = "source" if source else "destination"
    raise CheckpointError(f"{path}: cannot tell the {what} format from its "
                          f"{'content or ' if source else ''}extension; pass --{'from' if source else 'to'} "
                          f"({'/'.join(FORMATS if source else WRITABLE)})")


# --------------------------------------------------------------------------- flattening


@dataclass
class TensorSpec:
    name: str                 # flat name (keys joined with ".")
    dtype: torch.dtype
    shape: List[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def flatten_state(state: Any, sep: str = ".") -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """Nested state -> (flat name -> tensor, names of the non-tensor leaves)."""
    tensors: Dict[str, torch.Tensor] = {}
    skipped: List[str] = []

    def visit(value: Any, prefix: str) -> None:
        if isinstance(value, torch.Tensor):
            t = value
            if hasattr(t, "full_tensor") and type(t).__name__ == "DTensor":
                t = t.full_tensor()
            if prefix in tensors:
                raise CheckpointError(f"two values flatten to the same name {prefix!r}")
            tensors[prefix] = t.detach()
        elif isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and \
                _np_torch_dtype(value.dtype) is not None:
            tensors[prefix] = torch.from_numpy(np.ascontiguousarray(value))
        elif isinstance(value, dict) and value:
            for k, v in value.items():
                visit(v, f"{prefix}{sep}{k}" if prefix else str(k))
        elif isinstance(value, (list, tuple)) and value and any(_holds_tensor(v) for v in value):
            for i, v in enumerate(value):
                visit(v, f"{prefix}{sep}{i}" if prefix else str(i))
        else:
            skipped.append(prefix or "<root>")

    visit(state, "")
    return tensors, skipped


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _np_torch_dtype(dtype: np.dtype) -> Optional[torch.dtype]:
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- sources


class Source:
    """A checkpoint to convert from."""
    format = ""
    #: How the source is read, for the user.
    memory_note = ""

    def __init__(self, path: str, allow_pickle: bool):
        self.path = path
        self.allow_pickle = allow_pickle
        self._flat: Optional[Tuple[Dict[str, torch.Tensor], List[str]]] = None
        self._state: Any = None

    def state(self) -> Any:
        """The whole state, as nested Python objects."""
        raise NotImplementedError

    def specs(self, sep: str) -> Tuple[List[TensorSpec], List[str]]:
        """Tensors (flat names, dtypes, shapes) and the names of skipped non-tensor leaves."""
        flat, skipped = self._flatten(sep)
        return [TensorSpec(n, t.dtype, list(t.shape)) for n, t in flat.items()], skipped

    def read_tensors(self, names: List[str], sep: str, batch_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
        flat, _ = self._flatten(sep)
        for n in names:
            yield n, flat[n]

    def _flatten(self, sep: str) -> Tuple[Dict[str, torch.Tensor], List[str]]:
        if self._flat is None:
            self._flat = flatten_state(self.state(), sep)
        return self._flat

    def close(self) -> None:
        self._flat = None
        self._state = None


class LazySource(Source):
    format = "lazyckpt"
    memory_note = "read in batches of entries (keys=)"

    def __init__(self, path: str, allow_pickle: bool):
        super().__init__(path, allow_pickle)
        self.target = resolve_target(path)
        self.load_path = self.target.step_dir or self.target.path
        if self.target.manifest is not None and self.target.manifest.get("world_size", 1) > 1:
            self.memory_note = "a multi-rank step: loaded as rank 0 sees it (sharded tensors assembled)"

    def state(self) -> Any:
        if self._state is None:
            self.memory_note = "loaded whole"
            self._state = api.load(self.load_path, map_location="cpu", allow_pickle=self.allow_pickle)
        return self._state

    def _leaves(self, sep: str):
        f = CheckpointFile(self.target.files[0][1], resolve_options())
        specs, skipped, leaves = [], [], {}
        for leaf in walk(f.footer.tree):
            name = sep.join(leaf.path) or "<root>"
            node = leaf.node
            if leaf.type == "tensor" and node.get("e") is not None:
                dtype, shape = getattr(torch, node.get("dtype"), None), node.get("shape")
            elif leaf.type == "dtensor":
                dtype, shape = getattr(torch, node.get("dtype"), None), node.get("global_shape")
            elif leaf.type == "numpy" and node.get("t") == "array" and \
                    np.dtype(node["dtype"]).kind in "biuf" and _np_torch_dtype(np.dtype(node["dtype"])):
                dtype, shape = _np_torch_dtype(np.dtype(node["dtype"])), node.get("shape")
            else:
                skipped.append(name)
                continue
            if not isinstance(dtype, torch.dtype) or not isinstance(shape, list):
                raise CorruptCheckpointError(f"{f.path}: {name}: bad dtype or shape", path=f.path)
            if name in leaves:
                raise CheckpointError(f"two values flatten to the same name {name!r}; pass another --sep")
            specs.append(TensorSpec(name, dtype, shape))
            leaves[name] = leaf
        return specs, skipped, leaves

    def specs(self, sep: str) -> Tuple[List[TensorSpec], List[str]]:
        specs, skipped, _ = self._leaves(sep)
        return specs, skipped

    def read_tensors(self, names: List[str], sep: str, batch_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
        specs, _, leaves = self._leaves(sep)
        size = {s.name: s.nbytes for s in specs}
        batch: List[str] = []
        total = 0
        for n in names + [None]:                     # type: ignore[list-item]
            if n is not None and (not batch or total + size[n] <= batch_bytes):
                batch.append(n)
                total += size[n]
                continue
            if batch:
                yield from self._load_batch(batch, leaves)
            batch, total = ([n], size[n]) if n is not None else ([], 0)

    def _load_batch(self, names: List[str], leaves: Dict[str, Any]) -> Iterator[Tuple[str, torch.Tensor]]:
        selects = list(dict.fromkeys(leaves[n].select for n in names))
        if any(s == () for s in selects):
            part = self.state()                       # some leaf is not under a dict: whole state
        else:
            part = api.load(self.load_path, map_location="cpu", keys=selects, allow_pickle=self.allow_pickle)
        for n in names:
            yield n, _as_tensor(_navigate(part, leaves[n]), n)
        del part
        # lazyckpt.load's read buffers sit in a reference cycle (LoadContext <-> its
        # closures) until the cycle collector runs: collect now, or every batch stays
        # resident and memory is not bounded.
        gc.collect()


def _navigate(state: Any, leaf: Any) -> Any:
    value = state
    for k in leaf.select:
        value = value[k]
    for comp in leaf.path[len(leaf.select):]:
        if isinstance(value, (list, tuple)):
            value = value[int(comp)]
        elif isinstance(value, dict):
            matches = [v for k, v in value.items() if str(k) == comp]
            if len(matches) != 1:
                raise CheckpointError(f"cannot find {leaf.name!r} in the loaded state")
            value = matches[0]
        else:
            raise CheckpointError(f"cannot find {leaf.name!r} in the loaded state")
    return value


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor":
            value = value.full_tensor()
        return value.detach()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    raise CheckpointError(f"{name}: expected a tensor, found {type(value).__name__}")


class SafetensorsSource(Source):
    format = "safetensors"
    memory_note = "memory-mapped, zero-copy"

    def __init__(self, path: str, allow_pickle: bool):
        super().__init__(path, allow_pickle)
        self.header, self.data_start = read_safetensors_header(path)
        self.metadata = self.header.pop("__metadata__", None) or {}

    def _specs(self) -> List[Tuple[TensorSpec, int, int]]:
        out = []
        for name, info in self.header.items():
            out.append((TensorSpec(name, _ST_DTYPES[info["dtype"]], list(info["shape"])),
                        self.data_start + info["data_offsets"][0], self.data_start + info["data_offsets"][1]))
        return out

    def specs(self, sep: str) -> Tuple[List[TensorSpec], List[str]]:
        return [s for s, _, _ in self._specs()], []

    def state(self) -> Any:
        if self._state is None:
            size = os.path.getsize(self.path)
            state: Dict[str, torch.Tensor] = {}
            mapping = None
            with open(self.path, "rb") as f:
                if size:
                    # MAP_PRIVATE: writable for torch, never written, pages shared with the page cache.
                    mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            for spec, lo, hi in self._specs():
                if hi == lo or mapping is None:
                    state[spec.name] = torch.empty(spec.shape, dtype=spec.dtype)
                    continue
                try:
                    flat = torch.frombuffer(memoryview(mapping)[lo:hi], dtype=spec.dtype)
                except (ValueError, RuntimeError):
                    from safetensors import safe_open
                    with safe_open(self.path, framework="pt") as sf:
                        flat = sf.get_tensor(spec.name).reshape(-1)
                state[spec.name] = flat.reshape(spec.shape)
            self._state = state
        return self._state

    def read_tensors(self, names: List[str], sep: str, batch_bytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
        try:
            from safetensors import safe_open
        except ImportError:
            yield from super().read_tensors(names, sep, batch_bytes)
            return
        with safe_open(self.path, framework="pt") as sf:
            for n in names:
                yield n, sf.get_tensor(n)


def read_safetensors_header(path: str) -> Tuple[Dict[str, Any], int]:
    """Parse and validate a safetensors header: (header, absolute offset of the data)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptCheckpointError(f"{path}: not a safetensors file (too short)", path=path)
        n = struct.unpack("<Q", raw)[0]
        if n > MAX_ST_HEADER or 8 + n > size:
            raise CorruptCheckpointError(f"{path}: not a safetensors file (header length {n})", path=path)
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise CorruptCheckpointError(f"{path}: safetensors header is not valid JSON", path=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not an object", path=path)
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(info, dict) and info.get("dtype") in _ST_DTYPES and isinstance(info.get("shape"), list) \
            and all(type(s) is int and s >= 0 for s in info["shape"]) \
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2 \
            and all(type(o) is int for o in info["data_offsets"])
        if not ok:
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} is malformed or has an "
                                         f"unsupported dtype {info.get('dtype') if isinstance(info, dict) else None!r}",
                                         path=path)
        lo, hi = info["data_offsets"]
        expected = math.prod(info["shape"]) * _itemsize(_ST_DTYPES[info["dtype"]])
        if not 0 <= lo <= hi <= data or hi - lo != expected:
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} has offsets {lo}..{hi} that do "
                                         f"not fit its {expected} bytes or the file", path=path)
    return header, 8 + n


class TorchSource(Source):
    format = "torch"
    memory_note = "torch.load(mmap=True): storages paged in lazily"

    def state(self) -> Any:
        if self._state is None:
            kwargs = dict(map_location="cpu", weights_only=not self.allow_pickle)
            try:
                try:
                    self._state = torch.load(self.path, mmap=True, **kwargs)
                except RuntimeError as exc:
                    if "mmap" not in str(exc):
                        raise
                    self.memory_note = "legacy (non-zip) torch.save format: loaded whole"
                    self._state = torch.load(self.path, **kwargs)
            except pickle.UnpicklingError as exc:
                first = unpickling_reason(exc)
                if not self.allow_pickle:
                    raise UnsafeObjectError(
                        f"{self.path}: torch.load(weights_only=True) refused it ({first}); pass "
                        f"--allow-pickle if you trust this file (unpickling runs code from it)",
                        path=self.path) from None
                raise CorruptCheckpointError(f"{self.path}: cannot unpickle: {first}", path=self.path) from None
            except (RuntimeError, EOFError, ValueError, KeyError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CorruptCheckpointError(f"{self.path}: not a loadable torch.save file: {first}",
                                             path=self.path) from None
        return self._state


class DcpSource(Source):
    format = "dcp"
    memory_note = "DCP: read whole (no-dist FileSystemReader)"

    def state(self) -> Any:
        if self._state is None:
            self._state = load_dcp(self.path, self.allow_pickle)
        return self._state


def load_dcp(path: str, allow_pickle: bool) -> Dict[str, Any]:
    """Read a whole DCP checkpoint directory in this process (no process group)."""
    import warnings
    # lazy: torch.distributed.checkpoint costs a second to import and is absent from torch builds
    # without distributed support; only a DCP source needs it (and lazyckpt.interop.dcp imports it).
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from .dcp import SUFFIX, LazyStorageReader, MetadataUnpickler  # lazy: as above

    raised: List[CheckpointError] = []        # DCP turns errors into strings: keep ours

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            # DCP's own planner unpickles non-tensor items with weights_only=False.
            try:
                obj = torch.load(value, weights_only=not allow_pickle)
            except pickle.UnpicklingError as exc:
                raised.append(UnsafeObjectError(
                    f"{path}: item {read_item.dest_index.fqn!r} is a pickled object that "
                    f"torch.load(weights_only=True) refuses ({unpickling_reason(exc)}); pass "
                    f"--allow-pickle if you trust this checkpoint", path=path))
                raise raised[-1] from None
            if self.flatten_state_dict:
                default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    reader_cls: Any = FileSystemReader
    if any(n.endswith(SUFFIX) for n in os.listdir(path)):     # written by lazyckpt's DCP storage writer
        reader_cls = LazyStorageReader
    if reader_cls is FileSystemReader and not allow_pickle:
        class SafeReader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any):
                from torch.distributed.checkpoint.metadata import StorageMeta
                get_path = getattr(self, "_get_metadata_path", None)
                mpath = os.fspath(get_path(kwargs.get("rank"))) if get_path is not None else \
                    os.path.join(self.path, ".metadata")
                with open(mpath, "rb") as f:
                    try:
                        metadata = MetadataUnpickler(f, path).load()
                    except CheckpointError as exc:
                        raised.append(exc)
                        raise
                    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
                        raised.append(CorruptCheckpointError(f"{path}: DCP metadata cannot be read: "
                                                             f"{type(exc).__name__}: {exc}", path=path))
                        raise raised[-1] from None
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata
        reader_cls = SafeReader
    state: Dict[str, Any] = {}
    import logging
    dcp_log = logging.getLogger("torch.distributed.checkpoint")
    level = dcp_log.level
    try:
        dcp_log.setLevel(logging.CRITICAL)     # it logs tracebacks of the failures it then raises
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _load_state_dict(state, storage_reader=reader_cls(path), planner=Planner(), no_dist=True)
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:   # DCP wraps failures in its CheckpointException (a BaseException)
        if raised:
            raise raised[0] from None
        cause = exc
        for inner in _exception_chain(exc):
            if isinstance(inner, CheckpointError):
                raise inner from None
            cause = inner
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise CorruptCheckpointError(f"{path}: cannot read the DCP checkpoint: {type(cause).__name__}: "
                                     f"{first[:300]}", path=path) from None
    finally:
        dcp_log.setLevel(level)
    return state


def unpickling_reason(exc: BaseException) -> str:
    """The informative line of torch.load(weights_only=True)'s long refusal message."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "Unsupported global" in ln or "WeightsUnpickler error" in ln or "Unsupported operand" in ln:
            return ln[:200]
    return (lines[0] if lines else type(exc).__name__)[:200]


def _exception_chain(exc: BaseException) -> List[BaseException]:
    out, seen = [], set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        out.append(e)
        failures = getattr(e, "failures", None)        # torch's CheckpointException: {rank: exc}
        if isinstance(failures, dict):
            for v in failures.values():
                if isinstance(v, BaseException):
                    stack.append(v)
                elif isinstance(v, tuple) and v and isinstance(v[0], BaseException):
                    stack.append(v[0])
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                stack.append(nxt)
    return out


SOURCES = {"lazyckpt": LazySource, "safetensors": SafetensorsSource, "torch": TorchSource, "dcp": DcpSource}


# --------------------------------------------------------------------------- writers


def _atomic_output(dst: str) -> str:
    directory = os.path.dirname(os.path.abspath(dst)) or "."
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(f"{dst}: directory {directory} does not exist", path=dst)
    return sibling_temp(dst)


def _commit(tmp: str, dst: str) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dst)
    fsync_dir(os.path.dirname(os.path.abspath(dst)) or ".")


class _EarlyWriteback:
    """Flush a file being written sequentially in the background every
    ``every`` bytes, so the disk writes while the source is still being read
    (the kernel would otherwise hold everything dirty until the final fsync,
    which then waits for all of it)."""

    def __init__(self, f: Any, every: int = 64 << 20):
        self.f, self.every, self.since = f, every, 0
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazyckpt-writeback")
        self.job: Optional[cf.Future] = None

    def wrote(self, n: int) -> None:
        self.since += n
        if self.since >= self.every and (self.job is None or self.job.done()):
            if self.job is not None:
                self.job.result()               # an error of the last flush surfaces here
            self.f.flush()
            self.since = 0
            self.job = self.pool.submit(os.fdatasync, self.f.fileno())

    def __enter__(self) -> "_EarlyWriteback":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if self.job is not None and exc_type is None:
                self.job.result()
        finally:
            self.pool.shutdown(wait=True)       # before the file is closed


def write_safetensors(dst: str, specs: List[TensorSpec], tensors: Iterator[Tuple[str, torch.Tensor]],
                      metadata: Optional[Dict[str, str]] = None,
                      progress: Optional[Callable[[int], None]] = None) -> int:
    """Stream tensors into a safetensors file: header first (from ``specs``),
    then each tensor's bytes in the order of ``specs``. Returns the file size."""
    header: Dict[str, Any] = {}
    offset = 0
    for s in specs:
        code = _ST_CODES.get(_dtype_name(s.dtype))
        if code is None:
            raise CheckpointError(f"{s.name}: safetensors has no dtype for {_dtype_name(s.dtype)}")
        header[s.name] = {"dtype": code, "shape": s.shape, "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)                 # data starts 8-byte aligned
    tmp = _atomic_output(dst)
    try:
        with open(tmp, "wb") as f, _EarlyWriteback(f) as writeback:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            expected = iter(specs)
            for name, t in tensors:
                s = next(expected)
                if name != s.name or t.dtype != s.dtype or list(t.shape) != s.shape:
                    raise CheckpointError(f"{name}: the source changed while converting "
                                          f"({t.dtype} {list(t.shape)}, expected {s.dtype} {s.shape})")
                if s.nbytes:
                    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    f.write(memoryview(data))
                    writeback.wrote(s.nbytes)
                if progress is not None:
                    progress(s.nbytes)
            if next(expected, None) is not None:
                raise CheckpointError("the source yielded fewer tensors than it described")
        _commit(tmp, dst)
    except BaseException:
        remove_quietly(tmp)
        raise
    return os.path.getsize(dst)


def write_torch(dst: str, state: Any) -> int:
    tmp = _atomic_output(dst)
    try:
        torch.save(state, tmp)
        _commit(tmp, dst)
    except BaseException:
        remove_quietly(tmp)
        raise
    return os.path.getsize(dst)


# --------------------------------------------------------------------------- driver


@dataclass
class ConvertResult:
    src: str
    dst: str
    src_format: str
    dst_format: str
    tensors: int = 0
    tensor_bytes: int = 0
    file_bytes: int = 0
    seconds: float = 0.0
    skipped: List[str] = field(default_factory=list)
    memory: str = ""


def convert(src: str, dst: str, src_format: Optional[str] = None, dst_format: Optional[str] = None, *,
            allow_pickle: bool = False, overwrite: bool = False, sep: str = ".",
            batch_bytes: int = 256 << 20, progress: Optional[Callable[[int], None]] = None,
            on_total: Optional[Callable[[int], None]] = None) -> ConvertResult:
    """Convert ``src`` to ``dst``; formats detected unless given."""
    if not os.path.exists(src):
        raise CheckpointNotFoundError(f"{src}: no such file or directory", path=src)
    sfmt = detect(src, src_format, source=True)
    dfmt = detect(dst, dst_format, source=False)
    if dfmt not in WRITABLE:
        raise CheckpointError(f"cannot write {dfmt!r}: convert writes {', '.join(WRITABLE)}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise CheckpointError(f"{dst}: the destination is the source")
    if os.path.isdir(dst):
        raise CheckpointError(f"{dst}: is a directory; give a file name")
    if os.path.exists(dst) and not overwrite:
        raise CheckpointError(f"{dst}: already exists (pass --force to replace it)", path=dst)
    t0 = time.perf_counter()
    source = SOURCES[sfmt](src, allow_pickle)
    result = ConvertResult(src, dst, sfmt, dfmt)
    try:
        if dfmt == "safetensors":
            specs, skipped = source.specs(sep)
            # Largest elements first: every tensor stays aligned to its element size.
            specs = sorted(specs, key=lambda s: -_itemsize(s.dtype))
            if on_total is not None:
                on_total(sum(s.nbytes for s in specs))
            result.file_bytes = write_safetensors(
                dst, specs, source.read_tensors([s.name for s in specs], sep, batch_bytes),
                {"format": "pt"}, progress)
            result.tensors, result.tensor_bytes = len(specs), sum(s.nbytes for s in specs)
            result.skipped = skipped
            result.memory = source.memory_note + "; written streaming"
        else:
            state = source.state()
            flat, _ = flatten_state(state, sep)
            result.tensors = len(flat)
            result.tensor_bytes = sum(t.numel() * t.element_size() for t in flat.values())
            del flat
            if dfmt == "lazyckpt":
                result.file_bytes = api.save(state, dst)
                result.memory = source.memory_note + "; lazyckpt.save writes from the tensors' memory"
            else:
                result.file_bytes = write_torch(dst, state)
                result.memory = source.memory_note + "; torch.save pickles the whole state (materialized)"
            del state
    finally:
        source.close()
    result.seconds = time.perf_counter() - t0
    return result
