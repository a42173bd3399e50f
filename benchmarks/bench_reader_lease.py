"""What a reader lease costs per object-store load (issue 22, case 7).

Starts a SeaweedFS on loopback (tests/_s3server.py), commits one step with
``Checkpointer("s3://...")`` and loads it REPS times two ways: the previous
``load_step`` body (manifest GET, then the data; no lease) and the current
``load_step`` (reader lease PUT, manifest GET under it, data, lease DELETE).
Times are medians, talking to SeaweedFS directly; the requests of one load
are counted through the test proxy (tests/_s3proxy.py).

    python benchmarks/bench_reader_lease.py [--reps 9]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import torch  # noqa: E402

import lazyckpt  # noqa: E402
from _s3proxy import S3FaultProxy  # noqa: E402
from _s3server import SeaweedServer  # noqa: E402
from lazyckpt.knobs import resolve  # noqa: E402
from lazyckpt.loading.loader import load_step, load_tree  # noqa: E402
from lazyckpt.loading.stepfiles import StepFiles  # noqa: E402
from lazyckpt.storage.s3layout import read_manifest  # noqa: E402
from lazyckpt.storage.stores import for_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    srv = SeaweedServer(tempfile.mkdtemp())
    srv.start()
    try:
        bucket = srv.make_bucket()
        proxy = S3FaultProxy(srv.endpoint)
        creds = {"access_key_id": srv.access_key, "secret_access_key": srv.secret_key, "region": srv.region}
        direct = resolve(storage_options=dict(creds, endpoint_url=srv.endpoint))
        counted = resolve(storage_options=dict(creds, endpoint_url=proxy.endpoint))
        pool = cf.ThreadPoolExecutor(4)

        store = for_path(f"s3://{bucket}")

        def no_lease(url, options):
            m = read_manifest(url, options)
            step = StepFiles(url, m, options, None, store=store)
            return load_tree(step.file(0), step, pool)

        def reader_lease(url, options):
            return load_step(url, None, options, pool, 0, store=store)

        print(f"SeaweedFS on loopback, median of {args.reps} loads")
        for n in (1_000, 4_000_000):       # 4 KB and 16 MB of tensor data
            with lazyckpt.Checkpointer(f"s3://{bucket}/run{n}",
                                       io=lazyckpt.IO(storage_options=dict(direct.storage_options))) as ck:
                ck.save({"w": torch.randn(n)}, 1).wait()
                url = ck.layout.save_url(1, ck.layout.committed()[1])
            ms = {}
            for name, fn in (("no lease", no_lease), ("reader lease", reader_lease)):
                fn(url, direct)             # warm the connection pool
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    fn(url, direct)
                    times.append((time.perf_counter() - t0) * 1e3)
                ms[name] = statistics.median(times)
                before = len(proxy.requests)
                fn(url, counted)
                methods = [m for m, _, _ in proxy.requests[before:]]
                print(f"{n * 4 / 1e6:7.3f} MB  {name:13s} {ms[name]:7.1f} ms  {len(methods)} requests "
                      f"{dict(sorted((m, methods.count(m)) for m in set(methods)))}")
            print(f"{'':10s} lease costs {ms['reader lease'] - ms['no lease']:+.1f} ms per load")
        proxy.close()
        pool.shutdown()
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
