"""Retention policies: which committed steps a Checkpointer keeps.

A policy decides; storage only deletes the steps the policy does not keep
(``Directory.apply_retention(policy)``). ``keep=3`` is ``KeepLast(3)``.

(Interface stub: the full policies -- KeepEvery, KeepBest, combination with
``|`` -- are being written against this interface.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Union


@dataclass(frozen=True)
class StepInfo:
    """A committed step as a policy sees it: its number and the ``metadata=``
    its save recorded (an empty dict when none)."""
    step: int
    metadata: Dict[str, Any] = field(default_factory=dict)


class Policy:
    """Base of the retention policies."""

    def select(self, steps: List[StepInfo]) -> Set[int]:
        """The steps to keep among ``steps`` (committed, oldest first)."""
        raise NotImplementedError

    def metrics(self) -> List[str]:
        """The metadata keys this policy reads (a save lacking one is refused at save())."""
        return []

    def __or__(self, other: "Policy") -> "Policy":
        raise NotImplementedError


@dataclass(frozen=True)
class KeepLast(Policy):
    """Keep the ``k`` newest committed steps."""
    k: int

    def __post_init__(self) -> None:
        if type(self.k) is not int or self.k < 1:
            raise ValueError(f"KeepLast(k): k must be an int >= 1, got {self.k!r}")

    def select(self, steps: List[StepInfo]) -> Set[int]:
        return {s.step for s in steps[-self.k:]}


def as_policy(keep: Union[None, int, Policy], name: str = "keep") -> Optional[Policy]:
    """``None`` (keep every step), an int (``KeepLast``) or a policy, checked."""
    if keep is None or isinstance(keep, Policy):
        return keep
    if type(keep) is int:
        if keep < 1:
            raise ValueError(f"{name} must be an int >= 1, a retention policy or None, got {keep!r}")
        return KeepLast(keep)
    raise TypeError(f"{name} must be None, an int or a retention policy (lazyckpt.KeepLast, KeepEvery, KeepBest), "
                    f"got {type(keep).__name__}")


def keeps_superseded(policy: Optional[Policy]) -> bool:
    """Whether steps superseded by a rollback are kept aside (``.abandoned-*``)
    rather than deleted: only when no policy is set (keep everything)."""
    return policy is None


__all__ = ["StepInfo", "Policy", "KeepLast", "as_policy", "keeps_superseded"]
