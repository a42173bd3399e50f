"""What verifying every block's checksum costs a cold load, in one interleaved run.

Saves ``--gib`` GiB in 64 fp32 tensors with ``lazyckpt.save``, then loads it
``--reps`` times with checksum verification (the default) and without
(``LAZYCKPT_VERIFY_CHECKSUMS=0``), alternating the order, the page cache
dropped before every load (root). Prints each mode's median and the ratio.

    python benchmarks/ab_verify_checksums.py [--gib 1 --reps 6 --dir /work]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import lazyckpt  # noqa: E402
from lazyckpt.cli.bench import drop_caches_global  # noqa: E402

from _common import machine_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    fd, path = tempfile.mkstemp(suffix=".lzc", dir=a.dir)
    os.close(fd)
    try:
        g = torch.Generator().manual_seed(0)
        n = int(a.gib * (1 << 30)) // 4 // 64
        lazyckpt.save({f"t{i}": torch.randn(n, generator=g) for i in range(64)}, path)
        times = {"verify": [], "no verify": []}
        for rep in range(a.reps):
            for mode in (list(times) if rep % 2 == 0 else list(reversed(times))):
                if not drop_caches_global():
                    raise SystemExit("needs root to drop the page cache")
                if mode == "no verify":
                    os.environ["LAZYCKPT_VERIFY_CHECKSUMS"] = "0"
                t0 = time.perf_counter()
                state = lazyckpt.load(path)
                times[mode].append(time.perf_counter() - t0)
                os.environ.pop("LAZYCKPT_VERIFY_CHECKSUMS", None)
                del state
        print(machine_line())
        size = os.path.getsize(path)
        for mode, ts in times.items():
            m = statistics.median(ts)
            print(f"{mode:>10}: median {m:.3f} s ({size / m / 1e9:.2f} GB/s)  runs {[round(t, 3) for t in ts]}")
        v, nv = statistics.median(times["verify"]), statistics.median(times["no verify"])
        print(f"verification costs {v - nv:.3f} s of {v:.3f} s ({(v - nv) / v:.0%}); no verify / verify = "
              f"{v / nv:.2f}x")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
