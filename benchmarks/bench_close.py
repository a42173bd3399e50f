"""What ``Checkpointer.close()`` costs as the steps kept grow.

Opening a directory starts a background scan of its leftovers (one listing
of the directory, a look at each name); close() must not wait for it, so it
costs the same at 100,000 steps as at 10. The directory is built with one
real save whose step directory is copied under the other step numbers (the
scan looks at names and a stat or two each, not at the manifests' contents),
then the newest step saved for real; each round opens a Checkpointer on it
(keep=None: no retention) and times close() right after.

    .venv/bin/python benchmarks/bench_close.py --steps 10 3000 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import lazyckpt
from lazyckpt.formats.names import step_dirname


def build(directory: str, steps: int) -> None:
    with lazyckpt.Checkpointer(directory, keep=None) as ck:
        ck.save({"w": torch.ones(4)}, 1).wait()
    template = os.path.join(directory, step_dirname(1))
    for step in range(2, steps):
        shutil.copytree(template, os.path.join(directory, step_dirname(step)))
    with lazyckpt.Checkpointer(directory, keep=None) as ck:
        ck.save({"w": torch.ones(4) * steps}, steps).wait()


def measure(directory: str, rounds: int) -> list:
    times = []
    for _ in range(rounds):
        ck = lazyckpt.Checkpointer(directory, keep=None)
        t0 = time.perf_counter()
        ck.close()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[10, 3000])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    for steps in args.steps:
        with tempfile.TemporaryDirectory() as tmp:
            d = os.path.join(tmp, "run")
            build(d, steps)
            times = measure(d, args.rounds)
            print(f"steps={steps:>7}  close() median {statistics.median(times) * 1e3:8.2f} ms  "
                  f"max {max(times) * 1e3:8.2f} ms  ({args.rounds} rounds)")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
