"""Host memory that checkpoints travel through: the host cache and the DCP
staging arenas, both page-aligned, allocated once and reused, pinned when
CUDA is present.

The host cache is one bounded buffer cut into fixed-size chunks. A chunk is
taken by the capture stage, filled, handed to a writer and given back once
written; when none is free, capture waits (back-pressure). Extra host memory
is therefore the cache size plus a small constant, whatever the state's size.

Pinning is portable: the buffer is an anonymous mapping registered with
``cudaHostRegister`` where torch exposes the CUDA runtime; otherwise (other
builds, ROCm) it is allocated by torch's pinned host allocator
(``pin_memory=True``) and used if page-aligned; otherwise it stays pageable
(slower device copies, with a warning). Pinned memory is never allocated per
checkpoint.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from typing import Callable, List, Optional

import torch

from lazyckpt.errors import CheckpointWriteError
from lazyckpt.storage.fileio import anonymous_buffer

log = logging.getLogger(__name__)

PAGE = 4096


class PinnedBuffer:
    """``nbytes`` of page-aligned host memory as a uint8 tensor, a numpy array
    and a memoryview, pinned when CUDA is present."""

    def __init__(self, nbytes: int, pin: Optional[bool] = None):
        self.nbytes = nbytes
        self.pinned = False
        self._registered = False
        self._map: Optional[mmap.mmap] = None
        pin = torch.cuda.is_available() if pin is None else pin
        tensor = None
        if pin:
            tensor = self._register(nbytes) or self._allocate_pinned(nbytes)
            if tensor is None:
                log.warning("lazyckpt: could not pin %d bytes of host memory; device copies will be "
                            "slower", nbytes)
        if tensor is None:
            # An anonymous mapping is page-aligned, as O_DIRECT needs.
            self._map = anonymous_buffer(nbytes, huge_pages=True)
            tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor = tensor
        self.array = tensor.numpy()
        self.view = memoryview(self.array)

    def _register(self, nbytes: int) -> Optional[torch.Tensor]:
        cudart = getattr(torch.cuda, "cudart", None)
        try:
            runtime = cudart() if cudart is not None else None
            if runtime is None or not hasattr(runtime, "cudaHostRegister"):
                return None
            self._map = anonymous_buffer(nbytes, huge_pages=True)
            tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            rc = runtime.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
            if int(getattr(rc, "value", rc)) != 0:
                log.info("lazyckpt: cudaHostRegister returned %s; trying torch's pinned allocator", rc)
                del tensor
                self._map.close()
                self._map = None
                return None
        except Exception as exc:        # a build without the runtime bindings
            log.info("lazyckpt: cudaHostRegister unavailable (%s); trying torch's pinned allocator", exc)
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:
                    pass
                self._map = None
            return None
        self.pinned = self._registered = True
        return tensor

    def _allocate_pinned(self, nbytes: int) -> Optional[torch.Tensor]:
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except Exception as exc:
            log.info("lazyckpt: pinned allocation failed: %s", exc)
            return None
        if tensor.data_ptr() % PAGE:
            return None                 # O_DIRECT needs page alignment
        self.pinned = True
        return tensor

    def close(self) -> None:
        """Release the memory. The caller guarantees no copy into it is in flight."""
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False
        self.view.release()
        del self.array, self.tensor
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass                    # a view is still referenced; freed with it


class HostCache:
    def __init__(self, nbytes: int, chunk_bytes: int):
        if chunk_bytes % PAGE:
            raise ValueError("chunk_bytes must be a multiple of 4096")
        self.chunk_bytes = chunk_bytes
        self.num_chunks = max(2, nbytes // chunk_bytes)
        self.nbytes = self.num_chunks * chunk_bytes
        self._buffer = PinnedBuffer(self.nbytes)
        self.tensor = self._buffer.tensor
        self.pinned = self._buffer.pinned
        self._free = list(range(self.num_chunks - 1, -1, -1))
        self._cond = threading.Condition()
        self.closed = False

    def acquire(self, should_stop: Callable[[], bool], poll_s: float = 0.1) -> Optional[int]:
        """Take a free chunk, waiting for one; None if ``should_stop()`` turns true."""
        with self._cond:
            while not self._free:
                if should_stop():
                    return None
                self._cond.wait(poll_s)
            return self._free.pop()

    def release(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify()

    def chunk_tensor(self, index: int) -> torch.Tensor:
        start = index * self.chunk_bytes
        return self.tensor[start:start + self.chunk_bytes]

    def chunk_memory(self, index: int) -> memoryview:
        start = index * self.chunk_bytes
        return self._buffer.view[start:start + self.chunk_bytes]

    def free_chunks(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self.tensor
        self._buffer.close()


class Arena:
    """One staging buffer of :class:`StagingArenas`."""

    def __init__(self, nbytes: int):
        self.buffer = PinnedBuffer(nbytes)
        self.nbytes = nbytes
        self.in_use = False

    @property
    def start(self) -> int:
        return self.buffer.tensor.data_ptr()

    def holds(self, pointer: int) -> bool:
        return self.start <= pointer < self.start + self.nbytes


class StagingArenas:
    """Reused staging buffers under one byte budget (DCP's ``stage()`` needs a
    full copy of the state before its write starts). An arena is given back
    only once the write that reads it is over; ``acquire`` waits for one when
    the budget is spent."""

    def __init__(self, budget: int):
        self.budget = budget
        self._arenas: List[Arena] = []
        self._cond = threading.Condition()
        self.peak_bytes = 0

    @property
    def allocated(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    def acquire(self, nbytes: int, timeout_s: float) -> Arena:
        nbytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
        if nbytes > self.budget:
            raise CheckpointWriteError(f"staging needs {nbytes} bytes of host memory, over the budget of "
                                       f"{self.budget} (host_cache_bytes); raise host_cache_bytes or save "
                                       f"synchronously")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                free = sorted((a for a in self._arenas if not a.in_use and a.nbytes >= nbytes),
                              key=lambda a: a.nbytes)
                if free:
                    arena = free[0]
                    break
                # Make room by dropping idle arenas that are too small, then allocate.
                for idle in [a for a in self._arenas if not a.in_use]:
                    if self.allocated + nbytes <= self.budget:
                        break
                    self._arenas.remove(idle)
                    idle.buffer.close()
                if self.allocated + nbytes <= self.budget:
                    arena = Arena(nbytes)
                    self._arenas.append(arena)
                    self.peak_bytes = max(self.peak_bytes, self.allocated)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointWriteError(f"no staging memory became free within {timeout_s:.0f} s "
                                               f"(a previous save's write never finished)")
                self._cond.wait(min(left, 1.0))
            arena.in_use = True
            return arena

    def owner_of(self, pointer: int) -> Optional[Arena]:
        with self._cond:
            for arena in self._arenas:
                if arena.in_use and arena.holds(pointer):
                    return arena
        return None

    def release(self, arena: Arena) -> None:
        with self._cond:
            arena.in_use = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            for arena in self._arenas:
                arena.buffer.close()
            self._arenas.clear()
