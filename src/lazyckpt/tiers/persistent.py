"""The persistent tier: a background drain of each committed local step into
an object-store Checkpointer directory (:class:`PersistentTier`), the newest
step winning when the drain falls behind, and the upload of one local file
as a multipart object. See docs/STORAGE.md."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from lazyckpt.distributed import agree
from lazyckpt.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, rank_filename
from lazyckpt.history import Event
from lazyckpt.knobs import Options
from lazyckpt.storage.fileio import anonymous_buffer, open_for_read, pread_into
from lazyckpt.storage.layout import StepDir
from lazyckpt.storage.s3 import ObjectOutput
from lazyckpt.storage.s3layout import LEASE_PREFIX, ObjectCheckpointDir, ObjectLease, store_key

log = logging.getLogger("lazyckpt")


class RateLimit:
    """At most ``rate`` bytes/s on average (0: no limit), shared by the upload threads."""

    def __init__(self, rate: float):
        self.rate = rate
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, nbytes: int) -> None:
        """Called before sending ``nbytes``: returns when they fit the budget
        (the first send waits for its own share too, so no burst exceeds it)."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next = max(now, self._next) + nbytes / self.rate
            wake = self._next
        time.sleep(max(0.0, wake - now))


def upload_file(path: str, url: str, options: Options, part_bytes: int, pool: cf.ThreadPoolExecutor,
                limit: Optional[RateLimit] = None, stop: Optional[threading.Event] = None) -> int:
    """Upload a local file as one object, ``part_bytes`` per part, parts read and
    sent in parallel on ``pool`` (memory: one part buffer per thread); returns
    the bytes uploaded. A failure aborts the upload: no object appears."""
    size = os.path.getsize(path)
    out = ObjectOutput(url, options.storage_options, part_bytes)
    fd, _ = open_for_read(path, False)
    slots = threading.Semaphore(max(1, options.writer_threads))

    def send(offset: int) -> None:
        try:
            if stop is not None and stop.is_set():
                raise CheckpointWriteError(f"{url}: upload cancelled", path=url)
            n = min(out.part_bytes, size - offset)
            buf = anonymous_buffer(n)
            view = memoryview(buf)[:n]
            if pread_into(fd, view, offset, path) != n:
                raise CorruptCheckpointError(f"{path}: changed size while being uploaded", path=path)
            (limit or RateLimit(0)).take(n)
            out.pwrite_all(view, offset)
            view.release()
            buf.close()
        finally:
            slots.release()
    try:
        futures = []
        for offset in range(0, size, out.part_bytes):
            slots.acquire()
            futures.append(pool.submit(send, offset))
        for f in futures:
            f.result()
        out.finish(size)
        return size
    finally:
        out.close()
        os.close(fd)


class _Drain:
    """One committed local step waiting for the persistent tier."""

    def __init__(self, handle: Any, step: int, call: int, save_id: str, local_path: str, rank: int,
                 hold: contextlib.ExitStack):
        self.handle, self.step, self.call, self.save_id = handle, step, call, save_id
        self.local_path, self.rank, self.hold = local_path, rank, hold


