"""GPU checks for lazy capture (needs CUDA; finishes in well under 5 minutes on an H200).

1. Bit-exact capture under concurrent optimizer steps: a model on the GPU with
   AdamW attached saves every step while the optimizer updates every tensor
   in place right after the barrier; every committed checkpoint must equal a
   device-side clone taken at its save().
2. Device-to-host throughput: lazyckpt's capture of a multi-GB state versus a
   plain copy_ into pinned memory of the same bytes, and the blocking time of
   save().
3. No GPU memory allocated by the checkpoint path: allocated/reserved bytes
   and the allocator's peak are unchanged across save() + capture.
4. Persistent buffers and optimizer state: a BatchNorm model whose next
   training-mode forward runs while the capture streams through a small
   cache; model (buffers included) and AdamW state bit-exact.
5. Several devices (when there are two or more): one state on cuda:0 and
   cuda:1, work queued on each device's stream before save() included.
6. Cancel mid-capture, then a new save reuses freshly pinned memory cleanly
   (the side stream is synchronized before chunks are released).
7. How the host memory was pinned (cudaHostRegister or torch's allocator).

    python benchmarks/gpu_check.py [--gib 4] [--dir /tmp/lazyckpt-gpu]

Exits non-zero if a check fails.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

import lazyckpt


def check_consistency(directory: str) -> bool:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs = {}
    with lazyckpt.Checkpointer(directory, host_cache_bytes=64 << 20) as ckpt:
        ckpt.attach(opt)
        for step in range(10):
            model(torch.randn(64, 2048, device=dev)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            # Queue work on the training stream right before save(): the capture must
            # be ordered after it (the event recorded in save()).
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0001)
            refs[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            ckpt.save(state, step=step)
            ckpt.wait_for_snapshot()
            with torch.no_grad():                 # mutate everything at once after the barrier
                for p in model.parameters():
                    p.add_(1.0)
        ckpt.wait()
        ok = True
        for step, ref in refs.items():
            out = ckpt.load(step=step, map_location="cuda")
            same = all(torch.equal(out["model"][k], v) for k, v in ref.items())
            ok &= same
            if not same:
                print(f"  step {step}: MISMATCH")
    print(f"[1] bit-exact capture under in-place updates, 10 steps: {'OK' if ok else 'FAIL'}")
    return ok


def check_throughput_and_memory(directory: str, gib: float) -> bool:
    dev = torch.device("cuda")
    n = int(gib * (1 << 30)) // 4 // 64
    state = {f"t{i}": torch.randn(n, device=dev) for i in range(64)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    torch.cuda.synchronize()

    pinned = torch.empty(n, dtype=torch.float32, pin_memory=True)
    t = time.perf_counter()
    for v in state.values():
        pinned.copy_(v, non_blocking=True)
    torch.cuda.synchronize()
    plain = time.perf_counter() - t

    ckpt = lazyckpt.Checkpointer(directory, host_cache_bytes=min(nbytes, 8 << 30))
    ckpt.save({"warm": torch.ones(1, device=dev)}, step=0).wait()   # allocate + pin the cache once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    h = ckpt.save(state, step=1)
    ckpt.wait_for_snapshot()
    torch.cuda.synchronize()
    alloc1, reserved1, peak = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                               torch.cuda.max_memory_allocated())
    h.wait()
    ckpt.close()
    print(f"[2] {nbytes / 1e9:.2f} GB: plain pinned copy {nbytes / plain / 1e9:.1f} GB/s; lazyckpt capture "
          f"{nbytes / h.capture_s / 1e9:.1f} GB/s ({plain / h.capture_s:.0%} of plain); save() blocked "
          f"{h.blocking_s * 1e3:.2f} ms; durable after {h.flush_s:.2f} s ({h.gbps:.2f} GB/s)")
    no_alloc = alloc1 == alloc0 and reserved1 == reserved0 and peak == alloc0
    print(f"[3] GPU memory: allocated {alloc0} -> {alloc1}, reserved {reserved0} -> {reserved1}, "
          f"peak {peak}: {'OK (nothing allocated)' if no_alloc else 'FAIL'}")
    return no_alloc


def _cpu(x):
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_cpu(v) for v in x]
    return x.detach().cpu().clone() if isinstance(x, torch.Tensor) else x


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def check_buffers_and_optimizer(directory: str) -> bool:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 2048),
                                torch.nn.BatchNorm1d(2048)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    refs = {}
    with lazyckpt.Checkpointer(directory, host_cache_bytes=8 << 20, io=lazyckpt.IO(chunk_bytes=2 << 20)) as ckpt:
        ckpt.attach(opt)
        for step in range(6):
            x = torch.randn(128, 2048, device=dev)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            refs[step] = _cpu(state)
            ckpt.save(state, step=step)
            model(x)                                # mutates BatchNorm buffers: the guard waits
        ckpt.wait()
        ok = all(_same(_cpu(ckpt.load(step=s, map_location="cuda")), ref) for s, ref in refs.items())
    print(f"[4] buffers + AdamW state bit-exact with forwards racing the capture, 6 steps: "
          f"{'OK' if ok else 'FAIL'}")
    return ok


def check_several_devices(directory: str) -> bool:
    if torch.cuda.device_count() < 2:
        print("[5] several devices: skipped (one device)")
        return True
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    state = {"a": torch.randn(16 << 20, device=a), "b": torch.randn(16 << 20, device=b)}
    with torch.cuda.device(b):
        state["b"].mul_(2.0)                        # queued on cuda:1's stream before save()
    expected = _cpu(state)
    with lazyckpt.Checkpointer(directory, host_cache_bytes=16 << 20, io=lazyckpt.IO(chunk_bytes=4 << 20)) as ckpt:
        ckpt.save(state, step=1)
        ckpt.wait_for_snapshot()
        state["a"].add_(1.0)
        state["b"].add_(1.0)
        ckpt.wait()
        ok = _same(ckpt.load(), expected)
    print(f"[5] state on cuda:0 and cuda:1: {'OK' if ok else 'FAIL'}")
    return ok


def check_cancel(directory: str) -> bool:
    dev = torch.device("cuda")
    ckpt = lazyckpt.Checkpointer(os.path.join(directory, "a"), host_cache_bytes=8 << 20,
                                 io=lazyckpt.IO(chunk_bytes=2 << 20))
    ckpt.save({"w": torch.randn(256 << 20, device=dev)}, step=1)
    time.sleep(0.05)
    ckpt.close(cancel=True)
    torch.cuda.synchronize()
    small = {"w": torch.randn(4 << 20, device=dev)}
    with lazyckpt.Checkpointer(os.path.join(directory, "b"), host_cache_bytes=8 << 20,
                               io=lazyckpt.IO(chunk_bytes=2 << 20)) as c2:
        c2.save(small, step=1).wait()
        ok = torch.equal(c2.load()["w"], small["w"].cpu())
    print(f"[6] cancel mid-capture, then a clean save: {'OK' if ok else 'FAIL'}")
    return ok


def report_pinning() -> bool:
    from lazyckpt.saving.hostcache import PinnedBuffer
    buf = PinnedBuffer(64 << 20)
    how = "cudaHostRegister" if buf._registered else "torch pinned allocator" if buf.pinned else "NOT pinned"
    aligned = buf.tensor.data_ptr() % 4096 == 0
    buf.close()
    print(f"[7] host memory pinned by: {how}; page-aligned: {aligned}")
    return buf.pinned and aligned


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--dir", default="/tmp/lazyckpt-gpu")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available; nothing to check")
        sys.exit(2)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    shutil.rmtree(args.dir, ignore_errors=True)
    ok = check_consistency(os.path.join(args.dir, "consistency"))
    ok &= check_throughput_and_memory(os.path.join(args.dir, "throughput"), args.gib)
    ok &= check_buffers_and_optimizer(os.path.join(args.dir, "buffers"))
    ok &= check_several_devices(os.path.join(args.dir, "devices"))
    ok &= check_cancel(os.path.join(args.dir, "cancel"))
    ok &= report_pinning()
    shutil.rmtree(args.dir, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
