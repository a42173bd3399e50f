"""Long fuzzing run of the loader: the properties of tests/test_fuzz.py over
>= 10,000 inputs (a seeded random loop, every input reproducible from its seed).

For every mutated file (raw byte damage; footer byte damage with the checksum
recomputed; structured footer JSON mutations, see tests/lzc_fuzz.py), loaded
whole or with a random key selection: ``lazyckpt.load`` returns or raises a
``lazyckpt.CheckpointError``; never another exception, never a hang (10 s
SIGALRM per input), never a Python-heap peak over 4 MiB nor read buffers over
2 x file size + 1 MiB (the files are < 64 KiB).

    cd /work/main && .venv/bin/python benchmarks/fuzz_long.py --inputs 10000
    cd /work/main && .venv/bin/python benchmarks/fuzz_long.py --replay 1234   # one input, verbose

Prints inputs tried / loaded / library errors / other exceptions / hangs /
memory, per mutator, the most frequent library errors (how deep inputs got),
and each failing seed. Exit status 0 iff no failure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import lzc_fuzz as fz  # noqa: E402


def _category(detail: str) -> str:
    """An error message without key selection, paths and numbers, to group them."""
    text = re.sub(r"^keys=\[.*?\]: ", "", detail)
    text = re.sub(r"/\S*?\.lzc(: )?", "", text)
    text = re.sub(r"b?'[^']*'|\"[^\"]*\"|-?\d+", "#", text)
    return text[:100]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=0, help="input i uses seed + i")
    p.add_argument("--replay", type=int, default=None, help="run only this seed and print its outcome")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="lazyckpt-fuzz-")
    bases = fz.make_base_files(work)
    scratch = os.path.join(work, "mutated.lzc")
    if args.replay is not None:
        name, outcome, detail = fz.one_input(bases, random.Random(args.replay), scratch)
        print(f"seed {args.replay}: mutator {name}: {outcome}: {detail}\nfile kept at {scratch}")
        return 0 if outcome not in fz.FAILURES else 1
    totals = collections.Counter()
    per_mutator = collections.defaultdict(collections.Counter)
    categories = collections.Counter()
    failures = []
    t0 = time.monotonic()
    for i in range(args.inputs):
        seed = args.seed + i
        name, outcome, detail = fz.one_input(bases, random.Random(seed), scratch)
        totals[outcome] += 1
        per_mutator[name][outcome] += 1
        if outcome == "library":
            categories[_category(detail)] += 1
        if outcome in fz.FAILURES:
            failures.append({"seed": seed, "mutator": name, "outcome": outcome, "detail": detail})
        if (i + 1) % 1000 == 0:
            print(f"  {i + 1} inputs, {len(failures)} failures, {time.monotonic() - t0:.0f} s", flush=True)
    elapsed = time.monotonic() - t0
    summary = {"inputs": args.inputs, "loaded": totals["ok"], "library_errors": totals["library"],
               "other_exceptions": totals["other"], "hangs": totals["hang"], "memory": totals["memory"],
               "per_mutator": {k: dict(v) for k, v in per_mutator.items()},
               "distinct_library_errors": len(categories), "elapsed_s": round(elapsed, 1),
               "seed": args.seed, "failures": failures}
    print(f"\ninputs tried: {args.inputs}   loaded: {totals['ok']}   library errors: {totals['library']}   "
          f"other exceptions: {totals['other']}   hangs: {totals['hang']}   memory: {totals['memory']}   "
          f"({elapsed:.0f} s, {args.inputs / elapsed:.0f} inputs/s)")
    for name, counts in sorted(per_mutator.items()):
        print(f"  {name:13s} " + "  ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    print(f"distinct library error kinds: {len(categories)}; most frequent:")
    for text, n in categories.most_common(15):
        print(f"  {n:6d}  {text}")
    by_kind = collections.defaultdict(list)
    for f in failures:
        by_kind[_category(f["detail"])].append(f["seed"])
    if failures:
        print(f"\nFAILURES ({len(failures)}), grouped:")
        for text, seeds in sorted(by_kind.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(seeds):5d}  {text}   seeds {seeds[:5]}")
        print("replay one with: .venv/bin/python benchmarks/fuzz_long.py --replay SEED")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
