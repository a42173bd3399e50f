"""A two-tier Checkpointer (a local directory + ``Persist`` on SeaweedFS)
against the steps kept: what opening it and ``load()`` of the latest step
cost at 10, 1,000 and 10,000 steps on both tiers, and how many listings each
call makes (the project's rule: every capability costs the same at step
100,000 as at 10).

The directories are **synthetic** past two real saves, built as
``bench_long_run.py`` builds them (``build_local``: one real step cloned
into N step directories with hard links to its data file, each manifest
rewritten with its own step, save id and seq, ``history.json`` holding the
newest events as the library keeps them), and the same run is uploaded to
the store as the persistent tier holds it (``upload_run``: each step under
``step_X/<save_id>/``, one event object per commit, the index
``head.json``). Saving 10,000 steps for real would take an hour here; every
file the open and the load read is the library's own format.

For each repetition, for each size (the order rotates between
repetitions): a Checkpointer is opened (timed: ``open``), ``load()`` is
called (timed: ``load1``, the first load after the open), the open's
background leftover scans are joined, ``load()`` is called ``--loads``
times more (timed: ``load``, the median), and -- with ``--older`` -- one
choice of the copies of step N-1 (``Line.candidates(N-1)``, what
``load(step=N-1)`` does before reading: a step the indexes do not name, so
the whole line over both tiers is built). Printed: medians over the
repetitions, and the ratio of each to the 10-step figure.

Listings are counted by thread: every ``os.listdir`` and ``os.scandir`` of
the benchmark's directories, the local steps' listing
(``CheckpointDir._present``, what ``step_paths()`` runs: one ``listdir``
and a ``stat`` per step), the store's requests (``LIST``, ``GET``,
``HEAD``) and how many times the line over both tiers is built
(``Line.line_and_listing``); ``scan ...``: on the open's background
leftover scan. ``--no-scan``: the open starts no background leftover scan
(a diagnostic: what the scan's one listing, competing for the interpreter,
adds to ``open`` and ``load1``).

``--cut-upload``: before each open the store lacks the newest step (its
commit event is there, its objects are not, ``head.json`` names step N-1):
a restart after the process died while uploading it. The indexes cannot
tell the newest save then, so the open (its retried upload) and the load
build the whole line; the open's retried upload is waited for before
``close`` and cut again for the next repetition.

    .venv/bin/python benchmarks/bench_two_tier_load.py                   # 10, 1,000, 10,000
    .venv/bin/python benchmarks/bench_two_tier_load.py --older           # and an older step's choice
    .venv/bin/python benchmarks/bench_two_tier_load.py --no-scan
    .venv/bin/python benchmarks/bench_two_tier_load.py --cut-upload
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


class Counts:
    """Calls of the listing functions, by kind and by thread (``main`` or the
    background ``scan``), plus the store's requests (``RequestCounter``)."""

    def __init__(self, root: str) -> None:
        from bench_long_run import RequestCounter
        from lazyckpt.storage.layout import CheckpointDir
        from lazyckpt.tiers.line import Line

        self.requests = RequestCounter()
        self.calls: Dict[str, int] = {}
        self._wrap(CheckpointDir, "_present", "step listing")
        self._wrap(Line, "line_and_listing", "line built")
        # Only the benchmark's directories' (not the client library's data files, say).
        self._wrap(os, "listdir", "listdir", under=root)
        self._wrap(os, "scandir", "scandir", under=root)

    def _wrap(self, cls, name: str, label: str, under: str = "") -> None:
        original = getattr(cls, name)
        counts = self

        def counted(*args, **kwargs):
            if under and not (args and isinstance(args[0], str) and args[0].startswith(under)):
                return original(*args, **kwargs)
            where = "scan " if threading.current_thread().name == "lazyckpt-leftovers" else ""
            counts.calls[where + label] = counts.calls.get(where + label, 0) + 1
            return original(*args, **kwargs)
        setattr(cls, name, counted)

    def take(self) -> Dict[str, int]:
        out = dict(self.calls)
        self.calls = {}
        for kind, n in self.requests.take().items():
            out[f"store {kind}"] = n
        return out


def build(root: str, sizes: List[int], server) -> Dict[int, tuple]:
    """size -> (local path, store URL): both tiers hold the same run of ``size`` steps."""
    from bench_long_run import UPLOAD_THREADS, build_local, upload_run

    client = server.client(max_pool_connections=UPLOAD_THREADS)
    bucket = server.make_bucket()
    out = {}
    for n in sizes:
        t = time.perf_counter()
        path = os.path.join(root, f"run{n}")
        build_local(path, n)
        upload_run(path, client, bucket, f"run{n}")
        print(f"built {n} steps on both tiers in {time.perf_counter() - t:.1f} s", flush=True)
        out[n] = (path, f"s3://{bucket}/run{n}")
    return out


