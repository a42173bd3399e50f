"""The line of history: which committed saves are live, on every tier.

A committed save is a ``(step, save_id)``. The coordinator gives each commit
a sequence number ``seq`` (1 + the largest one it knows of; recorded in the
manifest, FORMAT.md §11.2). The rule that defines the line is the local
directory's: committing step S supersedes every step >= S. Applied to a set
of commit events in ``seq`` order, it gives one answer wherever the events
come from -- the local record, the manifests, the persistent tier's event
objects, the partners' replicas -- so every ``load()``, fallback, retention
decision and replica restore asks :func:`line` instead of comparing step
numbers across tiers (a step number alone cannot tell step 3 of an abandoned
run from step 3 of the resumed one, nor that step 5 was abandoned).

Events without a ``seq`` (manifests written before it existed) are ordered
by step before every numbered event: their directories were already one line.

Where the events live:

* local tier: ``DIR/history.json`` (:class:`LocalRecord`), written atomically
  by the coordinator once the new step is complete in its temporary
  directory. That write is the local commit's **commit point**: it also
  names the temporary directory (``"commit"``), so the renames that follow
  (superseded steps aside, the new step in) are replayed by whoever opens
  the directory after a crash (``CheckpointDir.recover``), and readers see
  the committed line in between (``CheckpointDir.step_paths``). It keeps the
  largest ``seq`` so that numbering survives the deletion of every step.
* object store (``persist_to`` or an ``s3://`` directory): one empty object
  per event, ``PREFIX/history/<seq>-<step>-<save_id>`` (all in the key: one
  listing reads them with the steps). Written when the local commit happens,
  before the step's upload, so a rollback supersedes there at once.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import re
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from lazyckpt.errors import CheckpointError, CorruptCheckpointError
from lazyckpt.formats.names import MANIFEST, MAX_SEQ, MAX_STEP, SAVE_ID
from lazyckpt.storage.fileio import read_small_file, write_file_atomic

log = logging.getLogger("lazyckpt")

RECORD = "history.json"
#: Object-store event keys, relative to the checkpoint prefix.
EVENTS_PREFIX = "history/"
_EVENT_KEY = re.compile(r"^history/(\d{12})-(\d{10})-([A-Za-z0-9_.-]{1,128})$")
# What an event key holds (formats/names.py: MAX_SEQ, MAX_STEP, SAVE_ID): every
# number read from a record, a manifest or a key is checked against them, and
# no commit is numbered past them.
#: Events kept in the local record (the newest; present steps' events are also
#: in their manifests): enough to tell any tier's leftover of a recent
#: abandoned run from the live line, and bounded (issue 34).
RECENT_EVENTS = 256


class Event(NamedTuple):
    step: int
    save_id: str
    #: None: a manifest written before ``seq`` existed.
    seq: Optional[int]


def _merge(events: Iterable[Event]) -> List[Event]:
    """One event per save (the same save seen on several tiers), numbered when any copy is."""
    by_save: Dict[Tuple[int, str], Event] = {}
    for e in events:
        old = by_save.get((e.step, e.save_id))
        if old is None or (old.seq is None and e.seq is not None) or \
                (e.seq is not None and old.seq is not None and e.seq > old.seq):
            by_save[(e.step, e.save_id)] = e
    return sorted(by_save.values(), key=lambda e: (e.seq if e.seq is not None else 0, e.step, e.save_id))


def line(events: Iterable[Event]) -> List[Tuple[int, str]]:
    """The live saves, oldest step first: the events applied in commit order,
    each one superseding every live step >= its own."""
    live: List[Event] = []                      # ascending steps: a commit pops from the end
    for e in _merge(events):                    # (a filter of the whole line per event made a
        while live and live[-1].step >= e.step:  # run of N steps cost N^2: minutes at 100,000)
            live.pop()
        live.append(e)
    return [(e.step, e.save_id) for e in live]


def abandoned(events: Iterable[Event]) -> Set[Tuple[int, str]]:
    """The saves a later commit superseded (never returned, never re-committed)."""
    merged = _merge(events)
    return {(e.step, e.save_id) for e in merged} - set(line(merged))


def event_problem(step: Any, save_id: Any, seq: Any, seq_optional: bool = True) -> Optional[str]:
    """What is wrong with an event's fields (None: nothing): a step in
    0..MAX_STEP, a seq in 1..MAX_SEQ (or None where ``seq_optional``), a save
    id of the event key's characters. ``bool`` is no number here."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        return f"step {step!r} is not an integer in 0..{MAX_STEP}"
    if not isinstance(save_id, str) or not SAVE_ID.fullmatch(save_id):
        return f"save_id {save_id!r} is not 1 to 128 of [A-Za-z0-9_.-]"
    if seq is None and seq_optional:
        return None
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        return f"seq {seq!r} is not an integer in 1..{MAX_SEQ}"
    return None


