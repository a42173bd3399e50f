"""The latest step, looked up once for the whole job.

A job restarting from an object store opens one Checkpointer per rank, and
every rank then loads the latest step. Asked separately, each rank would
query the index itself (``head.json``, two one-page listings, a HEAD): 2R
LIST requests for R ranks, all on the run's prefix at the same instant.
Opening is collective already, so the coordinator does the lookup there and
publishes it in the job's rendezvous store; the other ranks take it from
there: **one lookup per job, no LIST request on any other rank**.

The answer may age between ``open`` and ``load``: another process may
commit, or prune, in between. So it is used only while ``head.json`` is
byte for byte the one the lookup started from (every commit rewrites it:
one GET per rank, the check), and a load that finds the step gone drops it
and looks again. A run with no ``head.json`` (written before it existed)
or a lookup that failed is not shared: every rank looks for itself, as
before. Local directories answer the same question with a few ``stat``
calls (storage/layout.py ``tail``) and do not share.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

from lazyckpt.errors import CheckpointError

log = logging.getLogger("lazyckpt")

#: The store key the coordinator's lookup is published under.
KEY = "open/latest"


class JobLatest:
    """The coordinator's lookup of the latest step at open, on every rank."""

    def __init__(self, layout: Any, dist: Any, shared: bool = True):
        self.layout = layout
        #: ``head.json``'s bytes when the lookup started, or None: nothing shared.
        self.mark: Optional[bytes] = None
        #: (step, its save's URL), or None: no committed step (when ``mark`` is set).
        self.found: Optional[Tuple[int, str]] = None
        #: Whether the last :meth:`locate` answered from the shared lookup.
        self.used = False
        if not (shared and dist.distributed):
            return
        if dist.coordinator:
            value: dict = {}
            try:
                mark = layout.index_mark()
                if mark:
                    found = layout.locate_step(None, mark=mark)
                    value = {"mark": mark.decode("latin-1"), "found": list(found) if found else None}
            except CheckpointError as exc:      # every rank looks for itself, and reports it there
                log.debug("lazyckpt: %s: the lookup of the latest step at open failed: %s", layout.url, exc)
            dist.publish(KEY, value)
            dist.delete([KEY], after="*")       # every rank has read it once any later call agreed
        else:
            value = dist.wait_for([KEY], "the coordinator's lookup of the latest step", None)[KEY]
        if value.get("mark"):
            self.mark = value["mark"].encode("latin-1")
            self.found = tuple(value["found"]) if value["found"] else None

    def locate(self, step: Optional[int]) -> Any:
        """(step, URL) or None from the shared lookup when it still holds (one
        GET: ``head.json``); ``False`` when it cannot answer (the caller asks
        the layout)."""
        self.used = False
        if self.mark is None or (step is not None and (self.found is None or step != self.found[0])):
            return False
        if self.layout.index_mark() != self.mark:
            self.forget()                       # a commit since: it can only be older than the truth
            return False
        self.used = True
        return self.found

    def forget(self) -> None:
        """This job commits (or found the step gone): look for yourself from now on."""
        self.mark = None
        self.found = None
