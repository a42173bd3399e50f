"""Bookkeeping against history length (issue 34): what one commit, ``steps()``,
``latest_step()`` and opening a Checkpointer + ``load()`` of the latest step
cost when a run keeps every step (``keep_last=None``), at 10, 1,000, 10,000
and 100,000 steps kept, and how many bytes every record file holds.

Directories are **synthetic** past the first real saves: one real step is
saved, then cloned (hard links to its data file, a rewritten manifest with
its own step, save id and seq and a fresh checksum) into as many step
directories as the point needs, and ``history.json`` is written with the
events the library itself keeps for them. Building 100,000 steps by saving
them would take hours; the directory is the same byte for byte in every
file the bookkeeping reads. Then, on that directory, a Checkpointer is
opened, timed, and saves ``--commits`` more steps of a 4 KB state
(``save().wait()`` each, timed: the commit's latency), and ``steps()`` and
``latest_step()`` are timed on it.

    .venv/bin/python benchmarks/bench_long_run.py                 # local, 10..100,000
    .venv/bin/python benchmarks/bench_long_run.py --s3            # SeaweedFS too (10..10,000)
    .venv/bin/python benchmarks/bench_long_run.py --persist       # local + persist_to SeaweedFS
    .venv/bin/python benchmarks/bench_long_run.py --retain --sizes 10 1000   # keep_last= the size: retention at every commit
    .venv/bin/python benchmarks/bench_long_run.py --sizes 10 1000 --baseline-src /work/wt/orig/src

Each size runs in a fresh process (``--baseline-src``: the same with another
tree's ``src`` first on ``PYTHONPATH``, interleaved). Printed: medians, and
the ratio of every figure to the 10-step one (goal: commit within 1.2x).
"""

from __future__ import annotations

import argparse
import errno
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _median_ms(samples):
    return 1e3 * statistics.median(samples)


def build_local(path: str, steps: int) -> None:
    """``steps`` committed steps in ``path``: 2 real saves, the rest cloned."""
    import torch
    import lazyckpt
    from lazyckpt.formats import manifest as manifests

    with lazyckpt.Checkpointer(path, keep=None) as ckpt:
        for s in (1, 2):
            ckpt.save({"w": torch.randn(1024)}, step=s).wait()
    if steps <= 2:
        return
    src = os.path.join(path, "step_0000000001")
    with open(os.path.join(src, "manifest.json"), "rb") as f:
        template = json.loads(f.read())
    template.pop("checksum")
    # Steps 1..steps-1 are clones (step 2 is re-made as a clone too); the real
    # step 2 becomes the newest one, renumbered, so the latest step loads for real.
    real = os.path.join(path, "step_0000000002")
    last = os.path.join(path, f"step_{steps:010d}")
    os.rename(real, last)
    events = []
    for s in range(1, steps):
        d = os.path.join(path, f"step_{s:010d}")
        sid = uuid.uuid4().hex
        if s != 1:
            os.mkdir(d)
            for name in os.listdir(src):
                if name != "manifest.json":
                    try:
                        os.link(os.path.join(src, name), os.path.join(d, name))
                    except OSError as exc:      # ext4 allows 65,000 links per file: a fresh copy
                        if exc.errno != errno.EMLINK:
                            raise
                        shutil.copyfile(os.path.join(src, name), os.path.join(d, name))
                        src = d
        doc = dict(template, step=s, save_id=sid, seq=s, metadata={"step": s})
        doc["checksum"] = manifests.checksum(doc)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write(json.dumps(doc, separators=(",", ":")))
        events.append([s, sid, s])
    with open(os.path.join(last, "manifest.json"), "rb") as f:
        doc = json.loads(f.read())
    doc.pop("checksum")
    doc.update(step=steps, seq=steps, metadata={"step": steps})
    doc["checksum"] = manifests.checksum(doc)
    with open(os.path.join(last, "manifest.json"), "w") as f:
        f.write(json.dumps(doc, separators=(",", ":")))
    events.append([steps, doc["save_id"], steps])
    # The record as the tree being measured keeps it: the events of every step
    # present (before issue 34), or the newest RECENT_EVENTS (since).
    try:
        from lazyckpt import lineage as history
    except ImportError:             # a tree from before lazyckpt/history.py became lineage.py
        from lazyckpt import history
    try:
        from lazyckpt.storage.record import LocalRecord
    except ImportError:             # a tree from before the record moved out of history.py
        LocalRecord = history.LocalRecord
    if "present_steps" not in inspect.signature(LocalRecord.add).parameters:
        events = events[-history.RECENT_EVENTS:]
    record = {"seq": steps, "events": events,
              "commit": [steps, doc["save_id"], steps, ".tmp-step_%010d-000000000000" % steps]}
    with open(os.path.join(path, "history.json"), "w") as f:
        f.write(json.dumps(record, separators=(",", ":")))
    with open(os.path.join(path, "latest"), "w") as f:
        f.write(f"{steps}\n")
    os.sync()


def record_bytes(path: str) -> dict:
    """Bytes of every file the bookkeeping keeps outside the steps."""
    out = {}
    for name in sorted(os.listdir(path)):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            out[name] = os.path.getsize(p)
    return out