def max_seq(events: Iterable[Event]) -> int:
    return max((e.seq for e in events if e.seq is not None), default=0)


def manifest_event(raw: Optional[bytes]) -> Optional[Event]:
    """(step, save_id, seq) of a manifest's bytes, or None if unreadable. Only
    identifies the save; loading it checks the manifest in full."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
        step, sid, seq = doc.get("step"), doc.get("save_id"), doc.get("seq")
    except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return None
    if "seq" not in doc:
        seq = None
    if event_problem(step, sid, seq) is not None:
        return None             # identifies nothing: loading it reports the field (manifest.parse)
    return Event(step, sid, seq)


# --------------------------------------------------------------------------- object-store events


def event_key(e: Event) -> str:
    """The event's object key; refuses an event the key could not hold (it
    would not parse back, and its step would vanish from the line)."""
    problem = event_problem(e.step, e.save_id, e.seq, seq_optional=False)
    if problem is not None:
        raise CorruptCheckpointError(f"commit event {tuple(e)}: {problem}; its event key could not be parsed "
                                     f"back", step=e.step if type(e.step) is int else None)
    return f"{EVENTS_PREFIX}{e.seq:012d}-{e.step:010d}-{e.save_id}"


def parse_event_key(relative: str) -> Optional[Event]:
    m = _EVENT_KEY.match(relative)
    return Event(int(m.group(2)), m.group(3), int(m.group(1))) if m else None


def prunable(events: Iterable[Event], present: Dict[int, str]) -> List[Event]:
    """Events an object-store tier no longer needs: their save is not there,
    they supersede nothing still there, and they are not the largest ``seq``
    (which keeps the numbering). ``present``: step -> save_id committed there."""
    events = list(events)
    top = max_seq(events)
    present_seq = {(e.step, e.save_id): e.seq for e in events}
    # An event supersedes a present save when that save's step is >= its own
    # and it was committed before it (a save with no seq: -1 here, before
    # all). The oldest commit among the present steps >= s, for every s: one
    # bisect per event (a scan of the present steps per event cost events x steps).
    steps = sorted(present)
    oldest_from: List[int] = [0] * len(steps)
    oldest = None
    for i in range(len(steps) - 1, -1, -1):
        seq = present_seq.get((steps[i], present[steps[i]]))
        seq = -1 if seq is None else seq
        oldest = seq if oldest is None else min(oldest, seq)
        oldest_from[i] = oldest
    out = []
    for e in events:
        if e.seq == top or present.get(e.step) == e.save_id:
            continue
        i = bisect.bisect_left(steps, e.step)
        supersedes_present = i < len(steps) and oldest_from[i] < (e.seq or 0)
        if not supersedes_present:
            out.append(e)
    return out


# --------------------------------------------------------------------------- the local record


class Committing(NamedTuple):
    """The last commit the local record holds: its event and the name of the
    temporary directory that becomes ``step_<step>`` (docs/RELIABILITY.md)."""
    event: Event
    tmp: str


class LocalRecord:
    """``DIR/history.json``: ``{"seq": <largest>, "events": [[step, save_id, seq], ...],
    "commit": [step, save_id, seq, tmp]}`` (``commit``: the last commit, whose
    renames a crash may have interrupted; readers of older versions ignore it)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, RECORD)

    def _doc(self) -> Optional[Dict[str, Any]]:
        raw = read_small_file(self.path, 16 << 20)
        if raw is None:
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            return doc
        except (UnicodeDecodeError, ValueError, RecursionError):
            return {}

    def read(self) -> Tuple[int, List[Event]]:
        doc = self._doc()
        if doc is None:
            return 0, []
        try:
            events = [Event(s, sid, q) for s, sid, q in doc["events"]]
            top = doc["seq"]
            # Range-checked, not trusted: a number an event key cannot hold would number
            # the next commit into a key that does not parse back (FORMAT.md §11).
            problem = next((f"event {list(e)}: {p}" for e in events
                            for p in [event_problem(e.step, e.save_id, e.seq, seq_optional=False)] if p), None)
            if problem is None and (type(top) is not int or not 0 <= top <= MAX_SEQ):
                problem = f"seq {top!r} is not an integer in 0..{MAX_SEQ}"
            if problem is not None:
                raise ValueError(problem)
            return max(top, max_seq(events)), events
        except (ValueError, KeyError, TypeError) as exc:
            # Damaged: the manifests still carry every present step's seq.
            log.warning("lazyckpt: %s is unreadable (%s); the line of history is taken from the manifests",
                        self.path, exc)
            return 0, []

    def committing(self) -> Optional[Committing]:
        """The last commit recorded with its temporary directory, or None (no
        record, a record of an older version, or a damaged one)."""
        doc = self._doc()
        entry = doc.get("commit") if doc else None
        try:
            step, sid, seq, tmp = entry
            if event_problem(step, sid, seq, seq_optional=False) or not isinstance(tmp, str) or os.sep in tmp \
                    or not tmp.startswith(".tmp-step_"):
                raise ValueError(entry)
        except (TypeError, ValueError):
            return None
        return Committing(Event(step, sid, seq), tmp)

    def add(self, event: Event, tmp: Optional[str] = None) -> None:
        """Record a commit (coordinator, once the step is complete in ``tmp``:
        this atomic write is the commit point). Keeps the newest
        ``RECENT_EVENTS`` events, whatever the number of steps kept: every
        present step's event is also in its manifest, so the record's size,
        and the cost of rewriting it at every commit, do not grow with the run."""
        top, events = self.read()
        events = [e for e in events if (e.step, e.save_id) != (event.step, event.save_id)] + [event]
        events.sort(key=lambda e: e.seq)
        doc: Dict[str, Any] = {"seq": max(top, event.seq or 0),
                               "events": [[e.step, e.save_id, e.seq] for e in events[-RECENT_EVENTS:]]}
        if tmp is not None:
            doc["commit"] = [event.step, event.save_id, event.seq, tmp]
        write_file_atomic(self.path, json.dumps(doc, separators=(",", ":")).encode())


