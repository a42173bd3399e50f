"""When to save: ``interval=`` and preemption, asked through ``Checkpointer.should_save(step)``.

(Interface stub: ``Every``, ``Auto`` and preemption are being written against
this interface.)
"""

from __future__ import annotations

from typing import Any, Optional


class SaveSchedule:
    """Decides, at each step boundary, whether this step is saved.

    ``interval``: None (the user's loop decides: ``should_save`` is then only
    True on preemption), ``Every(steps=, seconds=)``, ``"auto"`` or ``Auto(mtbf=)``.
    ``preemption``: False, True or a ``Preemption``. ``dist``: the commit group's
    RankInfo (decisions that differ by rank are agreed on)."""

    def __init__(self, interval: Any = None, preemption: Any = False, dist: Any = None):
        if interval is not None or preemption not in (False, None):
            raise NotImplementedError("interval= and preemption= are not built yet")
        self.interval = interval
        self.preemption = preemption
        self.dist = dist
        #: Whether a preemption signal arrived.
        self.preempted = False

    def should_save(self, step: int) -> bool:
        return False

    def close(self) -> None:
        """Restore signal handlers installed for preemption."""


__all__ = ["SaveSchedule"]
