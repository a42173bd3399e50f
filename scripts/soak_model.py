#!/usr/bin/env python
"""Soak run of the model-based test (issue 22; tests/_model.py).

Runs seeded random programs over the configuration matrix (every accepted
configuration, or those named by --config) until --minutes have passed, with
the invariants checked after every rule. A failure is shrunk (rules removed
one at a time while the same invariant still fails) and printed with its seed,
configuration and minimal program; the run goes on with the next
configuration. Two-rank configurations run in gloo processes
(tests/_dist.py); persist_to configurations start a SeaweedFS server, reached
through the fault-injecting proxy of tests/_s3proxy.py. With --faults the
one-rank persist_to programs also draw the fault rules (fail_next, outage,
heal; tests/_model.py FAULT_WEIGHTS) and end with a heal (the store must catch
up). Each program's keep/full_every are drawn from its seed (run_knobs).

    .venv/bin/python scripts/soak_model.py --minutes 30 --seed 7
    .venv/bin/python scripts/soak_model.py --minutes 30 --seed 7 --faults
    .venv/bin/python scripts/soak_model.py --config incTrue-local-rep0-unset-1r --seed 123 --length 40 --once
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import re
import signal
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from _model import (Config, Faults, InvariantError, all_configs, expected_refusal, random_program,  # noqa: E402
                    run_knobs, run_program)


def parse_knobs(text: str) -> dict:
    """``--knobs`` as printed: a dict literal whose ``keep`` may be a retention
    policy's repr (``KeepLast(1) | KeepEvery(3)``); nothing else is evaluated."""
    from lazyckpt import retention
    names = {n: getattr(retention, n) for n in ("KeepLast", "KeepEvery", "KeepBest", "AnyOf")}
    return eval(compile(text, "--knobs", "eval"), {"__builtins__": {}}, names)


def _rank_program(rank, world, cfg, base, url, program, knobs):
    logging.getLogger("lazyckpt").setLevel(logging.CRITICAL)
    try:
        run_program(cfg, base, url, program, rank, world, knobs=knobs)
        return None
    except InvariantError as exc:
        return str(exc)


#: The proxy's Faults (set by main when a persist_to configuration runs).
FAULTS = None


def run_once(cfg: Config, program, persist_url, knobs=None):
    """None, or the failure's message."""
    url = f"{persist_url}/{uuid.uuid4().hex[:12]}" if cfg.persist else None
    if FAULTS is not None:
        FAULTS.clear()
    with tempfile.TemporaryDirectory(prefix="soak-") as base:
        if cfg.ranks == 1:
            try:
                run_program(cfg, base, url, program, knobs=knobs, faults=FAULTS if cfg.persist else None)
                return None
            except InvariantError as exc:
                return str(exc)
        from _dist import run_ranks
        try:
            results = run_ranks(cfg.ranks, _rank_program, cfg, base, url, program, knobs, timeout=600)
        except (RuntimeError, TimeoutError) as exc:
            return f"a rank failed outside the invariants: {exc}"
        finally:
            if FAULTS is not None:
                FAULTS.clear()
        failed = [r for r in results if r]
        return "; ".join(failed) if failed else None


def signature(message: str) -> str:
    """What the failure is, without the numbers and the program: a shrink keeps it."""
    core = message.split(": ", 3)[-1] if "program" in message else message
    core = re.sub(r"\[\(.*?\)\]", "", core)
    return re.sub(r"\d+", "N", core)[:160]


