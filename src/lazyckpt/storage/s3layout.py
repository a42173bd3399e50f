"""A Checkpointer directory on an object store (:class:`ObjectCheckpointDir`):
the manifest object is the commit, heartbeat leases, writer and reader leases,
leftovers. See docs/STORAGE.md.

Layout on the object store (no rename exists there, so every save attempt
gets its own prefix and the manifest, written last, is the commit)::

    PREFIX/step_0000000010/<save_id>/rank_00000.lzc    data, one object per rank
    PREFIX/step_0000000010/<save_id>/manifest.json     the commit: the step exists from here on
    PREFIX/latest                                      "10", written after the manifest (a hint)
    PREFIX/head.json                                   the index: the last commit event published here

A step is committed when its manifest exists; a prefix without one (an
interrupted or failed save) is invisible to listing and loading and is
deleted by ``clean_leftovers`` once older than the lease expiry. Retention
and superseding delete a step's manifest first, then its data, so a crash
in between leaves an invisible leftover, never a step with missing files.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import Any, Callable, ContextManager, Dict, List, Optional, Set, Tuple, Union

from lazyckpt.errors import CheckpointError, CheckpointNotFoundError
from lazyckpt.formats import manifest as manifests
from lazyckpt.formats.names import LATEST, MANIFEST, rank_filename, step_dirname
from lazyckpt.lineage import (EVENTS_PREFIX, Event, event_key, event_problem, line, manifest_event, max_seq,
                              parse_event_key, prunable)
from lazyckpt.knobs import Options
from lazyckpt.retention import Plan, Policy, as_policy, plan, saved_metadata
from .scan import BackgroundScan
from .base import Leftover, StepRecord
from .s3leases import FENCES, LEASE_PREFIX, READERS, ObjectLease, ObjectWriterLease, reading_object_step
from .s3 import ObjectOutput, ObjectURL, store_for

log = logging.getLogger("lazyckpt")

#: The index (FORMAT.md §11.9): ``{"step", "save_id", "seq"}`` of the
#: last commit event a writer published here. A hint: readers check it against
#: the events after it (one listing that starts there) and its manifest.
HEAD = "head.json"

#: "Read head.json now" (a head already read is its bytes, or b"" when absent).
_READ = object()

_COMMITTED = re.compile(r"^step_(\d{10})/([^/]+)/" + re.escape(MANIFEST) + "$")
_SAVE_KEY = re.compile(r"^step_(\d{10})/([^/]+)/")


class ObjectCheckpointDir:
    """A directory of committed steps on an object store (the layout above)."""

    def __init__(self, url: str, options: Options):
        self.url = str(ObjectURL.parse(url))
        self.options = options
        self.store, self.prefix = store_for(self.url, options.storage_options)
        self.path = self.url
        #: The writer lease this process holds here (``ObjectWriterLease``), checked before every commit.
        self.writer: Optional[ObjectWriterLease] = None
        #: (step, save id) of manifests written before commit events existed (no ``seq``).
        self._legacy: set = set()
        #: Save prefixes the last leftover scan found live: tidy() looks at them again.
        self._watch: set = set()
        self._watch_mutex = threading.Lock()
        self._scan = BackgroundScan(lambda: self._remove(self.leftovers(stop=self._scan.cancelled.is_set),
                                                         stop=self._scan.cancelled.is_set), self.url)
        #: (step, save id) -> the metadata its save recorded, for the policies that rank
        #: by it: read once per save; bounded by the steps present (:meth:`_plan`).
        self._metadata: Dict[Tuple[int, str], Dict[str, Any]] = {}

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

    # ---------------------------------------------------------------- the index

    def index_mark(self) -> bytes:
        """``head.json`` as stored (one GET; b"" when there is none): what a lookup
        of the latest step starts from. Every commit rewrites it, so an
        unchanged mark means no commit since that lookup (loading/joblatest.py)."""
        return self.store.get(self._key(HEAD), 4096) or b""

    def _head(self, raw: Any = _READ) -> Optional[Event]:
        raw = self.index_mark() if raw is _READ else raw
        if not raw:
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))
            event = Event(doc["step"], doc["save_id"], doc["seq"])
        except (UnicodeDecodeError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None
        return None if event_problem(event.step, event.save_id, event.seq, seq_optional=False) else event

    def _write_head(self, event: Event) -> None:
        try:
            self.store.put(self._key(HEAD), json.dumps({"step": event.step, "save_id": event.save_id,
                                                        "seq": event.seq}).encode())
        except CheckpointError as exc:          # a hint: without it readers list
            log.debug("lazyckpt: %s: writing %s failed (readers list instead): %s", self.url, HEAD, exc)

    def _event_objects_from(self, seq: int) -> List[Dict[str, Any]]:
        """The event objects numbered ``seq`` or later: one listing that starts
        at ``seq`` (event keys sort by it), costing what it returns."""
        return list(self.store.list(self._key(EVENTS_PREFIX), start_after=self._key(f"{EVENTS_PREFIX}{seq:012d}")))

    def _events_from(self, seq: int) -> List[Event]:
        """The events numbered ``seq`` or later, fenced ones dropped (one more
        listing: the fences)."""
        return self._events(self._event_objects_from(seq) + list(self.store.list(self._key(FENCES + "/"))))

    def tail(self, mark: Optional[bytes] = None) -> Optional[Event]:
        """The newest live committed save, from the index, in four requests
        whatever the number of steps kept (GET ``head.json``, a listing of the
        events from its ``seq`` on, one of the fences, a HEAD of the manifest);
        None when the index cannot answer (no head, the newest event's save not
        here yet or deleted): then the caller lists. The newest event is on
        the line (nothing after it supersedes it), and it is committed here
        when its manifest exists (written before the event on an object-store
        directory, uploaded after it on a persistent tier). ``mark``: the head
        as already read (:meth:`index_mark`)."""
        newest = self.newest_event(mark)
        return newest if newest is not None and self.holds(newest) else None

    def newest_event(self, mark: Optional[bytes] = None) -> Optional[Event]:
        """The newest live commit event here, from the index (GET ``head.json``,
        the events from its ``seq`` on, the fences), whether its save's upload
        is done or not (:meth:`holds` tells); None without an index."""
        head = self._head(_READ if mark is None else mark)
        events = self._events_from(head.seq) if head is not None else []
        return max(events, key=lambda e: e.seq) if events else None

    def holds(self, event: Event) -> bool:
        """Whether ``event``'s save is committed here: its manifest exists (one HEAD)."""
        return self.store.size(self._key(step_dirname(event.step), event.save_id, MANIFEST)) is not None

    def top_seq(self) -> int:
        """The largest ``seq`` here (numbering): from the index when there is one."""
        head = self._head()
        if head is not None:
            return max(head.seq, max_seq(e for e in (parse_event_key(self._relative(o["Key"]))
                                                     for o in self._event_objects_from(head.seq))
                                         if e is not None))
        return max_seq(self.listing()[1])

    def published_seq(self) -> Optional[int]:
        """The largest ``seq`` of a live event here, from the index (the head and
        the events after it, fenced ones dropped), or None without one."""
        head = self._head()
        events = self._events_from(head.seq) if head is not None else []
        return max_seq(events) if events else None

    def locate_step(self, step: Optional[int], mark: Optional[bytes] = None) -> Optional[Tuple[int, str]]:
        """(step, its save's prefix) for a committed step (None: the latest), or
        None: from the index for the latest, else from a listing."""
        tail = self.tail(mark)
        if tail is not None and (step is None or step == tail.step):
            return tail.step, self.save_url(tail.step, tail.save_id)
        if tail is not None and step is not None and step > tail.step:
            return None
        paths = self.step_paths()
        if step is None:
            return (max(paths), paths[max(paths)]) if paths else None
        return (step, paths[step]) if step in paths else None

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
        objects = list(self.store.list(self._key("")))
        events = self._events(objects)
        for obj in objects:
            m = _COMMITTED.match(self._relative(obj["Key"]))
            if m:
                found.setdefault(int(m.group(1)), []).append((m.group(2), obj["LastModified"]))
        recorded = {(e.step, e.save_id) for e in events}       # once: a lookup per manifest, not a scan
        found = {step: [v for v in saves if not self._uncommitted(step, v[0], recorded)]
                 for step, saves in found.items()}
        found = {step: saves for step, saves in found.items() if saves}
        seqs = {(e.step, e.save_id): e.seq for e in events}
        committed = {}
        for step, saves in found.items():
            committed[step] = max(saves, key=lambda v: (seqs.get((step, v[0]), 0), v[1]))[0]
        return committed, events

    def _events(self, objects: List[Dict[str, Any]]) -> List[Event]:
        """The commit events among ``objects`` (one listing), but those a displaced
        writer published after its fence (``s3leases.FENCES``: a takeover, or a
        lease that expired): such a commit never happened."""
        fences: Dict[str, Any] = {}
        stamped = []
        for obj in objects:
            relative = self._relative(obj["Key"])
            if relative.startswith(FENCES + "/"):
                fences[relative[len(FENCES) + 1:]] = obj["LastModified"]
                continue
            event = parse_event_key(relative)
            if event is not None:
                stamped.append((event, obj["LastModified"]))
        out = []
        for event, stamp in stamped:
            fenced = fences.get(event.save_id.split("-", 1)[0])
            if fenced is not None and stamp > fenced:
                log.warning("lazyckpt: %s: ignoring the commit of step %d (save %s): its writer had been "
                            "displaced when it was published", self.url, event.step, event.save_id)
                continue
            out.append(event)
        return out

    def _uncommitted(self, step: int, save_id: str, recorded: Set[Tuple[int, str]]) -> bool:
        """A manifest whose event is missing where events are kept: a commit
        interrupted between its manifest PUT and its event PUT (the commit
        point), so not committed -- unless the manifest carries no ``seq`` (a
        save from before events existed). One GET, only for such a manifest
        (never after a clean commit); the verdict on an old save is kept.
        ``recorded``: (step, save id) of every event of the listing, a set: one
        lookup per manifest (a scan of the events per manifest made a listing of
        N steps cost N^2 comparisons: minutes at 100,000 steps)."""
        if not recorded or (step, save_id) in self._legacy or (step, save_id) in recorded:
            return False
        raw = self.store.get(self._key(step_dirname(step), save_id, MANIFEST), manifests.MAX_MANIFEST_BYTES)
        numbered = manifest_event(raw)
        if numbered is not None and numbered.seq is None:
            self._legacy.add((step, save_id))
            return False
        return True

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
        tail = self.tail()
        if tail is not None:
            return tail.step
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Dict[str, Any]:
        url = self.step_path(step)
        return read_manifest(url, self.options)

    # ---------------------------------------------------------------- commit

    def commit(self, step: int, save_id: str, manifest_raw: bytes, event: Optional[Event] = None) -> List[int]:
        """Write the manifest of ``save_id``, then its commit ``event``: that PUT
        is the commit point (docs/RELIABILITY.md), step ``step`` exists from
        there on. Without an event (a persistent tier's upload, whose event went
        up at the local commit) the manifest is. Committed steps >= ``step``
        (an abandoned line of history) are deleted after it: readers already
        tell them superseded by the event."""
        if self.writer is not None:
            self.writer.check()         # displaced by a takeover since save(): commit nothing
        # Above the latest step (every commit but a rollback's) nothing is superseded:
        # the index says so in four requests, a listing grows with the run.
        quick = self._supersedes_nothing(step, event if event is not None else manifest_event(manifest_raw),
                                         published=event is None)
        committed, events = ({}, []) if quick else self.listing()
        self.store.put(self._key(step_dirname(step), save_id, MANIFEST), manifest_raw)
        if event is not None:
            self.put_event(event)
            events = events + [event]
        published = event if event is not None else manifest_event(manifest_raw)
        if published is not None and published.seq is not None:
            self._write_head(published)
        if quick:
            return []
        superseded = sorted((s for s in committed if s >= step and committed[s] != save_id), reverse=True)
        for s in superseded:
            self._drop(s, committed[s])
        if superseded:
            log.warning("lazyckpt: %s: step %d supersedes step(s) %s of an abandoned run (deleted)",
                        self.url, step, superseded)
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

    def _supersedes_nothing(self, step: int, mine: Optional[Event], published: bool) -> bool:
        """Whether a commit of ``step`` (its event ``mine``) supersedes nothing
        here, from the index. A directory's commit: above the tail. A persistent
        tier's upload, whose own event went up at the local commit (so the
        tail, that event's save not here yet, cannot answer): above the head
        and every event between the head and its own -- whatever is live here
        and older than it is one of those or older; later events are not its
        to supersede."""
        if not published:
            tail = self.tail()
            return tail is not None and step > tail.step
        head = self._head()
        if head is None or mine is None or mine.seq is None or head.step >= step or head.seq >= mine.seq:
            return False
        return all(e.step < step for e in self._events_from(head.seq) if e.seq < mine.seq)

    def acquire_writer(self, heartbeat_s: float, expiry_s: float, takeover: bool = False,
                       fence: Optional[str] = None) -> ObjectWriterLease:
        return ObjectWriterLease(self.store, self.prefix, self.url, heartbeat_s, expiry_s, takeover=takeover,
                                 fence=fence)

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

    def reading(self, step: int) -> ContextManager[Any]:
        """Hold committed ``step`` while it is read (a reader lease under its save prefix)."""
        return reading_object_step(self.step_path(step), self.options)

    def delete_step(self, step: int, even_if_read: bool = False) -> bool:
        """Delete a committed step; False if there is none, or a reader holds a
        live lease on it (unless ``even_if_read``)."""
        committed = self.listing()[0]          # an abandoned save left here too
        if step not in committed:
            return False
        return self._drop(step, committed[step], even_if_read)

    def apply_retention(self, policy: Union[None, int, Policy]) -> List[int]:
        """Delete the committed steps ``policy`` does not keep (None: keep every
        step; never the newest), newest first, and the saves a rollback
        abandoned here whatever the policy (superseded steps are never kept
        aside on an object store); a step being read stays until a later pass."""
        policy = as_policy(policy)
        if policy is None:
            return []
        committed, events = self.listing()
        # Decided on the line of history: an abandoned save left here (its
        # superseding step still uploading) is no kept step; it goes too.
        live = dict(line(events + [Event(s, sid, None) for s, sid in committed.items()]))
        on_line = {s: sid for s, sid in committed.items() if live.get(s) == sid}
        doomed = set(self._plan(policy, on_line).doomed) | {s for s in committed if s not in on_line}
        # A step being read (a live reader lease) stays until a later pass.
        old = sorted(doomed, reverse=True)
        busy = [s for s in old if not self._drop(s, committed[s], even_if_read=False)]
        if busy:
            log.info("lazyckpt: %s: step(s) %s are being read; deleting them later", self.url, busy)
        self.prune_events()
        return sorted(s for s in old if s not in busy)

    def _plan(self, policy: Optional[Policy], committed: Dict[int, str]) -> Plan:
        """:func:`lazyckpt.retention.plan` over ``committed`` (step -> save id, from
        one listing). No step refers to another here (incremental steps are
        local only). A save's metadata is read (one GET) only when the policy
        ranks by it, once per save: a save id's manifest never changes."""
        present = set(committed.items())
        for key in [k for k in self._metadata if k not in present]:
            del self._metadata[key]                     # bounded by the steps present
        return plan(policy, sorted(committed), lambda step: self._saved_metadata(step, committed[step]))

    def _saved_metadata(self, step: int, save_id: str) -> Dict[str, Any]:
        key = (step, save_id)
        found = self._metadata.get(key)
        if found is not None:
            return found
        # A store that fails the GET fails the pass (raised): guessing {} would
        # delete a step the policy keeps.
        raw = self.store.get(self._key(step_dirname(step), save_id, MANIFEST), manifests.MAX_MANIFEST_BYTES)
        if raw is None:
            return {}                           # deleted meanwhile: nothing to keep
        try:
            found = saved_metadata(manifests.parse(raw, f"{self.save_url(step, save_id)}/{MANIFEST}"))
        except CheckpointError as exc:          # damaged: never among the best (a load of it fails too)
            log.warning("lazyckpt: %s: step %d: its metadata cannot be read for retention: %s", self.url,
                        step, exc)
            found = {}
        self._metadata[key] = found
        return found

    # ---------------------------------------------------------------- leftovers

    def leftovers(self, expiry_s: Optional[float] = None, within: Optional[str] = None,
                  stop: Optional[Callable[[], bool]] = None) -> List[Leftover]:
        """Save prefixes without a manifest that are provably dead: their newest
        object (the heartbeat included) and their newest open multipart upload
        are older than the lease expiry ("interrupted-save", named
        ``step_X/<save_id>`` relative to the directory, oldest name first).
        Younger ones may be a save in progress and are not listed."""
        expiry = self.options.lease_expiry_s if expiry_s is None else expiry_s
        groups: Dict[str, List[Any]] = {}
        uploads: Dict[str, List[Any]] = {}
        committed = set()
        # now: the server's clock. ``stop`` (the scan at open, cancelled by close): looked
        # at between pages; a listing left unfinished ends the scan (ScanCancelled).
        objects, now = self.store.listing(within or self._key(""), stop=stop) if stop is not None \
            else self.store.listing(within or self._key(""))
        events = self._events(objects) if within is None else []
        recorded = {(e.step, e.save_id) for e in events}
        for obj in objects:
            prefix = self._save_prefix(obj["Key"])
            if prefix is None:
                continue
            m = _COMMITTED.match(self._relative(obj["Key"]))
            if m and (self._committed_alone(int(m.group(1)), m.group(2)) if within is not None
                      else not self._uncommitted(int(m.group(1)), m.group(2), recorded)):
                committed.add(prefix)
            groups.setdefault(prefix, []).append(obj)
        for up in self.store.uploads(within or self._key("")):
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
            if not (age > expiry or expiry <= 0):
                with self._watch_mutex:
                    self._watch.add(prefix)     # maybe a save in progress: tidy() looks again
                continue
            name = self._relative(prefix).rstrip("/")
            m = _SAVE_KEY.match(name + "/")
            out.append(Leftover(name, "interrupted-save", sum(o["Size"] for o in groups.get(prefix, [])),
                                int(m.group(1)) if m else None, self.store.url(prefix.rstrip("/")), age))
        return sorted(out, key=lambda lo: lo.name)

    def _committed_alone(self, step: int, save_id: str) -> bool:
        """Whether the manifest of one save is committed, without the run's
        listing: it carries no ``seq`` (before events), or its event exists."""
        raw = self.store.get(self._key(step_dirname(step), save_id, MANIFEST), manifests.MAX_MANIFEST_BYTES)
        event = manifest_event(raw)
        if event is None:
            return raw is not None          # unreadable: not ours to delete
        return event.seq is None or self.store.size(self._key(event_key(event))) is not None

    def _save_prefix(self, key: str) -> Optional[str]:
        m = _SAVE_KEY.match(self._relative(key))
        return self._key(step_dirname(int(m.group(1))), m.group(2)) + "/" if m else None

    def recover(self, wait: bool = True) -> List[int]:
        return []                       # a save becomes visible by one PUT (its manifest): nothing to finish

    def start_tidy(self) -> None:
        """At open: the full leftover scan (one listing of the directory, which
        grows with the steps kept), in the background (storage/scan.py)."""
        self._scan.start()

    def tidy(self) -> List[str]:
        """After a commit: the save prefixes the scan found live, listed one by
        one (not the whole prefix)."""
        self._scan.join()
        with self._watch_mutex:
            watched = sorted(self._watch)
        removed = []
        for prefix in watched:
            with self._watch_mutex:
                self._watch.discard(prefix)     # (leftovers() watches it again while it is live)
            removed += self._remove(self.leftovers(within=prefix))
        return removed

    def close(self) -> None:
        """Cancel the scan started at open: it stops at its next page (its
        listing grows with the steps kept, closing must not: storage/scan.py)."""
        self._scan.cancel()

    def wait_for_frees(self, timeout: Optional[float] = None) -> bool:
        return True                     # retention's deletes end before it returns here

    def clean_leftovers(self, expiry_s: Optional[float] = None) -> List[str]:
        """Delete dead saves' prefixes and abort their open uploads (never a
        save whose heartbeat or upload is younger than the lease expiry)."""
        return self._remove(self.leftovers(expiry_s))

    def _remove(self, leftovers: List[Leftover], stop: Optional[Callable[[], bool]] = None) -> List[str]:
        removed = []
        for leftover in leftovers:
            if stop is not None and stop():
                break                   # the scan at open, cancelled by close
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

    def retention_plan(self, policy: Union[None, int, Policy],
                       committed: Optional[Dict[int, str]] = None) -> Tuple[List[int], List[int]]:
        """(the steps ``policy`` does not keep, newest first; [] -- no step refers
        to another here: incremental steps are local only)."""
        return self._plan(as_policy(policy), self.committed() if committed is None else committed).doomed, []

    def retire_old(self, policy: Union[None, int, Policy],
                   line: Optional[List[int]] = None) -> Tuple[List[int], List[int]]:
        """Each step's manifest first, then its data; a step with a live reader
        lease stays, as a locked one does locally. Then the history events of
        the deleted steps (FORMAT.md §11.10). A save is deleted by its save id,
        never by its step number alone: a rollback that commits a new save
        under a planned number meanwhile keeps it. ``line``: filled with the
        committed steps once it is done (listed again)."""
        committed = self.committed()        # one listing for every step (one per step made
        doomed, _ = self.retention_plan(policy, committed)   # a prune of N steps list N times)
        deleted, kept = [], []
        for step in doomed:
            if self._drop(step, committed[step], even_if_read=False) or step not in self.committed():
                deleted.append(step)        # (or deleted concurrently: the outcome wanted)
            else:
                log.info("lazyckpt: %s: step %d is being read; deleting it later", self.url, step)
                kept.append(step)
        if line is not None:
            # Listed again: no lock keeps another process from committing meanwhile (a
            # rollback superseding planned steps), so this is the line as it is now.
            line[:] = sorted(self.committed())
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

    def open_output(self, path: str, options: Options, block_bytes: int) -> ObjectOutput:
        return ObjectOutput(path, options.storage_options, block_bytes)

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
        # The manifest, then the event (the commit point): killed in between, the save is not
        # committed (its manifest has a seq and no event) and the line before it stands.
        return self.directory.commit(self.step, self.save_id, manifest_raw, event)

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


