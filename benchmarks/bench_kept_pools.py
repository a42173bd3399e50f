"""What the kept pools' idle exit costs a save and a load (lazyckpt/keptpools.py).

The checksum and release threads end after ``keptpools.IDLE_S`` without a task
and the next task starts them again. This measures, interleaved in a new
random order every repetition, the same work with the threads alive (a save
and load just before, untimed) and after they ended (stopped as an idle exit
would, without waiting for it):

* a no-op task on each pool: the bare cost of starting a thread;
* ``lazyckpt.save`` + ``lazyckpt.load`` of a small file (the checksum threads);
* a Checkpointer ``save().wait()`` over the previous step (``keep=1``: the
  superseded step is freed on the release thread) + its ``load``.

    python benchmarks/bench_kept_pools.py --mib 4 --tensors 8 --reps 31
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch

import lazyckpt
from lazyckpt import checksums, keptpools
from lazyckpt.storage import fileio


def stop_kept_threads() -> None:
    for thread in keptpools.threads():
        if thread.is_alive():
            thread.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=float, default=4)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    nbytes = int(args.mib * (1 << 20))
    state = {f"t{i}": torch.randn(max(1, nbytes // 4 // args.tensors)) for i in range(args.tensors)}
    work = tempfile.mkdtemp(prefix="bench-kept-", dir=args.dir)
    path = os.path.join(work, "f.lzc")
    ck = lazyckpt.Checkpointer(os.path.join(work, "run"), keep=1)
    step = [0]

    def noop() -> None:
        checksums.pool().submit(lambda: None).result()
        fileio.wait_for_releases()

    def functional() -> None:
        lazyckpt.save(state, path)
        lazyckpt.load(path)

    def checkpointer() -> None:
        step[0] += 1
        ck.save(state, step[0]).wait()
        ck.load(step[0])
        fileio.wait_for_releases()

    cases = {"no-op task": noop, "lazyckpt.save + load": functional, "Checkpointer save().wait() + load": checkpointer}
    times = {(name, mode): [] for name in cases for mode in ("alive", "restarted")}
    for fn in cases.values():
        fn()                                           # every pool and cache made once, untimed
    for rep in range(args.reps):
        order = [(name, mode) for name in cases for mode in ("alive", "restarted")]
        random.Random(rep).shuffle(order)
        for name, mode in order:
            cases[name]()                              # the threads alive, warm
            if mode == "restarted":
                stop_kept_threads()
            t0 = time.perf_counter()
            cases[name]()
            times[(name, mode)].append(time.perf_counter() - t0)
    ck.close()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {nbytes / 1e6:.1f} MB in {args.tensors} tensors; "
          f"{args.reps} interleaved repetitions; idle exit after {keptpools.IDLE_S} s")
    print(f"{'':36} {'threads alive':>22} {'threads restarted':>22} {'difference of medians':>22}")
    for name in cases:
        a, r = times[(name, "alive")], times[(name, "restarted")]
        ma, mr = statistics.median(a), statistics.median(r)
        cell = lambda v, m: f"{m * 1e3:.3f} ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}) ms"  # noqa: E731
        print(f"{name:36} {cell(a, ma):>22} {cell(r, mr):>22} {(mr - ma) * 1e3:+.3f} ms ({(mr - ma) / ma:+.1%})")


if __name__ == "__main__":
    main()
