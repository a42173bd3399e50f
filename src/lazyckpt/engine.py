"""The resources a checkpointer reuses across saves: the host cache, the
writer and reader thread pools and the serializer thread."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Iterable, Optional

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

    def cache_for(self, sources: Iterable[Any]) -> HostCache:
        """The host cache: allocated on first use (sized by ``options``, or by the
        first state's bytes when automatic), then reused for every save."""
        with self._lock:
            if self._cache is None:
                state_bytes = sum(s.length or 0 for s in sources)
                size = self.options.cache_bytes_for(state_bytes)
                self._cache = HostCache(size, self.options.chunk_bytes_for(size))
            return self._cache

    def close(self) -> None:
        for pool in (self.writers, self.readers, self.serializer):
            pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            if self._cache is not None:
                self._cache.close()
                self._cache = None
