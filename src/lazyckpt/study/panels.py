"""What a plot of a run shows, decided once for the PNG (``lazyckpt
trajectory --png``) and the report page (``lazyckpt report``): which panel a
tensor goes to, which tensors are counters, when an axis is logarithmic, how
lines stay distinguishable, and the metrics the saves recorded.

* **Panels**: one per group, by default a key's top-level component (``model``,
  ``optimizer``), or the first match of a regex in the key (``--group``);
  keys that do not match go to ``other``. Values of different groups differ
  by orders of magnitude (AdamW's second moments against the weights), so
  they never share an axis.
* **Counters**: a tensor of at most one element whose values are all whole
  numbers at every step (AdamW's ``step``, BatchNorm's
  ``num_batches_tracked``). Counting from 0 to the step number, such a line
  sets the scale and flattens every other one; left out unless asked for.
* **Log scale**: where the positive values of a panel span at least
  :data:`LOG_SPAN` (two decades); non-positive values are left out of a log
  axis (said so in the panel's note).
* **Styles**: colours first, then a dash pattern per round of colours, so 16
  lines on 10 colours are still told apart.
* **Metrics**: the numbers each save's ``metadata=`` recorded (``{"loss":
  ...}``; nested objects flattened with ``/``), one series per name.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

#: A panel goes logarithmic when its largest positive value is this many times its smallest.
LOG_SPAN = 100.0

#: Distinct colours (matplotlib's tab10, also used on the report page) and dash patterns.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
#: (matplotlib linestyle, plotly dash) per round of colours.
DASHES = (("-", "solid"), ("--", "dash"), (":", "dot"), ("-.", "dashdot"))

#: A panel shows at most this many lines (every colour with every dash); the rest are named in its note.
MAX_LINES = len(COLOURS) * len(DASHES)

#: Metadata names that are not metrics (the Checkpointer records ``step`` itself).
_NOT_METRICS = {"step"}


def style(i: int) -> Tuple[str, int]:
    """(colour, dash index into :data:`DASHES`) of the ``i``-th line of a panel."""
    return COLOURS[i % len(COLOURS)], (i // len(COLOURS)) % len(DASHES)


def group_of(key: str, pattern: Optional["re.Pattern[str]"] = None) -> str:
    """The panel of ``key``: its top-level component, or the first match of ``pattern``."""
    if pattern is None:
        return key.split("/", 1)[0]
    m = pattern.search(key)
    return m.group(0) if m else "other"


def compile_group(text: Optional[str]) -> Optional["re.Pattern[str]"]:
    if text is None:
        return None
    try:
        return re.compile(text)
    except re.error as exc:
        raise ValueError(f"--group {text!r} is not a regular expression: {exc}") from None


def is_counter(values: Iterable[float], numel: Optional[int]) -> bool:
    """A tensor of at most one element whose every value is a whole number."""
    if numel is None or numel > 1:
        return False
    seen = False
    for v in values:
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
            return False
        seen = True
    return seen


def wants_log(values: Iterable[float]) -> bool:
    positive = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    return len(positive) > 1 and max(positive) >= LOG_SPAN * min(positive)


@dataclass
class Panel:
    """One axis: its title, its lines (name -> {step: value}), log or linear, a note."""
    title: str
    lines: Dict[str, Dict[int, float]]
    log: bool = False
    notes: List[str] = field(default_factory=list)
    kind: str = "tensors"               # tensors | metrics


def panels(table: Mapping[str, Mapping[int, Any]], numel: Mapping[str, Optional[int]], *,
           group: Optional[str] = None, counters: bool = False, stat: str = "norm") -> Tuple[List[Panel], List[str]]:
    """(the panels of a trajectory table ``key -> {step: value}``, the counters
    left out). ``numel``: each key's element count (None: unknown, never a
    counter). Non-numeric values (a callable's) are left out."""
    pattern = compile_group(group)
    grouped: Dict[str, Dict[str, Dict[int, float]]] = {}
    left_out: List[str] = []
    for key, by_step in table.items():
        values = {s: float(v) for s, v in by_step.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not values:
            continue
        if not counters and is_counter(values.values(), numel.get(key)):
            left_out.append(key)
            continue
        grouped.setdefault(group_of(key, pattern), {})[key] = values
    out = []
    for title, lines in grouped.items():
        panel = Panel(title, {}, wants_log(v for vals in lines.values() for v in vals.values()))
        names = list(lines)
        for name in names[:MAX_LINES]:
            panel.lines[name] = lines[name]
        if len(names) > MAX_LINES:
            panel.notes.append(f"{len(names) - MAX_LINES} more tensors not drawn (narrow --keys or --group)")
        if panel.log and any(v <= 0 for vals in panel.lines.values() for v in vals.values()):
            panel.notes.append(f"log scale: values <= 0 not drawn")
        out.append(panel)
    return out, left_out


def metrics(metadata: Mapping[int, Mapping[str, Any]]) -> Dict[str, Dict[int, float]]:
    """name -> {step: value} of every finite number in the saves' metadata
    (``step -> metadata``); nested objects flattened with ``/``; booleans and
    the recorded ``step`` are not metrics."""
    out: Dict[str, Dict[int, float]] = {}

    def walk(prefix: str, value: Any, step: int, depth: int) -> None:
        if isinstance(value, dict) and depth < 4:
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v, step, depth + 1)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.setdefault(prefix, {})[step] = float(value)

    for step in sorted(metadata):
        meta = metadata[step]
        if isinstance(meta, dict):
            walk("", {k: v for k, v in meta.items() if k not in _NOT_METRICS}, step, 0)
    return out


def metrics_panel(series: Mapping[str, Mapping[int, float]]) -> Optional[Panel]:
    if not series:
        return None
    lines = {k: dict(v) for k, v in series.items()}
    return Panel("metrics (from each save's metadata)", lines,
                 wants_log(v for vals in lines.values() for v in vals.values()), kind="metrics")


__all__ = ["Panel", "panels", "metrics", "metrics_panel", "is_counter", "wants_log", "group_of", "style",
           "COLOURS", "DASHES", "LOG_SPAN", "MAX_LINES"]