UPLOAD_THREADS = 32


def upload_run(path: str, client, bucket: str, prefix: str) -> None:
    """The synthetic local run as an object-store directory (FORMAT.md §11.9):
    each step under ``step_X/<save_id>/``, one event per commit, and -- where
    the tree being measured keeps one -- the index ``head.json``."""
    from concurrent.futures import ThreadPoolExecutor
    from lazyckpt.storage import s3layout
    puts = []
    top = None
    for name in sorted(os.listdir(path)):
        if not name.startswith("step_"):
            continue
        d = os.path.join(path, name)
        with open(os.path.join(d, "manifest.json"), "rb") as f:
            raw = f.read()
        doc = json.loads(raw)
        step, sid, seq = doc["step"], doc["save_id"], doc["seq"]
        for fname in os.listdir(d):
            with open(os.path.join(d, fname), "rb") as f:
                puts.append((f"{prefix}/{name}/{sid}/{fname}", f.read()))
        puts.append((f"{prefix}/history/{seq:012d}-{step:010d}-{sid}", b""))
        top = (step, sid, seq) if top is None or seq > top[2] else top
    if hasattr(s3layout, "HEAD") and top is not None:
        puts.append((f"{prefix}/{s3layout.HEAD}", json.dumps({"step": top[0], "save_id": top[1],
                                                               "seq": top[2]}).encode()))
    # As many connections as threads (botocore's pool holds 10 by default): at 100,000 steps
    # this is 300,000 small PUTs, bound by the client's CPU, not by the server.
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), puts))


class RequestCounter:
    """Every request lazyckpt's S3 clients send, by kind (a hook on each client)."""

    def __init__(self):
        from lazyckpt.storage import s3
        self.counts = {}
        original = s3.ObjectStore.__init__
        counter = self

        def count(request=None, **_kw):
            method = getattr(request, "method", "?")
            url = getattr(request, "url", "")
            kind = "LIST" if method == "GET" and ("list-type=" in url or "?prefix=" in url or "&prefix=" in url) \
                else method
            if threading.current_thread().name == "lazyckpt-leftovers":
                kind = "scan " + kind       # the leftover scan opening starts, in the background
            counter.counts[kind] = counter.counts.get(kind, 0) + 1

        def init(store, *args, **kwargs):
            original(store, *args, **kwargs)
            store.client.meta.events.register("before-send.s3", count)
        s3.ObjectStore.__init__ = init
        s3._stores.clear()

    def take(self) -> dict:
        out, self.counts = dict(self.counts), {}
        return out


def measure(url: str, steps: int, commits: int, counter=None, storage_options=None, persist_to=None,
            keep_last=None) -> dict:
    import torch
    import lazyckpt

    state = {"w": torch.randn(1024)}
    if persist_to:
        kw = {"persist": lazyckpt.Persist(persist_to, storage_options=storage_options)}
    else:
        kw = {"io": lazyckpt.IO(storage_options=storage_options)} if storage_options else {}
    requests = {}
    t0 = time.perf_counter()
    ckpt = lazyckpt.Checkpointer(url, keep=keep_last, **kw)
    got = ckpt.load()
    open_load = time.perf_counter() - t0
    assert got["w"].shape == (1024,)
    if counter is not None:
        # The leftover scan opening starts, waited for and counted apart ("scan ..."): tidy()
        # waits for it (close() cancels it since 0.2; older trees' close() waited).
        for layout in [ckpt.layout] + ([ckpt.persistent.dir] if ckpt.persistent is not None else []):
            wait = getattr(layout, "tidy", None) or getattr(layout, "close", None)
            if wait is not None:
                wait()
        requests["open_load"] = counter.take()
    commit = []
    step = steps
    scan_s = 0.0
    for i in range(commits):
        step += 1
        t = time.perf_counter()
        ckpt.save(state, step=step).wait()
        if persist_to and i == 0:
            # The first upload starts the store's leftover scan (one listing of the run, on a
            # thread): joined here, once, so the commits timed are the steady state's.
            ckpt.wait()
            t = time.perf_counter()
            if hasattr(ckpt.persistent.dir, "close"):       # (a tree before issue 34 scans at open)
                ckpt.persistent.dir.close()
            scan_s = time.perf_counter() - t
            continue
        commit.append(time.perf_counter() - t)
        if counter is not None and i == commits - 1:
            requests["one_commit"] = counter.take()
        elif counter is not None and i == commits - 2:
            counter.take()              # (the first save also takes the writer lease)
    t = time.perf_counter()
    listed = ckpt.steps()
    steps_s = time.perf_counter() - t
    t = time.perf_counter()
    latest = ckpt.latest_step()
    latest_s = time.perf_counter() - t
    if counter is not None:
        counter.take()
    assert latest == step and len(listed) == (keep_last or steps + commits), (latest, step, len(listed))
    if persist_to:
        ckpt.wait()
        ckpt.close()                    # (the old process is gone when a node is replaced)
        if counter is not None:
            counter.take()
        shutil.rmtree(url)              # a replaced node: the local tier gone, open and load from the store
        t0 = time.perf_counter()
        with lazyckpt.Checkpointer(url, keep=None, **kw) as fresh:
            assert fresh.load()["w"].shape == (1024,) and fresh.loaded_from["tier"] == "persistent"
            out_replaced = 1e3 * (time.perf_counter() - t0)
            if counter is not None:
                if hasattr(fresh.persistent.dir, "close"):
                    fresh.persistent.dir.close()
                requests["replaced_open_load"] = counter.take()
    else:
        ckpt.close()
    out = {"commit_ms": _median_ms(commit), "commit_p90_ms": 1e3 * sorted(commit)[int(0.9 * len(commit))],
           "steps_ms": 1e3 * steps_s, "latest_ms": 1e3 * latest_s, "open_load_ms": 1e3 * open_load}
    if persist_to:
        out["replaced_open_load_ms"] = out_replaced
        out["scan_join_ms"] = 1e3 * scan_s
    if requests:
        out["requests"] = requests
    return out