class PersistentTier:
    """Drains committed steps of a local Checkpointer directory to an object
    store, on one background thread, never blocking the training.

    Queue: every committed step is enqueued (holding a read lock on the
    local step, so local retention keeps it until uploaded). When the
    thread is free it takes the *newest* waiting step; older waiting ones
    are skipped (their handles say "superseded by step N"): a newer state
    is on its way, and uploading every step of a fast save schedule would
    let the backlog grow without bound. With several ranks the coordinator
    chooses the step and publishes it through the store, so every rank
    uploads the same one; each rank uploads its own file and the coordinator
    writes the manifest only after every rank's upload completed (two-phase,
    as the local commit)."""

    def __init__(self, url: str, options: Options, dist: Any, keep_last: Optional[int]):
        self.dir = ObjectCheckpointDir(url, options)
        self.url = self.dir.url
        self.options = options
        self.dist = dist
        self.keep_last = keep_last
        self.dir.store.check()          # wrong credentials, a missing bucket: one clear error, now
        self._cond = threading.Condition()
        self._pending: "collections.deque[_Drain]" = collections.deque()
        self._busy = False
        self._thread: Optional[threading.Thread] = None
        self._round = 0
        self._errors: List[Tuple[Any, CheckpointError]] = []      # (the failed step's handle, error)
        self._closed = False
        self._stop = threading.Event()
        self._limit = RateLimit(options.persist_bandwidth)
        self._pool = cf.ThreadPoolExecutor(max(1, options.writer_threads), thread_name_prefix="lazyckpt-persist")
        #: Commit events not written yet (the store failed): written before the next upload.
        self._unpublished: List[Event] = []
        if dist.coordinator:
            self.dir.clean_leftovers()

    def enqueue(self, handle: Any, step: int, call: int, save_id: str, local_path: str,
                seq: Optional[int] = None) -> None:
        hold = contextlib.ExitStack()
        hold.enter_context(StepDir(local_path, step).reading())
        handle._persist_pending()
        if seq is not None and self.dist.coordinator:
            # The commit event goes up now, on the commit's thread, not after the
            # upload: a rollback supersedes the abandoned steps here when it is
            # committed (a reader of this tier alone never returns them).
            self._publish_event(Event(step, save_id, seq))
        with self._cond:
            self._pending.append(_Drain(handle, step, call, save_id, local_path, self.dist.rank, hold))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lazyckpt-drain", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _publish_event(self, event: Event) -> None:
        """PUT a commit event; one that fails is retried by the drain before any upload."""
        try:
            self.dir.put_event(event)
        except CheckpointError as exc:
            log.warning("lazyckpt: %s: the commit event of step %d could not be written yet (%s); the drain "
                        "retries it", self.url, event.step, exc)
            with self._cond:
                self._unpublished.append(event)

    def _flush_events(self) -> None:
        with self._cond:
            events, self._unpublished = self._unpublished, []
        try:
            for i, event in enumerate(events):
                self.dir.put_event(event)
        except BaseException:
            with self._cond:
                self._unpublished = events[i:] + self._unpublished
            raise

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._pending:
                    self._thread = None
                    self._cond.notify_all()
                    return
                self._busy = True
            try:
                self._one_round()
            except BaseException as exc:        # recorded, raised at wait(); never kills training
                log.error("lazyckpt: %s: persisting failed: %s", self.url, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take(self, call: int) -> _Drain:
        """Remove and return the waiting step of ``call``; older waiting steps
        are superseded by it (skipped), newer ones stay queued."""
        with self._cond:
            chosen = next(d for d in self._pending if d.call == call)
            for d in self._pending:
                if d.call < call:
                    d.hold.close()
                    d.handle._persist_end(superseded_by=chosen.handle)
            self._pending = collections.deque(d for d in self._pending if d.call > call)
            return chosen

    def _one_round(self) -> None:
        d = self.dist
        key = f"persist/{self._round}"
        self._round += 1
        if d.distributed:
            if d.coordinator:
                with self._cond:
                    target = max(self._pending, key=lambda x: x.call)
                d.publish(f"{key}/target", {"call": target.call, "step": target.step})
                call = target.call
            else:
                call = d.wait_for([f"{key}/target"], "the coordinator's choice of step to persist",
                                  "persist")[f"{key}/target"]["call"]
            deadline = time.monotonic() + d.timeout_s
            while True:          # this rank's commit of that step may not have reached its queue yet
                with self._cond:
                    if any(x.call == call for x in self._pending):
                        break
                    if time.monotonic() > deadline:
                        raise CheckpointError(f"{self.url}: step of call {call} never reached this rank's "
                                              f"drain queue")
                    self._cond.wait(0.1)
        else:
            with self._cond:
                call = max(x.call for x in self._pending)
        item = self._take(call)
        lease = None
        try:
            if d.coordinator:
                self._flush_events()        # never a manifest here before its commit event
            save_url = self.dir.save_url(item.step, item.save_id)
            lease = ObjectLease(self.dir.store, f"{store_key(save_url)}/{LEASE_PREFIX}{d.rank:05d}",
                                self.options.lease_heartbeat_s)
            local = os.path.join(item.local_path, rank_filename(d.rank))
            remote = f"{self.dir.save_url(item.step, item.save_id)}/{rank_filename(d.rank)}"
            report: Dict[str, Any] = {"ok": True, "step": item.step}
            try:
                nbytes = upload_file(local, remote, self.options, max(self.options.chunk_bytes, 8 << 20),
                                     self._pool, self._limit, self._stop)
            except BaseException as exc:
                if not d.distributed:
                    raise
                report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                nbytes = 0

            def commit(_done: Dict[int, Dict[str, Any]]) -> None:
                with open(os.path.join(item.local_path, MANIFEST), "rb") as f:
                    raw = f.read()
                self.dir.commit(item.step, item.save_id, raw)
            if d.distributed:
                agree(d, key, report, item.step, commit)
                if not report["ok"]:
                    raise CheckpointError(f"step {item.step}: {report['error']}")
            else:
                commit({0: report})
            if d.coordinator:
                try:
                    self.dir.apply_retention(self.keep_last)
                    self.dir.write_latest(item.step)
                except CheckpointError as exc:
                    log.warning("lazyckpt: %s: step %d persisted, tidying up failed: %s", self.url, item.step, exc)
            item.handle._persist_end(url=remote)
            log.info("lazyckpt: step %d persisted to %s (%.1f MB)", item.step, self.url, nbytes / 1e6)
        except BaseException as exc:
            error = exc
            if not isinstance(exc, CheckpointWriteError):
                error = CheckpointWriteError(f"{self.url}: persisting step {item.step} failed: "
                                             f"{type(exc).__name__}: {exc}",
                                             path=self.url, step=item.step)
                error.__cause__ = exc
            item.handle._persist_end(error=error)
            with self._cond:
                self._errors.append((item.handle, error))
            raise error
        finally:
            item.hold.close()
            if lease is not None:
                lease.release()

    # ---------------------------------------------------------------- waiting

    def idle(self) -> bool:
        with self._cond:
            return not self._pending and not self._busy

    def wait(self, timeout: Optional[float] = None, raise_errors: bool = True) -> None:
        """Until every committed step is persisted (or skipped); raise the first
        persist failure not raised yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CheckpointError(f"{self.url}: steps still being persisted after {timeout} s")
                self._cond.wait(left if left is not None else 0.5)
            # Raised once: not one its handle's wait(persisted=True) already raised.
            errors = [(h, e) for h, e in self._errors if not h.persist_reported]
            self._errors = []
        if raise_errors and errors:
            handle, error = errors[0]
            handle.persist_reported = True
            raise error

    def close(self, cancel: bool = False) -> None:
        if cancel:
            self._stop.set()
            with self._cond:
                for d in self._pending:
                    d.hold.close()
                    d.handle._persist_end(error=CheckpointWriteError(f"{self.url}: not persisted: cancelled",
                                                                     step=d.step))
                self._pending.clear()
        try:
            self.wait(raise_errors=not cancel)
        finally:
            self._pool.shutdown(wait=True)
