"""Crash-consistency stress test: SIGKILL a training process at random instants
and prove that nothing committed is ever lost or wrong.

Each trial is one child process (forked from this parent, which has imported
torch but never runs it, so the child starts in milliseconds). The child

1. lists the leftovers the previous (killed) child left in the directory,
   waits until their leases have expired (``LEASE_EXPIRY_S``: the killed
   process no longer holds their locks nor refreshes their heartbeats), opens
   a ``Checkpointer`` (which must clean them, being provably dead), and checks
   that no leftover is listed by ``steps()`` nor survives the open;
2. loads EVERY committed step and compares each tensor's sha256 (and each
   scalar) with the reference log, written and fsynced before that step's
   ``save()``; restores the model and AdamW from the latest committed step and
   checks the live state against the reference too;
3. reports to the parent, then resumes training from the restored state,
   saving asynchronously EVERY step (``keep_last=2``, a host cache much
   smaller than the state, so every save streams through it), appending the
   reference hashes of each step to the log (fsynced) before saving it.

The parent SIGKILLs the child at a random instant: a uniform delay over
several step durations, or (``--targeted-fraction``) as soon as it sees a
given phase on disk (a data file being written, a manifest, a ``.deleting-*``
directory, ``latest.tmp-*``), so that capture, data writes, commit and
retention deletes are all hit. Which phase was interrupted is inferred from
the leftovers present right after the kill. After the last kill a final
verify-only child checks the directory once more.

Training is deterministic (batches seeded by step, one intra-op thread), so
a step recomputed after a resume must hash exactly as before the crash:
that is checked too (resume determinism).

    cd /work/main && .venv/bin/python benchmarks/stress_crash.py --trials 60
    cd /work/main && .venv/bin/python benchmarks/stress_crash.py --trials 5 --size small --json out.json

Exit status 0 iff every trial succeeded.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (imported once here, inherited by every forked child)

import lazyckpt  # noqa: E402
import lazyckpt.storage.layout  # noqa: E402

KEEP_LAST = 2
#: Short leases, so that a killed child's leftovers are provably dead soon.
LEASE_EXPIRY_S = 0.3
TRAILER_MAGIC = b"LZCKFOOT"
SIZES = {
    # hidden width -> Linear(h, 2h), Linear(2h, h): params ~ 4 h^2; checkpoint ~ 3 x params x 4 bytes
    "small": 256,       # ~0.26 M params, ~3 MB per checkpoint
    "medium": 512,      # ~1.05 M params, ~12.6 MB per checkpoint
    "large": 1024,      # ~4.2 M params, ~50 MB per checkpoint
}

# --------------------------------------------------------------------------- hashing


def tensor_digest(t: torch.Tensor) -> str:
    t = t.detach()
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    h = hashlib.sha256()
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(raw)
    return h.hexdigest()


def state_digests(state: Any, prefix: str = "") -> Dict[str, str]:
    """path -> sha256 of every tensor (dtype, shape, bytes) and repr of every other leaf."""
    out: Dict[str, str] = {}
    if isinstance(state, torch.Tensor):
        out[prefix or "<root>"] = tensor_digest(state)
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(state_digests(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(state_digests(v, f"{prefix}/{i}"))
    else:
        out[prefix or "<root>"] = f"{type(state).__name__}:{state!r}"
    return out


def diff_digests(ref: Dict[str, str], got: Dict[str, str]) -> List[str]:
    problems = [f"missing {k}" for k in ref if k not in got]
    problems += [f"unexpected {k}" for k in got if k not in ref]
    problems += [f"differs {k}" for k in ref if k in got and ref[k] != got[k]]
    return problems


# --------------------------------------------------------------------------- reference log


def append_reference(log_path: str, step: int, digests: Dict[str, str]) -> None:
    """One JSON line per step, fsynced before the step's save() is called."""
    line = json.dumps({"step": step, "digests": digests}, sort_keys=True) + "\n"
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _references_of(directory: str, step: int) -> List[int]:
    try:
        with open(os.path.join(directory, f"step_{step:010d}", "manifest.json")) as f:
            return list(json.load(f).get("references", []))
    except (OSError, ValueError):
        return []


