"""``lazyckpt report RUN -o report.html``: one self-contained page about a
run, built from its checkpoints alone.

What the page shows, and what it reads to show it:

* **the line of history**: every kept step and the tier it lives on, from
  the index alone (a local directory's listing -- names and a ``stat`` per
  manifest --, an object store's one listing); the commits that
  superseded steps (rollbacks), from the commit events (the local record's
  newest :data:`lazyckpt.lineage.RECENT_EVENTS`, every event kept on an
  object store) and the manifests read;
* for a **sample** of at most ``max_steps`` steps (the first, the last, the
  two compared steps and evenly spaced ones between): each manifest --
  commit time, ``seq``, size, incremental references, the metrics recorded
  in ``metadata=``, the save costs (``save()`` blocking, capture, flush,
  GB/s, the barrier wait the next save recorded);
* per-group **norm trajectories** over a sub-sample of ``norm_steps``
  steps (:func:`lazyckpt.trajectory`, pieces, never whole states; steps
  that refer to the same bytes measured once);
* the **biggest movers** between two steps (:func:`lazyckpt.diff`,
  ``from_step``/``to_step``, by default the first and the last kept).

So the cost grows with what the page shows, not with the run: 10,000 kept
steps read 10,000 directory entries and ``max_steps`` manifests.

The page embeds plotly.js (extra ``report``: ``pip install
'lazyckpt[report]'``) and its data: it opens from a file with no network,
and every chart is interactive (zoom, hover, hide a line by its legend).
Tables are plain HTML: they read without JavaScript.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import html
import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from lazyckpt.storage.stores import for_path
from ..errors import CheckpointError, CheckpointNotFoundError
from ..knobs import Options, resolve as resolve_options
from ..lineage import Event, _merge, line
from . import panels as _panels
from .diffs import DiffReport, diff
from .trajectories import trajectory

#: Steps whose manifests are read by default (the history table, metrics, costs).
MAX_STEPS = 500
#: Steps whose tensors are measured by default (the norm trajectories).
NORM_STEPS = 40
#: Rows of the movers table by default.
TOP = 20


def sample(steps: Sequence[int], n: int, must: Iterable[int] = ()) -> List[int]:
    """At most ``n`` of ``steps`` (ascending), evenly spaced by position,
    always with the first, the last and those of ``must`` that are kept."""
    if n < 2:
        raise ValueError(f"a sample needs at least 2 steps, got {n}")
    steps = list(steps)
    kept = set(steps)
    chosen = {s for s in must if s in kept}
    if len(steps) <= n:
        return steps
    room = max(2, n - len(chosen - {steps[0], steps[-1]}))
    last = len(steps) - 1
    chosen |= {steps[round(i * last / (room - 1))] for i in range(room)}
    return sorted(chosen)


def step_manifests(paths: Sequence[str], options: Optional[Options] = None,
                   workers: int = 8) -> List[Union[Dict[str, Any], CheckpointError]]:
    """The parsed manifest of each step directory or save prefix in
    ``paths`` (in order), or the error that says why it could not be read;
    read by ``workers`` threads (one request each on an object store)."""
    options = options or resolve_options()
    if not paths:
        return []

    def one(path: str) -> Union[Dict[str, Any], CheckpointError]:
        try:
            return for_path(path).read_manifest(path, options)
        except CheckpointError as exc:
            return exc

    if len(paths) == 1 or not for_path(paths[0]).is_remote:
        return [one(p) for p in paths]          # a local manifest is one small read: threads cost more
    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lazyckpt-report") as ex:
        return list(ex.map(one, paths))


# --------------------------------------------------------------------------- the run's index


@dataclass
class _Index:
    where: Dict[int, str]                # kept step -> where it is read from
    tiers: Dict[int, str]                # kept step -> local | persistent | local+persistent | object store
    events: List[Event]                  # the commit events known without reading manifests
    events_note: str


def _index(run: str, persist_to: Optional[str], options: Options) -> _Index:
    store = for_path(run)
    if store.is_remote:
        if persist_to is not None:
            raise ValueError("persist_to= is the persistent tier of a local run directory; "
                             f"{run} is itself on an object store")
    elif not os.path.isdir(run):
        raise CheckpointNotFoundError(f"{run}: no such Checkpointer directory", path=run)
    store.check(run, options)
    layout = store.checkpoint_dir(run, options)
    if store.is_remote:
        present, events = layout.listing()
        live = dict(line(events + [Event(s, sid, None) for s, sid in present.items()]))
        where = {s: layout.save_path(s, sid) for s, sid in sorted(present.items()) if live.get(s) == sid}
        return _Index(where, {s: "object store" for s in where}, list(events), "every commit event the store keeps")
    where = dict(layout.step_paths())
    events = list(layout.record().read()[1])
    tiers = {s: "local" for s in where}
    note = "the local record's newest commits"
    if persist_to is not None:
        tier_store = for_path(persist_to)
        tier_store.check(persist_to, options)
        remote_dir = tier_store.checkpoint_dir(persist_to, options)
        present, remote_events = remote_dir.listing()
        events += remote_events
        superseded = _superseded(events + [Event(s, sid, None) for s, sid in present.items()])
        for s, sid in present.items():
            if (s, sid) in superseded:
                continue
            if s in tiers:
                tiers[s] = "local+persistent"
            else:
                tiers[s] = "persistent"
                where[s] = remote_dir.save_path(s, sid)
        where = dict(sorted(where.items()))
        tiers = {s: tiers[s] for s in where}
        note += " and every commit event of the persistent tier"
    return _Index(where, tiers, events, note)


def _superseded(events: Iterable[Event]) -> Dict[Tuple[int, str], Event]:
    """(step, save_id) -> the commit that superseded it, for every save a later
    commit of a step <= its own superseded. Decided pair by pair, so a part of
    the events gives a part of the answer, never a wrong one."""
    live: List[Event] = []
    out: Dict[Tuple[int, str], Event] = {}
    for e in _merge(events):                # one event per save, in commit order (as line() takes them)
        while live and live[-1].step >= e.step:
            gone = live.pop()
            out[(gone.step, gone.save_id)] = e
        live.append(e)
    return out


def rollbacks(events: Iterable[Event]) -> List[Dict[str, Any]]:
    """The commits that superseded saves (a run resumed from an earlier step):
    ``{"seq", "step", "save_id", "superseded": [steps]}``, in commit order."""
    by: Dict[Tuple[int, str], Dict[str, Any]] = {}
    for (step, _sid), e in _superseded(events).items():
        row = by.setdefault((e.step, e.save_id), {"seq": e.seq, "step": e.step, "save_id": e.save_id,
                                                  "superseded": []})
        row["superseded"].append(step)
    out = sorted(by.values(), key=lambda r: (r["seq"] or 0, r["step"]))
    for r in out:
        r["superseded"].sort()
    return out


# --------------------------------------------------------------------------- the report


@dataclass
class RunReport:
    """What the page shows (:func:`collect`); :meth:`to_json` for machines,
    :func:`render` for the page."""
    run: str
    persist_to: Optional[str]
    kept: List[int]
    tiers: Dict[int, str]
    rows: List[Dict[str, Any]]
    rollbacks: List[Dict[str, Any]]
    events_note: str
    metrics: Dict[str, Dict[int, float]]
    norm_steps: List[int]
    norms: Dict[str, Dict[int, float]]
    numel: Dict[str, int]
    group: Optional[str]
    counters: bool
    from_step: Optional[int]
    to_step: Optional[int]
    diff: Optional[DiffReport]
    bytes_read: int
    manifests_read: int
    seconds: Dict[str, float]
    skipped: List[Tuple[int, str, str]] = field(default_factory=list)
    created_unix: float = field(default_factory=time.time)

    def panels(self) -> Tuple[List[_panels.Panel], List[str]]:
        return _panels.panels(self.norms, self.numel, group=self.group, counters=self.counters)

    def costs(self) -> List[Dict[str, Any]]:
        """One row per sampled step whose manifest records its cost: blocking,
        capture and flush seconds, bytes, GB/s (bytes / flush), and the
        barrier wait of the step the next save recorded it for."""
        waits = {}
        for r in self.rows:
            prev = (r.get("cost") or {}).get("previous_save")
            if isinstance(prev, dict) and isinstance(prev.get("barrier_wait_s"), (int, float)):
                waits[prev.get("step")] = prev["barrier_wait_s"]
        out = []
        for r in self.rows:
            c = r.get("cost")
            if not isinstance(c, dict) or not all(isinstance(c.get(k), (int, float))
                                                  for k in ("blocking_s", "capture_s", "flush_s", "bytes")):
                continue
            flush = c["flush_s"]
            out.append({"step": r["step"], "blocking_s": c["blocking_s"], "capture_s": c["capture_s"],
                        "flush_s": flush, "bytes": c["bytes"], "ranks": c.get("ranks"),
                        "gb_per_s": c["bytes"] / flush / 1e9 if flush > 0 else None,
                        "barrier_wait_s": waits.get(r["step"])})
        return out

    def to_json(self) -> Dict[str, Any]:
        shown, left_out = self.panels()
        return {"run": self.run, "persist_to": self.persist_to, "kept": len(self.kept),
                "first": self.kept[0] if self.kept else None, "last": self.kept[-1] if self.kept else None,
                "tiers": _count(self.tiers.values()), "rows": self.rows, "rollbacks": self.rollbacks,
                "metrics": {k: {str(s): v for s, v in vals.items()} for k, vals in self.metrics.items()},
                "norm_steps": self.norm_steps,
                "norms": {k: {str(s): _finite(v) for s, v in vals.items()} for k, vals in self.norms.items()},
                "counters_left_out": left_out, "costs": self.costs(),
                "diff": self.diff.to_json() if self.diff is not None else None, "from": self.from_step,
                "to": self.to_step, "bytes_read": self.bytes_read, "manifests_read": self.manifests_read,
                "seconds": self.seconds, "skipped": [{"step": s, "key": k, "why": w} for s, k, w in self.skipped]}


def _count(values: Iterable[str]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _finite(v: Any) -> Any:
    return v if not isinstance(v, float) or math.isfinite(v) else None


def _row(step: int, tier: str, manifest: Union[Dict[str, Any], CheckpointError]) -> Dict[str, Any]:
    if isinstance(manifest, CheckpointError):
        return {"step": step, "tier": tier, "error": str(manifest)}
    files = manifest.get("files") or []
    return {"step": step, "tier": tier, "seq": manifest.get("seq"), "save_id": manifest.get("save_id"),
            "created_unix": manifest.get("created_unix"), "world_size": manifest.get("world_size"),
            "bytes": sum(f.get("bytes", 0) for f in files if isinstance(f, dict)),
            "references": list(manifest.get("references") or []),
            "metadata": {k: v for k, v in (manifest.get("metadata") or {}).items() if k != "step"},
            "cost": manifest.get("cost")}


def collect(run: str, *, persist_to: Optional[str] = None, from_step: Optional[int] = None,
            to_step: Optional[int] = None, keys: Union[None, str, Sequence[str]] = None,
            group: Optional[str] = None, counters: bool = False, top: int = TOP, max_steps: int = MAX_STEPS,
            norm_steps: int = NORM_STEPS, workers: int = 4, options: Optional[Options] = None) -> RunReport:
    """Everything the page of ``run`` (a Checkpointer directory, local or
    ``s3://``; ``persist_to``: its persistent tier) shows, read as the module
    docstring says. ``from_step``/``to_step``: the steps the movers compare
    (default: the first and the last kept). ``keys``: globs of the tensors
    measured and compared (default: all); ``group``: a regex whose first
    match in a key is its panel (default: the top-level key); ``counters``:
    plot one-element whole-number tensors too."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if norm_steps < 2 or max_steps < 2:
        raise ValueError(f"max_steps and norm_steps must be >= 2, got {max_steps} and {norm_steps}")
    _panels.compile_group(group)                # a bad regex fails before any reading
    options = options or resolve_options()
    store = for_path(run)
    run = store.normalize(run)
    seconds: Dict[str, float] = {}
    t0 = time.perf_counter()
    index = _index(run, persist_to, options)
    kept = list(index.where)
    if not kept:
        raise CheckpointNotFoundError(f"{run}: no committed step (nothing to report)", path=run)
    for name, s in (("--from", from_step), ("--to", to_step)):
        if s is not None and s not in index.where:
            shown = ", ".join(map(str, kept[:5])) + (f", ..., {kept[-1]}" if len(kept) > 5 else "")
            raise CheckpointNotFoundError(f"{run}: {name} {s} is not a kept step (kept: {shown})", path=run, step=s)
    a = kept[0] if from_step is None else from_step
    b = kept[-1] if to_step is None else to_step
    seconds["index"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    shown = sample(kept, max_steps, must=(a, b))
    manifests = step_manifests([index.where[s] for s in shown], options)
    rows = [_row(s, index.tiers[s], m) for s, m in zip(shown, manifests)]
    events = list(index.events) + [Event(r["step"], r["save_id"], r["seq"]) for r in rows
                                   if isinstance(r.get("save_id"), str)]
    found_metrics = _panels.metrics({r["step"]: r.get("metadata") or {} for r in rows if "error" not in r})
    seconds["manifests"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    measured = sample(shown, norm_steps, must=(a, b))
    traj = trajectory(run, keys=keys, fn="norm", steps=measured, persist_to=persist_to, workers=workers,
                      options=options)
    norms = traj.table()
    numel = traj.numel()
    seconds["norms"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    moved = None
    if a != b:
        # Every row, then the top: counters (whose change is the number of steps between
        # the two) would otherwise head the list.
        moved = diff(index.where[a], index.where[b], keys=keys, workers=workers, options=options)
        left_out = set() if counters else set(_panels.panels(norms, numel, counters=False)[1])
        compared = [r for r in moved.compared if r.key not in left_out][:top]
        moved.rows = compared + moved.skipped
    seconds["diff"] = time.perf_counter() - t0
    return RunReport(run=run, persist_to=persist_to, kept=kept, tiers=index.tiers, rows=rows,
                     rollbacks=rollbacks(events), events_note=index.events_note, metrics=found_metrics,
                     norm_steps=[s for s, _ in traj.steps], norms=norms, numel=numel, group=group,
                     counters=counters, from_step=a, to_step=b, diff=moved,
                     bytes_read=traj.counter.bytes_read + (moved.bytes_read if moved is not None else 0),
                     manifests_read=len(rows), seconds=seconds, skipped=list(traj.skipped))


def write_report(run: str, path: str, **kwargs: Any) -> RunReport:
    """:func:`collect` the report of ``run`` and write its page to ``path``
    (one HTML file with everything inside: opens with no network). Needs
    plotly (``pip install 'lazyckpt[report]'``); checked before reading."""
    plotly_js()
    report = collect(run, **kwargs)
    t0 = time.perf_counter()
    page = render(report)
    tmp = f"{path}.tmp-{os.getpid()}"          # a reader never sees half a page
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    report.seconds["render"] = time.perf_counter() - t0
    return report


# --------------------------------------------------------------------------- the page


def plotly_js() -> Tuple[str, str]:
    """(plotly.js minified, its version), from the plotly package."""
    try:
        import plotly
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ImportError("lazyckpt report needs plotly: pip install 'lazyckpt[report]'") from None
    return get_plotlyjs(), getattr(plotly, "__version__", "?")


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.4g}"
    return str(v)


def _secs(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "-"
    return f"{v * 1e3:.3g} ms" if v < 1 else f"{v:.3g} s"


def _time(unix: Any) -> str:
    if not isinstance(unix, (int, float)):
        return "-"
    return datetime.datetime.fromtimestamp(unix, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]], cls: str, right: Sequence[int] = ()) -> str:
    out = [f'<table class="{cls}"><thead><tr>']
    out += [f'<th{" class=r" if i in right else ""}>{_e(h)}</th>' for i, h in enumerate(head)]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f'<td{" class=r" if i in right else ""}>{_e(c)}</td>'
                                    for i, c in enumerate(row)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _axis(title: str, log: bool = False) -> Dict[str, Any]:
    return {"title": {"text": title}, "type": "log" if log else "linear", "automargin": True,
            "gridcolor": "#e5e5e5", "zeroline": False}


def _layout(title: str, ytitle: str, log: bool = False, **more: Any) -> Dict[str, Any]:
    layout = {"title": {"text": title, "font": {"size": 14}}, "xaxis": _axis("step"),
              "yaxis": _axis(ytitle, log), "margin": {"l": 60, "r": 20, "t": 40, "b": 45}, "height": 340,
              "hovermode": "closest", "plot_bgcolor": "white", "legend": {"font": {"size": 10}}}
    layout.update(more)
    return layout


def _lines(panel: _panels.Panel) -> List[Dict[str, Any]]:
    traces = []
    for i, (name, values) in enumerate(panel.lines.items()):
        colour, dash = _panels.style(i)
        steps = sorted(values)
        ys = [_finite(values[s]) if not panel.log or values[s] > 0 else None for s in steps]
        label = name[len(panel.title) + 1:] if name.startswith(panel.title + "/") else name
        traces.append({"type": "scatter", "mode": "lines+markers" if len(steps) <= 120 else "lines",
                       "name": label, "x": steps, "y": ys,
                       "line": {"color": colour, "dash": _panels.DASHES[dash][1], "width": 1.6},
                       "marker": {"size": 4}, "hovertemplate": f"{_e(name)}<br>step %{{x}}: %{{y:.5g}}<extra></extra>"})
    return traces


#: Above this many kept steps the tier chart draws runs of steps as lines: a marker per step is an
#: SVG element per step, which a browser lays out slowly by the ten thousand.
MARKERS_UP_TO = 2000


def _tier_trace(report: RunReport, tier: str, colour: str) -> Dict[str, Any]:
    steps = [s for s in report.kept if report.tiers[s] == tier]
    trace = {"type": "scatter", "name": tier, "hovertemplate": "step %{x}<extra>" + _e(tier) + "</extra>"}
    if len(report.kept) <= MARKERS_UP_TO:
        trace.update(mode="markers", x=steps, y=[tier] * len(steps), marker={"size": 6, "color": colour})
        return trace
    # One segment per run of consecutive kept steps on this tier (a gap where another tier's steps are).
    xs: List[Any] = []
    position = {s: i for i, s in enumerate(report.kept)}
    for s in steps:
        if xs and position[s] != position[xs[-1]] + 1:
            xs.append(None)
        xs.append(s)
    trace.update(mode="lines", x=xs, y=[None if x is None else tier for x in xs],
                 line={"color": colour, "width": 10}, connectgaps=False)
    return trace


def charts(report: RunReport) -> List[Dict[str, Any]]:
    """The page's charts as plotly figure specs: ``{"id", "section", "data", "layout"}``."""
    out: List[Dict[str, Any]] = []
    # The line of history: every kept step on its tier (the index), rollbacks as lines.
    tiers = sorted(set(report.tiers.values()))
    traces = [_tier_trace(report, t, _panels.COLOURS[i]) for i, t in enumerate(tiers)]
    shapes = [{"type": "line", "xref": "x", "yref": "paper", "x0": r["step"], "x1": r["step"], "y0": 0, "y1": 1,
               "line": {"color": "#d62728", "dash": "dot", "width": 1}} for r in report.rollbacks]
    if report.rollbacks:
        traces.append({"type": "scatter", "mode": "markers", "name": "rollback (commit that superseded steps)",
                       "x": [r["step"] for r in report.rollbacks], "y": [tiers[0]] * len(report.rollbacks),
                       "marker": {"symbol": "x", "size": 10, "color": "#d62728"},
                       "text": [f"seq {r['seq']}: superseded {len(r['superseded'])} save(s) from step "
                                f"{r['superseded'][0]}" for r in report.rollbacks],
                       "hovertemplate": "step %{x}<br>%{text}<extra></extra>"})
    out.append({"id": "chart-line", "section": "history", "data": traces,
                "layout": _layout("kept steps by tier", "", shapes=shapes, height=90 + 50 * len(tiers),
                                  yaxis={"type": "category", "automargin": True})})
    sized = [r for r in report.rows if isinstance(r.get("bytes"), int)]
    if sized:
        full = [r for r in sized if not r["references"]]
        inc = [r for r in sized if r["references"]]
        data = []
        for name, rows, colour in (("full save", full, _panels.COLOURS[0]),
                                   ("incremental (refers to earlier steps)", inc, _panels.COLOURS[1])):
            if rows:
                data.append({"type": "scatter", "mode": "markers", "name": name, "x": [r["step"] for r in rows],
                             "y": [r["bytes"] for r in rows], "marker": {"size": 6, "color": colour},
                             "text": [", ".join(map(str, r["references"][:8])) for r in rows],
                             "hovertemplate": "step %{x}: %{y:,} bytes<br>refers to %{text}<extra></extra>"})
        log = _panels.wants_log(r["bytes"] for r in sized)
        layout = _layout("bytes written per step", "bytes", log)
        if not log:
            layout["yaxis"]["rangemode"] = "tozero"     # from 0: sizes that barely differ look it
        out.append({"id": "chart-sizes", "section": "history", "data": data, "layout": layout})
    for i, (name, values) in enumerate(report.metrics.items()):
        panel = _panels.Panel(name, {name: values}, _panels.wants_log(values.values()), kind="metrics")
        out.append({"id": f"chart-metric-{i}", "section": "metrics", "data": _lines(panel),
                    "layout": _layout(name + (" (log)" if panel.log else ""), name, panel.log, showlegend=False)})
    shown, _ = report.panels()
    for i, panel in enumerate(shown):
        out.append({"id": f"chart-norms-{i}", "section": "norms", "data": _lines(panel),
                    "layout": _layout(f"{panel.title}: norm" + (" (log)" if panel.log else ""), "norm", panel.log,
                                      height=380)})
    if report.diff is not None and report.diff.compared:
        rows = list(reversed(report.diff.compared))         # the largest on top
        out.append({"id": "chart-movers", "section": "movers", "data": [{
            "type": "bar", "orientation": "h", "x": [_finite(r.rel_change) for r in rows], "y": [r.key for r in rows],
            "marker": {"color": _panels.COLOURS[3]},
            "hovertemplate": "%{y}<br>||a-b||/||a|| = %{x:.4g}<extra></extra>"}],
            "layout": _layout(f"relative change, step {report.from_step} to {report.to_step}", "",
                              xaxis=_axis("||a-b|| / ||a||"), yaxis={"automargin": True, "type": "category"},
                              height=max(220, 60 + 22 * len(rows)))})
    costs = report.costs()
    if costs:
        data = []
        for i, (name, key) in enumerate((("save() blocking", "blocking_s"), ("capture", "capture_s"),
                                         ("flush (durable)", "flush_s"), ("barrier wait", "barrier_wait_s"))):
            pts = [c for c in costs if isinstance(c.get(key), (int, float))]
            if pts:
                data.append({"type": "scatter", "mode": "lines+markers", "name": name,
                             "x": [c["step"] for c in pts], "y": [c[key] for c in pts],
                             "line": {"color": _panels.COLOURS[i], "width": 1.5}, "marker": {"size": 4},
                             "hovertemplate": f"{name}<br>step %{{x}}: %{{y:.3g}} s<extra></extra>"})
        log = _panels.wants_log(c[k] for c in costs for k in ("blocking_s", "capture_s", "flush_s"))
        out.append({"id": "chart-costs", "section": "costs", "data": data,
                    "layout": _layout("what each save cost" + (" (log)" if log else ""), "seconds", log)})
        rate = [c for c in costs if c["gb_per_s"] is not None]
        if rate:
            out.append({"id": "chart-rate", "section": "costs", "data": [{
                "type": "scatter", "mode": "lines+markers", "name": "GB/s", "x": [c["step"] for c in rate],
                "y": [c["gb_per_s"] for c in rate], "line": {"color": _panels.COLOURS[2]}, "marker": {"size": 4},
                "hovertemplate": "step %{x}: %{y:.3g} GB/s<extra></extra>"}],
                "layout": _layout("write rate (bytes / flush time)", "GB/s", showlegend=False)})
    return out


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2a36;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#c8d1db;font-size:13px}
nav{padding:8px 24px;background:#eef1f4;font-size:13px}nav a{margin-right:14px;color:#1f4e79}
main{padding:8px 24px 40px;max-width:1400px}section{margin-top:18px}
h2{font-size:17px;border-bottom:1px solid #ddd;padding-bottom:4px}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:8px 12px;min-width:120px}.card b{display:block;font-size:18px}.card span{font-size:12px;color:#666}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}
.chart{background:#fff;border:1px solid #ddd;border-radius:6px;min-height:220px}
table{border-collapse:collapse;font-size:12px;background:#fff}th,td{border:1px solid #ddd;padding:3px 7px;
text-align:left;white-space:nowrap}th{background:#eef1f4;position:sticky;top:0}td.r,th.r{text-align:right}
.scroll{max-height:420px;overflow:auto;border:1px solid #ddd;display:inline-block;max-width:100%}
.note{color:#555;font-size:13px}code{background:#eef1f4;padding:0 3px}
"""

_SCRIPT = """
(function () {
  var data = JSON.parse(document.getElementById("lazyckpt-data").textContent);
  var config = {responsive: true, displaylogo: false};
  var pending = data.charts.map(function (c) {
    return Plotly.newPlot(c.id, c.data, c.layout, config);
  });
  Promise.all(pending).then(function () {
    document.body.setAttribute("data-charts-rendered", String(pending.length));
  }, function (err) {
    console.error("lazyckpt report: a chart failed: " + err);
  });
})();
"""


def _clean(doc: Any) -> Any:
    """``doc`` with every non-finite number as null (JSON has none; a manifest's
    JSON may: Python's parser reads ``NaN``)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: _clean(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_clean(v) for v in doc]
    return doc


def _json_for_script(doc: Any) -> str:
    """JSON that cannot end the ``<script>`` element holding it."""
    text = json.dumps(_clean(doc), separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(report: RunReport) -> str:
    """The page: one HTML document with plotly.js, the charts' data and the tables inside."""
    js, plotly_version = plotly_js()
    from lazyckpt import __version__        # lazy: lazyckpt sets it after importing lazyckpt.study
    specs = charts(report)
    by_section: Dict[str, List[str]] = {}
    for c in specs:
        by_section.setdefault(c["section"], []).append(f'<div class="chart" id="{c["id"]}"></div>')

    def grid(section: str) -> str:
        return f'<div class="grid">{"".join(by_section.get(section, []))}</div>' if section in by_section else ""

    kept = report.kept
    sizes = [r["bytes"] for r in report.rows if isinstance(r.get("bytes"), int)]
    costs = report.costs()
    tiers = _count(report.tiers.values())
    cards = [(f"{len(kept):,}", "kept steps"), (f"{kept[0]} .. {kept[-1]}", "steps"),
             (", ".join(f"{n:,} {t}" for t, n in tiers.items()), "tiers"),
             (_bytes(statistics.median(sizes)) if sizes else "-", "median step size (sampled)"),
             (str(len(report.rollbacks)), "rollbacks seen"),
             (str(sum(1 for r in report.rows if r.get("references"))), "incremental steps (sampled)"),
             (_secs(statistics.median([c["blocking_s"] for c in costs])) if costs else "-", "median save() blocking")]
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>lazyckpt report: {_e(report.run)}</title>"
             f"<meta name=viewport content='width=device-width,initial-scale=1'><style>{_CSS}</style></head><body>",
             f"<header><h1>lazyckpt report: {_e(report.run)}</h1><p>generated {_time(report.created_unix)} UTC by "
             f"lazyckpt {_e(__version__)} (plotly.js {_e(plotly_version)} inside: no network needed); read "
             f"{report.manifests_read:,} manifests and {_bytes(report.bytes_read)} of tensors"
             + (f"; persistent tier {_e(report.persist_to)}" if report.persist_to else "") + "</p></header>",
             "<nav><a href='#history'>line of history</a><a href='#metrics'>metrics</a><a href='#norms'>norms</a>"
             "<a href='#movers'>biggest movers</a><a href='#costs'>save costs</a><a href='#steps'>steps</a></nav><main>",
             "<section id=summary><div class=cards>"
             + "".join(f"<div class=card><b>{_e(v)}</b><span>{_e(k)}</span></div>" for v, k in cards)
             + "</div></section>"]

    # The line of history.
    shown_note = (f"{len(report.rows):,} of {len(kept):,} steps sampled (evenly, with the first, the last and "
                  f"the compared steps) for sizes, metrics and costs" if len(report.rows) < len(kept)
                  else "every kept step")
    parts.append(f"<section id=history><h2>Line of history</h2><p class=note>Every kept step, from the index; "
                 f"{_e(shown_note)}. Rollbacks from {_e(report.events_note)} and the manifests read.</p>"
                 + grid("history"))
    if report.rollbacks:
        rows = [[r["seq"] if r["seq"] is not None else "-", r["step"], len(r["superseded"]),
                 ", ".join(map(str, r["superseded"][:12])) + (", ..." if len(r["superseded"]) > 12 else "")]
                for r in report.rollbacks]
        parts.append("<h3>Rollbacks</h3><p class=note>A commit of step S supersedes every step &gt;= S (a run "
                     "resumed from an earlier step): those saves are no longer on the line.</p>"
                     + _table(["seq", "committed step", "saves superseded", "their steps"], rows, "rollbacks",
                              right=(0, 1, 2)))
    else:
        parts.append("<p class=note>No rollback among the commits seen.</p>")
    parts.append("</section>")

    # Metrics.
    parts.append("<section id=metrics><h2>Metrics recorded in the saves' metadata</h2>")
    if report.metrics:
        parts.append(grid("metrics"))
    else:
        parts.append("<p class=note>No number in the sampled saves' <code>metadata=</code> (e.g. "
                     "<code>ckpt.save(state, step, metadata={\"loss\": loss.item()})</code>).</p>")
    parts.append("</section>")

    # Norms.
    shown, left_out = report.panels()
    notes = [f"{p.title}: {'; '.join(p.notes)}" for p in shown if p.notes]
    if left_out:
        notes.append("counters left out: " + ", ".join(left_out[:8]) + (", ..." if len(left_out) > 8 else ""))
    parts.append(f"<section id=norms><h2>Norm trajectories</h2><p class=note>The L2 norm of each tensor at "
                 f"{len(report.norm_steps)} steps, one chart per group "
                 f"({'first match of ' + _e(report.group) if report.group else 'top-level key'}); a log axis where "
                 f"a chart spans two decades.{' ' + _e('; '.join(notes)) + '.' if notes else ''}</p>"
                 + (grid("norms") or "<p class=note>No tensor measured.</p>"))
    if report.skipped:
        names = sorted({k for _, k, _ in report.skipped})
        parts.append(f"<p class=note>Not measured ({len(names)} leaves, e.g. pickled objects): "
                     f"{_e(', '.join(names[:10]))}</p>")
    parts.append("</section>")

    # Movers.
    parts.append("<section id=movers><h2>Biggest movers</h2>")
    d = report.diff
    if d is None:
        parts.append(f"<p class=note>One step compared with itself (step {report.from_step}): nothing moved.</p>")
    else:
        parts.append(f"<p class=note>Step {report.from_step} to step {report.to_step}, the "
                     f"{len(d.compared)} tensors that changed most by ||a-b||/||a|| (as <code>lazyckpt diff "
                     f"--top</code>){'' if report.counters or not left_out else ', counters left out'}; read "
                     f"{_bytes(d.bytes_read)} of {_bytes(d.tensor_bytes)}.</p>"
                     + grid("movers"))
        rows = [[r.key, "[" + ", ".join(map(str, r.shape or [])) + "]", r.dtype or "-", _num(r.max_abs_diff),
                 _num(r.norm_diff), _num(r.rel_change), _num(r.cosine), _num(r.frac_changed),
                 ("same bytes" if r.by_reference else "") + (r.note or "")] for r in d.compared]
        parts.append("<div class=scroll>" + _table(["key", "shape", "dtype", "max|a-b|", "||a-b||", "rel", "cosine",
                                                    "changed", "note"], rows, "movers", right=(3, 4, 5, 6, 7))
                     + "</div>")
        if d.skipped:
            parts.append(_table(["key", "skipped because"], [[r.key, r.skipped] for r in d.skipped], "skipped"))
    parts.append("</section>")

    # Costs.
    parts.append("<section id=costs><h2>Save costs</h2>")
    if costs:
        def stat_row(name: str, key: str, fmt: Any) -> List[str]:
            vals = sorted(c[key] for c in costs if isinstance(c.get(key), (int, float)))
            if not vals:
                return [name, "-", "-", "-", "0"]
            p90 = vals[min(len(vals) - 1, int(0.9 * len(vals)))]
            return [name, fmt(statistics.median(vals)), fmt(p90), fmt(vals[-1]), str(len(vals))]
        rows = [stat_row("save() blocking", "blocking_s", _secs), stat_row("capture", "capture_s", _secs),
                stat_row("flush (durable)", "flush_s", _secs), stat_row("barrier wait", "barrier_wait_s", _secs),
                stat_row("bytes written", "bytes", _bytes),
                stat_row("GB/s (bytes / flush)", "gb_per_s", lambda v: f"{v:.3g}")]
        parts.append("<p class=note>As the manifests record them (the maximum over ranks; the barrier wait of a "
                     "save is recorded by the next one). <code>lazyckpt advise</code> turns them into an "
                     "interval.</p>" + grid("costs")
                     + _table(["figure", "median", "p90", "max", "steps"], rows, "costs", right=(1, 2, 3, 4)))
    else:
        parts.append("<p class=note>No sampled manifest records its save's cost (saved by a lazyckpt that did not "
                     "record them, or by <code>lazyckpt.save</code>).</p>")
    parts.append("</section>")

    # Steps.
    metric_names = list(report.metrics)[:4]
    rows = []
    for r in report.rows:
        if "error" in r:
            rows.append([r["step"], r["tier"]] + ["-"] * (6 + len(metric_names)) + [f"unreadable: {r['error']}"])
            continue
        c = r.get("cost") if isinstance(r.get("cost"), dict) else {}
        flush = c.get("flush_s")
        rate = c["bytes"] / flush / 1e9 if isinstance(flush, (int, float)) and flush > 0 and \
            isinstance(c.get("bytes"), int) else None
        refs = r.get("references") or []
        rows.append([r["step"], r["tier"], _time(r.get("created_unix")), r.get("seq") if r.get("seq") is not None
                     else "-", _bytes(r.get("bytes")), ", ".join(map(str, refs[:6])) + (", ..." if len(refs) > 6
                                                                                    else "") or "-",
                     _secs(c.get("blocking_s")), _secs(flush)]
                    + [_num(report.metrics[m].get(r["step"])) for m in metric_names]
                    + [f"{rate:.3g} GB/s" if rate is not None else ""])
    head = ["step", "tier", "committed (UTC)", "seq", "size", "refers to", "blocking", "flush"] + metric_names + ["rate"]
    parts.append(f"<section id=steps><h2>Steps</h2><p class=note>{_e(shown_note)}.</p><div class=scroll>"
                 + _table(head, rows, "steps", right=(0, 3, 4, 6, 7) + tuple(range(8, 9 + len(metric_names))))
                 + "</div></section>")

    parts.append("</main>")
    parts.append(f'<script type="application/json" id="lazyckpt-data">'
                 f'{_json_for_script({"charts": [{k: c[k] for k in ("id", "data", "layout")} for c in specs]})}'
                 f"</script>")
    parts.append(f"<script>{js}</script><script>{_SCRIPT}</script></body></html>")
    return "".join(parts)


__all__ = ["RunReport", "collect", "render", "write_report", "charts", "sample", "rollbacks", "step_manifests",
           "MAX_STEPS", "NORM_STEPS", "TOP"]
