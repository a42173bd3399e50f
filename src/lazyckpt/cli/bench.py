"""Side-by-side checkpoint benchmark (``lazyckpt bench``): a private module, loaded
only by that command and by benchmarks/ (the peers' setup lives here, not in the
core the library imports).

Why it lives in the package, and why it is one long module: ``lazyckpt
bench`` is a command of the installed package (README, ``[bench]`` extra), and
benchmarks/ is not installed (setuptools finds packages under src/ only), so
moving the harness there would break the command outside a checkout. It is
imported by nothing but ``cli.cmd_bench`` (a function-level import, ``# lazy``)
and benchmarks/, so ``import lazyckpt`` never loads it or its peers. Its length
is one concept repeated: one adapter per row of the table below (each a
``Method`` with setup/save/load, most a dozen lines of a peer's API), the
shared timing loop and the report; splitting the adapters into modules would
spread one table over many files without making any of them clearer.

One state (a flat dict of tensors: ``--size`` bytes split into ``--tensors``
tensors cycling through ``--dtypes``), saved and loaded in the same run by:

=========================  ===============================================  =================
row                        save / load                                      installed by
=========================  ===============================================  =================
raw O_DIRECT               aligned pwrite + fsync / pread, N threads        --
raw buffered               write() + fsync, 1 thread / sequential read()    --
raw mmap (read)            -- / mmap + one byte of every page touched       --
torch.save                 torch.save + fsync / torch.load(weights_only)    torch
safetensors                save_file + fsync / load_file                    ``safetensors``
dcp.save (1 thread)        FileSystemWriter(thread_count=1) / dcp.load      torch (distributed)
dcp.save (2 threads)       FileSystemWriter(thread_count=2) / dcp.load      torch (distributed)
dcp.async_save             future returned / future done / dcp.load         torch (distributed)
torchsnapshot take         Snapshot.take / restore                          ``torchsnapshot``
torchsnapshot async_take   Snapshot.async_take, wait() / restore            ``torchsnapshot``
torch-checkpointing        CheckpointManager sync save + fsync / load       ``torch-checkpointing``
torch-checkpointing async  save() returns / future done + fsync / load      ``torch-checkpointing``
deepspeed save_checkpoint  engine.save_checkpoint + fsync / load_checkpoint ``lazyckpt[deepspeed]``
lazyckpt.save (sync)       lazyckpt.save (durable on return) / load         --
lazyckpt Checkpointer      save() returns / handle.wait() / load            --
=========================  ===============================================  =================

The three raw rows are the ceiling: the same number of bytes written and read
back by the plain methods a program can use, measured in the same interleaved
repetitions as the others. The **best raw write** is the faster of O_DIRECT
pwrite (as many threads as lazyckpt writes with) and buffered write + fsync
(one thread, the way a plain program writes); the **best raw read** the
fastest of O_DIRECT pread (lazyckpt's reader threads), buffered sequential
read() (the kernel's default readahead, 32 MiB calls) and mmap (every page
touched once, as a zero-copy loader must at least). Which one wins depends on
the storage and its state, so each run measures all of them.

Every repetition runs the methods in a new order (seeded, ``--seed``): what
ran just before a method changes its load's time, and here every method's
load is bimodal from one repetition to the next, so a fixed order of 3
repetitions ranked the same code first in one run and last in the next.
Figures per row are the median over ``--reps`` (default 7, ``DEFAULT_REPS``
says why) with the min-max range of the repetitions beside it, as whiskers in
the chart. Under the table, per column (durable save, load), whether the
repetitions support the order (``rank_verdict``): a method ranks above
another only when its slowest repetition beats the other's fastest; medians
within 10 % with overlapping ranges are a tie; overlapping ranges with
medians further apart mean the spread is too wide to rank, and the table
says so. The figures:

* **save call s**: time inside the save call (what training waits for);
* **durable s**: until the checkpoint is on stable storage. Methods that do
  not fsync themselves (torch.save, safetensors, torchsnapshot, DeepSpeed)
  are followed by an fsync of every file and directory they wrote, inside
  the timing: without it a "save" is only a copy into the page cache;
* **GB/s** = state bytes / durable s; **of best write** = that over the best
  raw write method's GB/s (median) in the same run; the JSON also keeps
  ``of_raw_write``, the ratio to the raw O_DIRECT row alone;
* **load s**, **load GB/s**, **of best read**: the same for loading back
  (into freshly allocated memory; dcp/torchsnapshot/DeepSpeed restore into
  preallocated tensors, allocation included in the timing). One byte of
  every page of the loaded tensors is read inside the timing, so loaders
  that only map the file (safetensors) pay for their reads like the others.

``--drop-caches`` evicts the checkpoint from the page cache before each load:
globally (``/proc/sys/vm/drop_caches``, root only) or else file by file
(``posix_fadvise(DONTNEED)`` after fsync, permitted to any user). Without it,
buffered loaders (torch, safetensors, dcp) may read from memory while
O_DIRECT ones (raw, lazyckpt) always read the disk.

Under the table: each raw method's figure, the best raw write and read, and
lazyckpt's save and load as a fraction of the best raw method and of each
raw method, and against the fastest peer.

``--timeline PNG`` also runs a short training loop with a lazyckpt
Checkpointer and draws per iteration the forward/backward, optimizer step
and the wait for the capture, and per checkpoint the save call, the capture
(copy out of the live tensors; writing overlaps it), the remaining write and
the commit, on one time axis.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import gc
import logging
import math
import mmap
import os
import platform
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import lazyckpt
from lazyckpt.knobs import Options
from lazyckpt.storage.fileio import anonymous_buffer, open_for_read, read_buffer

GB = 1e9
CHUNK = 32 << 20

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64,
          "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
          "int64": torch.int64}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["fp8"] = DTYPES["fp8_e4m3"] = torch.float8_e4m3fn


def parse_dtypes(text: str) -> List[torch.dtype]:
    out = []
    for name in str(text).split(","):
        name = name.strip().lower()
        if not name:
            continue
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose from {', '.join(sorted(DTYPES))}")
        out.append(DTYPES[name])
    if not out:
        raise ValueError("--dtypes is empty")
    return out


def make_state(size: int, tensors: int, dtypes: List[torch.dtype], seed: int = 0) -> Dict[str, torch.Tensor]:
    """``tensors`` tensors of about ``size / tensors`` bytes each, dtypes cycled."""
    g = torch.Generator().manual_seed(seed)
    per = max(1, size // max(1, tensors))
    state = {}
    for i in range(tensors):
        dtype = dtypes[i % len(dtypes)]
        n = max(1, per // torch.empty((), dtype=dtype).element_size())
        shape = (n // 1024, 1024) if n >= 1024 and n % 1024 == 0 else (n,)
        if dtype.is_floating_point:
            make = dtype if dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16) else torch.float32
            t = torch.randn(shape, generator=g, dtype=make).to(dtype)
        elif dtype == torch.uint8:
            t = torch.randint(0, 256, shape, generator=g, dtype=dtype)
        else:
            t = torch.randint(-100, 100, shape, generator=g, dtype=dtype)
        state[f"layers.{i}.weight"] = t
    return state


def state_bytes(state: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# --------------------------------------------------------------------------- I/O helpers


def fsync_path(path: str) -> None:
    """fsync every file and directory under ``path`` (and its parent directory)."""
    def sync(p: str, directory: bool) -> None:
        try:
            fd = os.open(p, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
        except OSError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    if os.path.isdir(path):
        for root, _dirs, files in os.walk(path):
            for name in files:
                sync(os.path.join(root, name), False)
            sync(root, True)
    elif os.path.exists(path):
        sync(path, False)
    sync(os.path.dirname(os.path.abspath(path)), True)


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def _files(path: str) -> List[str]:
    if os.path.isdir(path):
        return [os.path.join(r, n) for r, _d, fs in os.walk(path) for n in fs]
    return [path] if os.path.isfile(path) else []


def drop_caches_global() -> bool:
    """Drop the whole machine's page cache (root only); False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def evict(path: str) -> None:
    """Evict the (clean, fsynced) pages of ``path``'s files from the page cache."""
    advise = getattr(os, "posix_fadvise", None)
    for p in _files(path):
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            if advise is not None:
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _o_direct_flag() -> int:
    return getattr(os, "O_DIRECT", 0)


