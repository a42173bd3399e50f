"""Warm lazyckpt.save timing for A/B between source trees (run once per tree with
PYTHONPATH=<tree>/src, alternately): 7 saves of the same 512 MiB, prints each and
the median of the last 6 (the first save of a process is bimodal on this disk)."""
import time, torch, lazyckpt, tempfile, os, statistics, shutil
torch.manual_seed(0)
n = (512 << 20) // 4 // 32
state = {f"l{i}": torch.randn(n) for i in range(32)}
d = tempfile.mkdtemp(dir=os.environ.get("TMPDIR_BENCH", "."))
ts = []
for i in range(7):
    p = os.path.join(d, f"s{i%2}.lzc")
    t0 = time.perf_counter(); lazyckpt.save(state, p); ts.append(time.perf_counter() - t0)
shutil.rmtree(d)
print(" ".join(f"{t:.3f}" for t in ts), "median(1:)", f"{statistics.median(ts[1:]):.3f}")
