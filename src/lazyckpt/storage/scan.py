"""The leftover scan a Checkpointer starts when it opens a directory, on a
thread (issue 34): a listing of the whole directory grows with the steps
kept, so opening and the first load do not wait for it; a commit's cleanup
and ``close()`` join it. Shared by the local and the object-store layouts."""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger("lazyckpt")


class BackgroundScan:
    def __init__(self, scan: Callable[[], object], where: str):
        self._run = scan
        self._where = where
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Once per directory object; later calls do nothing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._quietly, name="lazyckpt-leftovers", daemon=True)
            self._thread.start()

    def _quietly(self) -> None:
        try:
            self._run()
        except Exception as exc:        # cleanup is best effort: a later open scans again
            log.warning("lazyckpt: %s: the leftover scan failed: %s", self._where, exc)

    def join(self) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