def child(args: argparse.Namespace) -> None:
    root = tempfile.mkdtemp(prefix="lazyckpt-longrun-", dir=args.dir)
    try:
        path = os.path.join(root, "run")
        t = time.perf_counter()
        build_local(path, args.child)
        built_s = time.perf_counter() - t
        if not args.s3 and not args.persist:
            os.system("sync")
            out = measure(path, args.child, args.commits, keep_last=args.child if args.retain else None)
            out["records"] = record_bytes(path)
        else:
            sys.path.insert(0, os.path.join(HERE, "..", "tests"))
            from _s3server import SeaweedServer
            with SeaweedServer(os.path.join(root, "weed")) as server:
                client = server.client(max_pool_connections=UPLOAD_THREADS)
                bucket = server.make_bucket()
                upload_run(path, client, bucket, "run")
                built_s = time.perf_counter() - t
                so = {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
                      "secret_access_key": server.secret_key, "region": server.region}
                counter = RequestCounter()
                if args.persist:    # the same run on both tiers: local and persisted
                    out = measure(path, args.child, args.commits, counter, so, persist_to=f"s3://{bucket}/run")
                else:
                    out = measure(f"s3://{bucket}/run", args.child, args.commits, counter, so)
        out["build_s"] = built_s
        print(json.dumps(out))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 1000, 10000, 100000])
    ap.add_argument("--commits", type=int, default=30, help="timed commits per size")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per size (medians across)")
    ap.add_argument("--s3", action="store_true", help="on SeaweedFS instead of a local directory")
    ap.add_argument("--persist", action="store_true",
                    help="a local directory with persist_to= on SeaweedFS (both tiers hold the run)")
    ap.add_argument("--baseline-src", help="another tree's src, measured interleaved")
    ap.add_argument("--dir", default=None, help="where the synthetic directories go (default: $TMPDIR)")
    ap.add_argument("--retain", action="store_true",
                    help="keep_last= the size (local): every commit retires the oldest step, the size stays kept")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    trees = {"this": SRC}
    if args.baseline_src:
        trees["baseline"] = os.path.abspath(args.baseline_src)
    results = {name: {n: [] for n in args.sizes} for name in trees}
    for r in range(args.runs):
        for n in args.sizes:
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                cmd = [sys.executable, os.path.abspath(__file__), "--child", str(n), "--commits", str(args.commits)]
                if args.s3:
                    cmd.append("--s3")
                if args.persist:
                    cmd.append("--persist")
                if args.retain:
                    cmd.append("--retain")
                if args.dir:
                    cmd += ["--dir", args.dir]
                done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=trees[name]), check=True,
                                      capture_output=True, text=True)
                fig = json.loads(done.stdout.strip().splitlines()[-1])
                results[name][n].append(fig)
                print(f"run {r + 1} {name} {n:>7} steps: " +
                      " ".join(f"{k}={v:.2f}" for k, v in fig.items() if isinstance(v, float)), flush=True)
                if "records" in fig:
                    print(f"    record files (bytes): {fig['records']}", flush=True)
                if "requests" in fig:
                    print(f"    requests: {fig['requests']}", flush=True)
    metrics = ["commit_ms", "commit_p90_ms", "steps_ms", "latest_ms", "open_load_ms"] + \
        (["replaced_open_load_ms", "scan_join_ms"] if args.persist else [])
    where = "SeaweedFS (s3://)" if args.s3 else \
        "local directory + persist_to SeaweedFS" if args.persist else "local directory"
    for name, by_size in results.items():
        print(f"\n{name} ({trees[name]}), {where}, {'keep_last=<steps kept>' if args.retain else 'keep_last=None'}, 4 KB state; medians over {args.runs} run(s)")
        print(f"{'steps kept':>10}" + "".join(f"{m:>15}" for m in metrics) + f"{'commit/10':>11}")
        base = None
        for n in args.sizes:
            med = {m: statistics.median(f[m] for f in by_size[n]) for m in metrics}
            base = base or med
            print(f"{n:>10}" + "".join(f"{med[m]:>15.2f}" for m in metrics) +
                  f"{med['commit_ms'] / base['commit_ms']:>11.2f}")


if __name__ == "__main__":
    main()
