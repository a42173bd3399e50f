"""Run DeepSpeed's own checkpoint unit tests twice: with DeepSpeed's default
checkpoint engine and with lazyckpt's swapped in (not part of CI).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/ds_suite/run_deepspeed_suite.py \
        --tests /path/to/DeepSpeed/tests [--select unit/checkpoint/test_zero_optimizer.py ...] \
        [-k EXPR] [--out results.json]

``--tests`` is the ``tests/`` directory of a DeepSpeed checkout (nearest the
installed release). It is copied to a scratch directory, with one
compatibility edit that both runs get (see ``COMPAT``). Every rank process
imports ``sitecustomize.py`` from this directory: it skips DeepSpeed's CPU
shm-op build in both runs and, in the lazyckpt run, calls
``lazyckpt.integrations.deepspeed.enable(engine)`` on every engine
``deepspeed.initialize`` returns, logging every file the lazyckpt engine saves
with the test that saved it. A lazyckpt-run test that saved nothing through
lazyckpt while the default run's test wrote checkpoint files is reported as
"swap not proven". The default run logs the saves of DeepSpeed's own
engine the same way, so tests that never save a checkpoint are told apart.

Prints, per test: outcome with the default engine, with lazyckpt, lazyckpt
saves; then the counts. ``--out`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# The tests nearest the installed DeepSpeed 0.19.8 (mirror head 0.19.6.dev)
# still compare engine.sparse_tensor_module_names, an attribute 0.19.8 removed.
COMPAT = [("unit/checkpoint/common.py",
           "assert saved_model.sparse_tensor_module_names == loaded_model.sparse_tensor_module_names",
           "assert getattr(saved_model, 'sparse_tensor_module_names', None) == "
           "getattr(loaded_model, 'sparse_tensor_module_names', None)")]

PLUGIN = '''
import os


def pytest_runtest_setup(item):
    path = os.environ.get("LAZYCKPT_DS_CURRENT")
    if path:
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(item.nodeid)
        os.replace(path + ".tmp", path)
'''


def prepare(tests_dir: str, scratch: str) -> str:
    work = os.path.join(scratch, "tests")
    shutil.copytree(tests_dir, work, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, old, new in COMPAT:
        path = os.path.join(work, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if old in text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new))
    with open(os.path.join(work, "_lazyckpt_ds_plugin.py"), "w", encoding="utf-8") as f:
        f.write(PLUGIN)
    return work


def run(work: str, mode: str, select: list, kexpr: str, scratch: str, timeout_s: int) -> dict:
    junit = os.path.join(scratch, f"junit-{mode}.xml")
    log = os.path.join(scratch, f"saves-{mode}.log")
    env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               PYTHONPATH=os.pathsep.join([HERE, work, os.environ.get("PYTHONPATH", "")]),
               LAZYCKPT_DS_CURRENT=os.path.join(scratch, f"current-{mode}"),
               LAZYCKPT_DS_LOG=log, DS_UNITTEST_TIMEOUT=str(timeout_s),
               LAZYCKPT_DS_SWAP="1" if mode.startswith("lazyckpt") else "0",
               # "lazyckpt": the engine's default files (torch.save's zip); "lazyckpt-own": lazyckpt's format.
               LAZYCKPT_DS_FORMAT="lazyckpt" if mode == "lazyckpt-own" else "",
               # The CPU accelerator counts NUMA nodes as devices: without this every
               # 2- and 4-rank test skips ("not enough GPUs").
               LOCAL_SIZE=os.environ.get("LOCAL_SIZE", "4"))
    cmd = [sys.executable, "-m", "pytest", "-p", "_lazyckpt_ds_plugin", "-p", "no:cacheprovider",
           "--color=no", "-q", f"--junitxml={junit}", *select]
    if kexpr:
        cmd += ["-k", kexpr]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(os.path.join(scratch, f"pytest-{mode}.txt"), "w", encoding="utf-8") as f:
        f.write(proc.stdout)
    return dict(collect(scratch, mode), seconds=round(time.monotonic() - started, 1), returncode=proc.returncode)


def collect(scratch: str, mode: str) -> dict:
    """Outcomes (junit) and saves (the sitecustomize log) of one mode's run in ``scratch``."""
    junit = os.path.join(scratch, f"junit-{mode}.xml")
    log = os.path.join(scratch, f"saves-{mode}.log")
    outcomes = {}
    if os.path.exists(junit):
        for case in ET.parse(junit).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            outcome, reason = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    reason = (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                    break
            outcomes[name] = {"outcome": outcome, "reason": reason}
    saves = collections.Counter()
    if os.path.exists(log):
        with open(log, encoding="utf-8") as f:
            for line in f:
                nodeid = line.split("\t", 1)[0]
                saves[_junit_name(nodeid)] += 1
    return {"outcomes": outcomes, "saves": dict(saves), "seconds": None}


def _junit_name(nodeid: str) -> str:
    """unit/checkpoint/test_x.py::TestC::test_y[p] -> unit.checkpoint.test_x.TestC::test_y[p] (junit's)."""
    path, _, rest = nodeid.partition("::")
    module = path[:-3].replace("/", ".") if path.endswith(".py") else path
    cls, _, test = rest.rpartition("::")
    return f"{module}.{cls}::{test}" if cls else f"{module}::{test}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", help="a DeepSpeed checkout's tests/ directory")
    parser.add_argument("--select", nargs="*", default=["unit/checkpoint"])
    parser.add_argument("-k", default="")
    parser.add_argument("--modes", default="default,lazyckpt",
                        help="of default, lazyckpt (torch-format files, the default), "
                             "lazyckpt-own (file_format='lazyckpt')")
    parser.add_argument("--timeout", type=int, default=600, help="DeepSpeed's per-test worker timeout")
    parser.add_argument("--out", default="")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (logs, junit)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="report from the --out files or --keep scratch directories of earlier runs "
                             "(e.g. one per mode, run in parallel)")
    args = parser.parse_args()
    if args.merge:
        report(merge(args.merge), args.out)
        return 0
    if not args.tests:
        parser.error("--tests is required (unless --merge)")
    scratch = tempfile.mkdtemp(prefix="ds_suite_")
    work = prepare(os.path.abspath(args.tests), scratch)
    results = {mode: run(work, mode, args.select, args.k, scratch, args.timeout)
               for mode in args.modes.split(",")}
    report(results, args.out)
    print(f"scratch: {scratch}")
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def merge(paths: list) -> dict:
    results: dict = {}
    for path in paths:
        if os.path.isdir(path):                  # a --keep scratch directory: every mode run there
            for mode in ("default", "lazyckpt", "lazyckpt-own"):
                if os.path.exists(os.path.join(path, f"junit-{mode}.xml")):
                    results[mode] = collect(path, mode)
            continue
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        for mode, seconds in ((m, v.get("seconds")) for m, v in data["summary"].items() if isinstance(v, dict)):
            r = results.setdefault(mode, {"outcomes": {}, "saves": {}, "seconds": seconds})
            for row in data["tests"]:
                if mode in row and row[mode]["outcome"] != "missing":
                    r["outcomes"][row["test"]] = row[mode]
                    r["saves"][row["test"]] = row.get(f"{mode}_saves", 0)
    return results