def shrink(cfg: Config, program, persist_url, message, deadline, knobs=None):
    """Greedy: drop one rule at a time (and cut at the failing rule) while the same failure remains."""
    m = re.search(r"rule (\d+) ", message)
    if m:
        program = program[:int(m.group(1)) + 1]
    want = signature(message)
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i in range(len(program) - 1, -1, -1):
            candidate = program[:i] + program[i + 1:]
            got = run_once(cfg, candidate, persist_url, knobs)
            if got is not None and signature(got) == want:
                program, message, changed = candidate, got, True
                m = re.search(r"rule (\d+) ", got)
                if m:
                    program = program[:int(m.group(1)) + 1]
                break
            if time.monotonic() > deadline:
                break
    return program, message


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget (default 10)")
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: random, printed)")
    ap.add_argument("--config", action="append", default=[],
                    help="a configuration id, e.g. incTrue-local-rep0-unset-1r (repeatable; default: all)")
    ap.add_argument("--length", type=int, default=30, help="rules per program (default 30)")
    ap.add_argument("--once", action="store_true", help="run one program per configuration and stop")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--faults", action="store_true",
                    help="one-rank persist_to programs also draw the store's faults (fail_next, outage, heal)")
    ap.add_argument("--knobs", default=None,
                    help="replay with these knobs (a dict, as printed) instead of the program seed's draw")
    ap.add_argument("--program", default=None,
                    help="replay this program (a list of (rule, arg), as printed) instead of random ones")
    args = ap.parse_args()
    logging.getLogger("lazyckpt").setLevel(logging.CRITICAL)
    import random
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    configs = [Config.parse(c) for c in args.config] or [c for c in all_configs() if not expected_refusal(c)]
    print(f"soak_model: seed={seed} minutes={args.minutes} length={args.length} configs={len(configs)}", flush=True)
    # A SIGTERM (timeout, CI) still stops the SeaweedFS server started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    persist_url, server, proxy = None, None, None
    global FAULTS
    if any(c.persist for c in configs):
        from _s3proxy import S3FaultProxy
        from _s3server import SeaweedServer
        server = SeaweedServer(tempfile.mkdtemp(prefix="soak-seaweed-"))
        server.start()
        os.environ.update(server.env())
        persist_url = f"s3://{server.make_bucket()}/soak"
        proxy = S3FaultProxy(server.endpoint)
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint     # every Checkpointer (and child) goes through it
        FAULTS = Faults(proxy, server.endpoint)
    rng = random.Random(seed)
    deadline = time.monotonic() + args.minutes * 60
    runs, failures = 0, []
    broken = set()
    try:
        while time.monotonic() < deadline:
            for cfg in configs:
                if cfg in broken or time.monotonic() >= deadline:
                    continue
                program_seed = rng.randrange(1 << 30)
                program = random_program(program_seed, args.length, cfg, faults=args.faults) \
                    if args.program is None else ast.literal_eval(args.program)
                knobs = run_knobs(program_seed, cfg) if args.knobs is None else parse_knobs(args.knobs)
                t0 = time.monotonic()
                message = run_once(cfg, program, persist_url, knobs)
                runs += 1
                status = "ok" if message is None else "FAIL"
                print(f"{cfg.id} program-seed={program_seed} knobs={knobs} {status} "
                      f"{time.monotonic() - t0:.1f}s", flush=True)
                if message is None:
                    continue
                broken.add(cfg)     # one report per configuration; the others go on
                print(f"  failed: {message[-1500:]}", flush=True)
                minimal = program
                if not args.no_shrink:
                    minimal, message = shrink(cfg, program, persist_url, message,
                                              min(deadline, time.monotonic() + 600), knobs)
                failures.append((cfg, program_seed, minimal, message))
                print(f"  FAILURE {cfg.id} program-seed={program_seed} knobs={knobs}\n  minimal program ({len(minimal)} "
                      f"rules): {minimal}\n  {message[-1200:]}", flush=True)
            if args.once or args.program is not None:
                break
    finally:
        if proxy is not None:
            proxy.close()
        if server is not None:
            server.stop()
    print(f"soak_model: seed={seed}: {runs} programs of {args.length} rules, {len(failures)} failing "
          f"configuration(s)")
    for cfg, program_seed, minimal, message in failures:
        print(f"  {cfg.id} program-seed={program_seed}: {minimal}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
