"""The storage interface (lazyckpt/storage/base.py) is what a new store is
written from: every implementation must provide every member it declares,
with a signature that accepts every call the interface allows, and one place
(storage.stores.for_path) decides which store a path belongs to."""

import inspect
import os
import pytest

from _env import child_env
from lazyckpt.storage import base, fileio, iomode, layout, locks, s3, s3layout, s3leases, stores
from lazyckpt.storage.localstore import LocalStore
from lazyckpt.storage.s3 import InvalidURLError
from lazyckpt.storage.s3store import S3Store

#: interface -> its implementation on each store (local, S3).
IMPLEMENTATIONS = [
    (base.Output, fileio.OutputFile), (base.Output, iomode.AdaptiveOutputFile), (base.Output, s3.ObjectOutput),
    (base.Input, fileio.InputFile), (base.Input, iomode.AdaptiveInputFile), (base.Input, s3.ObjectInput),
    (base.Lease, locks.Lease), (base.Lease, s3leases.ObjectLease),
    (base.WriterLease, locks.WriterLease), (base.WriterLease, s3leases.ObjectWriterLease),
    (base.Directory, layout.CheckpointDir), (base.Directory, s3layout.ObjectCheckpointDir),
    (base.PendingFile, layout.PendingSiblingFile), (base.PendingFile, s3layout.PendingObject),
    (base.PendingStep, layout.PendingStepDir), (base.PendingStep, s3layout.PendingSavePrefix),
    (base.HeldStep, locks._Held), (base.HeldStep, s3leases._HeldObjectStep),
    (base.Store, LocalStore), (base.Store, S3Store),
]


def _members(interface):
    """Methods and attributes the interface declares itself."""
    names = {n for n in vars(interface) if not n.startswith("_")} | set(getattr(interface, "__annotations__", {}))
    return sorted(names)


def _attributes_of(cls):
    """Attributes an instance gets in ``__init__`` (self.X = ...) or the class declares."""
    source = inspect.getsource(cls)
    found = set(vars(cls))
    for line in source.splitlines():
        line = line.strip()
        for part in line.split("=")[0].split(","):
            part = part.strip().split(":")[0]
            if part.startswith("self.") and part[5:].isidentifier():
                found.add(part[5:])
    return found


