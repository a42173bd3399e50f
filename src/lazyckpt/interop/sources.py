"""The sources of a conversion (``convert.py``): each format read as flat named
tensors (``TensorSpec``: name, dtype, shape) or as a whole state, with the
memory each needs (see convert.py's docstring): a lazyckpt checkpoint in
batches of ``keys=``, safetensors memory-mapped, torch.save through
``torch.load(mmap=True, weights_only=True)``, DCP read whole in one process
with its metadata unpickled through an allow-list. Also the safetensors
dtype codes and header reader, which the writers and ``hf.py`` share."""

from __future__ import annotations

import gc
import io
import json
import math
import mmap
import os
import pickle
import re
import struct
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from lazyckpt import api
from lazyckpt.errors import CheckpointError, CorruptCheckpointError, UnsafeObjectError
from lazyckpt.knobs import resolve as resolve_options
from lazyckpt.loading.reader import CheckpointFile
from lazyckpt.loading.resolve import resolve as resolve_target
from lazyckpt.storage.stores import for_path
from lazyckpt.state.walk import walk
from .zipcheck import check_torch_zip

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec).
ST_CODES: Dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "complex64": "C64",
}
ST_DTYPES: Dict[str, torch.dtype] = {code: getattr(torch, name) for name, code in ST_CODES.items()
                                     if isinstance(getattr(torch, name, None), torch.dtype)}
MAX_ST_HEADER = 100 << 20          # what the safetensors library itself accepts


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------- flattening


@dataclass
class TensorSpec:
    name: str                 # flat name (keys joined with ".")
    dtype: torch.dtype
    shape: List[int]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


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
        self.target = resolve_target(path, store=for_path(path))
        self.load_path = self.target.step_dir or self.target.path
        if self.target.manifest is not None and self.target.manifest.get("world_size", 1) > 1:
            self.memory_note = "a multi-rank step: loaded as rank 0 sees it (sharded tensors assembled)"

    def state(self) -> Any:
        if self._state is None:
            self.memory_note = "loaded whole"
            self._state = api.load(self.load_path, map_location="cpu", allow_pickle=self.allow_pickle)
        return self._state

    def _leaves(self, sep: str):
        f = CheckpointFile(self.target.files[0][1], resolve_options(), store=self.target.store)
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
            out.append((TensorSpec(name, ST_DTYPES[info["dtype"]], list(info["shape"])),
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


#: A valid header nests three levels: the object, a tensor's entry, its shape or offsets.
MAX_ST_DEPTH = 8


def _json_depth(raw: bytes) -> int:
    """How deep the brackets of a JSON text nest, outside its strings."""
    depth = deepest = 0
    for ch in re.findall(rb"[\[\]{}]", re.sub(rb'"(?:[^"\\]|\\.)*"', b'""', raw)):
        if ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


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
        raw = f.read(n)
    depth = _json_depth(raw)
    if depth > MAX_ST_DEPTH:
        # json.loads recurses per level: a deep header would end in a RecursionError.
        raise CorruptCheckpointError(f"{path}: safetensors header nests {depth} levels deep (a valid one "
                                     f"nests {MAX_ST_DEPTH} at most)", path=path)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError(f"{path}: safetensors header is not valid JSON", path=path) from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not an object", path=path)
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise CorruptCheckpointError(f"{path}: safetensors __metadata__ is not an object of strings", path=path)
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"] in ST_DTYPES \
            and isinstance(info.get("shape"), list) \
            and all(type(s) is int and 0 <= s < 2**62 for s in info["shape"]) \
            and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2 \
            and all(type(o) is int for o in info["data_offsets"])
        if not ok:
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} is malformed or has an "
                                         f"unsupported dtype {info.get('dtype') if isinstance(info, dict) else None!r}",
                                         path=path)
        lo, hi = info["data_offsets"]
        expected = math.prod(info["shape"]) * itemsize(ST_DTYPES[info["dtype"]])
        if not 0 <= lo <= hi <= data or hi - lo != expected:
            raise CorruptCheckpointError(f"{path}: safetensors entry {name!r} has offsets {lo}..{hi} that do "
                                         f"not fit its {expected} bytes or the file", path=path)
    return header, 8 + n


def _safetensors_errors() -> Tuple[type, ...]:
    """The safetensors package's error, where installed: torch.load hands a file
    named ``*.safetensors`` to it (one too short to be recognised as safetensors
    here comes to the torch reader)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return ()
    return (SafetensorError,)


class TorchSource(Source):
    format = "torch"
    memory_note = "torch.load(mmap=True): storages paged in lazily"

    def state(self) -> Any:
        if self._state is None:
            kwargs = dict(map_location="cpu", weights_only=not self.allow_pickle)
            with open(self.path, "rb") as f:
                zipped = f.read(4) == b"PK\x03\x04"
            if zipped:
                # torch.load does not check the records' CRC-32s: a damaged record
                # would load as other values.
                check_torch_zip(self.path, self.path)
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
            except (RuntimeError, EOFError, ValueError, KeyError, IndexError, TypeError, AttributeError,
                    AssertionError, OSError, OverflowError, RecursionError, struct.error,
                    UnicodeDecodeError, *_safetensors_errors()) as exc:
                # The unpickler interprets the file's opcodes: a damaged stream fails in
                # whatever way the opcode it reaches does.
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CorruptCheckpointError(f"{self.path}: not a loadable torch.save file: "
                                             f"{type(exc).__name__}: {first[:300]}", path=self.path) from None
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
    # without distributed support; only a DCP source needs it (and lazyckpt.interop.dcp_source imports it).
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import default_planner
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from .dcp_source import SUFFIX, LazyStorageReader, MetadataUnpickler, StorageTransformsError  # lazy: as above

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
        # DCP's own layout without pickles allowed: lazyckpt's reader, which checks every
        # record's CRC-32 (FileSystemReader checks none: a damaged record would convert as
        # other values) and each span against its file. It applies no storage transforms:
        # a checkpoint written with them is read by FileSystemReader as before.
        try:
            return _load_dcp_with(path, LazyStorageReader, Planner, raised)
        except StorageTransformsError:
            raised.clear()
    return _load_dcp_with(path, reader_cls, Planner, raised)


def _load_dcp_with(path: str, reader_cls: Any, planner_cls: Any, raised: List[CheckpointError]) -> Dict[str, Any]:
    import warnings
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    state: Dict[str, Any] = {}
    import logging
    dcp_log = logging.getLogger("torch.distributed.checkpoint")
    level = dcp_log.level
    try:
        dcp_log.setLevel(logging.CRITICAL)     # it logs tracebacks of the failures it then raises
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _load_state_dict(state, storage_reader=reader_cls(path), planner=planner_cls(), no_dist=True)
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
