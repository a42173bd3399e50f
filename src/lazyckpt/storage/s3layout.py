"""A Checkpointer directory on an object store (:class:`ObjectCheckpointDir`):
the manifest object is the commit, heartbeat leases, writer and reader leases,
leftovers. See docs/STORAGE.md.

Layout on the object store (no rename exists there, so every save attempt
gets its own prefix and the manifest, written last, is the commit)::

    PREFIX/step_0000000010/<save_id>/rank_00000.lzc    data, one object per rank
    PREFIX/step_0000000010/<save_id>/manifest.json     the commit: the step exists from here on
    PREFIX/latest                                      "10", written after the manifest (a hint)

A step is committed when its manifest exists; a prefix without one (an
interrupted or failed save) is invisible to listing and loading and is
deleted by ``clean_leftovers`` once older than the lease expiry. Retention
and superseding delete a step's manifest first, then its data, so a crash
in between leaves an invisible leftover, never a step with missing files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import LATEST, MANIFEST, rank_filename, step_dirname
from lazyckpt.history import Event, event_key, line, parse_event_key, prunable
from lazyckpt.knobs import Options
from .base import Leftover, StepRecord
from .layout import deleted_while_reading, describe_writer
from .s3 import ObjectURL, store_for

log = logging.getLogger("lazyckpt")

_COMMITTED = re.compile(r"^step_(\d{10})/([^/]+)/" + re.escape(MANIFEST) + "$")
_SAVE_KEY = re.compile(r"^step_(\d{10})/([^/]+)/")


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
                 takeover: bool = False):
        import socket
        self.store, self.directory = store, directory
        self.base = f"{directory_key}/{WRITERS}/" if directory_key else f"{WRITERS}/"
        self.heartbeat_s, self.expiry_s = heartbeat_s, expiry_s
        self.token = uuid.uuid4().hex
        self.key = self.base + self.token
        self.holder: Dict[str, Any] = {"pid": os.getpid(), "host": socket.gethostname(), "id": self.token,
                                       "since": time.time()}
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

    def _take_over(self) -> None:
        live, _, _ = self._leases()
        previous = [h for h in (self._holder_of(t) for t in live) if h]
        holder = dict(self.holder, takes_over=True)
        if previous:
            holder["took_over_from"] = [{k: p.get(k) for k in ("pid", "host", "id")} for p in previous]
            log.warning("lazyckpt: %s: taking over the writer lease from %s (takeover=True)", self.directory,
                        "; ".join(describe_writer(p) for p in previous))
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


class ObjectCheckpointDir:
    """A directory of committed steps on an object store (the layout above)."""

    def __init__(self, url: str, options: Options):
        self.url = str(ObjectURL.parse(url))
        self.options = options
        self.store, self.prefix = store_for(self.url, options.storage_options)
        self.path = self.url
        #: The writer lease this process holds here (``ObjectWriterLease``), checked before every commit.
        self.writer: Optional[ObjectWriterLease] = None

    def _key(self, *names: str) -> str:
        return "/".join(([self.prefix] if self.prefix else []) + list(names))

    def _relative(self, key: str) -> str:
        return key[len(self.prefix) + 1:] if self.prefix else key

    # ---------------------------------------------------------------- names

    def save_url(self, step: int, save_id: str) -> str:
        return self.store.url(self._key(step_dirname(step), save_id))

    def temp_path(self, step: int, token: str) -> str:
        """Where a save in progress puts its files: its own prefix (invisible
        until its manifest exists)."""
        return self.save_url(step, token)

    def step_path(self, step: int) -> str:
        """The committed save of ``step`` (its prefix)."""
        committed = self.committed()
        if step not in committed:
            raise CheckpointNotFoundError(f"{self.url}: no committed step {step}", path=self.url, step=step)
        return self.save_url(step, committed[step])

    # ---------------------------------------------------------------- listing

    def committed(self) -> Dict[int, str]:
        """step -> save id of every live committed step (one listing request per
        1000 objects): a save its line of history abandoned (a rollback whose
        own step is not uploaded yet) is not one, so no reader of this tier
        alone returns it."""
        present, events = self.listing()
        live = dict(line(events + [Event(s, sid, None) for s, sid in present.items()]))
        return {s: sid for s, sid in present.items() if live.get(s) == sid}

    def listing(self) -> Tuple[Dict[int, str], List[Event]]:
        """(step -> save id of every committed step, the commit events stored
        here) from one listing. A step that shows two manifests (a crash inside
        a supersede) is the one committed later by ``seq``; only saves without
        events (written before them) fall back to the 1-second LastModified."""
        found: Dict[int, List[Tuple[str, Any]]] = {}
        events: List[Event] = []
        for obj in self.store.list(self._key("")):
            relative = self._relative(obj["Key"])
            m = _COMMITTED.match(relative)
            if m:
                found.setdefault(int(m.group(1)), []).append((m.group(2), obj["LastModified"]))
                continue
            event = parse_event_key(relative)
            if event is not None:
                events.append(event)
        seqs = {(e.step, e.save_id): e.seq for e in events}
        committed = {}
        for step, saves in found.items():
            committed[step] = max(saves, key=lambda v: (seqs.get((step, v[0]), 0), v[1]))[0]
        return committed, events

    def events(self) -> List[Event]:
        """Every commit event here, manifests without one included (seq None)."""
        committed, events = self.listing()
        return events + [Event(s, sid, None) for s, sid in committed.items()]

    def put_event(self, event: Event) -> None:
        """Record a commit here (an empty object; the key says it all)."""
        self.store.put(self._key(event_key(event)), b"")

    def prune_events(self) -> int:
        """Delete the events this tier no longer needs (history.prunable)."""
        committed, events = self.listing()
        doomed = prunable(events, committed)
        if doomed:
            self.store.delete([self._key(event_key(e)) for e in doomed])
        return len(doomed)

    def steps(self) -> List[int]:
        return sorted(self.committed())

    def latest(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Dict[str, Any]:
        url = self.step_path(step)
        return read_manifest(url, self.options)

    # ---------------------------------------------------------------- commit

    def commit(self, step: int, save_id: str, manifest_raw: bytes) -> List[int]:
        """Write the manifest of ``save_id``: step ``step`` exists from here on.
        Committed steps >= ``step`` (an abandoned line of history) are deleted
        first, as a local directory supersedes them."""
        if self.writer is not None:
            self.writer.check()         # displaced by a takeover since save(): commit nothing
        committed, events = self.listing()
        superseded = sorted((s for s in committed if s >= step and committed[s] != save_id), reverse=True)
        for s in superseded:
            self._drop(s, committed[s])
        if superseded:
            log.warning("lazyckpt: %s: step %d supersedes step(s) %s of an abandoned run (deleted)",
                        self.url, step, superseded)
        self.store.put(self._key(step_dirname(step), save_id, MANIFEST), manifest_raw)
        # Events no longer needed go from the same listing (bounded without keep_last too).
        present = {s: sid for s, sid in committed.items() if s not in superseded}
        present[step] = save_id
        doomed = prunable(events, present)
        if doomed:
            try:
                self.store.delete([self._key(event_key(e)) for e in doomed])
            except CheckpointError as exc:
                log.debug("lazyckpt: %s: pruning history events failed (retried later): %s", self.url, exc)
        return superseded

    def acquire_writer(self, heartbeat_s: float, expiry_s: float, takeover: bool = False) -> ObjectWriterLease:
        return ObjectWriterLease(self.store, self.prefix, self.url, heartbeat_s, expiry_s, takeover=takeover)

    def pending(self, step: int, save_id: str, token: str) -> "PendingSavePrefix":
        return PendingSavePrefix(self, step, save_id)      # the save id names the prefix: no token needed

    def save_path(self, step: int, save_id: str) -> str:
        return self.save_url(step, save_id)

    def record_event(self, event: Event) -> None:
        self.put_event(event)

    def write_latest(self, step: int) -> None:
        self.store.put(self._key(LATEST), f"{step}\n".encode())

    def _drop(self, step: int, save_id: str, even_if_read: bool = True) -> bool:
        """Manifest first (the step is gone at once), then the data. Unless
        ``even_if_read`` (superseding: an abandoned step must go), a step with a
        live reader lease is left, and False returned. A reader puts its lease
        and then reads the manifest; we delete the manifest and then list the
        leases again: so a reader that saw the manifest is always seen here,
        and gets its step back (the manifest re-put) instead of losing it."""
        prefix = self._key(step_dirname(step), save_id) + "/"
        manifest_key = prefix + MANIFEST
        raw = None
        if not even_if_read:
            if self._live_readers(prefix):
                return False
            raw = self.store.get(manifest_key, manifests.MAX_MANIFEST_BYTES)
            if raw is None:
                return False            # being deleted by another process
        self.store.delete([manifest_key])
        if raw is not None and self._live_readers(prefix):
            self.store.put(manifest_key, raw)
            return False
        self.store.delete([o["Key"] for o in self.store.list(prefix)])
        return True

    def _live_readers(self, prefix: str) -> List[str]:
        """Reader leases under ``prefix`` younger than the lease expiry, aged by
        the server's clock (``ObjectStore.listing``), never this host's."""
        objects, now = self.store.listing(prefix + READERS + "/")
        expiry = self.options.lease_expiry_s
        return [o["Key"] for o in objects if (now - o["LastModified"]).total_seconds() < expiry]

    def delete_step(self, step: int, even_if_read: bool = False) -> bool:
        """Delete a committed step; False if there is none, or a reader holds a
        live lease on it (unless ``even_if_read``)."""
        committed = self.listing()[0]          # an abandoned save left here too
        if step not in committed:
            return False
        return self._drop(step, committed[step], even_if_read)

    def apply_retention(self, keep_last: Optional[int]) -> List[int]:
        if keep_last is None:
            return []
        committed, events = self.listing()
        # Counted on the line of history: an abandoned save left here (its
        # superseding step still uploading) is no kept step; it goes too.
        live = dict(line(events + [Event(s, sid, None) for s, sid in committed.items()]))
        kept = [s for s in sorted(committed) if live.get(s) == committed[s]][-keep_last:]
        old = [s for s in sorted(committed) if s not in kept]
        # A step being read (a live reader lease) stays until a later pass.
        busy = [s for s in old if not self._drop(s, committed[s], even_if_read=False)]
        if busy:
            log.info("lazyckpt: %s: step(s) %s are being read; deleting them later", self.url, busy)
        old = [s for s in old if s not in busy]
        self.prune_events()
        return old

    # ---------------------------------------------------------------- leftovers

    def leftovers(self, expiry_s: Optional[float] = None) -> List[Leftover]:
        """Save prefixes without a manifest that are provably dead: their newest
        object (the heartbeat included) and their newest open multipart upload
        are older than the lease expiry ("interrupted-save", named
        ``step_X/<save_id>`` relative to the directory, oldest name first).
        Younger ones may be a save in progress and are not listed."""
        expiry = self.options.lease_expiry_s if expiry_s is None else expiry_s
        groups: Dict[str, List[Any]] = {}
        uploads: Dict[str, List[Any]] = {}
        committed = set()
        objects, now = self.store.listing(self._key(""))     # now: the server's clock
        for obj in objects:
            prefix = self._save_prefix(obj["Key"])
            if prefix is None:
                continue
            if _COMMITTED.match(self._relative(obj["Key"])):
                committed.add(prefix)
            groups.setdefault(prefix, []).append(obj)
        for up in self.store.uploads(self._key("")):
            prefix = self._save_prefix(up["Key"])
            if prefix is not None:
                uploads.setdefault(prefix, []).append(up)
        out = []
        for prefix in set(groups) | set(uploads):
            if prefix in committed:
                continue
            times = [o["LastModified"] for o in groups.get(prefix, [])] + \
                    [u["Initiated"] for u in uploads.get(prefix, [])]
            age = min((now - t).total_seconds() for t in times)
            # expiry 0: whatever its age (server stamps have 1 s resolution: "now" may equal them).
            if age > expiry or expiry <= 0:
                name = self._relative(prefix).rstrip("/")
                m = _SAVE_KEY.match(name + "/")
                out.append(Leftover(name, "interrupted-save", sum(o["Size"] for o in groups.get(prefix, [])),
                                    int(m.group(1)) if m else None, self.store.url(prefix.rstrip("/")), age))
        return sorted(out, key=lambda lo: lo.name)

    def _save_prefix(self, key: str) -> Optional[str]:
        m = _SAVE_KEY.match(self._relative(key))
        return self._key(step_dirname(int(m.group(1))), m.group(2)) + "/" if m else None

    def clean_leftovers(self, expiry_s: Optional[float] = None) -> List[str]:
        """Delete dead saves' prefixes and abort their open uploads (never a
        save whose heartbeat or upload is younger than the lease expiry)."""
        removed = []
        for leftover in self.leftovers(expiry_s):
            prefix = self._key(leftover.name) + "/"
            for up in self.store.uploads(prefix):
                self.store.abort_upload(up["Key"], up["UploadId"])
            self.store.delete([o["Key"] for o in self.store.list(prefix)])
            removed.append(self.store.url(prefix))
        return removed

    # ---------------------------------------------------------------- the read side (base.Directory)

    def step_paths(self) -> Dict[int, str]:
        committed = self.committed()
        return {s: self.save_url(s, committed[s]) for s in sorted(committed)}

    def step_records(self) -> List[StepRecord]:
        """From two listings (the committed saves, then every object for the
        sizes and the manifests' LastModified: the commit times)."""
        committed = self.committed()
        sizes: Dict[str, int] = {}
        mtimes: Dict[str, float] = {}
        for obj in self.store.list(self._key("")):
            parts = self._relative(obj["Key"]).split("/")
            if len(parts) < 3:
                continue
            save = "/".join(parts[:2])
            sizes[save] = sizes.get(save, 0) + int(obj["Size"])
            if len(parts) == 3 and parts[2] == MANIFEST:
                mtimes[save] = obj["LastModified"].timestamp()
        out = []
        for step in sorted(committed):
            name = f"{step_dirname(step)}/{committed[step]}"
            out.append(StepRecord(step, name, self.save_url(step, committed[step]), sizes.get(name, 0),
                                  mtimes.get(name)))
        return out

    def latest_file(self) -> Optional[int]:
        raw = self.store.get(self._key(LATEST), 64)
        try:
            return int(raw.decode().strip()) if raw is not None else None
        except (UnicodeDecodeError, ValueError):
            return None

    def remove_leftovers(self, leftovers: List[Leftover]) -> Dict[str, Optional[str]]:
        """Through :meth:`clean_leftovers`, which lists again: a prefix written to
        since it was listed is young again and stays (no lock says so here)."""
        try:
            removed = {u.rstrip("/") for u in self.clean_leftovers()}
        except CheckpointError as exc:
            return {lo.name: str(exc) for lo in leftovers}
        out: Dict[str, Optional[str]] = {}
        for lo in leftovers:
            prefix = self._key(lo.name)
            if self.store.url(prefix) in removed or next(iter(self.store.list(prefix + "/")), None) is None:
                out[lo.name] = None     # removed (by us, or concurrently: the outcome wanted)
            else:
                out[lo.name] = "written to since it was listed (a save may be in progress); kept"
        return out

    def retention_plan(self, keep: int) -> Tuple[List[int], List[int]]:
        """No references here (incremental steps are local only): the older steps, newest first."""
        steps = self.steps()
        return list(reversed(steps[:-keep] if keep else steps)), []

    def retire_old(self, keep: int) -> Tuple[List[int], List[int]]:
        """Each step's manifest first, then its data; a step with a live reader
        lease stays, as a locked one does locally. Then the history events of
        the deleted steps (FORMAT.md §11.10)."""
        doomed, _ = self.retention_plan(keep)
        deleted, kept = [], []
        for step in doomed:
            if self.delete_step(step) or step not in self.committed():
                deleted.append(step)        # (or deleted concurrently: the outcome wanted)
            else:
                log.info("lazyckpt: %s: step %d is being read; deleting it later", self.url, step)
                kept.append(step)
        if doomed:
            try:
                self.prune_events()
            except CheckpointError as exc:
                log.warning("lazyckpt: %s: pruning history events failed: %s", self.url, exc)
        return deleted, sorted(kept)


# ---------------------------------------------------------------------- saves in progress

class PendingSavePrefix:
    """A save of one step into an :class:`ObjectCheckpointDir`
    (``base.PendingStep``): every rank uploads its file under the save's own
    prefix ``step_X/<save_id>/`` (invisible until its manifest exists), a
    heartbeat object per rank keeps ``clean_leftovers`` off it, and the
    manifest object, written last, is the commit. There is no rename: a
    failed save aborts its uploads and :meth:`discard` deletes what was
    completed under its prefix."""

    needs_create = False        # a prefix exists as soon as something is put under it

    def __init__(self, directory: "ObjectCheckpointDir", step: int, save_id: str):
        self.directory, self.step, self.save_id = directory, step, save_id
        self.store = directory.store
        self.key = directory._key(step_dirname(step), save_id)
        self.path = self.store.url(self.key)

    def create(self) -> None:
        pass

    def file_path(self, rank: int) -> str:
        return f"{self.path}/{rank_filename(rank)}"

    def hold(self, rank: int, heartbeat_s: float) -> ObjectLease:
        return ObjectLease(self.store, f"{self.key}/{LEASE_PREFIX}{rank:05d}", heartbeat_s)

    def put_side(self, name: str, data: bytes) -> None:
        self.store.put(f"{self.key}/{name}", data)

    def take_side(self, name: str) -> bytes:
        data = self.store.get(f"{self.key}/{name}")
        if data is None:
            raise CheckpointError(f"{self.path}/{name}: a rank's shard report is missing", step=self.step)
        self.store.delete([f"{self.key}/{name}"])
        return data

    def read_ends(self, rank: int, options: Options, parse: Callable[[int, Callable[[int, int], bytes]], Any]) -> Any:
        key = f"{self.key}/{rank_filename(rank)}"

        def read(offset: int, n: int) -> bytes:
            buf = bytearray(n)
            return bytes(buf[:self.store.read_into(key, memoryview(buf), offset)])
        return parse(self.store.size(key) or 0, read)

    def publish(self, manifest_raw: bytes, event: Optional[Event], keep_superseded: bool) -> List[int]:
        # No place to keep superseded steps aside here: they are deleted (keep_superseded unused).
        if event is not None:
            # The event before the manifest: a second manifest of this step left
            # by a crash inside the supersede is told apart by seq.
            self.directory.put_event(event)
        return self.directory.commit(self.step, self.save_id, manifest_raw)

    def discard(self) -> None:
        try:
            if self.store.size(f"{self.key}/{MANIFEST}") is None:     # never delete a committed step
                self.store.delete([o["Key"] for o in self.store.list(self.key + "/")])
        except CheckpointError as exc:      # the store may be what failed; prune cleans up later
            log.warning("lazyckpt: %s: could not remove a failed save: %s", self.path, exc)


class PendingObject:
    """A save of one file as one object (``base.PendingFile``). No temporary
    name is needed: a multipart upload is invisible until completed
    (``ObjectOutput.finish``), and completing it replaces the old object
    atomically; an upload closed unfinished is aborted."""

    def __init__(self, url: str):
        self.final = url
        self.path = url                 # written in place: invisible until the upload completes

    def hold(self, heartbeat_s: float) -> None:
        return None                     # an open upload is no object: nothing can remove it

    def publish(self) -> None:
        pass                            # the upload's completion was the commit

    def discard(self) -> None:
        pass                            # the output's close aborted the upload


def store_key(url: str) -> str:
    return ObjectURL.parse(url).key


def read_manifest(step_url: str, options: Options) -> Dict[str, Any]:
    store, key = store_for(step_url, options.storage_options)
    url = f"{step_url}/{MANIFEST}"
    raw = store.get(f"{key}/{MANIFEST}", manifests.MAX_MANIFEST_BYTES)
    if raw is None:
        raise CheckpointNotFoundError(f"{step_url}: no committed checkpoint (no {MANIFEST})", path=step_url)
    return manifests.parse(raw, url)


# ---------------------------------------------------------------------- upload of a local file


# ---------------------------------------------------------------------- the drain


