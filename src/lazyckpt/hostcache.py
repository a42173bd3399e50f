"""The host cache: one bounded, page-aligned buffer, allocated once and reused.

Data travels from the state to disk through fixed-size chunks of this buffer.
A chunk is taken by the capture stage, filled, handed to a writer and given
back once written; when none is free, capture waits (back-pressure). Extra
host memory is therefore the cache size plus a small constant, whatever the
state's size. When CUDA is present the buffer is pinned once with
cudaHostRegister, so device-to-host copies run asynchronously at full speed.
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger(__name__)


class HostCache:
    def __init__(self, nbytes: int, chunk_bytes: int):
        if chunk_bytes % 4096:
            raise ValueError("chunk_bytes must be a multiple of 4096")
        self.chunk_bytes = chunk_bytes
        self.num_chunks = max(2, nbytes // chunk_bytes)
        self.nbytes = self.num_chunks * chunk_bytes
        # An anonymous mapping is page-aligned, as O_DIRECT needs.
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if torch.cuda.is_available():
            rc = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            self.pinned = int(rc) == 0
            if not self.pinned:
                log.warning("lazyckpt: cudaHostRegister failed (%s); device copies will be slower", rc)
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
        return self._view[start:start + self.chunk_bytes]

    def free_chunks(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        del self.tensor
        self._view.release()
        try:
            self._map.close()
        except BufferError:
            # A view is still referenced somewhere; the mapping is freed with it.
            pass
