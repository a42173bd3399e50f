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
    shutil.rmtree(args.dir, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
