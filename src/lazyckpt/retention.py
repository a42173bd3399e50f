"""Retention policies: which committed steps a Checkpointer keeps.

A policy decides; storage only deletes the steps the policy does not keep
(``Directory.apply_retention(policy)``)::

    keep=3                                   # KeepLast(3)
    keep=KeepLast(2) | KeepEvery(1000)       # the two newest, and every 1000th step for good
    keep=KeepLast(1) | KeepBest(3, metric="val_loss")   # ranked by save(..., metadata={"val_loss": x})

Whatever the policy, storage also keeps:

- the newest committed step (a restart resumes from it, ``latest`` names it);
- every step a kept step refers to (incremental checkpoints);
- a step another process is reading, until a later pass.

Which steps go is decided here, once (:func:`plan`), for every store: the
local directory and the object-store one only list, read what a policy asks
for and delete. Superseded steps (those a rollback abandoned) follow one
rule too, :func:`keeps_superseded`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple, Union


@dataclass(frozen=True)
class StepInfo:
    """A committed step as a policy sees it: its number and the ``metadata=``
    its save recorded (an empty dict when none, or when no policy reads it)."""
    step: int
    metadata: Dict[str, Any] = field(default_factory=dict)


class Policy:
    """Base of the retention policies. A policy is a value (frozen, hashable,
    compared by its fields); ``a | b`` keeps what either keeps."""

    def select(self, steps: List[StepInfo]) -> Set[int]:
        """The steps to keep among ``steps`` (committed, oldest first)."""
        raise NotImplementedError

    def metrics(self) -> List[str]:
        """The metadata keys this policy reads (a save lacking one is refused at save())."""
        return []

    def __or__(self, other: Any) -> "AnyOf":
        if not isinstance(other, Policy):
            raise TypeError(f"a retention policy combines with another policy (KeepLast(2) | KeepEvery(100)), "
                            f"not with {type(other).__name__}: write {self!r} | KeepLast({other!r})"
                            if type(other) is int else
                            f"a retention policy combines with another policy (KeepLast(2) | KeepEvery(100)), "
                            f"not with {type(other).__name__}")
        return AnyOf(self, other)


def _positive(name: str, value: Any, example: str) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}; for example {example}")


@dataclass(frozen=True, repr=False)
class KeepLast(Policy):
    """Keep the ``k`` newest committed steps."""
    k: int

    def __post_init__(self) -> None:
        _positive("KeepLast(k): k", self.k, "KeepLast(3)")

    def select(self, steps: List[StepInfo]) -> Set[int]:
        return {s.step for s in steps[-self.k:]}

    def __repr__(self) -> str:
        return f"KeepLast({self.k})"


@dataclass(frozen=True, repr=False)
class KeepEvery(Policy):
    """Keep for good every step divisible by ``n`` (``KeepEvery(1000)``: steps
    0, 1000, 2000, ...), whatever else the policy deletes."""
    n: int

    def __post_init__(self) -> None:
        _positive("KeepEvery(n): n", self.n, "KeepEvery(1000) keeps steps 0, 1000, 2000, ...")

    def select(self, steps: List[StepInfo]) -> Set[int]:
        return {s.step for s in steps if s.step % self.n == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.n})"


_MODES = ("min", "max")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, repr=False)
class KeepBest(Policy):
    """Keep the ``k`` steps with the best ``metric`` -- the lowest (``mode="min"``,
    a loss) or the highest (``"max"``, an accuracy) -- read from each save's
    ``metadata=``. A step whose metadata lacks the metric or holds something
    else than a number is never among the best (the Checkpointer refuses, at
    ``save()``, a save whose metadata lacks it). Between equal values the
    newer step ranks first."""
    k: int
    metric: str = "loss"
    mode: str = "min"

    def __post_init__(self) -> None:
        _positive("KeepBest(k): k", self.k, "KeepBest(3, metric='loss')")
        if not isinstance(self.metric, str) or not self.metric:
            raise ValueError(f"KeepBest(metric=...) must name a key of save()'s metadata=, got {self.metric!r}; "
                             f"for example KeepBest(3, metric='val_loss')")
        if self.metric in ("step", "lazyckpt"):
            raise ValueError(f"KeepBest(metric={self.metric!r}): that metadata key is the Checkpointer's own; "
                             f"name a value your save(..., metadata=) records, e.g. metric='val_loss'")
        if self.mode not in _MODES:
            raise ValueError(f"KeepBest(mode=...) must be 'min' (lower is better: a loss) or 'max' (higher is "
                             f"better: an accuracy), got {self.mode!r}")

    def select(self, steps: List[StepInfo]) -> Set[int]:
        sign = 1 if self.mode == "min" else -1
        ranked = sorted(((sign * s.metadata[self.metric], -s.step) for s in steps
                         if _number(s.metadata.get(self.metric))))
        return {-negated for _value, negated in ranked[:self.k]}

    def metrics(self) -> List[str]:
        return [self.metric]

    def __repr__(self) -> str:
        return f"KeepBest({self.k}, metric={self.metric!r}, mode={self.mode!r})"


@dataclass(frozen=True, init=False, repr=False)
class AnyOf(Policy):
    """A step is kept if any of ``policies`` keeps it (``a | b | c``); nested
    combinations are flattened, a policy named twice counts once."""
    policies: Tuple[Policy, ...]

    def __init__(self, *policies: Policy) -> None:
        flat: List[Policy] = []
        for p in policies:
            if not isinstance(p, Policy):
                raise TypeError(f"AnyOf takes retention policies (KeepLast, KeepEvery, KeepBest), got "
                                f"{type(p).__name__}: write AnyOf(KeepLast(2), KeepEvery(100)) or "
                                f"KeepLast(2) | KeepEvery(100)")
            for q in (p.policies if isinstance(p, AnyOf) else (p,)):
                if q not in flat:
                    flat.append(q)
        if not flat:
            raise ValueError("AnyOf needs at least one policy, e.g. AnyOf(KeepLast(2), KeepEvery(100))")
        object.__setattr__(self, "policies", tuple(flat))

    def select(self, steps: List[StepInfo]) -> Set[int]:
        kept: Set[int] = set()
        for p in self.policies:
            kept |= p.select(steps)
        return kept

    def metrics(self) -> List[str]:
        out: List[str] = []
        for p in self.policies:
            out += [m for m in p.metrics() if m not in out]
        return out

    def __repr__(self) -> str:
        return " | ".join(map(repr, self.policies))


def as_policy(keep: Union[None, int, Policy], name: str = "keep") -> Optional[Policy]:
    """``None`` (keep every step), an int (``KeepLast``) or a policy, checked."""
    if keep is None or isinstance(keep, Policy):
        return keep
    if type(keep) is int:
        if keep < 1:
            raise ValueError(f"{name} must be an int >= 1, a retention policy or None, got {keep!r}; "
                             f"for example {name}=3 or {name}=KeepLast(2) | KeepEvery(1000)")
        return KeepLast(keep)
    raise TypeError(f"{name} must be None, an int or a retention policy (lazyckpt.KeepLast, KeepEvery, KeepBest), "
                    f"got {type(keep).__name__}")


def keeps_superseded(policy: Optional[Policy]) -> bool:
    """Whether steps superseded by a rollback (a save of a step at or below a
    committed one) are kept aside (``.abandoned-*`` on a local directory)
    rather than deleted: only when no policy is set (``keep=None`` keeps
    everything). Any policy deletes them: a rollback's steps belong to no
    policy's choice. Every place that decides it asks here."""
    return policy is None


