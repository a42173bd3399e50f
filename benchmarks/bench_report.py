"""``lazyckpt report`` against the number of kept steps: the page of a run
of 100, 1,000 and 10,000 kept steps reads only what it shows (the index, a
sample of ``max_steps`` manifests, the tensors of ``norm_steps`` steps and
the two compared ones), so its time stays flat; and the page opens and draws
in headless Chromium in about the same time whatever the run.

Runs are built by ``tests/_report_runs.build_long_run`` (a few real saves of
an MLP + AdamW, the other steps cloned: hard links to a real save's data file,
a manifest of their own), once per size. Then, per size and repetition, in a
fresh process: ``write_report`` timed phase by phase (index, manifests,
norms, diff, render), the manifests and tensor bytes read, the page's size;
and, where Chromium and Playwright are installed, the time from opening the
file to every chart drawn (``tests/_browser.open_page``; starting Chromium
is printed apart). Beside it, the
baseline the sampling avoids: reading every kept step's manifest.

    .venv/bin/python benchmarks/bench_report.py                       # 100, 1,000, 10,000 steps, 3 reps
    .venv/bin/python benchmarks/bench_report.py --sizes 10000 --reps 1

Printed: medians over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests")


def child(run: str, page: str, browser: bool) -> dict:
    sys.path.insert(0, TESTS)
    from lazyckpt.study.report import step_manifests, write_report
    t0 = time.perf_counter()
    report = write_report(run, page)
    out = {"total_s": time.perf_counter() - t0, "phases": report.seconds, "kept": len(report.kept),
           "manifests_read": report.manifests_read, "bytes_read": report.bytes_read,
           "page_bytes": os.path.getsize(page)}
    t0 = time.perf_counter()
    every = step_manifests([os.path.join(run, f"step_{s:010d}") for s in report.kept])
    out["every_manifest_s"] = time.perf_counter() - t0
    assert len(every) == len(report.kept)
    if browser:
        import _browser
        seen = _browser.open_page(page, timeout_s=300)
        out["chromium_s"] = seen["draw_s"]
        out["launch_s"] = seen["launch_s"]
        out["chromium_ok"] = not seen["errors"] and seen["drawn"] == seen["charts"] == seen["rendered"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-browser", action="store_true", help="skip the Chromium timing")
    p.add_argument("--child", nargs=2, metavar=("RUN", "PAGE"), help=argparse.SUPPRESS)
    p.add_argument("--browser", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.browser)))
        return
    sys.path.insert(0, TESTS)
    from _browser import find_chromium
    from _report_runs import build_long_run
    try:
        import playwright  # noqa: F401
        browser = not args.no_browser and find_chromium() is not None
    except ImportError:
        browser = False
    base = tempfile.mkdtemp(prefix="lazyckpt-bench-report-")
    try:
        runs = {}
        for n in args.sizes:
            t0 = time.perf_counter()
            runs[n] = os.path.join(base, f"run{n}")
            build_long_run(runs[n], n)
            print(f"built {n:,} steps in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        results = {n: [] for n in args.sizes}
        for _ in range(args.reps):
            for n in args.sizes:                     # interleaved
                cmd = [sys.executable, __file__, "--child", runs[n], os.path.join(base, f"page{n}.html")]
                proc = subprocess.run(cmd + (["--browser"] if browser else []), capture_output=True, text=True,
                                      check=True)
                results[n].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        med = statistics.median
        print(f"\nlazyckpt report, medians of {args.reps} (torch {__import__('torch').__version__}, "
              f"{os.cpu_count()} CPUs){'' if browser else '; no Chromium timing (not installed)'}")
        head = ("kept steps", "report s", "index", "manifests", "norms", "diff", "render", "manifests read",
                "tensor KiB read", "page MB", "every manifest s", "Chromium: open to drawn s", "(launch s)")
        print(" | ".join(head))
        for n in args.sizes:
            rs = results[n]
            ph = {k: med([r["phases"][k] for r in rs]) for k in rs[0]["phases"]}
            print(" | ".join([f"{n:,}", f"{med([r['total_s'] for r in rs]):.2f}",
                              *(f"{ph[k]:.3f}" for k in ("index", "manifests", "norms", "diff", "render")),
                              f"{rs[0]['manifests_read']:,}", f"{rs[0]['bytes_read'] / 1024:.0f}",
                              f"{rs[0]['page_bytes'] / 1e6:.2f}", f"{med([r['every_manifest_s'] for r in rs]):.2f}",
                              f"{med([r['chromium_s'] for r in rs]):.2f}" if browser else "-",
                              f"{med([r['launch_s'] for r in rs]):.2f}" if browser else "-"]))
            if browser and not all(r["chromium_ok"] for r in rs):
                print(f"  WARNING: the page of {n:,} steps drew with errors or missing charts")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