def _compatible(declared: inspect.Signature, actual: inspect.Signature) -> str:
    """'' if every call ``declared`` allows is accepted by ``actual``, else why not."""
    params = list(actual.parameters.values())
    for i, p in enumerate(declared.parameters.values()):
        if p.name == "self":
            continue
        match = [q for q in params if q.name == p.name]
        if not match:
            return f"no parameter {p.name!r}"
        q = match[0]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and params.index(q) != i:
            return f"parameter {p.name!r} at position {params.index(q)}, declared at {i}"
        if p.default is not p.empty and q.default is p.empty:
            return f"parameter {p.name!r} has no default"
    extra = [q.name for q in params if q.name not in declared.parameters
             and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return f"required parameters {extra} the interface does not pass" if extra else ""


@pytest.mark.parametrize("interface,impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_implementation_provides_the_interface(interface, impl):
    have = _attributes_of(impl) | set(dir(impl))
    for name in _members(interface):
        assert name in have, f"{impl.__name__} lacks {interface.__name__}.{name}"
        declared = vars(interface).get(name)
        if inspect.isfunction(declared):
            actual = getattr(impl, name)
            assert callable(actual), f"{impl.__name__}.{name} is not a method"
            why = _compatible(inspect.signature(declared), inspect.signature(actual))
            assert not why, f"{impl.__name__}.{name}: {why}"


def test_stores_subclass_the_abc_and_are_complete():
    for cls in (LocalStore, S3Store):
        assert issubclass(cls, base.Store) and not inspect.isabstract(cls)


def test_a_store_missing_a_method_cannot_be_made():
    class Half(base.Store):
        def normalize(self, path):
            return path
    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_one_place_decides_which_store_a_path_belongs_to(tmp_path):
    assert isinstance(stores.for_path(str(tmp_path)), LocalStore)
    assert isinstance(stores.for_path(tmp_path), LocalStore)              # os.PathLike
    assert isinstance(stores.for_path("relative/dir"), LocalStore)
    assert isinstance(stores.for_path("s3://bucket/run"), S3Store)
    assert stores.for_path("s3://bucket/run").is_remote and not stores.for_path("x").is_remote
    for bad in ("gs://b/x", "S3://bucket/x", "s3:/bucket", "s3://b"):
        with pytest.raises(InvalidURLError):
            stores.for_path(bad)
    assert stores.join("s3://bucket/run", "step_0000000001", "m") == "s3://bucket/run/step_0000000001/m"
    assert stores.join(str(tmp_path), "a") == str(tmp_path / "a")


def test_a_new_store_is_one_registration():
    from lazyckpt.storage import base

    class Fake(S3Store):
        name, scheme = "fake", "fake://"

        def claims(self, path):
            return path.startswith(self.scheme)
    saved = list(base.URL_STORES)
    try:
        fake = base.register_store(Fake())
        assert stores.for_path("fake://x/y") is fake
        with pytest.raises(InvalidURLError, match=r"only s3:// or mem:// or fake:// URLs"):
            stores.for_path("gs://b/x")
    finally:
        base.URL_STORES[:] = saved
    with pytest.raises(InvalidURLError, match=r"only s3:// or mem:// URLs"):
        stores.for_path("fake://x/y")


def test_no_module_outside_storage_decides_by_a_path_s_spelling():
    """``for_path`` is the one place: no ``is_url`` helper, no ``startswith("s3://")``.
    The one exception is pure naming in formats/ (below storage/, so it cannot ask
    a store): ``manifest.step_named_by`` knows that an object store's step has a
    save-id level. Integrations translate their framework's own path conventions
    (Lightning's fsspec ``file://``) before a path reaches lazyckpt."""
    import ast
    import os
    import lazyckpt
    root = os.path.dirname(lazyckpt.__file__)
    allowed = {os.path.join("formats", "manifest.py"), os.path.join("integrations", "lightning.py")}
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "storage")]
        for name in files:
            rel = os.path.relpath(os.path.join(top, name), root)
            if not name.endswith(".py") or rel in allowed:
                continue
            with open(os.path.join(top, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id == "is_url":
                    found.append(f"{rel}:{node.lineno}: is_url")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "startswith" and any(
                            isinstance(a, ast.Constant) and isinstance(a.value, str) and "://" in a.value
                            for a in node.args):
                    found.append(f"{rel}:{node.lineno}: startswith(URL scheme)")
    assert not found, "decide through lazyckpt.storage.stores.for_path: " + "; ".join(found)


#: Modules outside storage/ that still import an S3 module directly: only the knobs'
#: ``storage_options`` check (the options of the one remote store there is, validated
#: when the options are resolved). Shrink this list; never grow it.
_S3_IMPORTERS = {"knobs.py"}


def test_nothing_outside_storage_reaches_object_stores_but_through_the_interface():
    """A new store is one module: nothing outside storage/ imports the S3 modules
    (the save side, the tiers, the read side, the CLI and the study tools ask
    ``for_path(p)`` and its ``Store``/``Directory``), except those listed above."""
    import ast
    import lazyckpt
    root = os.path.dirname(lazyckpt.__file__)
    s3_modules = {"lazyckpt.storage.s3", "lazyckpt.storage.s3layout", "lazyckpt.storage.s3store"}
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "storage")]
        for name in files:
            rel = os.path.relpath(os.path.join(top, name), root)
            if not name.endswith(".py") or rel in _S3_IMPORTERS:
                continue
            with open(os.path.join(top, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                names = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                if any(n in s3_modules for n in names):
                    found.append(f"{rel}:{node.lineno}")
    assert not found, "reach object stores through storage.stores.for_path: " + "; ".join(found)


def test_local_store_locates_and_holds_steps(tmp_path, monkeypatch):
    """The one resolver on the local file system: a file, a step, a directory
    (its latest step), an empty directory (refused unless empty_ok)."""
    import lazyckpt
    from lazyckpt.errors import CheckpointNotFoundError
    from lazyckpt.knobs import resolve as resolve_options
    options = resolve_options()
    store = stores.for_path(str(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint in this directory"):
        store.locate(str(tmp_path), options)
    assert store.locate(str(tmp_path), options, empty_ok=True).kind == "directory"
    with lazyckpt.Checkpointer(str(tmp_path)) as ckpt:
        for step in (1, 2):
            ckpt.save({"x": step}, step=step).wait()
    located = store.locate(str(tmp_path), options, all_steps=True)
    assert (located.kind, located.steps, located.step) == ("directory", [1, 2], 2)
    step_path = located.step_path
    # Without all_steps the latest step comes from the index, the directory unlisted.
    listed = []
    for name in ("listdir", "scandir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda p=".", real=real: listed.append(p) or real(p))
    latest = store.locate(str(tmp_path), options)
    monkeypatch.undo()
    assert (latest.kind, latest.step, latest.step_path, latest.steps, listed) == ("directory", 2, step_path, [], [])
    assert store.locate(step_path, options).kind == "step"
    directory = store.checkpoint_dir(str(tmp_path), options)
    assert directory.step_paths() == {1: directory.step_path(1), 2: step_path}
    assert [r.step for r in directory.step_records()] == [1, 2]
    # The line of history's inputs, as an object-store directory gives them: save ids
    # from the manifests, the events from the local record (the Checkpointer's commits).
    committed, events = directory.listing()
    manifests = {s: store.read_manifest(directory.step_path(s), options) for s in (1, 2)}
    assert committed == {s: m["save_id"] for s, m in manifests.items()}
    assert {(e.step, e.save_id, e.seq) for e in events} >= {(s, m["save_id"], m["seq"]) for s, m in manifests.items()}
    assert directory.save_path(2, committed[2]) == step_path
    with store.reading_step(step_path, options) as held:
        assert isinstance(held, base.HeldStep) and held.step == 2 and held.still_there()
        assert held.read_manifest()["step"] == 2 == store.read_manifest(step_path, options)["step"]
        assert held.directory == os.path.realpath(str(tmp_path))
        assert directory.retire_old(1) == ([1], [])                  # not the one being read


def test_a_temporary_of_a_killed_process_is_cleaned_at_once_and_a_live_one_is_kept(tmp_path):
    """Issue 35 (2): a sibling temporary names its holder (random-pid-host); cleanup
    removes it at once when that process of this host is gone and holds no lock,
    and keeps the temporaries of live holders, of other hosts, and of old names
    until their lease expires."""
    import signal
    import subprocess
    import sys
    from lazyckpt.storage import locks, sidefiles
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    child = ("import os, signal, sys\n"
             "from lazyckpt.storage.sidefiles import file_lease, sibling_temp\n"
             "tmp = sibling_temp(sys.argv[1]); lease = file_lease(tmp, 1.0)\n"
             "print(tmp, flush=True); os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", child, str(tmp_path / "a.ckpt")], capture_output=True, text=True,
                          env=child_env(PYTHONPATH=src), timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    dead = proc.stdout.strip()
    mine = sidefiles.sibling_temp(str(tmp_path / "b.ckpt"))
    held = locks.Lease(mine, 1.0)
    dead_pid = dead.rsplit("-", 2)[1]                           # the same dead pid, on another host
    other_host = str(tmp_path / f".c.ckpt.tmp-{locks.new_token()}-{dead_pid}-{'0' * 8}")
    old_style = str(tmp_path / f".d.ckpt.tmp-{locks.new_token()}")
    for path in (other_host, old_style):
        open(path, "wb").close()
    try:
        assert os.path.exists(dead)
        removed = sidefiles.clean_sibling_temps(str(tmp_path), expiry_s=3600)
        assert removed == [os.path.basename(dead)]
        assert all(os.path.exists(p) for p in (mine, other_host, old_style))
    finally:
        held.release()
