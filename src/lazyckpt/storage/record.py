"""``DIR/history.json``, the local tier's record of recent commits: the
local commit's commit point (its rules: :mod:`lazyckpt.lineage`; its format:
docs/FORMAT.md)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from lazyckpt.formats.names import MAX_SEQ
from lazyckpt.lineage import RECENT_EVENTS, RECORD, Committing, Event, event_problem, max_seq
from lazyckpt.storage.fileio import read_small_file, write_file_atomic

log = logging.getLogger("lazyckpt")


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
