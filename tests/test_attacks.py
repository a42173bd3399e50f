"""Every hostile payload in attacks/ against the loader (threat model:
attacks/README.md).

For each case a generator makes, loading it (``lazyckpt.load`` or
``Checkpointer(dir).load(step=...)``) must end in the case's expected
CheckpointError subclass (or load, where the case says a value is
acceptable), within 10 s (SIGALRM), with a Python-heap peak under 4 MiB and
read buffers under 2 x the payload's size + 1 MiB, and the payload's marker
file (created only if code from the file ran) must not exist."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

import pytest

import lazyckpt
import lzc_fuzz as fz

pytestmark = pytest.mark.timeout(240)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTACKS = os.path.join(ROOT, "attacks")
MODULES = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ATTACKS, "[a-z]*.py")))


def _module(name):
    if ATTACKS not in sys.path:
        sys.path.insert(0, ATTACKS)
    spec = importlib.util.spec_from_file_location(f"attacks_{name}", os.path.join(ATTACKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _size(path) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if os.path.isfile(p):
                total += os.path.getsize(p)
    return total


def _load(case):
    kwargs = case.get("kwargs", {})
    if case.get("via") == "checkpointer":
        with lazyckpt.Checkpointer(case["path"]) as ckpt:
            return ckpt.load(step=case["step"], **kwargs)
    return lazyckpt.load(case["path"], **kwargs)


def run_case(case) -> str:
    """'' if the case ended safely, else why not."""
    heap = case.get("heap_budget", fz.HEAP_BUDGET)
    outcome, detail, error = fz.run_guarded(lambda: _load(case), max(_size(case["path"]), 4096), heap_budget=heap,
                                            time_limit=case.get("time_limit", fz.TIME_LIMIT_S))
    marker = case.get("marker")
    if marker and os.path.exists(marker):
        return f"CODE FROM THE FILE RAN (marker {marker} exists); outcome {outcome}: {detail}"
    expected = getattr(lazyckpt, case["expect"])
    if outcome == "ok":
        return "" if case.get("may_load") else f"loaded, expected {case['expect']}"
    if outcome == "library":
        if isinstance(error, expected):
            return ""
        return f"{type(error).__name__} instead of {case['expect']}: {detail}"
    return f"{outcome}: {detail}"


def test_every_attack_module_is_listed_in_the_readme():
    readme = open(os.path.join(ATTACKS, "README.md")).read()
    assert MODULES, "no attack generators found"
    for name in MODULES:
        assert f"{name}.py" in readme, f"attacks/{name}.py is not described in attacks/README.md"


@pytest.mark.parametrize("name", MODULES)
def test_attack(name, tmp_path):
    cases = _module(name).make(str(tmp_path))
    assert cases, f"{name} made no payload"
    failures = []
    for case in cases:
        why = run_case(case)
        if why:
            failures.append(f"{case['name']}: {why}")
    assert not failures, f"{len(failures)} of {len(cases)} payloads of attacks/{name}.py not handled safely:\n" \
        + "\n".join(failures)


def test_opting_in_to_pickle_does_run_the_payload(tmp_path):
    """The guard is real: the same payload with allow_pickle=True runs (so the
    marker check above would notice a loader that unpickles)."""
    cases = [c for c in _module("pickle_os_system").make(str(tmp_path)) if c["name"] == "pickle Exec"]
    lazyckpt.load(cases[0]["path"], allow_pickle=True)
    assert os.path.exists(cases[0]["marker"])
