"""The persistent tier: a background drain of each committed local step into
a Checkpointer directory on another store (:class:`PersistentTier`, on the
newest-wins queue of :mod:`lazyckpt.tiers.drain`), and the upload of one
local file in parts. Which store, and how a step becomes visible there, is
the store's (its ``Directory.pending``): nothing here is S3's. See
docs/STORAGE.md."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import threading
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Union

from lazyckpt.distributed import agree
from lazyckpt.errors import CheckpointError, CheckpointReadError, CheckpointWriteError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, rank_filename
from lazyckpt.lineage import Event, line, max_seq
from lazyckpt.knobs import Options
from lazyckpt.retention import Policy, as_policy, keeps_superseded
from lazyckpt.saving.tierstate import PERSISTENT
from lazyckpt.storage.fileio import anonymous_buffer, open_for_read, pread_into
from lazyckpt.storage.base import Store
from .drain import NewestWinsDrain, RateLimit, Waiting

log = logging.getLogger("lazyckpt")


def upload_file(path: str, store: Store, url: str, options: Options, part_bytes: int, pool: cf.ThreadPoolExecutor,
                limit: Optional[RateLimit] = None, stop: Optional[threading.Event] = None) -> int:
    """Upload a local file to ``url`` (any store's output), ``part_bytes`` per part
    (at least the store's smallest part), parts read and sent in parallel on
    ``pool`` (memory: one part buffer per thread); returns the bytes
    uploaded. A failure aborts the upload: no object appears."""
    fd, _ = open_for_read(path, False)
    size = os.fstat(fd).st_size             # of the file opened (a path may be replaced meanwhile)
    try:
        out = store.open_output(url, options, part_bytes)
    except BaseException:
        os.close(fd)
        raise
    slots = threading.Semaphore(max(1, options.writer_threads))

    def send(offset: int) -> None:
        try:
            if stop is not None and stop.is_set():
                raise CheckpointWriteError(f"{url}: upload cancelled", path=url)
            n = min(part_bytes, size - offset)
            buf = anonymous_buffer(n, huge_pages=True)
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
        for offset in range(0, size, part_bytes):
            slots.acquire()
            futures.append(pool.submit(send, offset))
        for f in futures:
            f.result()
        out.finish(size)
        return size
    finally:
        out.close()
        os.close(fd)


class PersistentTier(NewestWinsDrain):
    """Drains committed steps of a local Checkpointer directory to an object
    store, on one background thread, never blocking the training.

    The queue is a :class:`~lazyckpt.tiers.drain.NewestWinsDrain` (the newest
    waiting step is uploaded, older waiting ones are superseded: their handles
    say "superseded by step N"). Each rank uploads its own file of the chosen
    step and the coordinator writes the manifest only after every rank's
    upload completed (two-phase, as the local commit)."""

    tier = PERSISTENT
    thread_name = "lazyckpt-drain"
    round_prefix = "persist"
    choice_what = "the coordinator's choice of step to persist"
    choice_of = "persist"

    def __init__(self, store: Store, url: str, options: Options, dist: Any, keep: Union[None, int, Policy]):
        """``store``: ``url``'s, looked up by the Checkpointer that was given it;
        ``keep``: this tier's own retention policy (None: keep every step)."""
        if not store.is_remote:
            # Its saves need no directory created before the ranks upload (and the
            # Checkpointer refuses a local persist_to before it gets here).
            raise ValueError(f"persist_to must be on a remote store, got {url!r}")
        self.url = store.normalize(url)
        self.store = store
        try:
            store.check(self.url, options)  # wrong credentials, a missing bucket: one clear error, now
        except CheckpointReadError as exc:
            # Down or overloaded (the request was retried): the local tier still opens, loads and
            # saves; the drain publishes and uploads once the store answers (the outbox).
            log.warning("lazyckpt: %s cannot be reached now (%s); saves go on locally and reach it later",
                        self.url, exc)
        self.dir = store.checkpoint_dir(self.url, options)
        super().__init__(dist, self.url)
        self.options = options
        self.keep = as_policy(keep, "Persist(keep)")
        self._stop = threading.Event()
        self._limit = RateLimit(options.persist_bandwidth)
        self._pool = cf.ThreadPoolExecutor(max(1, options.writer_threads), thread_name_prefix="lazyckpt-persist")
        #: The outbox (docs/RELIABILITY.md "The persistent tier's outbox"): commit events
        #: known not to be on the store yet, in seq order, published before anything newer.
        #: Its durable copy is the local record: every local event with a seq above the
        #: store's largest is unpublished (:meth:`reconcile` rebuilds this list from it).
        self._outbox: List[Event] = []
        #: The largest seq on the store (None: not known yet, the next publish lists it first).
        self._published: Optional[int] = None
        #: One publisher at a time (the commit's thread, the drain): events go up in seq order.
        self._publishing = threading.Lock()
        #: The local events (the Checkpointer's Line.local_events), the outbox's durable copy.
        self.local_events: Callable[[], List[Event]] = lambda: []
        #: Whether a save was superseded locally (a rollback committed since): its upload is dropped.
        self.abandoned: Callable[[int, str], bool] = lambda step, save_id: False
        #: The local events above a seq from the local record alone, or None when it
        #: may not hold them all (the Checkpointer's Line.local_events_above).
        self.local_events_above: Callable[[int], Optional[List[Event]]] = lambda seq: None

    def enqueue(self, handle: Any, step: int, call: int, save_id: str, local_path: str,
                seq: Optional[int] = None, *, reading: ContextManager[Any]) -> None:
        """Queue committed ``step`` (at ``local_path``); ``reading`` (the local
        directory's hold on it, not entered) keeps retention off it until it is
        uploaded or superseded."""
        hold = contextlib.ExitStack()
        hold.enter_context(reading)
        if seq is not None and self.world.coordinator:
            # The commit event goes up now, on the commit's thread, not after the
            # upload: a rollback supersedes the abandoned steps here when it is
            # committed (a reader of this tier alone never returns them).
            self._publish_event(Event(step, save_id, seq))
        self._queue(handle, step, call, local_path, hold, save_id)

    # ---------------------------------------------------------------- the outbox

    def _add(self, events: Iterable[Event], force: bool = False) -> None:
        """Into the outbox (under ``_cond``): once each, in seq order; without ``force``
        never one at or below the store's largest seq (published already)."""
        have = {(e.step, e.save_id) for e in self._outbox}
        for e in events:
            if e.seq is None or (not force and self._published is not None and e.seq <= self._published):
                continue
            if (e.step, e.save_id) not in have:
                have.add((e.step, e.save_id))
                self._outbox.append(e)
        self._outbox.sort(key=lambda e: e.seq)

    def reconcile(self, listing: Optional[Any] = None) -> None:
        """Rebuild the outbox from the local record: every local event above the
        store's largest seq (``listing``: the store's ``(steps, events)`` if the
        caller has just listed it; else one listing, raising if the store cannot
        be listed). On an empty store only the live line's events go up: the
        abandoned ones would supersede nothing there."""
        if listing is None and not self._outbox:
            # The store's index and the local record, when they tell: no listing.
            top = self.dir.published_seq()
            missing = self.local_events_above(top) if top else None
            if missing is not None:
                with self._cond:
                    self._published = top
                    self._add(missing)
                return
        steps, events = listing if listing is not None else self.dir.listing()
        top = max_seq(events)
        local = self.local_events()
        missing = [e for e in local if e.seq is not None and e.seq > top]
        if not steps and not events:
            live = set(line(local))
            missing = [e for e in missing if (e.step, e.save_id) in live]
        with self._cond:
            self._published = top
            on_store = {(e.step, e.save_id) for e in events}
            self._outbox = [e for e in self._outbox if (e.step, e.save_id) not in on_store]
            self._add(missing)

    def open_outbox(self, listing: Optional[Any] = None) -> None:
        """At open (coordinator): publish what the last run committed and the store
        never learned, in seq order, before anything newer. A store that cannot be
        listed or written now: the drain does it before its first upload."""
        try:
            with self._publishing:
                self.reconcile(listing)
            self._flush_events()
        except CheckpointError as exc:
            log.warning("lazyckpt: %s: the commit events not on it yet cannot be published now (%s); the "
                        "drain publishes them before its next upload", self.url, exc)

    def _publish_event(self, event: Event) -> None:
        """Publish a commit event, after every older one still in the outbox; one
        that fails stays there, and the drain retries before any upload."""
        with self._cond:
            self._add([event], force=True)     # a commit's own event always goes up (idempotent)
        try:
            self._flush_events()
        except CheckpointError as exc:
            log.warning("lazyckpt: %s: the commit event of step %d could not be written yet (%s); the drain "
                        "retries it", self.url, event.step, exc)

    def _flush_events(self) -> None:
        """Publish the outbox in seq order; raise at the first failure (the rest stays).
        Lists the store first only when its largest seq is not known (the open could
        not list it): never a listing per commit."""
        with self._publishing:
            if self._published is None:
                self.reconcile()
            while True:
                with self._cond:
                    if not self._outbox:
                        return
                    event = self._outbox[0]
                self.dir.record_event(event)
                with self._cond:
                    if self._outbox and self._outbox[0] == event:
                        self._outbox.pop(0)
                    self._published = max(self._published or 0, event.seq)

    # ---------------------------------------------------------------- one step

    def _send(self, item: Waiting, key: str) -> None:
        d = self.world
        lease = pending = None
        try:
            if d.coordinator:
                # The store's leftover scan: one listing, which grows with the steps it keeps,
                # on a thread from the first upload on, never in the way of opening and a
                # restore (a replaced node's open + load at 10,000 steps waited
                # for it, 4.1 s); close() joins it.
                self.dir.start_tidy()
                self._flush_events()        # never a manifest here before its commit event
            # The local step's own save id names the copy: one line of history over both tiers.
            pending = self.dir.pending(item.step, item.save_id, item.save_id)
            lease = pending.hold(d.rank, self.options.lease_heartbeat_s)
            local = os.path.join(item.local_path, rank_filename(d.rank))
            remote = pending.file_path(d.rank)
            report: Dict[str, Any] = {"ok": True, "step": item.step}
            try:
                nbytes = upload_file(local, self.store, remote, self.options, max(self.options.chunk_bytes, 8 << 20),
                                     self._pool, self._limit, self._stop)
            except BaseException as exc:
                if not d.distributed:
                    raise
                report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                nbytes = 0

            def commit(_done: Dict[int, Dict[str, Any]]) -> None:
                if self._abandoned(item):
                    raise CheckpointError(f"step {item.step} was abandoned by a rollback while it uploaded")
                with open(os.path.join(item.local_path, MANIFEST), "rb") as f:
                    raw = f.read()
                # Its event went up at enqueue. (A store has no place to keep superseded steps aside.)
                pending.publish(raw, None, keep_superseded=keeps_superseded(self.keep))
            if d.distributed:
                agree(d, key, report, item.step, commit)
                if not report["ok"]:
                    raise CheckpointError(f"step {item.step}: {report['error']}")
            else:
                commit({0: report})
            if d.coordinator:
                try:
                    self.dir.apply_retention(self.keep)
                    self.dir.write_latest(item.step)
                except CheckpointError as exc:
                    log.warning("lazyckpt: %s: step %d persisted, tidying up failed: %s", self.url, item.step, exc)
            item.state.done("persisted", where=remote)
            log.info("lazyckpt: step %d persisted to %s (%.1f MB)", item.step, self.url, nbytes / 1e6)
        except BaseException as exc:
            if self._abandoned(item):
                # Superseded locally while it uploaded (a rollback): nothing is lost, its
                # manifest never goes up (or, raced, goes up abandoned by the newer event).
                log.info("lazyckpt: %s: step %d was abandoned by a rollback while it uploaded; dropped",
                         self.url, item.step)
                if d.coordinator and pending is not None:
                    pending.discard()
                item.state.abandoned()
                return
            error = exc
            if not isinstance(exc, CheckpointWriteError):
                error = CheckpointWriteError(f"{self.url}: persisting step {item.step} failed: "
                                             f"{type(exc).__name__}: {exc}",
                                             path=self.url, step=item.step)
                error.__cause__ = exc
            self._fail(item, error)
            raise error
        finally:
            if lease is not None:
                lease.release()

    def _abandoned(self, item: Waiting) -> bool:
        try:
            return item.save_id is not None and self.abandoned(item.step, item.save_id)
        except Exception:       # the record unreadable: not known abandoned, the error stands
            return False

    def _round_failed(self, exc: BaseException) -> None:
        log.error("lazyckpt: %s: persisting failed: %s", self.url, exc)

    # ---------------------------------------------------------------- waiting

    def _not_drained(self, timeout: float) -> CheckpointError:
        return CheckpointError(f"{self.url}: steps still being persisted after {timeout} s")

    def close(self, cancel: bool = False) -> None:
        if cancel:
            self._stop.set()
            self._drop_waiting(lambda w: w.state.failed(CheckpointWriteError(f"{self.url}: not persisted: cancelled",
                                                                             step=w.step)))
        try:
            self.wait(raise_errors=not cancel)
        finally:
            self._pool.shutdown(wait=True)
            self.dir.close()
