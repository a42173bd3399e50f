"""Converting checkpoints between lazyckpt, torch.save, safetensors and
torch.distributed.checkpoint (DCP, as a source).

How much memory each direction needs is decided by the formats:

* **safetensors -> anything**: the file is memory-mapped and every tensor is
  a zero-copy view of the mapping, read page by page as the writer consumes
  it (file-backed pages the kernel can drop), so nothing forces the whole
  checkpoint into anonymous memory. Writing safetensors reads tensors one by
  one (``safe_open(...).get_tensor``).
* **anything -> safetensors**: streamed. The header (names, dtypes, shapes, offsets) is computed first from the source's metadata, then the tensors are
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
import json
import os
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from lazyckpt import api
from lazyckpt.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, STEP_DIR
from lazyckpt.state.providers import dtype_name
from lazyckpt.storage.fileio import fsync_dir, remove_quietly
from lazyckpt.storage.sidefiles import sibling_temp
from .sources import MAX_ST_HEADER, SOURCES, ST_CODES, TensorSpec, flatten_state, itemsize

FORMATS = ("lazyckpt", "torch", "safetensors", "dcp")
EXTENSIONS = {".lzc": "lazyckpt", ".pt": "torch", ".pth": "torch", ".bin": "torch", ".ckpt": "torch",
              ".tar": "torch", ".safetensors": "safetensors"}
WRITABLE = ("lazyckpt", "torch", "safetensors")


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
        code = ST_CODES.get(dtype_name(s.dtype))
        if code is None:
            raise CheckpointError(f"{s.name}: safetensors has no dtype for {dtype_name(s.dtype)}")
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
    try:
        mode = os.stat(src).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{src}: no such file or directory", path=src) from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        # A FIFO or a device (/dev/zero) would block the reader or never end.
        raise CorruptCheckpointError(f"{src}: not a regular file or directory; convert reads checkpoint "
                                     f"files and directories", path=src)
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
            specs = sorted(specs, key=lambda s: -itemsize(s.dtype))
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
