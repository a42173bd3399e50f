"""Soak test: hundreds of asynchronous saves with a host cache smaller than the
state, optimizer steps interleaved, and random wait() / handle.wait() /
wait_for_snapshot() / close() / close(cancel=True) / reopen calls.

Checked:

* every committed checkpoint loads and matches the sha256 of every tensor
  taken at its save() (verified as soon as it is seen committed, before
  retention can remove it; the final survivors again at the end);
* no deadlock: every wait has a bound (--bound, default 60 s) and a wait that
  exceeds it is a failure; a watchdog dumps all stacks and aborts if the
  loop makes no progress for 2 x bound;
* no leaked threads (threading.enumerate) or file descriptors (/proc/self/fd)
  after the last close, compared with the start (after one warm-up save);
* memory stays flat: VmRSS / VmHWM at start, middle and end (a failure if the
  end RSS exceeds the middle by more than max(64 MiB, 25 %)).

    cd /work/main && .venv/bin/python benchmarks/soak.py --saves 300

Exit status 0 iff every check passed.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402

import lazyckpt  # noqa: E402


def digests(state: Any, prefix: str = "") -> Dict[str, str]:
    out: Dict[str, str] = {}
    if isinstance(state, torch.Tensor):
        t = state.detach().contiguous().reshape(-1)
        h = hashlib.sha256(f"{t.dtype}|{tuple(state.shape)}|".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())
        out[prefix] = h.hexdigest()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(digests(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(digests(v, f"{prefix}/{i}"))
    else:
        out[prefix] = repr(state)
    return out


def proc_status() -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM", "VmSize", "Threads"):
                out[key] = int(line.split()[1])
    return out


def fds() -> List[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return sorted(out)


def mib(kib: int) -> str:
    return f"{kib / 1024:.0f} MiB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--saves", type=int, default=300)
    p.add_argument("--hidden", type=int, default=512, help="model width (state ~ 12 x hidden^2 x 4 bytes)")
    p.add_argument("--host-cache-bytes", type=int, default=2 << 20)
    p.add_argument("--keep-last", type=int, default=6)
    p.add_argument("--bound", type=float, default=60.0, help="the longest any wait may take (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(2)
    base = args.dir or tempfile.mkdtemp(prefix="lazyckpt-soak-")
    directory = os.path.join(base, "run")
    knobs = dict(host_cache_bytes=args.host_cache_bytes, io=lazyckpt.IO(max_pending_saves=2))
    h = args.hidden
    model = torch.nn.Sequential(torch.nn.Linear(h, 2 * h), torch.nn.GELU(), torch.nn.Linear(2 * h, h))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    failures: List[str] = []
    counts: collections.Counter = collections.Counter()
    refs: Dict[int, Dict[str, str]] = {}
    verified: set = set()
    verified_ever: set = set()
    committed: set = set()          # steps whose handle reported success
    wait_times: List[float] = []

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, h, generator=g)
        torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def bounded(what: str, fn) -> None:
        t = time.monotonic()
        try:
            fn()
        except lazyckpt.CheckpointError as exc:
            if "not committed within" in str(exc) or "not finished within" in str(exc):
                failures.append(f"{what} exceeded the {args.bound} s bound: {exc}")
            else:
                failures.append(f"{what} raised: {type(exc).__name__}: {exc}")
        wait_times.append(time.monotonic() - t)
        counts[what] += 1

    def verify_committed(ckpt: "lazyckpt.Checkpointer") -> None:
        for step in ckpt.steps():
            if step in verified:
                continue
            try:
                got = digests(ckpt.load(step=step))
            except lazyckpt.CheckpointError as exc:
                failures.append(f"committed step {step} does not load: {exc}")
                verified.add(step)
                continue
            if got != refs.get(step):
                bad = [k for k in refs.get(step, {}) if refs[step][k] != got.get(k)]
                failures.append(f"committed step {step} differs from its reference at {bad[:4]}")
            verified.add(step)
            verified_ever.add(step)
            counts["verified"] += 1

    # Warm-up outside the measurements: lazy imports, torch's thread pools, the first cache.
    warm = os.path.join(base, "warm")
    with lazyckpt.Checkpointer(warm, **knobs) as c:
        c.attach(opt)
        train(0)
        c.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=0).wait(args.bound)
        c.load(step=0)
    shutil.rmtree(warm)
    threads0 = sorted(t.name for t in threading.enumerate())
    fds0 = fds()
    mem = {"start": proc_status()}

    faulthandler.dump_traceback_later(2 * args.bound, exit=True)
    ckpt = lazyckpt.Checkpointer(directory, keep=args.keep_last, **knobs)
    ckpt.attach(opt)
    handles: List[Any] = []
    t0 = time.monotonic()
    print(f"soak: {args.saves} saves of a {state_bytes / 2**20:.1f} MiB state through a "
          f"{args.host_cache_bytes / 2**20:.1f} MiB host cache, keep_last={args.keep_last}, dir {directory}",
          flush=True)
    for step in range(1, args.saves + 1):
        faulthandler.dump_traceback_later(2 * args.bound, exit=True)       # progress: re-arm the watchdog
        train(step)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        refs[step] = digests(state)
        try:
            handles.append(ckpt.save(state, step=step))
        except lazyckpt.CheckpointError as exc:
            failures.append(f"save({step}) raised {type(exc).__name__}: {exc}")
        counts["save"] += 1
        roll = rng.random()
        if roll < 0.10:
            bounded("ckpt.wait", lambda: ckpt.wait(args.bound))
        elif roll < 0.18:
            bounded("handle.wait", lambda: handles[-1].wait(args.bound))
        elif roll < 0.26:
            bounded("wait_for_snapshot", lambda: ckpt.wait_for_snapshot(args.bound))
        elif roll < 0.30:
            bounded("close", lambda: ckpt.close())
            ckpt = lazyckpt.Checkpointer(directory, keep=args.keep_last, **knobs)
            ckpt.attach(opt)
            counts["reopen"] += 1
        elif roll < 0.32:
            bounded("close(cancel=True)", lambda: ckpt.close(cancel=True))
            counts["cancelled"] += sum(1 for x in handles if x.cancelled)
            ckpt = lazyckpt.Checkpointer(directory, keep=args.keep_last, **knobs)
            ckpt.attach(opt)
            counts["reopen"] += 1
        if roll < 0.32 or step % 3 == 0:
            verify_committed(ckpt)
        for x in handles:
            if x.done() and x.error is not None and not x.cancelled:
                failures.append(f"step {x.step} failed: {x.error}")
            elif x.done() and x.error is None and not x.cancelled and not x.skipped:
                committed.add(x.step)
        handles = [x for x in handles if not x.done()]
        if step == args.saves // 2:
            mem["middle"] = proc_status()
        if step % 50 == 0:
            print(f"  {step} saves, {counts['verified']} verified, {len(failures)} failures, "
                  f"RSS {mib(proc_status()['VmRSS'])}, {time.monotonic() - t0:.0f} s", flush=True)
    bounded("ckpt.wait", lambda: ckpt.wait(args.bound))
    committed.update(x.step for x in handles if x.done() and x.error is None and not x.cancelled)
    verify_committed(ckpt)
    final_steps = ckpt.steps()
    # Re-verify the survivors from a fresh Checkpointer.
    verified.clear()
    bounded("close", lambda: ckpt.close())
    with lazyckpt.Checkpointer(directory, keep=args.keep_last, **knobs) as again:
        verify_committed(again)
    faulthandler.cancel_dump_traceback_later()
    ckpt = again = None
    import gc
    gc.collect()
    elapsed = time.monotonic() - t0
    mem["end"] = proc_status()
    deadline = time.monotonic() + 10           # bounded polling: pool threads exit asynchronously
    while time.monotonic() < deadline:
        threads1 = sorted(t.name for t in threading.enumerate())
        if len(threads1) <= len(threads0):
            break
        time.sleep(0.05)
    fds1 = fds()
    leaked_threads = sorted((collections.Counter(threads1) - collections.Counter(threads0)).elements())
    leaked_fds = sorted(set(fds1) - set(fds0))
    if leaked_threads:
        failures.append(f"threads leaked: {leaked_threads}")
    if leaked_fds:
        failures.append(f"file descriptors leaked: {leaked_fds}")
    growth = mem["end"]["VmRSS"] - mem["middle"]["VmRSS"]
    if growth > max(64 * 1024, mem["middle"]["VmRSS"] // 4):
        failures.append(f"RSS grew by {mib(growth)} from the middle to the end")
    unverified = sorted(committed - verified_ever)
    if unverified:
        failures.append(f"committed steps never verified (retired first): {unverified[:10]}")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)

    summary = {
        "saves": args.saves, "state_mib": round(state_bytes / 2**20, 1),
        "host_cache_mib": round(args.host_cache_bytes / 2**20, 2), "elapsed_s": round(elapsed, 1),
        "calls": dict(counts), "final_steps": final_steps, "committed": len(committed),
        "verified_distinct": len(verified_ever), "unverified": unverified,
        "max_wait_s": round(max(wait_times), 3) if wait_times else 0.0, "bound_s": args.bound,
        "threads_start": len(threads0), "threads_end": len(threads1), "fds_start": len(fds0),
        "fds_end": len(fds1), "memory_kib": mem, "failures": failures,
    }
    print(f"\nsaves: {args.saves} ({summary['state_mib']} MiB state, {summary['host_cache_mib']} MiB cache) "
          f"in {elapsed:.0f} s; reported committed: {len(committed)}; verified bit-exact: "
          f"{len(verified_ever)} distinct steps ({counts['verified']} loads); unverified: {len(unverified)}; "
          f"final steps {final_steps}")
    print("calls: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"longest wait: {summary['max_wait_s']} s (bound {args.bound} s)")
    print(f"threads: {len(threads0)} at start, {len(threads1)} at end; fds: {len(fds0)} at start, "
          f"{len(fds1)} at end")
    for when in ("start", "middle", "end"):
        m = mem[when]
        print(f"memory {when:6s}: VmRSS {mib(m['VmRSS'])}, VmHWM {mib(m['VmHWM'])}")
    for f in failures:
        print("FAILURE:", f)
    print("OK" if not failures else f"{len(failures)} FAILURES")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
