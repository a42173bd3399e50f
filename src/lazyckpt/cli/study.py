"""``lazyckpt diff`` and ``lazyckpt trajectory``: the command-line face of
:mod:`lazyckpt.study` (registered by :func:`add_commands` from cli.py)."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, Callable, Dict, List, Optional

from lazyckpt.study import STATS, diff, trajectory
from lazyckpt.study.report import MAX_STEPS, NORM_STEPS, TOP as REPORT_TOP, step_manifests, write_report
from lazyckpt.study.panels import DASHES, metrics as saved_metrics, metrics_panel, panels, style
from .inspect import human_bytes
from .output import print_json, text_table

EXIT_OK = 0


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0:
            return "0"
        return f"{v:.4g}"
    return str(v)


def _shape(v: Any) -> str:
    return "[" + ", ".join(map(str, v)) + "]" if isinstance(v, list) else "-"


def cmd_diff(args: argparse.Namespace) -> int:
    report = diff(args.a, args.b, keys=args.keys, top=args.top, workers=args.workers)
    if args.json:
        print_json(report.to_json())
        return EXIT_OK
    compared, skipped = report.compared, report.skipped
    by_ref = sum(1 for r in compared if r.by_reference)
    print(f"A: {report.a}\nB: {report.b}")
    print(f"{len(compared)} tensor{'s' if len(compared) != 1 else ''} shown"
          + (f" (top {args.top} by relative change)" if args.top is not None else "")
          + f", {by_ref} unchanged by reference (not read), {len(skipped)} skipped; read "
          f"{human_bytes(report.bytes_read)} of {human_bytes(report.tensor_bytes)} held"
          + (f"; {report.values_not_compared} Python values not compared" if report.values_not_compared else ""))
    if compared:
        rows = [[r.key, _shape(r.shape), r.dtype or "-", _num(r.max_abs_diff), _num(r.norm_diff), _num(r.rel_change),
                 _num(r.cosine), _num(r.frac_changed), ("same bytes" if r.by_reference else "") +
                 (r.note or "")] for r in compared]
        for line in text_table(["key", "shape", "dtype", "max|a-b|", "||a-b||", "rel", "cosine", "changed", "note"],
                           rows, right=(3, 4, 5, 6, 7)):
            print("  " + line)
    if skipped:
        print(f"skipped ({len(skipped)}):")
        for line in text_table(["key", "why"], [[r.key, r.skipped] for r in skipped]):
            print("  " + line)
    return EXIT_OK


def _progress(args: argparse.Namespace) -> bool:
    """On when asked, or on a terminal when tqdm is there (the bar is optional: extra 'cli')."""
    if args.progress is not None:
        return args.progress
    if not sys.stderr.isatty():
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def _steps_arg(text: Optional[str]) -> Optional[List[int]]:
    if text is None:
        return None
    out: List[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        try:
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
        except ValueError:
            raise ValueError(f"--steps {text!r}: expected steps like 10,20 or 10-50") from None
    return out


def cmd_trajectory(args: argparse.Namespace) -> int:
    if args.png is not None:
        _pyplot()                       # a missing matplotlib fails before any reading
    traj = trajectory(args.run, keys=args.keys, fn=args.stat, steps=_steps_arg(args.steps),
                      persist_to=args.persist_to, workers=args.workers, progress=_progress(args))
    tiers = dict(traj.steps)
    table: Dict[str, Dict[int, float]] = {}
    for step, key, value in traj:
        table.setdefault(key, {})[step] = value
    steps = [s for s, _ in traj.steps]
    if args.json:
        print_json({"run": args.run, "stat": args.stat, "steps": [{"step": s, "tier": tiers[s]} for s in steps],
                     "values": {k: {str(s): _json_float(v) for s, v in vals.items()} for k, vals in table.items()},
                     "skipped": [{"step": s, "key": k, "why": w} for s, k, w in traj.skipped],
                     "bytes_read": traj.counter.bytes_read})
    else:
        print(f"{args.run}: {args.stat} of {len(table)} tensor{'s' if len(table) != 1 else ''} over {len(steps)} "
              f"step{'s' if len(steps) != 1 else ''}; read {human_bytes(traj.counter.bytes_read)}")
        keys = list(table)
        if len(keys) <= args.wide:
            rows = [[str(s), tiers[s]] + [_num(table[k].get(s)) for k in keys] for s in steps]
            lines = text_table(["step", "tier"] + keys, rows, right=tuple(range(2, 2 + len(keys))))
        else:
            rows = [[k, str(s), _num(v)] for k in keys for s, v in table[k].items()]
            lines = text_table(["key", "step", args.stat], rows, right=(1, 2))
        for line in lines:
            print("  " + line)
        if traj.skipped:
            print(f"skipped ({len(traj.skipped)}):")
            for line in text_table(["step", "key", "why"], [[str(s), k, w] for s, k, w in traj.skipped]):
                print("  " + line)
    if args.png is not None:
        manifests = step_manifests([where for _, _, where in traj.locations])
        found = saved_metrics({s: m.get("metadata") for s, m in zip(steps, manifests) if m is not None})
        for note in plot_trajectory(table, args.stat, args.png, group=args.group, title=args.run,
                                    numel=traj.numel(), metrics=found, counters=args.counters):
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {args.png}", file=sys.stderr)
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    report = write_report(args.run, args.output, persist_to=args.persist_to, from_step=args.from_step,
                          to_step=args.to_step, keys=args.keys, group=args.group, counters=args.counters,
                          top=args.top, max_steps=args.max_steps, norm_steps=args.norm_steps, workers=args.workers)
    if args.json:
        print_json(report.to_json())
    took = sum(report.seconds.values())
    print(f"wrote {args.output}: {len(report.kept):,} kept steps, {report.manifests_read:,} manifests and "
          f"{human_bytes(report.bytes_read)} of tensors read, {took:.2f} s", file=sys.stderr)
    return EXIT_OK


def _json_float(v: Any) -> Any:
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def _pyplot() -> Any:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--png needs matplotlib: pip install 'lazyckpt[plot]'") from None
    return plt


def cmd_history(args: argparse.Namespace) -> int:
    """``lazyckpt history``: the old name of ``lazyckpt trajectory``."""
    print("lazyckpt: note: `lazyckpt history` is deprecated and will be removed in 0.3: use `lazyckpt trajectory` "
          "(same arguments)", file=sys.stderr)
    return cmd_trajectory(args)


def plot_trajectory(table: Dict[str, Dict[int, float]], stat: str, png: str, group: Optional[str] = None,
                    title: str = "", numel: Optional[Dict[str, int]] = None,
                    metrics: Optional[Dict[str, Dict[int, float]]] = None, counters: bool = False) -> List[str]:
    """One panel per group (lazyckpt/study/panels.py: top-level keys, or
    ``group``), counters left out unless ``counters``, a log axis where a
    panel spans decades, a dash pattern per round of colours, and the saves'
    metrics in a panel of their own. Returns the notes to show (what was left
    out)."""
    plt = _pyplot()
    shown, left_out = panels(table, numel or {}, group=group, counters=counters, stat=stat)
    notes = []
    if left_out:
        notes.append(f"counters left out (--counters to plot them): {', '.join(left_out[:6])}"
                     + (", ..." if len(left_out) > 6 else ""))
    if len(shown) > MAX_PANELS:
        notes.append(f"{len(shown) - MAX_PANELS} groups not drawn (at most {MAX_PANELS} panels: a coarser --group "
                     f"or --keys)")
        shown = shown[:MAX_PANELS]
    extra = metrics_panel(metrics or {})
    if extra is not None:
        shown = [extra] + shown
    if not shown:
        raise ValueError("nothing to plot: every value selected is a counter or not a number (--counters plots "
                         "counters)")
    cols = 1 if len(shown) == 1 else 2
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(9.5 * cols, 3.6 * rows + 0.6), squeeze=False)
    for ax, panel in zip(axes.flat, shown):
        for i, (name, values) in enumerate(panel.lines.items()):
            colour, dash = style(i)
            steps = sorted(values)
            ys = [values[s] if not panel.log or values[s] > 0 else float("nan") for s in steps]
            ax.plot(steps, ys, color=colour, linestyle=DASHES[dash][0], marker="o", markersize=2.5, linewidth=1.4,
                    label=_short(name, panel.title))
        if panel.log:
            ax.set_yscale("log")
        ax.set_title(panel.title + ("" if panel.kind == "metrics" else f": {stat}") + (" (log)" if panel.log else ""),
                     fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=8)
        # Beside the axes, not on them: with many lines a legend inside hides the lines it names.
        ax.legend(fontsize=7, ncol=2 if len(panel.lines) > 12 else 1, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0.0, frameon=False)
        if panel.notes:
            ax.text(0.01, 0.01, "; ".join(panel.notes), transform=ax.transAxes, fontsize=7, color="#555")
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return notes


#: Panels of one PNG at most (two columns).
MAX_PANELS = 16


def _short(name: str, group: str) -> str:
    """A legend label: the key less its panel's top-level component."""
    prefix = group + "/"
    return name[len(prefix):] if name.startswith(prefix) else name