class History:
    """The line of history of one Checkpointer: numbers its commits and
    answers which saves are live, from the local record, the local manifests
    and (``remote``) the persistent tier's events."""

    def __init__(self, layout: Any, remote: Any = None):
        #: A local CheckpointDir (None: the directory is itself on an object store).
        self.layout = layout
        #: An ObjectCheckpointDir whose events count too (persist_to=, or the directory itself).
        self.remote = remote
        self.record = LocalRecord(layout.path) if layout is not None else None
        self._top: Optional[int] = None

    # ------------------------------------------------------------ numbering

    def next_seq(self) -> int:
        """1 + the largest seq known (read once, then counted here)."""
        if self._top is None:
            top = 0
            if self.record is not None:
                top = self.record.read()[0]
                tail = self.layout.tail() if top else None
                if tail is not None:
                    # The record holds the largest seq; the newest step's manifest too, in
                    # case a copy brought it in without the record (no listing either way).
                    e = manifest_event(read_small_file(os.path.join(tail[1], MANIFEST), 1 << 30))
                    top = max(top, e.seq or 0) if e is not None else top
                else:
                    top = max(top, max_seq(self.local_events()))     # no record, or no index: every manifest
            if self.remote is not None:
                try:
                    top = max(top, self.remote.top_seq())
                except Exception as exc:        # unreachable now: local numbering still orders locally
                    log.warning("lazyckpt: %s: its history cannot be read (%s); numbering commits from the "
                                "local tier", getattr(self.remote, "url", self.remote), exc)
            self._top = top
        if self._top >= MAX_SEQ:
            where = self.record.path if self.record is not None else getattr(self.remote, "url", "its history")
            raise CorruptCheckpointError(
                f"{where}: the line of history is numbered up to seq {self._top} (history.json, a manifest or an "
                f"event says so), the largest an event key holds is {MAX_SEQ}: no commit can be numbered after "
                f"it. A damaged or hand-edited record? Fix or remove the field that says so",
                path=where if isinstance(where, str) else None)
        self._top += 1
        return self._top

    def saw(self, seq: Optional[int]) -> None:
        """A save numbered elsewhere (a replica restored here) keeps the numbering above it."""
        if seq is not None and self._top is not None:
            self._top = max(self._top, seq)

    # ------------------------------------------------------------ the indexes of both tiers

    def local_tail(self) -> Any:
        """The local tier's newest commit as an Event, from its index (a few
        ``stat`` calls and its manifest); None when the tier holds no step;
        False when its index cannot tell (then only every manifest can)."""
        tail = self.layout.tail()
        if tail is None:
            return None if not self.layout.step_paths() else False
        e = manifest_event(read_small_file(os.path.join(tail[1], MANIFEST), 1 << 30))
        return e if e is not None and e.step == tail[0] and e.seq is not None else False

    def newest_save(self) -> Optional[Tuple[Optional[Event], Event, Event]]:
        """(the local tail or None, the persistent tail, the newest live save) from
        the two tiers' indexes alone, without reading every manifest or listing
        the store (issue 34); None when either cannot tell -- the caller builds
        the whole line. Why the newest commit by ``seq`` is the newest live save:
        a commit of S supersedes every save >= S, so after the last one nothing
        is above it; each tier's tail is its own newest commit."""
        local = self.local_tail()
        if local is False:
            return None
        try:
            remote = self.remote.tail()
        except CheckpointError:
            return None
        if remote is None or remote.seq is None:
            return None             # no index there (an empty store, one from before it): list it
        if local is not None and local.seq == remote.seq and local != remote:
            return None             # two saves numbered alike: not one line, let the line decide
        newest = local if local is not None and local.seq > remote.seq else remote
        return local, remote, newest

    def local_events_above(self, seq: int) -> Optional[List[Event]]:
        """The local events numbered above ``seq``, from the record alone (it
        keeps the newest ones), or None when it may not hold them all."""
        events = self.record.read()[1] if self.record is not None else []
        if not events:
            return None if self.layout.step_paths() else []     # (no record, no step: nothing here)
        if min(e.seq for e in events) > seq + 1:
            return None
        return [e for e in events if e.seq > seq]

    # ------------------------------------------------------------ the local tier

    def local_saves(self) -> Dict[int, Event]:
        """step -> its event, for every step present locally (from its manifest,
        else from the record; save_id None where neither tells)."""
        out: Dict[int, Event] = {}
        recorded: Dict[int, Event] = {}
        if self.record is not None:
            for e in sorted(self.record.read()[1], key=lambda e: e.seq):
                recorded[e.step] = e
        for step, path in self.layout.step_paths().items():
            e = manifest_event(read_small_file(os.path.join(path, MANIFEST), 1 << 30))
            if e is None or e.step != step:
                e = recorded.get(step, Event(step, None, None))     # type: ignore[arg-type]
            out[step] = e
        return out

    def local_events(self) -> List[Event]:
        events = [e for e in self.local_saves().values() if e.save_id is not None]
        if self.record is not None:
            events += self.record.read()[1]
        return events


__all__ = ["Event", "Committing", "line", "abandoned", "max_seq", "History", "LocalRecord", "RECORD",
           "EVENTS_PREFIX", "event_key", "parse_event_key", "prunable", "manifest_event", "event_problem", "MAX_SEQ",
           "MAX_STEP", "SAVE_ID"]
