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

* local tier: ``DIR/history.json`` (``lazyckpt.storage.record.LocalRecord``), written atomically
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
import re
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from lazyckpt.errors import CorruptCheckpointError
from lazyckpt.formats.names import MAX_SEQ, MAX_STEP, SAVE_ID

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
#: abandoned run from the live line, and bounded.
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


__all__ = ["Event", "Committing", "line", "abandoned", "max_seq", "RECORD",
           "EVENTS_PREFIX", "event_key", "parse_event_key", "prunable", "manifest_event", "event_problem", "MAX_SEQ",
           "MAX_STEP", "SAVE_ID"]