def report(results: dict, out: str) -> None:
    names = sorted(set().union(*(r["outcomes"] for r in results.values())))
    table = []
    for name in names:
        row = {"test": name}
        for mode, r in results.items():
            row[mode] = r["outcomes"].get(name, {"outcome": "missing", "reason": ""})
        for mode, r in results.items():
            row[f"{mode}_saves"] = r["saves"].get(name, 0)
        row.setdefault("lazyckpt_saves", 0)
        row.setdefault("default_saves", 0)
        table.append(row)
        line = f"{name}: " + " | ".join(f"{m}={row[m]['outcome']}" for m in results)
        lazy_modes = [m for m in results if m.startswith("lazyckpt")]
        if lazy_modes:
            line += f" | saves default={row['default_saves']} " + " ".join(
                f"{m}={row.get(m + '_saves', 0)}" for m in lazy_modes)
            for m in lazy_modes:
                if row[m]["outcome"] in ("failed", "error"):
                    line += f"\n    {m}: {row[m]['reason']}"
        print(line)
    summary = {mode: dict(collections.Counter(r["outcomes"][n]["outcome"] for n in r["outcomes"]),
                          seconds=r["seconds"]) for mode, r in results.items()}
    for mode in (m for m in results if m.startswith("lazyckpt") and "default" in results):
        suffix = "" if mode == "lazyckpt" else "_" + mode.replace("-", "_")
        summary["pass_default_fail_lazyckpt" + suffix] = [row["test"] for row in table
                                                          if row["default"]["outcome"] == "passed"
                                                          and row[mode]["outcome"] != "passed"]
        # A test that saved through DeepSpeed's engine must save through lazyckpt's.
        summary["swap_not_proven" + suffix] = [row["test"] for row in table
                                               if row["default_saves"] and not row.get(f"{mode}_saves")]
        summary["saving_tests"] = sum(1 for row in table if row["default_saves"])
    print(json.dumps(summary, indent=1))
    if out:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "tests": table}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
