"""The leftover scan a Checkpointer starts when it opens a directory, on a
thread: a listing of the whole directory grows with the steps kept, so
opening and the first load do not wait for it; a commit's cleanup joins it.
``close()`` cancels it, then joins it: the scan looks at the cancel before
each name it reads from the directory (the listing is read incrementally:
``os.scandir``, a page of an object listing) and before each removal, so the
join waits for one batch of names, not for the listing, and closing costs the
same whatever the number of steps (benchmarks/bench_close.py). A cancelled
scan removes nothing more; what it did not reach waits for the next open.
Shared by the local and the object-store layouts."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger("lazyckpt")


class ScanCancelled(Exception):
    """Raised inside a scan whose directory was closed (its listing left unfinished)."""


class BackgroundScan:
    def __init__(self, scan: Callable[[], object], where: str):
        self._run = scan
        self._where = where
        self._thread: Optional[threading.Thread] = None
        #: Set by :meth:`cancel`: the scan looks at it before each name it would act on.
        self.cancelled = threading.Event()

    def start(self) -> None:
        """Once per directory object; later calls do nothing."""
        if self._thread is None and not self.cancelled.is_set():
            self._thread = threading.Thread(target=self._quietly, name="lazyckpt-leftovers", daemon=True)
            self._thread.start()

    def _quietly(self) -> None:
        try:
            self._run()
        except Exception as exc:        # cleanup is best effort: a later open scans again
            if self.cancelled.is_set():     # closed meanwhile (the directory may be gone): no one to tell
                log.debug("lazyckpt: %s: the cancelled leftover scan stopped: %s", self._where, exc)
            else:
                log.warning("lazyckpt: %s: the leftover scan failed: %s", self._where, exc)

    def cancel(self) -> None:
        """Stop the scan at its next name or page, and wait for it to stop (close)."""
        self.cancelled.set()
        self.join()

    def join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