# The raw methods move bytes between the file and the same kind of memory as
# lazyckpt's (page-aligned): the writers' pattern is reused memory with huge
# pages asked for, like the host cache; the readers fill fresh memory under
# the loader's own policy (fileio.read_buffer).


def _pattern(size: int) -> mmap.mmap:
    """``size`` bytes of page-aligned anonymous memory holding one random MiB
    repeated: what the raw writers write (incompressible, identical pieces)."""
    buf = anonymous_buffer(max(1, size), huge_pages=True)
    seed = os.urandom(min(len(buf), 1 << 20))
    for off in range(0, len(buf), len(seed)):
        buf[off:off + len(seed)] = seed[:len(buf) - off]
    return buf


def raw_write(path: str, nbytes: int, threads: int) -> Tuple[float, bool]:
    """Seconds to write ``nbytes`` of random data with aligned O_DIRECT pwrites
    from ``threads`` threads, fsynced; and whether O_DIRECT was used (buffered
    where the file system refuses it)."""
    total = (nbytes + 4095) // 4096 * 4096
    piece = min(CHUNK, total)
    buf = _pattern(piece * threads)
    view = memoryview(buf)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = bool(_o_direct_flag())
    try:
        fd = os.open(path, flags | _o_direct_flag(), 0o644) if direct else os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct = False
        fd = os.open(path, flags, 0o644)

    def worker(k: int) -> None:
        for off in range(k * piece, total, piece * threads):
            n = min(piece, total - off)
            os.pwrite(fd, view[k * piece:k * piece + n], off)

    def write_all() -> None:
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(worker, range(threads)))
        os.ftruncate(fd, nbytes)
    return _timed_write(fd, buf, view, write_all), direct