def read_references(log_path: str) -> Tuple[Dict[int, Dict[str, str]], List[str]]:
    """Last reference per step, plus determinism violations (a step written twice
    with different digests). A torn last line (killed mid-write) is ignored."""
    refs: Dict[int, Dict[str, str]] = {}
    problems: List[str] = []
    if not os.path.exists(log_path):
        return refs, problems
    with open(log_path, "rb") as f:
        lines = f.read().split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError:
            if i != len(lines) - 1:
                problems.append(f"reference log line {i} unreadable (not the last line)")
            continue
        step, dig = rec["step"], rec["digests"]
        if step in refs and refs[step] != dig:
            problems.append(f"step {step} recomputed after a resume hashes differently "
                            f"({len(diff_digests(refs[step], dig))} leaves differ)")
        refs[step] = dig
    return refs, problems


def truncate_torn_tail(log_path: str) -> None:
    """Drop a partial last line left by a kill, so later appends start cleanly."""
    if not os.path.exists(log_path):
        return
    with open(log_path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(log_path, "r+b") as f:
            f.truncate(keep)
            os.fsync(f.fileno())


# --------------------------------------------------------------------------- phases


def is_leftover(name: str) -> bool:
    return name.startswith(".tmp-step_") or name.startswith(".deleting-step_") or name.startswith("latest.tmp-")


def leftovers(directory: str) -> List[str]:
    return sorted(n for n in os.listdir(directory) if is_leftover(n))


def committed_dirs(directory: str) -> List[str]:
    import re
    return sorted(n for n in os.listdir(directory) if re.fullmatch(r"step_\d{10}", n)
                  and os.path.isfile(os.path.join(directory, n, "manifest.json")))


def committed_steps(directory: str) -> List[int]:
    """The committed steps by FORMAT.md §11.3, read here without the library:
    the step directories holding a manifest -- unless history.json's
    ``"commit"`` names a temporary directory still holding its manifest (a
    commit killed between its record, the commit point, and its rename): then
    the steps below that step, and that step."""
    import json
    steps = [int(n[5:]) for n in committed_dirs(directory)]
    try:
        with open(os.path.join(directory, "history.json"), "rb") as f:
            step, _sid, _seq, tmp = json.load(f)["commit"]
    except (OSError, ValueError, KeyError, TypeError):
        return steps
    if not os.path.isfile(os.path.join(directory, tmp, "manifest.json")):
        return steps
    return [s for s in steps if s < step] + [step]


def classify(directory: str, keep_last: int = KEEP_LAST) -> str:
    """Which phase a kill interrupted, from what it left on disk."""
    names = os.listdir(directory)
    if any(n.startswith(".deleting-step_") for n in names):
        return "retention delete (.deleting-*)"
    if any(n.startswith("latest.tmp-") for n in names):
        return "latest update (latest.tmp-*)"
    tmps = [n for n in names if n.startswith(".tmp-step_")]
    if tmps:
        path = os.path.join(directory, sorted(tmps)[-1])
        try:
            inside = os.listdir(path)
        except FileNotFoundError:
            inside = []
        if "manifest.json" in inside:
            if committed_steps(directory)[-1:] == [int(sorted(tmps)[-1][len(".tmp-step_"):][:10])]:
                return "commit: recorded (committed), renames pending"
            return "commit: manifest written, record pending"
        if any(n.startswith("manifest.json.tmp-") for n in inside):
            return "commit: manifest being written"
        data = [n for n in inside if n.endswith(".lzc")]
        if not data:
            return "save started: temp dir created, no data file yet"
        try:
            with open(os.path.join(path, data[0]), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 8))
                tail = f.read(8)
        except OSError:
            tail, size = b"", 0
        if tail == TRAILER_MAGIC:
            return "data: footer written, truncate/fsync pending"
        return "data: capture + writes in progress"
    if len(committed_steps(directory)) > keep_last:
        return "renamed (committed), retention not yet started"
    return "no checkpoint I/O on disk (compute, queue, or between saves)"


# --------------------------------------------------------------------------- the child


#: --incremental: the first layer is frozen, so later steps refer to its bytes
#: in earlier steps (set before the children are forked).
FROZEN_FIRST_LAYER = False


def build(size: int, lr: float = 1e-3):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(size, 2 * size), torch.nn.GELU(),
                                torch.nn.Linear(2 * size, size))
    if FROZEN_FIRST_LAYER:
        model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    return model, opt