def add_commands(sub: Any, progress_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``diff``, ``report`` and ``trajectory`` (and its old name ``history``) on the ``lazyckpt`` parser."""
    sp = sub.add_parser("diff", help="compare two committed steps tensor by tensor (reads pieces, not states)",
                        description="A and B: a .lzc file, a step directory, a Checkpointer directory (its latest "
                        "step) or RUN@STEP; local or s3://; any world size on either side. One row per tensor: "
                        "max|a-b|, ||a-b||, ||a-b||/||a||, cosine, fraction of elements changed; sorted by "
                        "relative change. Tensors an incremental step holds as a reference to the other's bytes "
                        "are reported unchanged without being read.")
    sp.add_argument("a", metavar="A")
    sp.add_argument("b", metavar="B")
    sp.add_argument("--keys", action="append", metavar="GLOB",
                    help="only tensors whose /-joined path matches (repeatable), e.g. 'model/*.weight'")
    sp.add_argument("--top", type=int, metavar="K", help="the K tensors that changed most (skipped rows are "
                    "always listed)")
    sp.add_argument("--workers", type=int, default=2, help="tensors compared in parallel (default 2)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    sp.set_defaults(func=cmd_diff)

    rp = sub.add_parser("report", help="one self-contained HTML page of a run: its steps, commits and rollbacks, metrics, "
                        "norms, biggest movers and save costs",
                        description="Reads the run's index (every kept step and its tier), the manifests of at most "
                        "--max-steps sampled steps, the tensors of --norm-steps of them, and the two steps compared; "
                        "writes one HTML file with interactive charts (plotly.js inside: it opens with no network). "
                        "Needs plotly: pip install 'lazyckpt[report]'.")
    rp.add_argument("run", metavar="RUN", help="a Checkpointer directory or s3:// prefix")
    rp.add_argument("-o", "--output", metavar="FILE", default="report.html", help="the page (default report.html)")
    rp.add_argument("--persist-to", metavar="URL", help="the run's persistent tier (s3://...): its steps too")
    rp.add_argument("--from", dest="from_step", type=int, metavar="STEP",
                    help="the biggest movers from this step (default: the first kept)")
    rp.add_argument("--to", dest="to_step", type=int, metavar="STEP", help="... to this one (default: the last kept)")
    rp.add_argument("--keys", action="append", metavar="GLOB", help="tensors to measure and compare (repeatable)")
    rp.add_argument("--group", metavar="REGEX", help="one norm chart per group: a key's first match of REGEX "
                    "(default: the top-level keys)")
    rp.add_argument("--counters", action="store_true", help="plot counters (one-element whole-number tensors) too")
    rp.add_argument("--top", type=int, default=REPORT_TOP, metavar="K", help=f"movers shown (default {REPORT_TOP})")
    rp.add_argument("--max-steps", type=int, default=MAX_STEPS, metavar="N",
                    help=f"manifests read at most: a sample of the kept steps (default {MAX_STEPS})")
    rp.add_argument("--norm-steps", type=int, default=NORM_STEPS, metavar="N",
                    help=f"steps whose tensors are measured (default {NORM_STEPS})")
    rp.add_argument("--workers", type=int, default=4, help="tensors read in parallel (default 4)")
    rp.add_argument("--json", action="store_true", help="also print what the page shows as JSON")
    rp.set_defaults(func=cmd_report)

    trajectory_parser(sub, "trajectory", progress_flags,
                      help="a statistic of tensors over every kept step of a run (table, --png)")
    # The command's old name, one more release: not listed, it says so on stderr and runs trajectory.
    trajectory_parser(sub, "history", progress_flags).set_defaults(func=cmd_history)


def trajectory_parser(sub: Any, name: str, progress_flags: Callable[[argparse.ArgumentParser], None],
                      **listed: Any) -> argparse.ArgumentParser:
    """The ``lazyckpt trajectory`` parser, under ``name`` (``help=`` lists it)."""
    sp = sub.add_parser(name, **listed,
                        description="Reads every kept step (and, with --persist-to, the persistent tier's) "
                        "chunk by chunk; a step that refers to an earlier step's bytes (incremental) reuses its "
                        "value without reading.")
    sp.add_argument("run", metavar="RUN", help="a Checkpointer directory or s3:// prefix")
    sp.add_argument("--keys", action="append", metavar="GLOB", help="tensors to follow (repeatable; default all)")
    sp.add_argument("--stat", default="norm", choices=STATS, help="statistic (default norm; std is unbiased)")
    sp.add_argument("--steps", metavar="LIST", help="only these steps, e.g. 100,200 or 100-500")
    sp.add_argument("--persist-to", metavar="URL", help="the run's persistent tier (s3://...): its steps too")
    sp.add_argument("--workers", type=int, default=4, help="tensors read in parallel (default 4)")
    sp.add_argument("--png", metavar="FILE", help="plot one line per tensor (needs matplotlib: lazyckpt[plot])")
    sp.add_argument("--group", metavar="REGEX", help="with --png: one panel per group, a tensor's group being "
                    r"the first match of REGEX in its key (e.g. 'layers\.\d+'); default: the top-level keys "
                    "(model, optimizer, ...)")
    sp.add_argument("--counters", action="store_true", help="with --png: plot counters too (one-element tensors "
                    "holding whole numbers, e.g. AdamW's step), which are left out by default")
    sp.add_argument("--wide", type=int, default=6, metavar="N",
                    help="one column per tensor when there are at most N (default 6), else one row per value")
    sp.add_argument("--json", action="store_true", help="machine-readable output")
    progress_flags(sp)
    sp.set_defaults(func=cmd_trajectory)
    return sp
