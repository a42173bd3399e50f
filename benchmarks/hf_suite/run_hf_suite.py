"""Run transformers' own Trainer checkpoint tests twice: with the plain
``transformers.Trainer`` and with ``LazyCheckpointTrainer`` swapped in (not
part of CI: the repository's pytest config collects only tests/).

    DS_ACCELERATOR=cpu .venv/bin/python benchmarks/hf_suite/run_hf_suite.py [-k EXPR] [--out results.json]

The test files live in tests/trainer/ here (git-ignored; fetched from
huggingface/transformers tests/trainer/test_trainer_checkpointing.py @ 22c22fa2
and trainer_test_utils.py @ 2d754248: see their docstrings for the cuts). They
must sit under a directory named ``tests``: transformers' ``get_tests_dir()``
walks up to one. ``conftest.py`` does the swap (LAZYCKPT_HF_SWAP=1) and logs
every ``_save_checkpoint`` with its test. A lazyckpt-run test that saved a
checkpoint in the plain run but logged no lazyckpt save (or logged a plain
save: the mixin's fallback) is reported as "swap not proven". Runs offline
(HF_HUB_OFFLINE=1): tests that need a download fail in both runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def run(mode: str, kexpr: str, scratch: str, timeout_s: int) -> dict:
    junit = os.path.join(scratch, f"junit-{mode}.xml")
    log = os.path.join(scratch, f"saves-{mode}.log")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               LAZYCKPT_HF_SWAP="1" if mode == "lazyckpt" else "0", LAZYCKPT_HF_SAVE_LOG=log)
    cmd = [sys.executable, "-m", "pytest", "-c", os.path.join(HERE, "pytest.ini"), "--rootdir", HERE,
           os.path.join(HERE, "tests"), "-q", f"--junitxml={junit}", "-p", "no:randomly"]
    if kexpr:
        cmd += ["-k", kexpr]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    outcomes, messages = {}, {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "")[:200]
        outcomes[name], messages[name] = outcome, message
    saves = collections.defaultdict(collections.Counter)
    if os.path.exists(log):
        with open(log, encoding="utf-8") as f:
            for line in f:
                entry = json.loads(line)
                test = entry["test"].split("::", 1)[1] if entry["test"] else "?"
                saves[test][entry["kind"]] += 1
    return {"outcomes": outcomes, "messages": messages, "saves": saves, "wall_s": wall,
            "tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="")
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=int, default=3600)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hf-suite-") as scratch:
        runs = {mode: run(mode, ns.k, scratch, ns.timeout) for mode in ("plain", "lazyckpt")}
    plain, lazy = runs["plain"], runs["lazyckpt"]
    rows = []
    for name in sorted(set(plain["outcomes"]) | set(lazy["outcomes"])):
        p, z = plain["outcomes"].get(name, "-"), lazy["outcomes"].get(name, "-")
        psaves = sum(plain["saves"][name].values())
        zl, zp = lazy["saves"][name]["lazyckpt"], lazy["saves"][name]["plain"]
        proof = ""
        if psaves and (zl == 0 or zp):
            proof = "swap not proven"
        rows.append({"test": name, "plain": p, "lazyckpt": z, "plain_saves": psaves,
                     "lazyckpt_saves": zl, "fallback_saves": zp, "note": proof,
                     "plain_message": plain["messages"].get(name, ""),
                     "lazyckpt_message": lazy["messages"].get(name, "")})
        print(f"{name:75s} plain={p:8s} lazyckpt={z:8s} saves plain={psaves:3d} lazyckpt={zl:3d}"
              f"{' fallback=' + str(zp) if zp else ''} {proof}")
    count = collections.Counter
    summary = {"tests": len(rows),
               "plain": dict(count(r["plain"] for r in rows)),
               "lazyckpt": dict(count(r["lazyckpt"] for r in rows)),
               "lazyckpt_only_failures": [r["test"] for r in rows
                                          if r["plain"] == "passed" and r["lazyckpt"] != "passed"],
               "swap_not_proven": [r["test"] for r in rows if r["note"]],
               "wall_s": {m: round(r["wall_s"], 1) for m, r in runs.items()}}
    print(json.dumps(summary, indent=1))
    for r in rows:
        if r["test"] in summary["lazyckpt_only_failures"]:
            print(f"--- {r['test']}: {r['lazyckpt_message']}")
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
