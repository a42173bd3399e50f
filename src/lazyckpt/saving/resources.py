"""The resources a save engine reuses across saves: the host cache, the writer
and reader thread pools and the serializer thread."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any, Callable, Iterable, Optional

from lazyckpt.keptpools import KeptPool
from lazyckpt.knobs import Options
from .hostcache import HostCache


class Resources:
    """``kept=True``: the pools are :class:`~lazyckpt.keptpools.KeptPool` s, whose
    threads end after a second idle and start again at the next task, for the
    resources the functional API keeps for the whole process (a Checkpointer's
    are shut down by its ``close()``)."""

    def __init__(self, options: Options, kept: bool = False):
        self.options = options
        self.cache: Optional[HostCache] = None
        #: A cache size fixed by the owner (overrides the automatic sizing).
        self.fixed_cache_bytes: Optional[int] = None
        self._lock = threading.Lock()
        #: Held by whoever runs a job on the caller's thread (functional save, DCP's
        #: write_data): one file job at a time per cache.
        self.save_lock = threading.Lock()
        pool: Callable[[int, str], cf.Executor] = (
            KeptPool if kept else lambda size, name: cf.ThreadPoolExecutor(size, thread_name_prefix=name))
        self.writers = pool(options.writer_threads, "lazyckpt-writer")
        self.readers = pool(options.reader_threads, "lazyckpt-reader")
        self.serializer = pool(1, "lazyckpt-serializer")

    def cache_for(self, sources: Iterable[Any]) -> HostCache:
        """The host cache: allocated on first use (``fixed_cache_bytes``, else sized
        by ``options``, or by the first state's bytes when automatic), then reused."""
        with self._lock:
            if self.cache is None:
                cache_bytes = self.fixed_cache_bytes
                if cache_bytes is None:
                    state_bytes = sum(s.length or 0 for s in sources)
                    cache_bytes = self.options.cache_bytes_for(state_bytes)
                self.cache = HostCache(cache_bytes, self.options.chunk_bytes_for(cache_bytes))
            return self.cache

    def close(self, wait: bool = True) -> None:
        """Stop the pools and free the cache. ``wait=False`` from a finalizer, which
        may run on one of the pools' own threads."""
        for pool in (self.writers, self.readers, self.serializer):
            pool.shutdown(wait=wait, cancel_futures=True)
        with self._lock:
            if self.cache is not None:
                self.cache.close()
                self.cache = None