def missing_metrics(policy: Optional[Policy], metadata: Dict[str, Any]) -> List[str]:
    """The metrics ``policy`` reads that ``metadata`` lacks (save() refuses such a save)."""
    return [] if policy is None else [m for m in policy.metrics() if m not in metadata]


def check_metadata(metadata: Dict[str, Any], policies: Iterable[Tuple[str, Optional[Policy]]]) -> None:
    """Refuse, on the caller's thread, a save whose ``metadata`` lacks a metric
    that a policy ranks steps by (``policies``: (where it is set, the policy))."""
    for where, policy in policies:
        missing = missing_metrics(policy, metadata)
        if missing:
            example = ", ".join(f"{m!r}: <value>" for m in missing)
            raise ValueError(f"save(): metadata has no {', '.join(map(repr, missing))}, which {where}={policy!r} "
                             f"ranks steps by; pass save(..., metadata={{{example}}})")


def saved_metadata(manifest: Dict[str, Any]) -> Dict[str, Any]:
    """The ``metadata=`` a save recorded, from its parsed manifest (without the
    ``step`` the Checkpointer adds to it)."""
    recorded = manifest.get("metadata")
    if not isinstance(recorded, dict):
        return {}
    return {k: v for k, v in recorded.items() if k != "step"}


# --------------------------------------------------------------------------- the one rule storage applies


class Plan(NamedTuple):
    """What a retention pass does to the committed ``steps`` (oldest first)."""
    steps: List[int]
    #: What the policy keeps, and the newest step.
    kept: Set[int]
    #: ``kept`` and every step they refer to, transitively.
    needed: Set[int]
    #: The steps to delete, newest first: deleting in this order never leaves a
    #: remaining step referring to a deleted one, whatever instant a crash hits
    #: (a step only refers to older ones, and every step a remaining step refers
    #: to is needed).
    doomed: List[int]
    #: Steps kept only because a kept step refers to them (sorted).
    referred: List[int]


References = Callable[[int], Optional[List[int]]]


def need(start: Iterable[int], needed: Set[int], steps: List[int], references: Optional[References]) -> None:
    """Add to ``needed`` every step the steps of ``start`` refer to, transitively
    (``references(s)``: the earlier steps ``s`` refers to, or None when that
    cannot be read: then it may need every older one)."""
    if references is None:
        return
    todo = list(start)
    while todo:
        current = todo.pop()
        refs = references(current)
        for r in ([s for s in steps if s < current] if refs is None else refs):
            if r not in needed:
                needed.add(r)
                todo.append(r)


def plan(policy: Optional[Policy], steps: List[int], metadata: Callable[[int], Dict[str, Any]],
         references: Optional[References] = None) -> Plan:
    """Which of ``steps`` (committed, oldest first) a retention pass deletes.
    ``metadata(step)``: its save's metadata, asked for only when the policy
    reads some (:meth:`Policy.metrics`); ``references``: what a step refers to
    (None: no step refers to another). ``policy`` None deletes nothing."""
    steps = list(steps)
    if policy is None or not steps:
        return Plan(steps, set(steps), set(steps), [], [])
    reads = bool(policy.metrics())
    kept = set(policy.select([StepInfo(s, metadata(s) if reads else {}) for s in steps])) & set(steps)
    kept.add(steps[-1])                     # the newest: what a restart resumes from
    needed = set(kept)
    need(sorted(kept, reverse=True), needed, steps, references)
    doomed = [s for s in reversed(steps) if s not in needed]
    return Plan(steps, kept, needed, doomed, sorted(needed - kept))


__all__ = ["StepInfo", "Policy", "KeepLast", "KeepEvery", "KeepBest", "AnyOf", "as_policy", "keeps_superseded",
           "missing_metrics", "check_metadata", "saved_metadata", "Plan", "plan", "need"]