def cut_upload(url: str, client) -> None:
    """The store as a process that died uploading the newest step leaves it:
    that step's objects gone (its commit event stays), ``head.json`` naming
    the step before it."""
    from lazyckpt.lineage import parse_event_key
    from lazyckpt.storage import s3layout
    bucket, prefix = url[len("s3://"):].split("/", 1)

    def keys(under: str) -> List[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/{under}")
        return [o["Key"] for page in pages for o in page.get("Contents", [])]
    events = sorted((parse_event_key(k[len(prefix) + 1:]) for k in keys("history/")), key=lambda e: e.seq)
    newest, before = events[-1], events[-2]
    for key in keys(f"step_{newest.step:010d}/{newest.save_id}/"):
        client.delete_object(Bucket=bucket, Key=key)
    client.put_object(Bucket=bucket, Key=f"{prefix}/{s3layout.HEAD}", Body=json.dumps(
        {"step": before.step, "save_id": before.save_id, "seq": before.seq}).encode())


def one(n: int, path: str, url: str, so: dict, loads: int, older: bool, counts: Counts,
        cut=None) -> Dict[str, object]:
    """``cut``: a client of the store, to cut the newest step's upload first."""
    import lazyckpt

    if cut is not None:
        cut_upload(url, cut)
    counts.take()
    t = time.perf_counter()
    ckpt = lazyckpt.Checkpointer(path, keep=None, persist=lazyckpt.Persist(url, storage_options=so))
    fig: Dict[str, object] = {"open": time.perf_counter() - t}
    try:
        t = time.perf_counter()
        got = ckpt.load()
        fig["load1"] = time.perf_counter() - t
        assert got["w"].shape == (1024,) and ckpt.loaded_from["step"] == n \
            and ckpt.loaded_from["tier"] == "local", ckpt.loaded_from
        ckpt.layout.tidy()                  # the open's leftover scans, joined: counted apart ("scan ...")
        ckpt.persistent.dir.close()
        fig["open+load1 calls"] = counts.take()
        times = []
        for _ in range(loads):
            t = time.perf_counter()
            ckpt.load()
            times.append(time.perf_counter() - t)
        fig["load"] = statistics.median(times)
        fig["load calls"] = {k: v / loads for k, v in counts.take().items()}
        if older:
            # The choice of copies alone: the clones' data files belong to the real step's save,
            # so their load would stop at that check, after the choice.
            t = time.perf_counter()
            picked = list(ckpt.line.candidates(n - 1))
            fig["older pick"] = time.perf_counter() - t
            assert [c[:2] for c in picked] == [(n - 1, "local"), (n - 1, "persistent")], picked
            fig["older pick calls"] = counts.take()
        if cut is not None:
            assert ckpt.resumed_drain is not None      # the open found the newest step missing there
            ckpt.wait()
    finally:
        ckpt.close()
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 10000])
    ap.add_argument("--reps", type=int, default=7, help="repetitions, sizes interleaved (medians across)")
    ap.add_argument("--loads", type=int, default=5, help="timed load() calls per repetition after the first")
    ap.add_argument("--older", action="store_true", help="also time the choice of step N-1's copies: the whole line is built")
    ap.add_argument("--no-scan", action="store_true",
                    help="diagnostic: the open starts no background leftover scan of the local directory")
    ap.add_argument("--cut-upload", action="store_true",
                    help="the store lacks the newest step before each open (its upload was cut)")
    ap.add_argument("--dir", default=None, help="where the synthetic directories go (default: $TMPDIR)")
    args = ap.parse_args()

    from _s3server import SeaweedServer

    root = tempfile.mkdtemp(prefix="lazyckpt-twotier-", dir=args.dir)
    try:
        with SeaweedServer(os.path.join(root, "weed")) as server:
            runs = build(root, args.sizes, server)
            so = {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
                  "secret_access_key": server.secret_key, "region": server.region}
            counts = Counts(root)
            cut = server.client() if args.cut_upload else None
            if args.no_scan:
                from lazyckpt.formats.names import WRITER
                from lazyckpt.storage.layout import CheckpointDir
                CheckpointDir.start_tidy = lambda self: self.clean_leftovers([WRITER])
            # Untimed: the store's client is made by the first open of the process.
            one(args.sizes[0], *runs[args.sizes[0]], so, 1, False, counts, cut)
            figs: Dict[int, List[Dict[str, object]]] = {n: [] for n in args.sizes}
            for r in range(args.reps):
                order = args.sizes[r % len(args.sizes):] + args.sizes[:r % len(args.sizes)]
                for n in order:
                    fig = one(n, *runs[n], so, args.loads, args.older, counts, cut)
                    figs[n].append(fig)
                    print(f"rep {r + 1} {n:>6} steps: " + " ".join(
                        f"{k}={1e3 * v:.2f}ms" for k, v in fig.items() if isinstance(v, float)), flush=True)
            timed = ["open", "load1", "load"] + (["older pick"] if args.older else [])
            print(f"\nlocal directory + Persist on SeaweedFS, both tiers holding N steps, keep=None, 4 KB state"
                  f"{', no leftover scan at open' if args.no_scan else ''}"
                  f"{', the newest step missing on the store before each open' if args.cut_upload else ''}; "
                  f"medians over {args.reps} interleaved repetitions (load: of {args.loads} calls each)")
            print(f"{'N':>7}" + "".join(f"{m + ' ms':>14}" for m in timed) + "".join(f"{m + '/N10':>12}" for m in timed))
            base = None
            for n in args.sizes:
                med = {m: 1e3 * statistics.median(f[m] for f in figs[n]) for m in timed}
                base = base or med
                print(f"{n:>7}" + "".join(f"{med[m]:>14.2f}" for m in timed)
                      + "".join(f"{med[m] / base[m]:>12.2f}" for m in timed))
            print("\nlistings and requests per call (last repetition; 'scan': the open's background leftover scan)")
            for n in args.sizes:
                last = figs[n][-1]
                for what in ("open+load1 calls", "load calls", "older pick calls"):
                    if what in last:
                        print(f"{n:>7} {what:<17} {last[what]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
