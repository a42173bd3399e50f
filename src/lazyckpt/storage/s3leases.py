"""Who holds what on an object store: the heartbeat lease of a save in
progress (:class:`ObjectLease`), the one-writer lease of a Checkpointer
prefix (:class:`ObjectWriterLease`) and the reader lease of a step being read
(:func:`reading_object_step`). The twins of ``storage/locks.py``: S3 has no
lock that dies with its process, so each is an object whose age (by the
server's clock) says whether its holder is alive. ``s3layout`` decides what
may be deleted; this module only answers who still holds a prefix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import MANIFEST
from lazyckpt.knobs import Options
from .locks import deleted_while_reading, describe_writer
from .s3 import store_for

log = logging.getLogger("lazyckpt")


LEASE_PREFIX = ".lease-"


class ObjectLease:
    """A save in progress on an object store: a small heartbeat object under
    its prefix, rewritten every ``heartbeat_s`` on a thread of its own (a slow
    or unreachable store must not delay the local leases' keeper). A prefix
    whose newest object and newest open upload are both older than the lease
    expiry is dead; a live save keeps its heartbeat young even while one of
    its uploads runs for longer than that. ``release()`` deletes it."""

    def __init__(self, store: Any, key: str, heartbeat_s: float):
        self.store, self.key, self.heartbeat_s = store, key, heartbeat_s
        self._stop = threading.Event()
        self.store.put(self.key, b"")
        self._thread = threading.Thread(target=self._run, name="lazyckpt-object-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self.store.put(self.key, b"")
            except CheckpointError as exc:      # the save itself will meet the same problem
                log.debug("lazyckpt: heartbeat %s failed: %s", self.key, exc)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        # A heartbeat still in flight would re-create the object after the delete.
        self._thread.join()
        try:
            self.store.delete([self.key])
        except CheckpointError:
            pass                                # expires by age; retention deletes it with its prefix


#: Writer leases of an object-store Checkpointer directory: ``PREFIX/.writers/<token>``.
WRITERS = ".writers"
#: ``PREFIX/.fences/<fence id>``: the writer of that fence id was displaced at the object's LastModified.
FENCES = ".fences"
_BEAT = ".beat"


class ObjectWriterLease:
    """One writer per object-store prefix: the object-store twin of
    ``layout.WriterLease`` (same contract, README "One writer per directory").

    S3 has no lock that dies with its process, and conditional PUT is not in
    every S3-compatible store, so the lease is an election by listing. Each
    writer PUTs ``PREFIX/.writers/<token>`` (JSON: pid, host, id; written once,
    so its ``LastModified`` is the server's time of taking) and keeps
    ``<token>.beat`` fresh with an :class:`ObjectLease`. Then it lists
    ``.writers/``: a lease is live while its newest object is younger than
    ``expiry_s`` by the server's clock (``ObjectStore.listing``). The writer
    wins when every other live lease was taken strictly later; a loser deletes
    its own and is refused, naming the holder. Stamps have 1 s resolution, and
    a holder that won before a newcomer's PUT never saw it, so an equal stamp
    is not broken by token (both could win): the newcomer backs off and PUTs
    again, which orders it after the holder.

    A newcomer that finds an older live lease watches it: once its heartbeat
    moves (about one heartbeat period, ``expiry_s / 12``, plus the 1 s stamp
    resolution) the holder is alive and the newcomer is refused; a holder
    that never beats again (a crashed writer) expires, so a restart waits for
    at most ``expiry_s`` and then takes the lease.

    ``takeover=True`` PUTs a lease marked ``takes_over`` and deletes every
    other; the displaced writer's :meth:`check` (each save, and before its
    commit's manifest) finds its own lease gone, or a newer takeover, and
    fails. Two simultaneous takeovers may delete each other: both then fail
    their next save (never two writers)."""

    def __init__(self, store: Any, directory_key: str, directory: str, heartbeat_s: float, expiry_s: float,
                 takeover: bool = False, fence: Optional[str] = None):
        import socket
        self.store, self.directory = store, directory
        self.base = f"{directory_key}/{WRITERS}/" if directory_key else f"{WRITERS}/"
        self.fences = f"{directory_key}/{FENCES}/" if directory_key else f"{FENCES}/"
        self.heartbeat_s, self.expiry_s = heartbeat_s, expiry_s
        self.token = uuid.uuid4().hex
        #: What the save ids of this writer begin with (``<fence>-``): a fence object of that
        #: name makes readers ignore its commit events published after the fence.
        self.fence = fence or self.token[:12]
        self.key = self.base + self.token
        self.holder: Dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "id": self.token,
                                       "since": time.time(), "fence": self.fence}
        self._beat: Optional[ObjectLease] = None
        self._beat_lock = threading.Lock()     # check() runs on the save thread and the commit thread
        self._released = False
        if takeover:
            self._take_over()
        else:
            self._acquire()

    # ---------------------------------------------------------------- the listing

    def _leases(self) -> Tuple[Dict[str, Dict[str, Any]], Any, List[str]]:
        """(token -> {"taken": LastModified of the holder, "last": its newest
        object}, the server's now, keys of dead leases and orphan heartbeats)."""
        objects, now = self.store.listing(self.base)
        holders: Dict[str, Any] = {}
        beats: Dict[str, Any] = {}
        for o in objects:
            name = o["Key"][len(self.base):]
            if name.endswith(_BEAT):
                beats[name[:-len(_BEAT)]] = o["LastModified"]
            elif "/" not in name:
                holders[name] = o["LastModified"]
        live, dead = {}, []
        for token, taken in holders.items():
            last = max(taken, beats.get(token, taken))
            # Our own is never "dead" here: with 1 s stamps a tiny expiry could say so while we hold it.
            if token == self.token or (now - last).total_seconds() < self.expiry_s:
                live[token] = {"taken": taken, "last": last}
            else:
                dead += [self.base + token, self.base + token + _BEAT]
        # A heartbeat without its holder: a displaced writer's, or one mid-release.
        dead += [self.base + t + _BEAT for t, last in beats.items()
                 if t not in holders and (now - last).total_seconds() >= self.expiry_s]
        return live, now, dead

    def _holder_of(self, token: str) -> Optional[Dict[str, Any]]:
        import json
        raw = self.store.get(self.base + token, 1 << 16)
        try:
            holder = json.loads(raw.decode()) if raw else None
        except (UnicodeDecodeError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _put_own(self, holder: Dict[str, Any]) -> None:
        import json
        self.store.put(self.key, json.dumps(holder, sort_keys=True).encode())
        self._beat = ObjectLease(self.store, self.key + _BEAT, self.heartbeat_s)

    def _stop_beat(self) -> None:
        with self._beat_lock:
            beat, self._beat = self._beat, None
        if beat is not None:
            beat.release()              # stops the heartbeat, then deletes it

    def _drop_own(self) -> None:
        self._stop_beat()
        try:
            self.store.delete([self.key])
        except CheckpointError:
            pass                        # expires by age

    # ---------------------------------------------------------------- taking it

    def _acquire(self) -> None:
        import random
        give_up = time.monotonic() + self.expiry_s + 2 * max(1.0, self.heartbeat_s)
        while True:
            self._put_own(self.holder)
            try:
                live, now, dead = self._leases()
            except BaseException:
                self._drop_own()
                raise
            if dead:
                # A holder whose lease expired may only be stalled: fenced before it is replaced.
                self._fence([k[len(self.base):] for k in dead if not k.endswith(_BEAT)])
                try:
                    self.store.delete(dead)
                except CheckpointError as exc:
                    log.debug("lazyckpt: %s: removing dead writer leases failed: %s", self.directory, exc)
            mine = live.get(self.token)
            others = {t: v for t, v in live.items() if t != self.token}
            if mine is None:            # deleted under us: a takeover since our PUT
                self._drop_own()
                raise self._refused(next(iter(others), None))
            earlier = {t: v for t, v in others.items() if v["taken"] <= mine["taken"]}
            if not earlier:
                return                  # every other live lease was taken later: they lose
            self._drop_own()
            strictly = {t: v for t, v in earlier.items() if v["taken"] < mine["taken"]}
            if not strictly:            # equal stamps: PUT again, later (see the class doc)
                if time.monotonic() > give_up:
                    raise self._refused(next(iter(earlier)))
                time.sleep(random.uniform(0.2, 1.2))
                continue
            token, blocker = min(strictly.items(), key=lambda kv: (kv[1]["taken"], kv[0]))
            self._wait_out(token, blocker["last"], give_up)

    def _wait_out(self, token: str, last: Any, give_up: float) -> None:
        """Return once the lease ``token`` is gone or expired (a crashed writer:
        at most ``expiry_s``); refuse as soon as its heartbeat moves (alive:
        within about one heartbeat period plus the 1 s stamp resolution)."""
        while True:
            time.sleep(min(1.0, self.heartbeat_s))
            lease = self._leases()[0].get(token)
            if lease is None:
                return
            if lease["last"] > last or time.monotonic() > give_up:
                raise self._refused(token)

    def _fence(self, tokens: List[str]) -> None:
        """PUT ``.fences/<fence id>`` for each displaced holder, then wait out the
        1 s stamp resolution: any commit event a displaced writer publishes after
        this returns is stamped later than its fence, and readers ignore it
        (``ObjectCheckpointDir.listing``). Its lease check before the commit is
        the first line; this one holds when it paused past that check."""
        fences = []
        for token in tokens:
            holder = self._holder_of(token)
            fence = holder.get("fence") if holder else None
            fence = fence if isinstance(fence, str) and re.fullmatch(r"[0-9a-f]{1,32}", fence) else token[:12]
            if fence != self.fence:
                fences.append(fence)
        for fence in fences:
            self.store.put(self.fences + fence, b"")
        if fences:
            time.sleep(1.1)

    def _take_over(self) -> None:
        live, _, _ = self._leases()
        others = [t for t in live if t != self.token]
        previous = [h for h in (self._holder_of(t) for t in others) if h]
        holder = dict(self.holder, takes_over=True)
        if previous:
            holder["took_over_from"] = [{k: p.get(k) for k in ("pid", "host", "id")} for p in previous]
            log.warning("lazyckpt: %s: taking over the writer lease from %s (takeover=True)", self.directory,
                        "; ".join(describe_writer(p) for p in previous))
        self._fence(others)
        self._put_own(holder)
        try:
            others = [o["Key"] for o in self.store.list(self.base)
                      if o["Key"] not in (self.key, self.key + _BEAT)]
            if others:
                self.store.delete(others)
        except BaseException:
            self._drop_own()
            raise

    def _refused(self, token: Optional[str]) -> CheckpointError:
        holder = self._holder_of(token) if token else None
        who = describe_writer(holder)
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == self.holder["host"]:
            who += " (this process: another Checkpointer on this prefix is still open; close() it)"
        return CheckpointError(f"{self.directory}: another Checkpointer is saving into this prefix: {who}. "
                               f"One writer per directory: two would supersede each other's steps. Load with "
                               f"this one, or pass takeover=True to make it the writer (the other one's next "
                               f"save then fails). A writer that died stops blocking after lease_expiry_s "
                               f"({self.expiry_s:g} s)", path=self.directory)

    # ---------------------------------------------------------------- holding it

    def check(self) -> None:
        """Raise unless this is still the prefix's writer (before every save and
        before every commit's manifest); one listing request."""
        if self._released:
            raise CheckpointError(f"{self.directory}: this Checkpointer gave up its writer lease (closed)",
                                  path=self.directory)
        live, _, _ = self._leases()
        mine = live.get(self.token)
        newer = [t for t, v in live.items()
                 if t != self.token and (mine is None or v["taken"] >= mine["taken"])]
        takers = [h for h in (self._holder_of(t) for t in newer) if h and h.get("takes_over")]
        if mine is not None and not takers:
            return
        self._stop_beat()               # no orphan heartbeat left beating
        if takers:
            raise CheckpointError(f"{self.directory}: another Checkpointer took over this prefix "
                                  f"({describe_writer(takers[0])}, takeover=True); this one can no longer save "
                                  f"into it", path=self.directory)
        raise CheckpointError(f"{self.directory}: the writer lease {self.store.url(self.key)} was removed while "
                              f"this Checkpointer held it (another Checkpointer took over, or its heartbeat "
                              f"could not reach the store for lease_expiry_s); it no longer saves here",
                              path=self.directory)

    def release(self) -> None:
        """Idempotent: the heartbeat stops and both objects are deleted (our own
        token: no other writer's lease can be hit)."""
        if self._released:
            return
        self._released = True
        self._drop_own()


#: Reader leases of a committed save: ``step_X/<save_id>/.readers/<token>``.
READERS = ".readers"


@contextlib.contextmanager
def reading_object_step(step_url: str, options: Options) -> Iterator["_HeldObjectStep"]:
    """Hold a reader lease on a committed save prefix while it is read: an
    object under ``.readers/`` whose heartbeat keeps it younger than the lease
    expiry, so that retention and prune (in any process) keep the step until
    the reader is done. Taken *before* the caller looks at the manifest again
    (``_HeldObjectStep``): a deleter that removed the manifest re-lists the
    prefix and puts the manifest back if a lease appeared (see ``_drop``)."""
    store, key = store_for(step_url, options.storage_options)
    lease = ObjectLease(store, f"{key}/{READERS}/{uuid.uuid4().hex}", options.lease_heartbeat_s)
    try:
        yield _HeldObjectStep(store, key, step_url)
    finally:
        lease.release()


class _HeldObjectStep:
    """A save prefix held by :func:`reading_object_step` (a ``base.HeldStep``)."""

    def __init__(self, store: Any, key: str, url: str):
        self.store, self.key, self.url = store, key, url
        self.path = url
        m = re.search(r"step_(\d{10})/[^/]+$", key)
        self.step = int(m.group(1)) if m else None
        # DIR/step_X/<save_id>: the run is two levels up (a bare save prefix: itself).
        self.directory = url.rsplit("/", 2)[0] if m else url

    def read_manifest(self) -> Dict[str, Any]:
        raw = self.store.get(f"{self.key}/{MANIFEST}", manifests.MAX_MANIFEST_BYTES)
        if raw is None:
            raise CheckpointNotFoundError(f"{self.url}: no committed checkpoint (no {MANIFEST})",
                                          path=self.url, step=self.step)
        return manifests.parse(raw, f"{self.url}/{MANIFEST}")

    def still_there(self) -> bool:
        """Whether the manifest (the commit) still exists; True when the store
        cannot say (then the original error is the one to report)."""
        try:
            return self.store.size(f"{self.key}/{MANIFEST}") is not None
        except CheckpointError:
            return True

    def deleted(self) -> CheckpointNotFoundError:
        return deleted_while_reading(self.url, self.step)