def train_step(model, opt, size: int, step: int) -> None:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(16, size, generator=g)
    y = torch.randn(16, size, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()          # the attached hook waits here for the previous capture
    opt.zero_grad(set_to_none=True)


def make_state(model, opt, step: int) -> Dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def verify_directory(directory: str, log_path: str, size: int, ckpt_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Open the directory as a fresh process would; check everything committed.
    Returns a report (and the Checkpointer plus restored model/opt/step)."""
    report: Dict[str, Any] = {"problems": []}
    problems = report["problems"]
    before = leftovers(directory) if os.path.isdir(directory) else []
    report["leftovers_before_open"] = before
    refs, det = read_references(log_path)
    if before:
        # With the leftovers still there: they are never listed, and the
        # functional loader (which cleans nothing) picks the latest committed step.
        listed_before = lazyckpt.storage.layout.CheckpointDir(directory).steps()
        expected = committed_steps(directory)
        if listed_before != expected:
            problems.append(f"with leftovers {before}, steps() = {listed_before}, committed = {expected}")
        if expected:
            try:
                bad = diff_digests(refs.get(expected[-1], {}), state_digests(lazyckpt.load(directory)))
                if bad:
                    problems.append(f"lazyckpt.load(dir) with leftovers present differs from step "
                                    f"{expected[-1]}: {bad[:5]}")
            except lazyckpt.CheckpointError as exc:
                problems.append(f"lazyckpt.load(dir) with leftovers present failed: {exc}")
    if before or os.path.exists(os.path.join(directory, ".writer")):
        # The killed child's leases run out, its writer lease too: a lease whose
        # heartbeat is fresh is live (its holder may be on a node whose locks
        # this one cannot see, storage/locks.py), so an open within
        # LEASE_EXPIRY_S of the kill rightly leaves it, and a verify-only
        # Checkpointer never takes (and so never replaces) it.
        time.sleep(LEASE_EXPIRY_S * 1.2)
    ckpt = lazyckpt.Checkpointer(directory, keep=KEEP_LAST, **ckpt_kwargs)
    ckpt.layout.tidy()      # the leftover scan opening starts runs in the background: wait for it (close() cancels it)
    after = leftovers(directory)
    report["leftovers_after_open"] = after
    if after:
        problems.append(f"leftovers not cleaned when a Checkpointer opened the directory: {after}")
    steps = ckpt.steps()
    report["steps"] = steps
    # Incremental runs: which committed steps refer to earlier ones (the checks are not vacuous).
    report["referring_steps"] = [s for s in steps if _references_of(directory, s)]
    listed = committed_steps(directory)
    if steps != listed:
        problems.append(f"steps() = {steps} but committed directories are {listed}")
    report["determinism_problems"] = det
    problems.extend(det)
    model, opt = build(size)
    start = 0
    for s in steps:
        try:
            loaded = ckpt.load(step=s)
        except lazyckpt.CheckpointError as exc:
            problems.append(f"committed step {s} does not load: {type(exc).__name__}: {exc}")
            continue
        if s not in refs:
            problems.append(f"committed step {s} has no reference (saved before its reference was durable?)")
            continue
        bad = diff_digests(refs[s], state_digests(loaded))
        if bad:
            problems.append(f"committed step {s} differs from its reference: {bad[:5]}")
    if steps:
        latest = steps[-1]
        state = ckpt.load(step=latest)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
        if start != latest:
            problems.append(f"step {latest} holds step value {start}")
        live = state_digests(make_state(model, opt, start))
        bad = diff_digests(refs.get(latest, {}), live)
        if bad:
            problems.append(f"restored live state differs from step {latest}'s reference: {bad[:5]}")
    report["restored_step"] = steps[-1] if steps else None
    return report, ckpt, model, opt, start


def child_main(directory: str, log_path: str, size: int, ckpt_kwargs: Dict[str, Any], conn,
               train: bool) -> None:
    torch.set_num_threads(1)
    ckpt = None
    try:
        truncate_torn_tail(log_path)
        t0 = time.perf_counter()
        report, ckpt, model, opt, start = verify_directory(directory, log_path, size, ckpt_kwargs)
        report["verify_s"] = time.perf_counter() - t0
        conn.send(("ready", report))
        if not train:
            ckpt.close()
            conn.send(("done", None))
            return
        ckpt.attach(opt)
        step = start
        while True:
            step += 1
            train_step(model, opt, size, step)
            state = make_state(model, opt, step)
            append_reference(log_path, step, state_digests(state))
            ckpt.save(state, step=step)          # raises an earlier save's failure, if any
            conn.send(("saved", step))
    except BaseException:                        # report, never hide
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
        os._exit(3)


# --------------------------------------------------------------------------- the parent


def _recv(conn, proc, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            return conn.recv()
        if not proc.is_alive():
            if conn.poll(0.1):
                return conn.recv()
            return ("died", proc.exitcode)
    return ("timeout", timeout)


def _drain(conn) -> List[Tuple[str, Any]]:
    out = []
    try:
        while conn.poll(0):
            out.append(conn.recv())
    except (EOFError, OSError):
        pass
    return out


TARGETS = {
    "data": lambda d: any(n.startswith(".tmp-step_") and any(f.endswith(".lzc") for f in _ls(d, n))
                          for n in os.listdir(d)),
    "manifest": lambda d: any(n.startswith(".tmp-step_") and any(f.startswith("manifest") for f in _ls(d, n))
                              for n in os.listdir(d)),
    "deleting": lambda d: any(n.startswith(".deleting-") for n in os.listdir(d)),
    "latest": lambda d: any(n.startswith("latest.tmp-") for n in os.listdir(d)),
}


def _ls(d: str, n: str) -> List[str]:
    try:
        return os.listdir(os.path.join(d, n))
    except OSError:
        return []


def warm_up_imports() -> None:
    """Import what the children would import lazily (the optimizer pulls in
    torch._dynamo: seconds), so each forked child starts at once. Runs a tiny
    model single-threaded: the parent must stay a single-threaded process."""
    torch.set_num_threads(1)
    build(8)
    import importlib
    importlib.import_module("torch.distributed")
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if tasks != 1:
        print(f"warning: the parent has {tasks} threads before forking", file=sys.stderr)


def run(trials: int, directory: str, size: int, seed: int, max_delay: float,
        targeted_fraction: float, ckpt_kwargs: Dict[str, Any], verbose: bool = True) -> Dict[str, Any]:
    rng = random.Random(seed)
    warm_up_imports()
    os.makedirs(directory, exist_ok=True)
    log_path = os.path.join(os.path.dirname(os.path.abspath(directory)),
                            os.path.basename(os.path.abspath(directory)) + ".reflog")
    ctx = mp.get_context("fork")
    phases: collections.Counter = collections.Counter()
    results: List[Dict[str, Any]] = []
    failures: List[Tuple[int, str]] = []     # (trial whose kill/training it concerns, what)
    step_times: List[float] = []

    def one(train: bool, trial: int) -> Optional[Dict[str, Any]]:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=child_main, args=(directory, log_path, size, ckpt_kwargs, child, train),
                           daemon=True)
        proc.start()
        child.close()
        kind, report = _recv(parent, proc, timeout=120)
        if kind != "ready":
            failures.append((trial - 1, f"child of trial {trial} did not verify/start: {kind} {report}"))
            proc.kill()
            proc.join(10)
            return None
        if report["problems"]:
            # Found by the process that follows the kill of trial - 1.
            failures.append((trial - 1, f"after the kill of trial {trial - 1}: " + "; ".join(report["problems"])))
        if not train:
            _recv(parent, proc, timeout=60)
            proc.join(30)
            return {"report": report}
        # Kill at a random instant of the training that follows.
        t_ready = time.monotonic()
        targeted = rng.random() < targeted_fraction
        target = rng.choice(sorted(TARGETS)) if targeted else None
        delay = rng.uniform(0.0, max_delay)
        killed_by = "delay"
        if target is None:
            time.sleep(delay)
        else:
            # Let at least one save run, then kill as soon as the target phase is seen on disk.
            time.sleep(delay / 2)
            deadline = time.monotonic() + max(5.0, 4 * max_delay)
            while time.monotonic() < deadline and proc.is_alive():
                if TARGETS[target](directory):
                    killed_by = f"target:{target}"
                    break
                time.sleep(0.0005)
        messages = _drain(parent)
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        t_kill = time.monotonic() - t_ready
        proc.join(30)
        messages += _drain(parent)
        parent.close()
        for kind, value in messages:
            if kind == "error":
                failures.append((trial, f"trial {trial}: child raised while training:\n{value}"))
        saved = [v for k, v in messages if k == "saved"]
        if len(saved) >= 2 and t_kill > 0:
            step_times.append(t_kill / len(saved))
        phase = classify(directory)
        phases[phase] += 1
        return {"report": report, "phase": phase, "kill_after_s": round(t_kill, 4),
                "killed_by": killed_by, "saves_called": len(saved),
                "last_saved_call": saved[-1] if saved else None}

    t_start = time.monotonic()
    for trial in range(trials):
        r = one(True, trial)
        if r is None:
            continue
        results.append(r)
        if verbose:
            rep = r["report"]
            print(f"trial {trial:3d}: restored step {rep['restored_step']!s:>5} "
                  f"(cleaned {len(rep['leftovers_before_open'])} leftovers, verify {rep['verify_s']:.2f} s) | killed after "
                  f"{r['kill_after_s']:.3f} s ({r['killed_by']}, {r['saves_called']} save() calls) "
                  f"in: {r['phase']}", flush=True)
    final = one(False, trials)
    elapsed = time.monotonic() - t_start
    # A trial succeeds when it trained and saved without error until killed and the
    # next process found everything it checks correct.
    bad_trials = {t for t, _ in failures}
    verified = len(results) if final else len(results) - 1
    successes = sum(1 for t in range(trials) if t not in bad_trials) if final else 0
    summary = {
        "trials": trials,
        "successes": successes,
        "failures": [f for _, f in failures],
        "phases": dict(phases.most_common()),
        "killed_by": dict(collections.Counter(r["killed_by"].split(":")[0] for r in results)),
        "final_steps": final["report"]["steps"] if final else None,
        "referring_steps_seen": sum(len(r["report"].get("referring_steps", [])) for r in results)
        + (len(final["report"].get("referring_steps", [])) if final else 0),
        "leftovers_cleaned_total": sum(len(r["report"]["leftovers_before_open"]) for r in results)
        + (len(final["report"]["leftovers_before_open"]) if final else 0),
        "max_restored_step": max([r["report"]["restored_step"] or 0 for r in results] + [0]),
        "mean_step_s": round(sum(step_times) / len(step_times), 4) if step_times else None,
        "elapsed_s": round(elapsed, 1),
        "verified_trials": verified,
        "seed": seed,
    }
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--size", choices=sorted(SIZES), default="medium")
    p.add_argument("--dir", default=None, help="checkpoint directory (default: a fresh temp dir)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-delay", type=float, default=2.0, help="kill delays are uniform in [0, this] s")
    p.add_argument("--targeted-fraction", type=float, default=0.35,
                   help="fraction of kills aimed at a phase seen on disk")
    p.add_argument("--host-cache-bytes", type=int, default=1 << 20)
    p.add_argument("--incremental", choices=["off", "content", "version-counters", "version"], default="off",
                   help="incremental checkpoints, with the first layer frozen (its bytes are referred to)")
    p.add_argument("--full-every", type=int, default=0, help="with --incremental: every k-th save is full")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--keep", action="store_true", help="keep the directory")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    base = args.dir or tempfile.mkdtemp(prefix="lazyckpt-crash-")
    directory = os.path.join(base, "run") if args.dir is None else args.dir
    kwargs = dict(host_cache_bytes=args.host_cache_bytes,
                  io=lazyckpt.IO(max_pending_saves=2, lease_expiry=LEASE_EXPIRY_S),
                  incremental=(lazyckpt.Incremental(args.incremental, full_every=args.full_every)
                               if args.incremental != "off" else False))
    global FROZEN_FIRST_LAYER
    FROZEN_FIRST_LAYER = args.incremental != "off"
    print(f"stress_crash: {args.trials} trials, size {args.size} (hidden {SIZES[args.size]}), seed {seed}, "
          f"dir {directory}, host cache {args.host_cache_bytes} B, keep_last={KEEP_LAST}, "
          f"incremental={args.incremental} full_every={args.full_every}", flush=True)
    try:
        summary = run(args.trials, directory, SIZES[args.size], seed, args.max_delay,
                      args.targeted_fraction, kwargs, verbose=not args.quiet)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print(f"trials: {summary['trials']}   successes: {summary['successes']}   "
          f"failures: {len(summary['failures'])}   elapsed: {summary['elapsed_s']} s")
    print(f"final committed steps: {summary['final_steps']}   highest restored step: "
          f"{summary['max_restored_step']}   leftovers cleaned: {summary['leftovers_cleaned_total']}   "
          f"mean step: {summary['mean_step_s']} s")
    print(f"kills: {summary['killed_by']}")
    print("interrupted phase (inferred from leftovers after the kill):")
    for phase, n in summary["phases"].items():
        print(f"  {n:4d}  {phase}")
    for f in summary["failures"]:
        print("FAILURE:", f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if not summary["failures"] and summary["successes"] == summary["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