def raw_write_buffered(path: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` (the same pattern as :func:`raw_write`) with
    plain write() calls of 32 MiB from one thread, then fsync: the way a
    program that does not use O_DIRECT writes (page cache, kernel writeback)."""
    piece = min(CHUNK, max(1, nbytes))
    buf = _pattern(piece)
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write_all() -> None:
        off = 0
        while off < nbytes:
            n = min(piece, nbytes - off)
            done = 0
            while done < n:
                done += os.write(fd, view[done:n])
            off += n
    return _timed_write(fd, buf, view, write_all)


def _timed_write(fd: int, buf: mmap.mmap, view: memoryview, write_all: Callable[[], None]) -> float:
    """Seconds for ``write_all()`` and the fsync that makes it durable: what
    every raw writer measures. Closes ``fd`` and frees the pattern whatever
    happens."""
    try:
        t = time.perf_counter()
        write_all()
        os.fsync(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        view.release()
        buf.close()


def _timed_fill(nbytes: int, fill: Callable[[memoryview], None]) -> float:
    """Seconds to allocate fresh memory for ``nbytes`` (as lazyckpt's reader
    does) and ``fill`` it: what every raw reader measures."""
    t = time.perf_counter()
    buf = read_buffer(max(1, nbytes))
    view = memoryview(buf)
    try:
        fill(view)
        return time.perf_counter() - t
    finally:
        view.release()
        buf.close()


def raw_read(path: str, nbytes: int, threads: int) -> float:
    """Seconds to read ``nbytes`` with O_DIRECT preads of 32 MiB from ``threads``
    threads into fresh aligned memory (allocation included)."""
    total = (nbytes + 4095) // 4096 * 4096
    fd, _direct = open_for_read(path, True)         # buffered where O_DIRECT is refused

    def fill(view: memoryview) -> None:
        with cf.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda off: os.preadv(fd, [view[off:off + CHUNK]], off), range(0, total, CHUNK)))
    try:
        return _timed_fill(total, fill)
    finally:
        os.close(fd)


def raw_read_buffered(path: str, nbytes: int) -> float:
    """Seconds to read ``nbytes`` with sequential read() calls of 32 MiB through
    the page cache (the kernel's default readahead), one thread, into fresh
    memory (allocation included)."""
    fd = os.open(path, os.O_RDONLY)

    def fill(view: memoryview) -> None:
        off = 0
        while off < nbytes:
            n = os.readv(fd, [view[off:off + CHUNK]])
            if n <= 0:
                raise EOFError(f"{path}: {off} bytes of {nbytes}")
            off += n
    try:
        return _timed_fill(nbytes, fill)
    finally:
        os.close(fd)


def raw_read_mmap(path: str, nbytes: int) -> float:
    """Seconds to map ``nbytes`` of the file and touch one byte of every page
    (each fault reads ahead): the least a loader that maps the file instead of
    reading it pays before the bytes are in memory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.perf_counter()
        mm = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        view = memoryview(mm)
        touched = bytes(view[::mmap.PAGESIZE])          # one byte per page, in order
        view.release()
        elapsed = time.perf_counter() - t
    finally:
        mm.close()
    assert len(touched) == -(-nbytes // mmap.PAGESIZE)
    return elapsed


#: The raw methods, by the key of their row: the names the ceiling lines print.
RAW_NAMES = {"raw": "O_DIRECT", "raw_buffered": "buffered", "raw_mmap": "mmap"}


def best_raw(figures: Dict[str, Optional[float]]) -> Tuple[str, float]:
    """The fastest raw method of ``figures`` ({method: GB/s}; None, zero or
    non-finite figures are ignored) as (method, GB/s): the ceiling of that run."""
    usable = {k: v for k, v in figures.items() if v is not None and math.isfinite(v) and v > 0}
    if not usable:
        raise ValueError("no raw figure to choose from")
    name = max(usable, key=lambda k: usable[k])
    return name, usable[name]


def ceiling_lines(write: Dict[str, float], read: Dict[str, float]) -> List[str]:
    """One line each for the raw write and read methods: every figure, the best first."""
    lines = []
    for kind, figures in (("write", write), ("read", read)):
        if not figures:
            continue
        name, best = best_raw(figures)
        others = [f"{k} {v:.2f}" for k, v in figures.items() if k != name and v]
        lines.append(f"best raw {kind}: {name} {best:.2f} GB/s"
                     + (f" (also measured: {', '.join(others)} GB/s)" if others else ""))
    return lines


def fraction_line(label: str, save_gbps: Optional[float], load_gbps: Optional[float],
                  write: Dict[str, float], read: Dict[str, float]) -> str:
    """``label``'s save and load as a fraction of the best raw method, and of each one."""
    parts = []
    for what, gbps, figures in (("save (durable)", save_gbps, write), ("load", load_gbps, read)):
        if not gbps or not figures:
            continue
        name, best = best_raw(figures)
        each = ", ".join(f"{gbps / v:.0%} of {k}" for k, v in figures.items() if v)
        parts.append(f"{what} {gbps:.2f} GB/s = {gbps / best:.0%} of the best raw ({name}; {each})")
    return f"{label}: " + ("; ".join(parts) if parts else "-")


def touch(obj: Any) -> None:
    """Read one byte of every page of every tensor in ``obj``: a loader that maps
    the file instead of reading it (safetensors, torch mmap) pays for its reads
    inside the load timing too, like the loaders that copy."""
    stack = [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            if v.numel() and v.device.type == "cpu":
                flat = torch.empty((0,), dtype=torch.uint8).set_(v.untyped_storage())
                flat[::4096].sum()
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif hasattr(v, "state_dict") and callable(v.state_dict):
            stack.append(v.state_dict())


def filesystem_of(path: str) -> str:
    path = os.path.realpath(path)
    best, fstype = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


@contextlib.contextmanager
def stdout_to_stderr():
    """Send what a peer library prints (banners, INFO logs) to stderr, keeping stdout for the table."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# --------------------------------------------------------------------------- methods


@dataclass
class SaveTimes:
    blocking: float
    durable: float
    extra: Dict[str, float] = field(default_factory=dict)


class Method:
    key = ""
    label = ""
    install: Optional[str] = None      # what installs the peer
    isolated = False                    # run after the others (global side effects)
    self_durable = True                 # fsyncs by itself
    note = ""

    def unavailable(self) -> Optional[str]:
        return None

    def setup(self, b: "Bench") -> None:
        pass

    def save(self, b: "Bench", path: str) -> Optional[SaveTimes]:
        """The save's timings; None for a method that only reads (its file written untimed)."""
        raise NotImplementedError

    def load(self, b: "Bench", path: str) -> Any:
        raise NotImplementedError

    def teardown(self, b: "Bench") -> None:
        pass

    def _timed_save(self, fn: Callable[[], Any], path: str) -> SaveTimes:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        fsync_path(path)
        return SaveTimes(t1 - t0, time.perf_counter() - t0)


def _have(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class Raw(Method):
    key, label = "raw", "raw O_DIRECT"
    note = "ceiling: aligned O_DIRECT pwrite + fsync / pread of the same bytes, as many threads as lazyckpt uses"

    def setup(self, b):
        self.note = (f"ceiling: aligned O_DIRECT pwrite from {b.options.writer_threads} threads + fsync / "
                     f"pread from {b.options.reader_threads} threads, 32 MiB pieces")

    def save(self, b, path):
        s, direct = raw_write(path, b.nbytes, b.options.writer_threads)
        if not direct:
            self.label = "raw buffered (O_DIRECT refused)"
        return SaveTimes(s, s)

    def load(self, b, path):
        return raw_read(path, b.nbytes, b.options.reader_threads)


class RawBuffered(Method):
    key, label = "raw_buffered", "raw buffered"
    note = ("ceiling: write() of 32 MiB from one thread + fsync / sequential read() of 32 MiB, default "
            "readahead, into fresh memory")

    def save(self, b, path):
        s = raw_write_buffered(path, b.nbytes)
        return SaveTimes(s, s)

    def load(self, b, path):
        return raw_read_buffered(path, b.nbytes)


class RawMmap(Method):
    key, label = "raw_mmap", "raw mmap (read)"
    note = "ceiling: mmap of the file, one byte of every page touched (its file is written untimed)"

    def save(self, b, path):
        raw_write(path, b.nbytes, b.options.writer_threads)
        return None                       # a read method only

    def load(self, b, path):
        return raw_read_mmap(path, b.nbytes)


class TorchSave(Method):
    key, label = "torch", "torch.save"
    self_durable = False

    def save(self, b, path):
        return self._timed_save(lambda: torch.save(b.state, path), path)

    def load(self, b, path):
        return torch.load(path, map_location="cpu", weights_only=True)


class Safetensors(Method):
    key, label, install = "safetensors", "safetensors", "pip install safetensors  (or lazyckpt[bench])"
    self_durable = False

    def unavailable(self):
        return None if _have("safetensors") else "not installed"

    def save(self, b, path):
        from safetensors.torch import save_file
        return self._timed_save(lambda: save_file(b.state, path), path)

    def load(self, b, path):
        from safetensors.torch import load_file
        return load_file(path)


def _dcp_unavailable() -> Optional[str]:
    import torch.distributed as dist
    if not dist.is_available():
        return "this torch is built without torch.distributed"
    return None


class DcpSave(Method):
    install = "torch with torch.distributed"

    def __init__(self, threads: int):
        self.threads = threads
        self.key = f"dcp{threads}"
        self.label = f"dcp.save ({threads} thread{'s' if threads > 1 else ''})"

    def unavailable(self):
        return _dcp_unavailable()

    def save(self, b, path):
        import torch.distributed.checkpoint as dcp
        writer = dcp.FileSystemWriter(path, thread_count=self.threads)   # sync_files=True: fsyncs
        return self._timed_save(lambda: dcp.save(b.state, storage_writer=writer, no_dist=True), path)

    def load(self, b, path):
        return _dcp_load(b, path)


def _dcp_load(b: "Bench", path: str) -> Any:
    import torch.distributed.checkpoint as dcp
    target = {k: torch.empty_like(v) for k, v in b.state.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return target


class DcpAsync(Method):
    key, label, install = "dcp_async", "dcp.async_save", "torch with torch.distributed"
    note = "default stager: the staging copy runs inside the call; durable when the future completes"

    def unavailable(self):
        return _dcp_unavailable()

    def save(self, b, path):
        import torch.distributed.checkpoint as dcp
        writer = dcp.FileSystemWriter(path, thread_count=1)
        t0 = time.perf_counter()
        result = dcp.async_save(b.state, storage_writer=writer, no_dist=True)
        t1 = time.perf_counter()
        future = getattr(result, "upload_completion", result)
        future.result()
        fsync_path(path)
        return SaveTimes(t1 - t0, time.perf_counter() - t0)

    def load(self, b, path):
        return _dcp_load(b, path)


class TorchSnapshot(Method):
    install = "pip install torchsnapshot"
    self_durable = False

    def __init__(self, asynchronous: bool):
        self.asynchronous = asynchronous
        self.key = "torchsnapshot_async" if asynchronous else "torchsnapshot"
        self.label = "torchsnapshot async_take" if asynchronous else "torchsnapshot take"

    def unavailable(self):
        return None if _have("torchsnapshot") else "not installed"

    def save(self, b, path):
        from torchsnapshot import Snapshot, StateDict
        app_state = {"state": StateDict(**b.state)}
        t0 = time.perf_counter()
        if self.asynchronous:
            pending = Snapshot.async_take(path=path, app_state=app_state)
            t1 = time.perf_counter()
            pending.wait()
        else:
            Snapshot.take(path=path, app_state=app_state)
            t1 = time.perf_counter()
        fsync_path(path)
        return SaveTimes(t1 - t0, time.perf_counter() - t0)

    def load(self, b, path):
        from torchsnapshot import Snapshot, StateDict
        target = StateDict(**{k: torch.empty_like(v) for k, v in b.state.items()})
        Snapshot(path=path).restore(app_state={"state": target})
        return target


# torch-checkpointing (meta-pytorch, PyPI ``torch-checkpointing``): a CheckpointManager
# saves {item: value} payloads, one torch.save file per item (``<item>_<rank>.pt``)
# in a temporary directory renamed onto the checkpoint path; the async saver stages
# the tensors in a background thread (into pinned memory with CUDA, shared memory
# without) and writes from a spawned process. It never fsyncs.

TC_INSTALL = "pip install 'lazyckpt[bench]'  (torch-checkpointing)"


def tc_storage(directory: str) -> Tuple[Any, str]:
    """torch-checkpointing's local file storage for ``directory`` and a note saying
    which: its default (O_DIRECT writes) where a tiny synchronous save works there,
    else buffered writes (``use_direct_io=False``). Its writer streams torch.save
    through an O_DIRECT file object, and ext4/XFS refuse the unaligned writes that
    makes (EINVAL); tmpfs takes them."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)
    probe = tempfile.mkdtemp(prefix=".tc-probe-", dir=directory)
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(),
                                                         storage_config=LocalFileSystemStorageConfig()))
    try:
        manager.save(os.path.join(probe, "ckpt"), {"probe": {"x": torch.arange(1000.0)}})
        return LocalFileSystemStorageConfig(), "its default O_DIRECT writes"
    except Exception as exc:          # the first error of a chain: OSError EINVAL, then torch's RuntimeError
        first = exc
        while first.__context__ is not None:
            first = first.__context__
        why = (str(first).strip().splitlines() or [""])[0][:80]
        return (LocalFileSystemStorageConfig(use_direct_io=False),
                f"buffered writes (use_direct_io=False): its default O_DIRECT writes fail on this file system "
                f"({type(first).__name__}: {why})")
    finally:
        manager.close()
        shutil.rmtree(probe, ignore_errors=True)


def tc_manager(asynchronous: bool, storage_config: Any) -> Any:
    """A torch-checkpointing CheckpointManager with its default configuration but
    ``storage_config``: synchronous (writes in the calling thread) or asynchronous
    (background staging thread + spawned writer process; on CPU the stager's
    defaults turn pinned memory off and stage into shared memory)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    logging.getLogger("torch_checkpointing").setLevel(logging.ERROR)
    save = AsyncCheckpointSaverConfig() if asynchronous else SyncCheckpointSaverConfig()
    return CheckpointManager(CheckpointManager.Config(save=save, storage_config=storage_config))


def tc_staging_note(manager: Any) -> str:
    stager = getattr(getattr(manager, "_saver", None), "stager", None)
    cfg = getattr(stager, "_config", None)
    if cfg is None:
        return ""
    if getattr(cfg, "use_pinned_memory", False):
        return "staging into pinned memory"
    return ("staging into " + ("shared" if getattr(cfg, "use_shared_memory", False) else "plain") +
            " memory, not pinned (" + ("pinning needs CUDA: its default turns it off here"
                                       if not torch.cuda.is_available() else "pinning off") + ")")


class TorchCheckpointing(Method):
    install = TC_INSTALL
    self_durable = False

    def __init__(self, asynchronous: bool):
        self.asynchronous = asynchronous
        self.key = "torch_checkpointing_async" if asynchronous else "torch_checkpointing"
        self.label = "torch-checkpointing async" if asynchronous else "torch-checkpointing (sync)"
        self.manager: Any = None
        self.note = ""

    def unavailable(self):
        return None if _have("torch_checkpointing") else "not installed"

    def setup(self, b):
        if "tc_storage" not in b.cache:
            b.cache["tc_storage"] = tc_storage(b.workdir)
        storage, storage_note = b.cache["tc_storage"]
        self.manager = tc_manager(self.asynchronous, storage)
        notes = ["CheckpointManager, one torch.save file per item ({'model': state})", storage_note]
        if self.asynchronous:
            # Outside the timing, as a training job would have them: the writer process
            # (spawned; a tiny first save waits for it) and the staging buffers.
            t = time.perf_counter()
            warm = os.path.join(b.workdir, "tc-warmup")
            self.manager.save(warm, {"warmup": {"x": torch.zeros(1)}}).result()
            remove(warm)
            self.manager.prewarm_staging({"model": b.state})
            prewarm = getattr(self.manager, "_prewarm_staging_future", None)   # else the first save waits
            if prewarm is not None:
                prewarm.result()
            notes.append(f"writer process spawned and staging buffers allocated (prewarm_staging) in setup, "
                         f"untimed ({time.perf_counter() - t:.1f} s)")
            notes.append(tc_staging_note(self.manager))
            notes.append("durable = write future done + fsync; capture = staging done")
        self.note = "; ".join(n for n in notes if n)

    def save(self, b, path):
        t0 = time.perf_counter()
        future = self.manager.save(path, {"model": b.state})
        t1 = time.perf_counter()
        extra: Dict[str, float] = {}
        if future is not None:
            staging = getattr(self.manager, "_staging_future", None)   # no public handle on staging
            if staging is not None:
                staging.result()
                extra["capture_s"] = time.perf_counter() - t0
            future.result()
        fsync_path(path)
        return SaveTimes(t1 - t0, time.perf_counter() - t0, extra)

    def load(self, b, path):
        return self.manager.load(path, into={"model": None})["model"]

    def teardown(self, b):
        if self.manager is not None:
            with stdout_to_stderr():
                self.manager.close()
            self.manager = None


class DeepSpeed(Method):
    key, label, install = "deepspeed", "deepspeed save_checkpoint", "pip install 'lazyckpt[deepspeed]'"
    isolated = True
    self_durable = False
    note = ("DeepSpeed engine (ZeRO stage 0, no optimizer) over the same tensors as parameters, 1-process "
            "gloo group; its CPU shared-memory allreduce op is not built (unused by checkpointing)")

    def __init__(self) -> None:
        self.engine = None
        self._env: Dict[str, Optional[str]] = {}
        self._initialized_dist = False
        self._patched: Optional[Tuple[Any, Any]] = None

    def unavailable(self):
        return None if _have("deepspeed") else "not installed"

    def setup(self, b):
        with stdout_to_stderr(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed
            import torch.distributed as dist
            logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
            comm_torch = sys.modules.get("deepspeed.comm.torch")
            if comm_torch is not None and hasattr(comm_torch, "build_shm_op"):
                # A JIT C++ build of a CPU allreduce op, minutes long, that checkpointing never uses.
                self._patched = (comm_torch, comm_torch.build_shm_op)
                comm_torch.build_shm_op = lambda: None
            if not dist.is_initialized():
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
                    self._env[k] = os.environ.get(k)
                    os.environ[k] = v
                deepspeed.init_distributed(dist_backend="gloo", verbose=False)
                self._initialized_dist = True
            module = torch.nn.Module()
            module.params = torch.nn.ParameterList(
                [torch.nn.Parameter(t, requires_grad=False) for t in b.state.values()])
            self.engine, *_ = deepspeed.initialize(
                model=module, config={"train_batch_size": 1, "zero_optimization": {"stage": 0},
                                      "steps_per_print": 1 << 30})

    def save(self, b, path):
        with stdout_to_stderr():
            return self._timed_save(lambda: self.engine.save_checkpoint(path, tag="bench"), path)

    def load(self, b, path):
        with stdout_to_stderr():
            self.engine.load_checkpoint(path, tag="bench", load_optimizer_states=False,
                                        load_lr_scheduler_states=False, load_module_only=True)
        return None                       # loaded into the engine's parameters

    def teardown(self, b):
        self.engine = None
        try:
            import torch.distributed as dist
            if self._initialized_dist and dist.is_initialized():
                dist.destroy_process_group()
        finally:
            for k, v in self._env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if self._patched is not None:
                setattr(self._patched[0], "build_shm_op", self._patched[1])


class LazySync(Method):
    key, label = "lazyckpt", "lazyckpt.save (sync)"

    def save(self, b, path):
        t0 = time.perf_counter()
        lazyckpt.save(b.state, path)
        s = time.perf_counter() - t0
        return SaveTimes(s, s)

    def load(self, b, path):
        return lazyckpt.load(path)


class LazyAsync(Method):
    key, label = "lazyckpt_async", "lazyckpt Checkpointer (async)"
    note = "save() returns after walking the state; durable = handle.flush_s (capture, write, commit)"

    def __init__(self) -> None:
        self.ckpt: Optional[lazyckpt.Checkpointer] = None
        self.step = 0

    def setup(self, b):
        self.root = os.path.join(b.workdir, "lazyckpt-async")
        self.ckpt = lazyckpt.Checkpointer(self.root)

    def save(self, b, path):
        self.step += 1
        handle = self.ckpt.save(b.state, step=self.step)
        handle.wait()
        b.paths[self.key] = self.ckpt.step_path(self.step)
        return SaveTimes(handle.blocking_s, handle.flush_s, {"capture_s": handle.capture_s})

    def load(self, b, path):
        return lazyckpt.load(b.paths[self.key])

    def teardown(self, b):
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
        remove(self.root)


def all_methods() -> List[Method]:
    return [Raw(), RawBuffered(), RawMmap(), TorchSave(), Safetensors(), DcpSave(1), DcpSave(2), DcpAsync(),
            TorchSnapshot(False), TorchSnapshot(True), TorchCheckpointing(False), TorchCheckpointing(True),
            DeepSpeed(), LazySync(), LazyAsync()]


METHOD_KEYS = [m.key for m in all_methods()]


# --------------------------------------------------------------------------- running


@dataclass
class Bench:
    state: Dict[str, torch.Tensor]
    nbytes: int
    workdir: str
    options: Options
    drop: str                  # "global", "fadvise" or "no"
    paths: Dict[str, str] = field(default_factory=dict)
    cache: Dict[str, Any] = field(default_factory=dict)     # what setups share (a probe's result)


def _summary(values: List[float]) -> Dict[str, Any]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


# --------------------------------------------------------------------------- order and spread

#: Repetitions by default. With n repetitions and nothing assumed about the
#: distribution of one method's times, its true median lies outside the min-max
#: range of the n values with probability 2 / 2**n: 25 % at 3, 6 % at 5, 1.6 % at
#: 7. Loads here are bimodal from one repetition to the next (a fast and a slow
#: mode, 3x apart), so the median of 3 can land in either mode; 7 makes the range
#: shown beside each median a 98 % interval for it, for about twice the time of 3.
DEFAULT_REPS = 7
#: Two medians closer than this (relative to the faster) are a tie, not an order.
TIE = 0.10


def rep_order(keys: List[str], rep: int, seed: int = 0) -> List[str]:
    """The order of the methods in repetition ``rep``: a new shuffle each time,
    the same for the same seed. What ran just before a method (memory it freed,
    the disk's state) moves a load's time as much as the method itself, so a
    fixed order would credit a method with its neighbour's effect."""
    order = list(keys)
    random.Random(seed * 1_000_003 + rep).shuffle(order)
    return order


def range_misses_median(reps: int) -> float:
    """Probability that a method's true median lies outside the min-max range of
    ``reps`` repetitions (any distribution, independent repetitions)."""
    return min(1.0, 2 * 0.5 ** reps)


def median_interval(values: List[float], level: float = 0.95) -> Tuple[float, float, float]:
    """A distribution-free interval for the median: (lo, hi, coverage), the k-th
    fastest and k-th slowest of the values, k the largest whose coverage is at
    least ``level`` (k = 1, min-max, when none is). Up to 8 repetitions that is
    min-max (98 % at 7); with more it drops the extremes, so that more
    repetitions narrow it where min-max would only widen."""
    v = sorted(values)
    k, coverage = interval_rank(len(v), level)
    return v[k - 1], v[len(v) - k], coverage


def interval_rank(n: int, level: float = 0.95) -> Tuple[int, float]:
    """``median_interval``'s k for ``n`` values, and the interval's coverage."""
    def coverage(k: int) -> float:
        return max(0.0, 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2 ** n)
    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return k, coverage(k)


def rank_verdict(samples: Dict[str, List[float]], tie: float = TIE) -> Dict[str, Any]:
    """Whether the repetitions support ordering methods by their median time
    (``samples``: {method: seconds per repetition}; lower is faster).

    The rule: a method ranks above another only when their intervals for the
    median (``median_interval``: min-max up to 8 repetitions) do not overlap.
    Two methods whose intervals overlap and whose medians are within ``tie`` of
    each other are a *tie* (as fast as each other: a result, not noise). Two
    whose intervals overlap while their medians are further apart are
    *unresolved*: the table's order between them is chance. Any unresolved pair
    makes the spread too wide to rank (``rankable`` False)."""
    stats = {k: (statistics.median(v), *median_interval(v)[:2]) for k, v in samples.items() if v}
    names = sorted(stats, key=lambda k: stats[k][0])
    unresolved: List[Dict[str, Any]] = []
    ties: List[List[str]] = []
    for i, a in enumerate(names):
        med_a, lo_a, hi_a = stats[a]
        for b in names[i + 1:]:
            med_b, lo_b, hi_b = stats[b]
            if hi_a < lo_b or hi_b < lo_a:
                continue                               # intervals apart: ordered
            gap = (med_b - med_a) / med_a if med_a > 0 else math.inf
            if gap > tie:
                unresolved.append({"faster": a, "slower": b, "gap": gap})
            else:
                ties.append([a, b])
    unresolved.sort(key=lambda u: -u["gap"])
    return {"rankable": not unresolved, "order": names, "unresolved": unresolved, "ties": ties,
            "intervals": {k: [lo, hi] for k, (_m, lo, hi) in stats.items()}}


def separated(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> bool:
    """Whether two summaries' intervals for the median do not overlap."""
    if not (a and b):
        return False
    lo_a, hi_a, _ = median_interval(a["values"])
    lo_b, hi_b, _ = median_interval(b["values"])
    return hi_a < lo_b or hi_b < lo_a


def run(size: int = 256 << 20, tensors: int = 16, dtypes: Optional[List[torch.dtype]] = None,
        reps: int = DEFAULT_REPS, drop_caches: bool = False, directory: Optional[str] = None,
        methods: Optional[List[str]] = None, keep: bool = False, log: Callable[[str], None] = lambda s: None,
        seed: int = 0) -> Dict[str, Any]:
    """Run the benchmark; return the results as JSON-able data. The methods run
    in a new order in every repetition (``rep_order(keys, rep, seed)``; the
    orders are in ``config["orders"]``), except the isolated ones (global side
    effects: DeepSpeed's process group), which run after the others."""
    dtypes = dtypes or [torch.float32]
    chosen = all_methods()
    if methods:
        unknown = set(methods) - set(METHOD_KEYS)
        if unknown:
            raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {', '.join(METHOD_KEYS)}")
        chosen = [m for m in chosen if m.key in methods or m.key in RAW_NAMES]
    own_dir = directory is None
    workdir = tempfile.mkdtemp(prefix=".lazyckpt-bench-", dir=os.getcwd() if own_dir else directory)
    log(f"generating the state: {size} bytes in {tensors} tensors ({', '.join(map(str, dtypes))})")
    state = make_state(size, tensors, dtypes)
    nbytes = state_bytes(state)
    drop = "no"
    if drop_caches:
        drop = "global" if drop_caches_global() else "fadvise"
    b = Bench(state, nbytes, workdir, lazyckpt.Options(), drop)
    rows: Dict[str, Dict[str, Any]] = {}
    times: Dict[str, Dict[str, List[float]]] = {}
    active: List[Method] = []
    orders: List[List[str]] = []
    for m in chosen:
        reason = m.unavailable()
        if reason is not None:
            rows[m.key] = {"key": m.key, "method": m.label, "status": "skipped", "reason": reason,
                           "install": m.install}
        else:
            rows[m.key] = {"key": m.key, "method": m.label, "status": "ok"}
            times[m.key] = {"blocking_s": [], "durable_s": [], "load_s": [], "capture_s": []}
            active.append(m)

    def fail(m: Method, exc: BaseException) -> None:
        msg = (str(exc).strip().splitlines() or [""])[0][:300]
        rows[m.key].update(status="failed", reason=f"{type(exc).__name__}: {msg}")
        log(f"{m.label}: failed: {type(exc).__name__}: {msg}")

    def one_rep(m: Method, rep: int) -> None:
        path = os.path.join(workdir, f"{m.key}-{rep}")
        b.paths[m.key] = path
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                st = m.save(b, path)
                target = b.paths[m.key]
                if b.drop == "global":
                    drop_caches_global()
                elif b.drop == "fadvise":
                    evict(target)
                t0 = time.perf_counter()
                loaded = m.load(b, target)
                touch(loaded)
                load_s = time.perf_counter() - t0
                del loaded
                gc.collect()        # lazyckpt.load's buffers are freed by the cycle collector only
        except Exception as exc:
            fail(m, exc)
            return
        finally:
            remove(b.paths.get(m.key, path))
        times[m.key]["load_s"].append(load_s)
        if st is None:                    # a read-only method (raw mmap)
            log(f"{m.label}: rep {rep + 1}: load {load_s:.4f} s")
            return
        times[m.key]["blocking_s"].append(st.blocking)
        times[m.key]["durable_s"].append(st.durable)
        if "capture_s" in st.extra:
            times[m.key]["capture_s"].append(st.extra["capture_s"])
        log(f"{m.label}: rep {rep + 1}: save call {st.blocking:.4f} s, durable {st.durable:.4f} s, "
            f"load {load_s:.4f} s")

    def setup(m: Method) -> bool:
        try:
            m.setup(b)
            return True
        except Exception as exc:
            fail(m, exc)
            return False

    def teardown(m: Method) -> None:
        try:
            m.teardown(b)
        except Exception as exc:
            log(f"{m.label}: teardown failed: {type(exc).__name__}: {exc}")

    try:
        shared = {m.key: m for m in active if not m.isolated and setup(m)}
        for rep in range(reps):
            order = rep_order(list(shared), rep, seed)    # interleaved and shuffled: drift and
            orders.append(order)                          # neighbours spread over every method
            for key in order:
                if rows[key]["status"] == "ok":
                    one_rep(shared[key], rep)
        for m in shared.values():
            teardown(m)
        for m in active:
            if m.isolated and setup(m):
                for rep in range(reps):
                    if rows[m.key]["status"] == "ok":
                        one_rep(m, rep)
                teardown(m)
            elif m.isolated:
                teardown(m)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)

    for m in chosen:
        row = rows[m.key]
        row["method"] = m.label
        if m.note:
            row["note"] = m.note
        if row["status"] != "ok":
            continue
        t = times[m.key]
        row["load_s"] = _summary(t["load_s"])
        row["load_gbps"] = nbytes / row["load_s"]["median"] / GB
        if t["durable_s"]:
            row["blocking_s"] = _summary(t["blocking_s"])
            row["durable_s"] = _summary(t["durable_s"])
            row["save_gbps"] = nbytes / row["durable_s"]["median"] / GB
            row["fsync_added"] = not m.self_durable
        if t["capture_s"]:
            row["capture_s"] = _summary(t["capture_s"])
    ceiling = ceiling_of(rows)
    raw = rows.get("raw")
    for row in rows.values():
        if row["status"] != "ok":
            continue
        for kind, field_ in (("write", "save_gbps"), ("read", "load_gbps")):
            gbps = row.get(field_)
            if gbps is None:
                continue
            if raw is not None and raw["status"] == "ok" and raw.get(field_):
                row[f"of_raw_{kind}"] = gbps / raw[field_]        # the raw O_DIRECT row alone
            if ceiling[kind]["gbps"]:
                row[f"of_best_{kind}"] = gbps / ceiling[kind]["gbps"]
    ok = [rows[m.key] for m in chosen if rows[m.key]["status"] == "ok"]
    ranking = {key: rank_verdict({r["key"]: r[key]["values"] for r in ok if r.get(key)})
               for key in ("durable_s", "load_s")}
    return {
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "lazyckpt": lazyckpt.__version__},
        "config": {"size_bytes": nbytes, "tensors": len(state), "dtypes": [str(d).removeprefix("torch.")
                                                                             for d in dtypes],
                   "reps": reps, "seed": seed, "orders": orders,
                   "isolated": [m.key for m in active if m.isolated],
                   "directory": os.path.dirname(workdir) if own_dir else directory,
                   "filesystem": filesystem_of(workdir if keep else os.path.dirname(workdir)),
                   "drop_caches": drop, "writer_threads": b.options.writer_threads,
                   "reader_threads": b.options.reader_threads},
        "ceiling": ceiling,
        "ranking": ranking,
        "rows": [rows[m.key] for m in chosen],
    }


def ceiling_of(rows: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The raw rows' median GB/s per method, and the best, for writes and reads."""
    out: Dict[str, Dict[str, Any]] = {}
    for kind, field_ in (("write", "save_gbps"), ("read", "load_gbps")):
        methods = {name: rows[key][field_] for key, name in RAW_NAMES.items()
                   if key in rows and rows[key]["status"] == "ok" and rows[key].get(field_)}
        entry: Dict[str, Any] = {"methods": methods, "best": None, "gbps": None}
        if methods:
            entry["best"], entry["gbps"] = best_raw(methods)
        out[kind] = entry
    return out


def _cell(summary: Optional[Dict[str, Any]]) -> str:
    if not summary:
        return "-"
    med, lo, hi = summary["median"], summary["min"], summary["max"]
    digits = 4 if med < 0.1 else 3
    text = f"{med:.{digits}f}"
    if len(summary["values"]) > 1:
        text += f" ({lo:.{digits}f}-{hi:.{digits}f})"
    return text


def ranking_lines(result: Dict[str, Any]) -> List[str]:
    """Whether the repetitions support the table's order, per column, in words."""
    cfg = result["config"]
    labels = {r["key"]: r["method"] for r in result["rows"]}
    rows = {r["key"]: r for r in result["rows"]}
    lines = []
    reps = cfg["reps"]
    if reps < DEFAULT_REPS:
        lines.append(f"note: with {reps} repetition{'s' if reps != 1 else ''} a method's median lies outside its "
                     f"min-max range with probability {range_misses_median(reps):.0%}; --reps {DEFAULT_REPS} "
                     f"(the default) makes that {range_misses_median(DEFAULT_REPS):.1%}")
    ranking = result.get("ranking") or {}
    for key, what in (("durable_s", "durable save"), ("load_s", "load")):
        verdict = ranking.get(key)
        if not verdict or len(verdict["order"]) < 2:
            continue
        if verdict["rankable"]:
            n = len(verdict["ties"])
            lines.append(f"{what}: ranked: every two methods' intervals are apart"
                         + (f", but for {n} tie{'s' if n != 1 else ''} (medians within {TIE:.0%})" if n else ""))
            continue
        worst = verdict["unresolved"][:2]
        def shown(name: str) -> str:
            med, (lo, hi) = rows[name][key]["median"], verdict["intervals"][name]
            digits = 4 if med < 0.1 else 3
            return f"{labels[name]} {med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"
        pairs = "; ".join(f"{shown(u['faster'])} vs {shown(u['slower'])}" for u in worst)
        n = len(verdict["unresolved"])
        lines.append(f"{what}: SPREAD TOO WIDE TO RANK: {n} pair{'s' if n != 1 else ''} ordered by medians more "
                     f"than {TIE:.0%} apart overlap, e.g. {pairs}; their order is chance (rerun alone on the "
                     f"machine, with more --reps)")
    if ranking:
        k, coverage = interval_rank(reps)
        nth = {2: "2nd", 3: "3rd"}.get(k, f"{k}th")
        interval = "min-max ranges" if k == 1 else f"intervals from the {nth} fastest to the {nth} slowest repetition"
        lines.append(f"(a method ranks above another only when their {interval} do not overlap: an interval that "
                     f"holds the true median with probability {coverage:.0%})")
    return lines


def format_table(result: Dict[str, Any]) -> str:
    cfg, mach = result["config"], result["machine"]
    lines = [f"machine: {mach['host']}, {mach['cpus']} cores, Linux {mach['kernel']}, Python {mach['python']}, "
             f"torch {mach['torch']}, lazyckpt {mach['lazyckpt']}",
             f"state: {cfg['size_bytes'] / GB:.3f} GB in {cfg['tensors']} tensors ({', '.join(cfg['dtypes'])}); "
             f"{cfg['reps']} repetitions, the methods in a new order in each (seed {cfg.get('seed', 0)}); "
             f"median (min-max); directory {cfg['directory']} ({cfg['filesystem']})",
             {"global": "page cache dropped before every load (/proc/sys/vm/drop_caches)",
              "fadvise": "page cache: checkpoint files evicted before every load (posix_fadvise DONTNEED)",
              "no": "page cache NOT dropped: buffered loaders may read from memory (--drop-caches)"}[cfg["drop_caches"]],
             ""]
    if cfg["size_bytes"] < 64 << 20:
        lines.insert(3, "note: a state this small measures per-call overheads more than throughput")
    headers = ["method", "save call s", "durable s", "GB/s", "of best write", "load s", "load GB/s",
               "of best read"]
    pct = lambda row, key: f"{row[key]:.0%}" if key in row else "-"  # noqa: E731
    body = []
    for row in result["rows"]:
        if row["status"] != "ok":
            continue
        body.append([row["method"] + (" *" if row.get("fsync_added") else ""), _cell(row.get("blocking_s")),
                     _cell(row.get("durable_s")),
                     f"{row['save_gbps']:.2f}" if row.get("save_gbps") else "-", pct(row, "of_best_write"),
                     _cell(row["load_s"]), f"{row['load_gbps']:.2f}", pct(row, "of_best_read")])
    if body:
        widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]
        lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
        lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for r in body:
            lines.append("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                           for i, (c, w) in enumerate(zip(r, widths))) + " |")
    if any(r.get("fsync_added") for r in result["rows"] if r["status"] == "ok"):
        lines.append("* does not fsync by itself: an fsync of what it wrote is included in 'durable s'")
    for row in result["rows"]:
        if row["status"] == "ok" and row.get("capture_s"):
            lines.append(f"{row['method']}: capture (bytes copied out of the live state) "
                         f"{_cell(row['capture_s'])} s")
    if cfg.get("isolated"):
        lines.append(f"run after the others, not shuffled with them (global side effects): "
                     f"{', '.join(r['method'] for r in result['rows'] if r['key'] in cfg['isolated'])}")
    lines.extend(summary_lines(result))
    lines.extend(ranking_lines(result))
    for row in result["rows"]:
        if row["status"] == "skipped":
            lines.append(f"skipped: {row['method']}: {row['reason']}"
                         + (f" -- {row['install']}" if row.get("install") else ""))
        elif row["status"] == "failed":
            lines.append(f"failed: {row['method']}: {row['reason']}")
    notes = [f"  {row['method']}: {row['note']}" for row in result["rows"] if row["status"] == "ok" and row.get("note")]
    if notes:
        lines.append("notes:")
        lines.extend(notes)
    return "\n".join(lines)


def summary_lines(result: Dict[str, Any]) -> List[str]:
    """The ceiling (each raw method, the best), lazyckpt against it, and against the fastest peer."""
    ceiling = result.get("ceiling") or {}
    write = (ceiling.get("write") or {}).get("methods") or {}
    read = (ceiling.get("read") or {}).get("methods") or {}
    lines = ceiling_lines(write, read)
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    for row in ok:
        if row["key"].startswith("lazyckpt"):
            lines.append(fraction_line(row["method"], row.get("save_gbps"), row.get("load_gbps"), write, read))
    peers = [r for r in ok if r["key"] not in RAW_NAMES and not r["key"].startswith("lazyckpt")]
    ours = [r for r in ok if r["key"].startswith("lazyckpt")]
    for what, field_, times in (("save (durable)", "save_gbps", "durable_s"), ("load", "load_gbps", "load_s")):
        candidates = [r for r in peers if r.get(field_)]
        if not candidates or not ours:
            continue
        best = max(candidates, key=lambda r: r[field_])

        def against(r: Dict[str, Any]) -> str:
            apart = separated(r.get(times), best.get(times))
            return (f"{r['method']} {r[field_] / best[field_]:.2f}x"
                    + ("" if apart else " (ranges overlap: not resolved)"))
        vs = ", ".join(against(r) for r in ours if r.get(field_))
        lines.append(f"fastest peer, {what}: {best['method']} {best[field_]:.2f} GB/s; {vs}")
    return lines


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        raise ImportError("drawing PNGs needs matplotlib: pip install 'lazyckpt[plot]'") from None


def check_plotting() -> None:
    _pyplot()


def plot(result: Dict[str, Any], png: str) -> None:
    plt = _pyplot()
    rows = [r for r in result["rows"] if r["status"] == "ok"]
    names = [r["method"] for r in rows][::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 2.0), sharey=True)
    y = range(len(rows))
    med = lambda r, key: r[key]["median"] if r.get(key) else 0.0  # noqa: E731  (raw mmap: no save)

    def whiskers(key: str) -> List[List[float]]:
        """Min-max around the median, as matplotlib's asymmetric xerr (zero where none)."""
        lo = [r[key]["median"] - r[key]["min"] if r.get(key) else 0.0 for r in rows][::-1]
        hi = [r[key]["max"] - r[key]["median"] if r.get(key) else 0.0 for r in rows][::-1]
        return [lo, hi]
    dur = [med(r, "durable_s") for r in rows][::-1]
    blk = [med(r, "blocking_s") for r in rows][::-1]
    load = [r["load_s"]["median"] for r in rows][::-1]
    ax1.barh(y, dur, color="#9ecae1", label="to durable")
    ax1.barh(y, blk, color="#08519c", height=0.45, label="save call (blocking)")
    ax1.set_yticks(list(y), names)
    ax1.set_xlabel("seconds")
    ax2.barh(y, load, color="#74c476")
    for ax, x, key in ((ax1, dur, "durable_s"), (ax2, load, "load_s")):
        ax.errorbar(x, list(y), xerr=whiskers(key), fmt="none", ecolor="#333333", capsize=3, lw=0.9, zorder=3,
                    label="min-max" if ax is ax1 else None)
    ax1.legend(loc="best", fontsize=8)
    ax2.set_xlabel("seconds")
    ranking = result.get("ranking") or {}
    for ax, key, what in ((ax1, "durable_s", "save"), (ax2, "load_s", "load")):
        verdict = ranking.get(key)
        if verdict and not verdict["rankable"]:
            ax.set_title(f"{what}: spread too wide to rank", color="#b30000")
        else:
            ax.set_title(what)
    for ax, key in ((ax1, "durable_s"), (ax2, "load_s")):
        raws = [r[key]["median"] for r in rows if r["key"] in RAW_NAMES and r.get(key)]
        if raws:
            ax.axvline(min(raws), color="k", lw=0.8, ls="--")
    cfg = result["config"]
    size = cfg["size_bytes"]
    size_text = f"{size / GB:.2f} GB" if size >= GB else f"{size / 1e6:.1f} MB"
    fig.suptitle(f"{size_text}, {cfg['tensors']} tensors ({', '.join(cfg['dtypes'])}), "
                 f"bars: median of {cfg['reps']}, whiskers: min-max; dashed: best raw method (ceiling)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- timeline


def run_timeline(size: int, iters: int = 12, every: int = 3, directory: Optional[str] = None,
                 log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Train a small MLP with AdamW, checkpointing every ``every`` iterations with a
    Checkpointer (``attach``-style barrier before each optimizer step, timed), and
    record when each phase ran (seconds from the first timed iteration)."""
    if iters < 2 or every < 1:
        raise ValueError("--iters must be at least 2 and --every at least 1")
    torch.manual_seed(0)
    params = max(1024, size // 12)            # weights + two AdamW moments, fp32
    width = 512 if params >= 8 * 512 * 512 else max(32, int((params / 4) ** 0.5))
    layers = max(1, min(64, round(params / (width * width))))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(128, width)
    for _ in range(2):                          # warm-up, untimed: first AdamW step allocates its state
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    own_dir = directory is None
    workdir = tempfile.mkdtemp(prefix=".lazyckpt-timeline-", dir=os.getcwd() if own_dir else directory)
    ckpt = lazyckpt.Checkpointer(workdir, keep=2)
    start = time.perf_counter()
    now = lambda: time.perf_counter() - start  # noqa: E731
    iterations: List[Dict[str, float]] = []
    waits: List[Tuple[float, float]] = []
    commits: Dict[int, Tuple[float, float]] = {}

    def barrier(_opt, _args, _kwargs):
        t = now()
        ckpt.wait_for_snapshot()
        waits.append((t, now()))
    hook = opt.register_step_pre_hook(barrier)
    commit = getattr(ckpt, "_commit", None)
    if commit is not None:
        # No public hook marks the commit; time it around the Checkpointer's commit step.
        def timed_commit(handle, *args, **kwargs):
            t = now()
            try:
                return commit(handle, *args, **kwargs)
            finally:
                commits[handle.step] = (t, now())
        ckpt._commit = timed_commit  # type: ignore[attr-defined]
    saves = []
    try:
        for it in range(iters):
            t0 = now()
            loss = model(x).square().mean()
            loss.backward()
            t1 = now()
            n_waits = len(waits)
            opt.step()
            t2 = now()
            opt.zero_grad(set_to_none=True)
            wait = waits[-1] if len(waits) > n_waits else (t1, t1)
            iterations.append({"iter": it, "fwd_bwd": [t0, t1], "optimizer": [t1, t2], "wait": list(wait)})
            if (it + 1) % every == 0 and it + 1 < iters:     # leave training after each to overlap with
                ts = now()
                handle = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "iter": it},
                                   step=it + 1)
                saves.append((ts, handle))
        t_end_loop = now()
        ckpt.wait()
    finally:
        hook.remove()
        ckpt.close()
        shutil.rmtree(workdir, ignore_errors=True)
    checkpoints = []
    for ts, h in saves:
        end = ts + h.flush_s                 # committed and durable
        c0, c1 = commits.get(h.step, (end, end))
        c0 = min(c0, end)
        checkpoints.append({"step": h.step, "save_call": [ts, ts + h.blocking_s],
                            "capture": [ts, ts + h.capture_s], "write": [ts + h.capture_s, c0],
                            # manifest, fsyncs, rename: until durable; then retention and `latest`
                            "commit": [c0, end], "tidy": [end, max(end, c1)], "durable_at": end,
                            "bytes": h.bytes, "blocking_s": h.blocking_s, "capture_s": h.capture_s,
                            "flush_s": h.flush_s})
    state_b = sum(p.numel() * 4 * 3 for p in model.parameters())
    log(f"timeline: {layers} x Linear({width}, {width}), {state_b / 1e6:.1f} MB of model+optimizer state, "
        f"{iters} iterations, a checkpoint every {every}")
    return {"model": {"layers": layers, "width": width, "state_bytes": state_b}, "iters": iters,
            "every": every, "iterations": iterations, "checkpoints": checkpoints, "loop_s": t_end_loop,
            "total_wait_s": sum(b - a for a, b in waits),
            "commit_timed": commit is not None}


def format_timeline(tl: Dict[str, Any]) -> str:
    lines = [f"timeline: {tl['iters']} iterations in {tl['loop_s']:.3f} s, a checkpoint every {tl['every']} "
             f"({tl['model']['state_bytes'] / 1e6:.1f} MB each); training waited {tl['total_wait_s'] * 1e3:.1f} ms "
             f"in total for captures"]
    for c in tl["checkpoints"]:
        lines.append(f"  step {c['step']}: save() {c['blocking_s'] * 1e3:.2f} ms, capture {c['capture_s'] * 1e3:.1f} ms, "
                     f"commit {(c['commit'][1] - c['commit'][0]) * 1e3:.1f} ms, durable "
                     f"{c['flush_s'] * 1e3:.1f} ms after save()")
    return "\n".join(lines)


def plot_timeline(tl: Dict[str, Any], png: str) -> None:
    plt = _pyplot()
    ms = 1e3
    lanes = ["forward/backward", "optimizer step", "wait for capture", "save() call", "capture", "write",
             "commit", "retention, latest"]
    colors = ["#6baed6", "#74c476", "#de2d26", "#252525", "#fd8d3c", "#9e9ac8", "#8c6d31", "#cccccc"]
    fig, ax = plt.subplots(figsize=(13, 4.6))

    def bars(lane: int, spans: List[List[float]]) -> None:
        spans = [(a * ms, max((b - a) * ms, 0.02)) for a, b in spans if b >= a]
        ax.broken_barh(spans, (len(lanes) - 1 - lane - 0.38, 0.76), facecolors=colors[lane])

    bars(0, [i["fwd_bwd"] for i in tl["iterations"]])
    bars(1, [i["optimizer"] for i in tl["iterations"]])
    bars(2, [i["wait"] for i in tl["iterations"] if i["wait"][1] > i["wait"][0]])
    for lane, key in ((3, "save_call"), (4, "capture"), (5, "write"), (6, "commit"), (7, "tidy")):
        bars(lane, [c[key] for c in tl["checkpoints"]])
    for c in tl["checkpoints"]:
        ax.axvline(c["save_call"][0] * ms, color="#bbbbbb", lw=0.6, zorder=0)
    ax.set_yticks(range(len(lanes)), lanes[::-1])
    ax.set_xlabel("ms since the first iteration")
    ax.set_title(f"lazyckpt: {tl['model']['state_bytes'] / 1e6:.1f} MB checkpoint every {tl['every']} iterations; "
                 f"training waited {tl['total_wait_s'] * ms:.1f} ms in total (capture overlaps forward/backward)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
