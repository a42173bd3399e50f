"""A/B of save and load, local and on S3: this tree's lazyckpt against another
source tree (e.g. main before a refactor), in one run, interleaved.

A refactor must cost nothing. ``ab_training.py`` answers that for training;
this script answers it for the I/O paths a refactor moves: a file save
(``lazyckpt.save``, durable on return) and its load, a Checkpointer step
(save until committed) and its load, and the same Checkpointer on an
S3-compatible server (SeaweedFS, started here once and shared by both trees).
Each round runs one child process per tree with that tree's ``src`` on
``PYTHONPATH`` (same state, same disk, same server), in ABBA order (which tree
goes first alternates, so a drift during the run favours neither), and the
parent prints medians per tree and the ratios this/baseline. Every load is
checked bit-exact against the saved state. Only the public API is used, so
any two trees compare.

    git worktree add /tmp/base <commit>
    .venv/bin/python benchmarks/ab_trees.py --baseline-src /tmp/base/src --rounds 4 --mib 512
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from _ab import print_medians, run_abba

HERE = os.path.dirname(os.path.abspath(__file__))
METRICS = ("file_save_s", "file_load_s", "step_save_s", "step_load_s", "s3_save_s", "s3_load_s")


def _drop_caches() -> None:
    # Not _common.drop_caches: that one goes through the package's own helper, whose
    # module path differs between the trees this script compares.
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass        # not root: loads may hit the page cache, for both trees alike


def child(args: argparse.Namespace) -> None:
    """One measurement of every metric with the lazyckpt on PYTHONPATH."""
    import torch

    import lazyckpt
    torch.manual_seed(0)
    n = args.mib * (1 << 20) // 4 // args.tensors
    state = {f"layer{i}.weight": torch.randn(n) for i in range(args.tensors)}
    state["step"] = 7
    work = tempfile.mkdtemp(prefix="ab-trees-", dir=args.dir)
    out = {}

    def same(loaded) -> None:
        assert loaded["step"] == 7 and all(torch.equal(loaded[k], v) for k, v in state.items() if k != "step")

    def timed(key, fn):
        t0 = time.perf_counter()
        result = fn()
        out[key] = time.perf_counter() - t0
        return result

    try:
        path = os.path.join(work, "state.lzc")
        timed("file_save_s", lambda: lazyckpt.save(state, path))
        _drop_caches()
        same(timed("file_load_s", lambda: lazyckpt.load(path)))
        for key, directory in (("step", os.path.join(work, "run")), ("s3", args.url)):
            with lazyckpt.Checkpointer(directory) as ck:
                timed(f"{key}_save_s", lambda: ck.save(state, step=1).wait())
            _drop_caches()
            with lazyckpt.Checkpointer(directory) as ck:
                same(timed(f"{key}_load_s", lambda: ck.load(step=1)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-src", required=True, help="the other tree's src/ folder")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--mib", type=int, default=512, help="state size (MiB of float32)")
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--dir", default=None, help="where the local files go (default: a temporary folder)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from _s3server import SeaweedServer
    tmp = tempfile.mkdtemp(prefix="ab-trees-")
    try:
        with SeaweedServer(os.path.join(tmp, "server")) as server:
            results = run_abba(args.baseline_src, args.rounds, lambda name: [
                __file__, "--child", "--url", f"s3://{server.make_bucket()}/run", "--baseline-src", "-",
                "--mib", str(args.mib), "--tensors", str(args.tensors), "--dir", args.dir or tmp],
                env=dict(os.environ, **server.env()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_medians(results, METRICS, f"{args.mib} MiB in {args.tensors} tensors, medians of {args.rounds} rounds "
                                    f"(ABBA); seconds, lower is better")

if __name__ == "__main__":
    main()
