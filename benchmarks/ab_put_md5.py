"""What ``Content-MD5`` on the object store's small-object PUT costs, in one interleaved run.

``ObjectStore.put`` (manifests, ``head.json``, leases, framework files under a
part's size) sends ``Content-MD5`` so that a server refuses a body that is not
all there (RELIABILITY.md finding 23). This PUTs objects of several sizes to a
SeaweedFS started here, with the header (the library's ``put``) and without
(the same ``put_object`` call minus the header), alternating the order every
repetition, and prints each size's medians and their ratio.

    python benchmarks/ab_put_md5.py [--reps 15 --sizes 4096 1048576 8388608]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _common import machine_line  # noqa: E402
from _s3server import SeaweedServer  # noqa: E402
from lazyckpt.knobs import resolve  # noqa: E402
from lazyckpt.storage.s3 import store_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 1 << 20, 8 << 20])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer(tmp) as srv:
        bucket = srv.make_bucket()
        options = resolve(storage_options={"endpoint_url": srv.endpoint, "access_key_id": srv.access_key,
                                           "secret_access_key": srv.secret_key, "region": srv.region})
        store, _ = store_for(f"s3://{bucket}/x", options.storage_options)

        def with_md5(key: str, data: bytes) -> None:
            store.put(key, data)

        def without(key: str, data: bytes) -> None:
            store.client.put_object(Bucket=bucket, Key=key, Body=data)

        print(machine_line())
        print("SeaweedFS on loopback; medians of", a.reps, "interleaved PUTs per size and mode")
        for size in a.sizes:
            data = os.urandom(size)
            times = {"Content-MD5": [], "no header": []}
            for fn in (with_md5, without):          # warm the connection pool
                fn("warm", data)
            for rep in range(a.reps):
                order = [("Content-MD5", with_md5), ("no header", without)]
                for mode, fn in (order if rep % 2 == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    fn(f"obj-{size}-{rep}-{mode[0]}", data)
                    times[mode].append(time.perf_counter() - t0)
            m = {k: statistics.median(v) for k, v in times.items()}
            print(f"{size:>10} B: with Content-MD5 {m['Content-MD5'] * 1e3:7.2f} ms, without "
                  f"{m['no header'] * 1e3:7.2f} ms, with / without = {m['Content-MD5'] / m['no header']:.2f}x")


if __name__ == "__main__":
    main()
