"""A restart storm on an object store (issue 34): R ranks restarting from an
``s3://`` run at once, each opening a Checkpointer and loading the latest
step. Counted per rank: every request its client sends, by kind (LIST, GET,
HEAD, PUT, POST = DeleteObjects), and the LIST requests of the whole job.

What is simulated, and how (this machine has 2 cores):

* The run: ``--steps`` real saves of a small state by one Checkpointer, then
  every step's save prefix gets ``R - 1`` more rank objects (copies of rank
  0's file), so the prefix holds what an R-rank job's would and any listing
  costs what it would cost there.
* The ranks: R threads, each one a restarting rank (``Checkpointer(url)``,
  ``load()``), all started together against one SeaweedFS. They share one
  boto3 client (thread-safe) and each counts its own requests (the hook
  knows the thread). Every simulated rank reads rank 0's file (the run was
  saved by one rank): the metadata path is a rank's, the bytes are rank 0's.
  At sizes above ``--full-ranks`` only that many ranks open a Checkpointer
  and load; the others run the metadata path alone (the directory's
  ``locate_step(None)`` -- a listing in trees before issue 34 -- and the
  manifest read), saying so in the output.
* The leftover scan opening starts runs on the coordinator only in a real
  job (rank 0 here); its requests, on their own thread, are counted apart.

    .venv/bin/python benchmarks/bench_restart_storm.py --ranks 8 64 512 4096
    .venv/bin/python benchmarks/bench_restart_storm.py --ranks 8 64 --baseline-src /work/wt/orig/src

Each size runs in a fresh process; ``--baseline-src`` runs the same with
another tree's ``src`` first (interleaved), for the requests before issue 34.
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def child(ranks: int, steps: int, full_ranks: int, threads: int, data_mb: int = 0) -> dict:
    import torch
    import lazyckpt
    from lazyckpt.storage import s3
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from _s3server import SeaweedServer

    root = tempfile.mkdtemp(prefix="lazyckpt-storm-")
    try:
        with SeaweedServer(os.path.join(root, "weed")) as server:
            client = server.client(max_pool_connections=64)
            bucket = server.make_bucket()
            url = f"s3://{bucket}/run"
            so = {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
                  "secret_access_key": server.secret_key, "region": server.region,
                  "max_pool_connections": 64}
            state = {"w": torch.randn(4096), "b": torch.randn(64)}
            with lazyckpt.Checkpointer(url, keep=None, io=lazyckpt.IO(storage_options=so)) as ckpt:
                for s in range(1, steps + 1):
                    ckpt.save(state, step=s).wait()
            # Every save prefix as an R-rank job's: R rank objects.
            objects = client.list_objects_v2(Bucket=bucket, Prefix="run/step_")["Contents"]
            firsts = [o["Key"] for o in objects if o["Key"].endswith("/rank_00000.lzc")]
            body = client.get_object(Bucket=bucket, Key=firsts[-1])["Body"].read()
            copies = [k.replace("rank_00000", f"rank_{r:05d}") for k in firsts for r in range(1, ranks)]
            t = time.perf_counter()
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda k: client.put_object(Bucket=bucket, Key=k, Body=body), copies))
            build_s = time.perf_counter() - t

            counts = {}
            lock = threading.Lock()

            def count(request=None, **_kw):
                method = getattr(request, "method", "?")
                u = getattr(request, "url", "")
                kind = "LIST" if method == "GET" and "list-type=" in u else method
                who = threading.current_thread().name
                who = "scan" if who == "lazyckpt-leftovers" else who
                with lock:
                    counts.setdefault(who, {}).setdefault(kind, 0)
                    counts[who][kind] += 1

            s3._stores.clear()
            store, _prefix = s3.store_for(url, tuple(sorted(so.items())))
            store.client.meta.events.register("before-send.s3", count)
            barrier = threading.Barrier(min(ranks, threads))

            from lazyckpt.storage import s3layout
            from lazyckpt.knobs import resolve
            from lazyckpt.storage.stores import for_path
            options = resolve(storage_options=so)

            # The job's place of each simulated rank: rank r of R, one rendezvous store shared by
            # all (an in-process HashStore standing in for torchrun's TCPStore), as rank_info()
            # gives a real rank under torch.distributed.
            from lazyckpt import checkpointer as checkpointer_module
            from lazyckpt.distributed import RankInfo
            import torch.distributed as dist
            rendezvous = dist.PrefixStore("lazyckpt/storm/0/", dist.HashStore())
            place = threading.local()
            checkpointer_module.rank_info = lambda *_a, **_k: place.info
            try:
                from lazyckpt.loading.joblatest import JobLatest
            except ImportError:                 # a tree before it: every rank looks for itself
                JobLatest = None

            def rank(r: int) -> float:
                threading.current_thread().name = f"rank-{r}"
                place.info = RankInfo(rank=r, world_size=ranks, store=rendezvous, run_id="storm",
                                      timeout_s=600.0)
                if r < threads:
                    barrier.wait()
                t0 = time.perf_counter()
                if r < full_ranks:
                    # A restarting rank: open, load the latest step.
                    c = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so))
                    try:
                        got = c.load()
                        assert got["w"].shape == (4096,)
                    finally:
                        c.close()
                else:
                    # Its metadata path alone: open's part (the job's one lookup, where the tree
                    # has it), find the step to load, read its manifest.
                    layout = for_path(url).checkpoint_dir(url, options)
                    found = False
                    if JobLatest is not None:
                        found = JobLatest(layout, place.info, shared=True).locate(None)
                    if found is False:
                        found = layout.locate_step(None) if hasattr(layout, "locate_step") \
                            else max(layout.step_paths().items())
                    assert found is not None and found[0] == steps, found
                    s3layout.read_manifest(found[1], options)
                return time.perf_counter() - t0

            t = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                per_rank_s = list(pool.map(rank, range(ranks)))
            wall_s = time.perf_counter() - t
            per_rank = [v for k, v in counts.items() if k.startswith("rank-")]
            kinds = sorted({k for v in per_rank for k in v})
            out = {"ranks": ranks, "full_ranks": min(full_ranks, ranks), "steps": steps,
                   "objects": len(objects) + len(copies), "build_s": build_s, "wall_s": wall_s,
                   "rank_s_median": statistics.median(per_rank_s),
                   "per_rank_max": {k: max(v.get(k, 0) for v in per_rank) for k in kinds},
                   "per_rank_median": {k: statistics.median(v.get(k, 0) for v in per_rank) for k in kinds},
                   "job_lists": sum(v.get("LIST", 0) for v in per_rank),
                   "scan_once": {k: v for k, v in counts.get("scan", {}).items()}}
            if full_ranks < ranks:
                loaders = [counts.get(f"rank-{r}", {}) for r in range(min(full_ranks, ranks))]
                out["loader_max"] = {k: max(v.get(k, 0) for v in loaders) for k in kinds}
            if data_mb:
                place.info = RankInfo()
                out["data"] = data_reads(lazyckpt, client, bucket, so, data_mb, min(full_ranks, ranks), place)
                out["data_processes"] = data_reads_processes(server, bucket, so, min(full_ranks, ranks))
            return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def data_reads(lazyckpt, client, bucket: str, so: dict, data_mb: int, readers: int, place) -> dict:
    """``readers`` ranks restoring a ``data_mb`` file at once (each its own
    ``Checkpointer.load()``: ranged GETs, tensors out) against the best raw
    boto3 read of the same object by as many threads (one GET each; or 8 MiB
    ranged GETs on 4 threads each), 3 interleaved repetitions, medians."""
    import torch
    from lazyckpt.distributed import RankInfo
    url = f"s3://{bucket}/data"
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so)) as c:
        c.save({"w": torch.randn(data_mb * 2 ** 20 // 4)}, step=1).wait()
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="data/step_")["Contents"]
               if o["Key"].endswith("/rank_00000.lzc"))
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]

    def lazy(_r: int) -> None:
        place.info = RankInfo()
        with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so)) as c:
            assert c.load()["w"].numel() == data_mb * 2 ** 20 // 4

    def lazy_opened(_r: int) -> float:
        """The data read alone: every rank's Checkpointer opened first (a barrier),
        then the loads timed from one instant, then the closes (untimed)."""
        place.info = RankInfo()
        with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so)) as c:
            opened.wait()
            t = time.perf_counter()
            assert c.load()["w"].numel() == data_mb * 2 ** 20 // 4
            done = time.perf_counter() - t
            loaded.wait()
        return done

    def raw_whole(_r: int) -> None:
        assert len(client.get_object(Bucket=bucket, Key=key)["Body"].read()) == size

    part = 8 * 2 ** 20

    def raw_ranged(_r: int) -> None:
        def one(off: int) -> int:
            rng = f"bytes={off}-{min(size, off + part) - 1}"
            return len(client.get_object(Bucket=bucket, Key=key, Range=rng)["Body"].read())
        with ThreadPoolExecutor(4) as pool:
            assert sum(pool.map(one, range(0, size, part))) == size

    times = {"lazyckpt": [], "lazyckpt load() alone": [], "raw boto3, one GET": [], "raw boto3, 8 MiB ranges x 4": []}
    fns = dict(zip(times, (lazy, lazy_opened, raw_whole, raw_ranged)))
    for rep in range(3):
        for name in (list(times) if rep % 2 == 0 else list(reversed(times))):
            opened, loaded = threading.Barrier(readers), threading.Barrier(readers)
            t = time.perf_counter()
            with ThreadPoolExecutor(readers) as pool:
                got = list(pool.map(fns[name], range(readers)))
            # The loads alone: from the first start to the last end (they start together).
            times[name].append(max(got) if name == "lazyckpt load() alone" else time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    best_raw = min(v for k, v in med.items() if k.startswith("raw"))
    return {"readers": readers, "file_mb": size / 2 ** 20, "seconds": med,
            "gb_s": {k: readers * size / v / 1e9 for k, v in med.items()},
            "of_best_raw": best_raw / med["lazyckpt"], "load_alone_of_best_raw": best_raw / med["lazyckpt load() alone"]}


def _process_load(args) -> float:
    """One rank as its own process: open a Checkpointer, wait for the others,
    time ``load()`` (ranged GETs, checksums verified), close."""
    url, so, barrier = args
    import lazyckpt
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so)) as c:
        barrier.wait()
        t = time.perf_counter()
        c.load()
        return time.perf_counter() - t


def _process_raw(args) -> float:
    """The best raw boto3 read measured above (8 MiB ranged GETs on 4 threads), in
    its own process; ``keep``: the bytes kept in one buffer of the object's size,
    as a restore must (else each range is dropped once read: no memory to fill)."""
    (endpoint, access, secret, region, bucket, key, size), keep, barrier = args
    import boto3
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                          region_name=region)
    part = 8 * 2 ** 20

    def one(off: int) -> int:
        rng = f"bytes={off}-{min(size, off + part) - 1}"
        data = client.get_object(Bucket=bucket, Key=key, Range=rng)["Body"].read()
        if keep:
            buf[off:off + len(data)] = data
        return len(data)
    barrier.wait()
    t = time.perf_counter()
    buf = bytearray(size) if keep else None
    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(one, range(0, size, part))) == size
    return time.perf_counter() - t


def data_reads_processes(server, bucket: str, so: dict, readers: int, reps: int = 5) -> dict:
    """The same restore with each rank a process of its own, as real ranks are
    (the threads above share one interpreter's lock): ``readers`` processes
    start their reads at one instant (a barrier after opening); the figure is
    the slowest one's read; ``reps`` interleaved repetitions, medians."""
    import multiprocessing
    client = server.client()
    key = next(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="data/step_")["Contents"]
               if o["Key"].endswith("/rank_00000.lzc"))
    size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    raw_args = (server.endpoint, server.access_key, server.secret_key, server.region, bucket, key, size)
    ctx = multiprocessing.get_context("forkserver")
    times = {"lazyckpt load()": [], "raw boto3, 8 MiB ranges x 4": [], "raw boto3, the same into one buffer": []}
    with ctx.Manager() as manager:
        for rep in range(reps):
            for name in (list(times) if rep % 2 == 0 else list(reversed(times))):
                barrier = manager.Barrier(readers)
                fn, arg = (_process_load, (f"s3://{bucket}/data", so, barrier)) if name.startswith("lazy") \
                    else (_process_raw, (raw_args, name.endswith("buffer"), barrier))
                with ctx.Pool(readers) as pool:
                    times[name].append(max(pool.map(fn, [arg] * readers)))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"readers": readers, "file_mb": size / 2 ** 20, "seconds": med,
            "spread": {k: [min(v), max(v)] for k, v in times.items()},
            "of_raw": med["raw boto3, 8 MiB ranges x 4"] / med["lazyckpt load()"],
            "of_raw_kept": med["raw boto3, the same into one buffer"] / med["lazyckpt load()"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    ap.add_argument("--steps", type=int, default=20, help="steps in the run")
    ap.add_argument("--full-ranks", type=int, default=64, help="ranks that also load the data")
    ap.add_argument("--threads", type=int, default=64, help="ranks restarting at the same instant")
    ap.add_argument("--baseline-src", help="another tree's src, measured interleaved")
    ap.add_argument("--data-mb", type=int, default=0,
                    help="then time --full-ranks ranks restoring a file of this size against raw boto3")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        import logging
        logging.getLogger("lazyckpt").setLevel(logging.ERROR)
        print(json.dumps(child(args.child, args.steps, args.full_ranks, args.threads, args.data_mb)))
        return
    trees = {"this": SRC}
    if args.baseline_src:
        trees["baseline"] = os.path.abspath(args.baseline_src)
    rows = []
    for i, r in enumerate(args.ranks):
        for name in (list(trees) if i % 2 == 0 else list(reversed(trees))):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", str(r), "--steps", str(args.steps),
                   "--full-ranks", str(args.full_ranks), "--threads", str(args.threads),
                   "--data-mb", str(args.data_mb if name == "this" else 0)]
            done = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=trees[name]), capture_output=True,
                                  text=True)
            if done.returncode != 0:
                print(f"{name} {r} ranks failed:\n{done.stderr[-3000:]}", flush=True)
                continue
            fig = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append((name, fig))
            print(f"{name} {r} ranks: {json.dumps(fig)}", flush=True)
    print(f"\nrequests per rank (max over ranks; LIST pages of 1,000 keys), {args.steps} steps, "
          f"SeaweedFS on this machine")
    print(f"{'tree':<9}{'ranks':>7}{'objects':>9}{'LIST':>6}{'GET':>6}{'HEAD':>6}{'PUT':>6}{'POST':>6}"
          f"{'job LISTs':>11}{'wall s':>9}  loaded")
    for name, f in rows:
        m = f["per_rank_max"]
        print(f"{name:<9}{f['ranks']:>7}{f['objects']:>9}{m.get('LIST', 0):>6}{m.get('GET', 0):>6}"
              f"{m.get('HEAD', 0):>6}{m.get('PUT', 0):>6}{m.get('POST', 0):>6}{f['job_lists']:>11}"
              f"{f['wall_s']:>9.1f}  {f['full_ranks']} of {f['ranks']} ranks")
    for name, f in rows:
        if "data" in f:
            d = f["data"]
            print(f"\n{name}, {f['ranks']} ranks: {d['readers']} ranks restoring {d['file_mb']:.0f} MiB each at once: "
                  + ", ".join(f"{k} {d['seconds'][k]:.2f} s ({d['gb_s'][k]:.2f} GB/s)" for k in d["seconds"])
                  + f"; lazyckpt = {d['of_best_raw']:.2f} of the best raw method (open + load + close), its load() alone "
                  + f"{d['load_alone_of_best_raw']:.2f}")
        if "data_processes" in f:
            d = f["data_processes"]
            print(f"{name}, {d['readers']} ranks as processes, {d['file_mb']:.0f} MiB each, reads from one instant "
                  f"(medians of 5, [min, max]): "
                  + ", ".join(f"{k} {d['seconds'][k]:.2f} s {[round(x, 2) for x in d['spread'][k]]}" for k in d["seconds"])
                  + f"; lazyckpt = {d['of_raw']:.2f} of raw (read and dropped), {d['of_raw_kept']:.2f} of raw "
                  f"into memory")


if __name__ == "__main__":
    main()
