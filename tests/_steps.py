"""Step states for the tests that force one interleaving between two actors on a
Checkpointer directory (tests/test_neighbours.py, tests/test_lease_release.py
and the second process it starts): each step's values say which step saved
them, so a load shows at once which save it returned."""

from __future__ import annotations

from typing import Any, Dict, Iterable

import torch

import lazyckpt


def step_state(step: int) -> Dict[str, Any]:
    """The state saved as ``step``: eight floats, ``step`` to ``step + 7``."""
    return {"w": torch.arange(8, dtype=torch.float32) + step}


def is_step_state(state: Dict[str, Any], step: int) -> bool:
    """Whether ``state`` (what a load returned) is the state saved as ``step``."""
    return torch.equal(state["w"], step_state(step)["w"])


def make_steps(directory: Any, steps: Iterable[int]) -> None:
    """``steps`` saved and committed in ``directory`` (no retention), the writer closed."""
    with lazyckpt.Checkpointer(directory, keep=None) as ck:
        for s in steps:
            ck.save(step_state(s), s)
        ck.wait()
