"""lazyckpt on an S3-compatible object store against the raw client ceiling and DCP peers.

One SeaweedFS server started here (tests/_s3server.py), one state of
``--size`` bytes in ``--tensors`` tensors of mixed dtypes (fp32, bf16,
int64), ``--reps`` interleaved repetitions (the order reversed every other
one), medians. Every method gets a fresh bucket, emptied and deleted after
it (untimed). Methods:

* raw boto3          the ceiling: the state's bytes as one flat buffer,
                     create_multipart_upload / upload_part from a
                     ThreadPoolExecutor (``--part-mb`` parts, ``--threads``
                     threads, zero-copy bodies, no extra CRC: the client of
                     bench_s3_clients.py "boto3-parts-nocrc", configured as
                     lazyckpt's) / complete; download = parallel ranged GETs
                     readinto() one preallocated buffer.
* lazyckpt.save      ``lazyckpt.save(state, "s3://b/ckpt.lzc")`` (synchronous:
                     blocking = persisted); ``lazyckpt.load(url)``.
* Checkpointer s3    ``Checkpointer("s3://b/run")``: blocking = the save() call,
                     persisted = until ``h.wait()`` returns (the commit is on the
                     store); load = ``ck.load()`` by a fresh Checkpointer.
* Checkpointer tier  ``Checkpointer(local, persist="s3://b/run")``: blocking =
                     the save() call, local = ``stats()["tiers"]["local"]``,
                     persisted = until ``h.wait(persisted=True)`` returns
                     (``stats()["tiers"]["persistent"]`` printed too); load = a
                     fresh Checkpointer with an empty local dir and the same
                     persist_to, ``ck.load()`` (``loaded_from["tier"]`` must be
                     "persistent").
* dcp+s3fs           torch.distributed.checkpoint ``dcp.save(no_dist=True,
                     storage_writer=FsspecWriter("s3://b/dcp", thread_count=T,
                     sync_files=False, key, secret, client_kwargs))`` (s3fs;
                     synchronous); ``dcp.load`` with FsspecReader into a
                     preallocated state of the same shapes (allocated untimed).
* dcp.async+s3fs     ``dcp.async_save`` with the same writer: blocking = the
                     call (its staging copy), persisted = its future done.
* dcp+s3torch        s3torchconnector's DCP ``S3StorageWriter`` /
                     ``S3StorageReader`` (``S3ClientConfig(force_path_style=
                     True)``; the endpoint is given to the S3Client it builds,
                     which S3StorageWriter's constructor does not accept).

The DCP peers run in a child process each (one per method and repetition,
startup and state generation untimed): s3fs needs aiobotocore, which pins
botocore to a range that may not match the boto3 lazyckpt uses in this
environment; ``--peer-path DIR`` puts DIR (e.g. a ``pip install --target``
of s3fs/aiobotocore/botocore) first on the s3fs children's sys.path only.

    .venv/bin/python benchmarks/bench_s3.py [--size 512M] [--tensors 64] [--reps 3]
    .venv/bin/python benchmarks/bench_s3.py --size 64M --reps 1       # smoke run, < 1 min
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
import warnings
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

MiB = 1 << 20
PEERS = ("dcp+s3fs", "dcp.async+s3fs", "dcp+s3torch")
OURS = ("lazyckpt.save", "Checkpointer s3", "Checkpointer tier")
METHODS = ("raw boto3",) + OURS + PEERS


def parse_size(text: str) -> int:
    t = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(t[-1:], None)
    return int(float(t[:-1]) * mult) if mult else int(float(t) * MiB)    # a bare number: MiB


def make_state(nbytes: int, ntensors: int) -> Dict[str, Any]:
    """``ntensors`` tensors of fp32 / bf16 / int64 in turn, sizes varying
    0.5x-1.5x around the mean, ``nbytes`` in all; deterministic."""
    import torch
    g = torch.Generator().manual_seed(0)
    weights = [0.5 + (i * 0.618) % 1.0 for i in range(ntensors)]
    scale = nbytes / sum(weights)
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    state: Dict[str, Any] = {}
    left = nbytes
    for i in range(ntensors):
        dt = dtypes[i % 3]
        es = torch.empty((), dtype=dt).element_size()
        want = left if i == ntensors - 1 else int(weights[i] * scale)
        n = max(1, want // es)
        left -= n * es
        if dt == torch.int64:
            t = torch.randint(0, 1 << 40, (n,), generator=g, dtype=torch.int64)
        else:
            t = torch.randn(n, generator=g).to(dt)
        state[f"t{i:03d}.{str(dt).split('.')[-1]}"] = t
    return state


def flat_bytes(state: Dict[str, Any]) -> bytearray:
    import torch
    total = sum(t.numel() * t.element_size() for t in state.values())
    buf = bytearray(total)
    pos = 0
    for t in state.values():
        b = t.contiguous().view(-1).view(torch.uint8).numpy()
        buf[pos:pos + len(b)] = memoryview(b)
        pos += len(b)
    return buf


def equal(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    import torch
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                    torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# ---------------------------------------------------------------------- peers (child process)

def peer_child(args) -> None:
    """Run one DCP peer once (save, then load) and print a JSON line."""
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    cfg = json.loads(args.peer_child)
    method, url, ep = cfg["method"], cfg["url"], cfg["endpoint"]
    torch.set_num_threads(2)
    state = make_state(cfg["size"], cfg["tensors"])
    template = {k: torch.empty_like(v) for k, v in state.items()}
    out: Dict[str, Any] = {"method": method}
    if method in ("dcp+s3fs", "dcp.async+s3fs"):
        import s3fs  # noqa: F401
        import botocore
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        out["versions"] = f"s3fs {s3fs.__version__} (botocore {botocore.__version__})"
        kw = dict(key=cfg["key"], secret=cfg["secret"],
                  client_kwargs={"endpoint_url": ep, "region_name": cfg["region"]})
        writer = FsspecWriter(url, thread_count=cfg["threads"], sync_files=False, **kw)
        reader = lambda: FsspecReader(url, **kw)  # noqa: E731
    else:
        import s3torchconnector
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem
        out["versions"] = f"s3torchconnector {s3torchconnector.__version__}"
        os.environ.update(AWS_ACCESS_KEY_ID=cfg["key"], AWS_SECRET_ACCESS_KEY=cfg["secret"])
        conf = S3ClientConfig(force_path_style=True, part_size=cfg["part"])
        client = S3Client(cfg["region"], endpoint=ep, s3client_config=conf)
        writer = S3StorageWriter(cfg["region"], url, s3client_config=conf, thread_count=cfg["threads"])
        writer.fs = S3FileSystem(cfg["region"], s3_client=client)

        def reader():
            r = S3StorageReader(cfg["region"], url, s3client_config=conf)
            r.fs = S3FileSystem(cfg["region"], s3_client=client, reader_constructor=r._reader_constructor)
            return r
    t0 = time.perf_counter()
    if method == "dcp.async+s3fs":
        fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
        t1 = time.perf_counter()
        fut.result()
    else:
        dcp.save(state, storage_writer=writer, no_dist=True)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    out.update(blocking=t1 - t0, persisted=t2 - t0)
    t0 = time.perf_counter()
    dcp.load(template, storage_reader=reader(), no_dist=True)
    out["load"] = time.perf_counter() - t0
    out["ok"] = equal(state, template)
    print("RESULT " + json.dumps(out), flush=True)


def run_peer(method: str, server, bucket: str, args, nbytes: int) -> Dict[str, Any]:
    cfg = {"method": method, "url": f"s3://{bucket}/dcp", "endpoint": server.endpoint,
           "key": server.access_key, "secret": server.secret_key, "region": server.region,
           "size": nbytes, "tensors": args.tensors, "threads": args.threads, "part": args.part_mb * MiB}
    env = dict(os.environ)
    if "s3fs" in method and args.peer_path:
        env["PYTHONPATH"] = os.pathsep.join([args.peer_path] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--peer-child", json.dumps(cfg)],
                       capture_output=True, text=True, env=env, timeout=1800)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (p.stderr or p.stdout).strip().splitlines()
    return {"method": method, "error": tail[-1] if tail else f"exit {p.returncode}"}


# ---------------------------------------------------------------------- driver

def empty_bucket(server, bucket: str) -> None:
    c = server.client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
    for page in c.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
        for up in page.get("Uploads", []):
            c.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    c.delete_bucket(Bucket=bucket)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="512M", help="state size: 512M, 1G, 64M (a bare number: MiB)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--part-mb", type=int, default=32, help="raw ceiling's part size (MiB)")
    ap.add_argument("--threads", type=int, default=4,
                    help="raw ceiling's upload/download threads, DCP writers' thread_count")
    ap.add_argument("--chunk-mb", type=int, default=None, help="lazyckpt chunk_bytes (MiB; default: its own)")
    ap.add_argument("--writer-threads", type=int, default=None, help="lazyckpt writer_threads (default: its own)")
    ap.add_argument("--local-dir", default=None,
                    help="parent of the tiered Checkpointer's local directory (default: a temp dir under "
                         "/tmp, the server's disk; /dev/shm for a RAM tier)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {list(METHODS)}")
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--peer-path", default=os.environ.get("BENCH_S3_PEER_PATH", ""),
                    help="directory put first on sys.path of the s3fs peer children (s3fs/aiobotocore/"
                         "botocore installed with pip --target, when they conflict with this env's boto3)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--peer-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer_child:
        return peer_child(args)

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    import torch

    import lazyckpt
    from _common import emit_json, machine_line, print_table
    from _s3server import SeaweedServer
    from bench_s3_clients import Boto3Parts

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {list(METHODS)}")
    if args.skip_peers:
        methods = [m for m in methods if m not in PEERS]
    knobs: Dict[str, Any] = {}
    if args.chunk_mb:
        knobs["chunk_bytes"] = args.chunk_mb * MiB
    if args.writer_threads:
        knobs["writer_threads"] = args.writer_threads
    torch.set_num_threads(2)

    state = make_state(parse_size(args.size), args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    flat = flat_bytes(state)
    view = memoryview(flat)
    down = bytearray(nbytes)
    gb = nbytes / 1e9
    opts = lazyckpt.Options(**knobs)
    tmp = tempfile.mkdtemp(prefix="bench-s3-", dir="/tmp")
    local_parent = tempfile.mkdtemp(prefix="bench-s3-local-", dir=args.local_dir or tmp)
    res: Dict[str, Dict[str, List[float]]] = {m: {} for m in methods}
    notes: Dict[str, str] = {}
    errors: Dict[str, str] = {}

    def rec(method: str, **vals: Optional[float]) -> None:
        for k, v in vals.items():
            if v is not None:
                res[method].setdefault(k, []).append(v)

    try:
        with SeaweedServer(os.path.join(tmp, "server")) as server:
            import boto3
            so = {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
                  "secret_access_key": server.secret_key, "region": server.region}
            raw = Boto3Parts(server, args.part_mb * MiB, args.threads, nocrc=True)
            dtypes = sorted({str(t.dtype).split(".")[-1] for t in state.values()})
            print(machine_line())
            print(f"server: SeaweedFS (weed server, one process, same machine) at {server.endpoint}; "
                  f"boto3 {boto3.__version__}")
            print(f"state: {nbytes / 1e9:.3f} GB ({nbytes / MiB:.0f} MiB) in {len(state)} tensors "
                  f"({'/'.join(dtypes)}), reps={args.reps} (interleaved, order reversed every other rep), "
                  f"medians; lazyckpt chunk_bytes={opts.chunk_bytes >> 20} MiB writer_threads="
                  f"{opts.writer_threads}; raw: {args.part_mb} MiB parts, {args.threads} threads; "
                  f"tier local dir under {local_parent}", flush=True)
            seq = 0

            def one(method: str, rep: int) -> None:
                nonlocal seq
                seq += 1
                bucket = server.make_bucket()
                server.client().put_object(Bucket=bucket, Key="warm", Body=b"x")   # volume growth, untimed
                try:
                    if method == "raw boto3":
                        t0 = time.perf_counter()
                        raw.upload(bucket, "raw.bin", view)
                        t1 = time.perf_counter()
                        raw.download(bucket, "raw.bin", down)
                        t2 = time.perf_counter()
                        if rep == 0 and down != flat:
                            raise RuntimeError("raw download differs")
                        down[:64] = bytes(64)
                        rec(method, blocking=t1 - t0, persisted=t1 - t0, load=t2 - t1)
                    elif method == "lazyckpt.save":
                        url = f"s3://{bucket}/ckpt.lzc"
                        t0 = time.perf_counter()
                        lazyckpt.save(state, url, storage_options=so, **knobs)
                        t1 = time.perf_counter()
                        got = lazyckpt.load(url, storage_options=so, **knobs)
                        t2 = time.perf_counter()
                        if rep == 0 and not equal(state, got):
                            raise RuntimeError("lazyckpt.load differs")
                        del got
                        rec(method, blocking=t1 - t0, persisted=t1 - t0, load=t2 - t1)
                    elif method == "Checkpointer s3":
                        url = f"s3://{bucket}/run"
                        ck = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so, **knobs))
                        try:
                            t0 = time.perf_counter()
                            h = ck.save(state, step=seq)
                            t1 = time.perf_counter()
                            h.wait()
                            t2 = time.perf_counter()
                        finally:
                            ck.close()
                        ck = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=so, **knobs))
                        try:
                            t3 = time.perf_counter()
                            got = ck.load()
                            t4 = time.perf_counter()
                        finally:
                            ck.close()
                        if rep == 0 and not equal(state, got):
                            raise RuntimeError("Checkpointer(s3) load differs")
                        del got
                        rec(method, blocking=t1 - t0, persisted=t2 - t0, load=t4 - t3,
                            lib_blocking=h.blocking_s)
                    elif method == "Checkpointer tier":
                        url = f"s3://{bucket}/run"
                        local = os.path.join(local_parent, f"tier-{seq}")
                        ck = lazyckpt.Checkpointer(local, persist=lazyckpt.Persist(url, storage_options=so),
                                                   io=lazyckpt.IO(**knobs))
                        try:
                            t0 = time.perf_counter()
                            h = ck.save(state, step=seq)
                            t1 = time.perf_counter()
                            h.wait()
                            t2 = time.perf_counter()
                            h.wait(persisted=True)
                            t3 = time.perf_counter()
                            tiers = h.stats()["tiers"]
                        finally:
                            ck.close()
                        shutil.rmtree(local, ignore_errors=True)
                        empty_local = os.path.join(local_parent, f"tier-{seq}-empty")
                        ck = lazyckpt.Checkpointer(empty_local, persist=lazyckpt.Persist(url, storage_options=so),
                                                   io=lazyckpt.IO(**knobs))
                        try:
                            t4 = time.perf_counter()
                            got = ck.load()
                            t5 = time.perf_counter()
                            tier = (ck.loaded_from or {}).get("tier")
                        finally:
                            ck.close()
                        shutil.rmtree(empty_local, ignore_errors=True)
                        if tier != "persistent":
                            raise RuntimeError(f"loaded from tier {tier!r}, expected 'persistent'")
                        if rep == 0 and not equal(state, got):
                            raise RuntimeError("tiered load differs")
                        del got
                        rec(method, blocking=t1 - t0, local=tiers["local"], local_wait=t2 - t0,
                            persisted=t3 - t0, persisted_stat=tiers["persistent"], load=t5 - t4,
                            lib_blocking=h.blocking_s)
                    else:
                        r = run_peer(method, server, bucket, args, nbytes)
                        if "error" in r:
                            raise RuntimeError(r["error"])
                        if not r.get("ok"):
                            raise RuntimeError("loaded state differs")
                        notes[method] = r.get("versions", "")
                        rec(method, blocking=r["blocking"], persisted=r["persisted"], load=r["load"])
                    r_ = res[method]
                    print(f"rep {rep} {method:18s} blocking {r_['blocking'][-1]:7.3f} s  persisted "
                          f"{r_['persisted'][-1]:7.3f} s ({gb / r_['persisted'][-1]:.3f} GB/s)  load "
                          f"{r_['load'][-1]:7.3f} s ({gb / r_['load'][-1]:.3f} GB/s)", flush=True)
                except Exception as exc:
                    errors[method] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"rep {rep} {method:18s} FAILED: {errors[method]}", flush=True)
                finally:
                    try:
                        empty_bucket(server, bucket)
                    except Exception as exc:
                        print(f"  (cleanup of {bucket} failed: {exc})")

            for rep in range(args.reps):
                for m in (methods if rep % 2 == 0 else methods[::-1]):
                    if m in errors and m in PEERS:
                        continue            # a peer that cannot run here fails every rep the same way
                    one(m, rep)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(local_parent, ignore_errors=True)

    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in res.items() if r.get("persisted")}
    up_raw = med.get("raw boto3", {}).get("persisted")
    down_raw = med.get("raw boto3", {}).get("load")
    peers_ok = [m for m in PEERS if m in med]
    best_peer_p = min((med[m]["persisted"] for m in peers_ok), default=None)
    best_peer_l = min((med[m]["load"] for m in peers_ok), default=None)
    best_peer_b = min((med[m]["blocking"] for m in peers_ok), default=None)
    fmt = lambda v, s=".3f": "-" if v is None else format(v, s)  # noqa: E731
    rows = []
    for m in methods:
        if m not in med:
            rows.append([m, "error"] + ["-"] * 10)
            continue
        r = med[m]
        spread = lambda k: (f" ±{(max(res[m][k]) - min(res[m][k])) / 2:.3f}" if len(res[m][k]) > 1 else "")  # noqa: E731,E501
        rows.append([m, fmt(r["blocking"], ".4f"), fmt(r.get("local")), fmt(r["persisted"]) + spread("persisted"),
                     fmt(gb / r["persisted"]),
                     fmt(up_raw / r["persisted"] if up_raw else None, ".0%"),
                     fmt(best_peer_p / r["persisted"] if best_peer_p else None, ".2f") + "x",
                     fmt(best_peer_b / r["blocking"] if best_peer_b else None, ".1f") + "x",
                     fmt(r["load"]) + spread("load"), fmt(gb / r["load"]),
                     fmt(down_raw / r["load"] if down_raw else None, ".0%"),
                     fmt(best_peer_l / r["load"] if best_peer_l else None, ".2f") + "x"])
    print()
    print_table(["method", "blocking s", "local s", "persisted s", "GB/s", "of raw up",
                 "speed vs best peer", "blocking vs best peer", "load s", "load GB/s", "of raw down",
                 "load vs best peer"], rows)
    print("(medians ± half-range; GB = 1e9 bytes; GB/s = state bytes / persisted s; 'of raw' = raw time / "
          "method time; 'vs best peer' = fastest DCP peer's time / method time, >1x = faster than it)")
    if "Checkpointer tier" in med:
        r = med["Checkpointer tier"]
        print(f"Checkpointer tier: stats()['tiers'] local {r['local']:.3f} s (h.wait() returned at "
              f"{r['local_wait']:.3f} s), persistent {r['persisted_stat']:.3f} s (h.wait(persisted=True) "
              f"returned at {r['persisted']:.3f} s); loads came from the persistent tier")
    for m in ("Checkpointer s3", "Checkpointer tier"):
        if m in med:
            print(f"{m}: h.blocking_s (library's own figure) {med[m]['lib_blocking']:.4f} s")
    for m in PEERS:
        if m in notes:
            print(f"{m}: {notes[m]}")
    for m, e in errors.items():
        print(f"{m}: FAILED: {e}")
    emit_json({"machine": machine_line(), "bytes": nbytes, "tensors": len(state), "reps": args.reps,
               "knobs": knobs, "medians": med, "raw": res, "errors": errors, "notes": notes}, args.json)


if __name__ == "__main__":
    main()
