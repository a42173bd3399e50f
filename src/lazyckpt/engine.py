"""The resources a checkpointer reuses across saves: the host cache, the
writer and reader thread pools and the serializer thread."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Optional

from .hostcache import HostCache
from .knobs import Options


class Resources:
    def __init__(self, options: Options):
        self.options = options
        self._cache: Optional[HostCache] = None
        self._lock = threading.Lock()
        self.save_lock = threading.Lock()
        self.writers = cf.ThreadPoolExecutor(options.writer_threads, thread_name_prefix="lazyckpt-writer")
        self.readers = cf.ThreadPoolExecutor(options.reader_threads, thread_name_prefix="lazyckpt-reader")
        self.serializer = cf.ThreadPoolExecutor(1, thread_name_prefix="lazyckpt-serializer")

    @property
    def cache(self) -> HostCache:
        """Allocated on first use, then reused for every save."""
        with self._lock:
            if self._cache is None:
                self._cache = HostCache(self.options.host_cache_bytes, self.options.effective_chunk_bytes)
            return self._cache

    def close(self) -> None:
        for pool in (self.writers, self.readers, self.serializer):
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None
