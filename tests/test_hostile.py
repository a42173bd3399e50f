"""Corrupt and hostile checkpoint *directories* (tests/test_corruption.py covers
single files): missing, truncated, swapped or stale shard files in a
multi-rank step, manifests naming other format versions, manifests whose
world_size and file list disagree, hostile shard indexes, and bit flips
anywhere in manifest.json.

The property everywhere: loading returns exactly what was saved, or raises
CorruptCheckpointError / UnsupportedVersionError. Never another exception
type, never a huge allocation, never silently wrong values."""

from __future__ import annotations

import copy
import json
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import lazyckpt
from _dist import run_ranks
from lzc_tools import assert_same

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_KEY = '["sharded"]'


# --------------------------------------------------------------------------- fixtures


def _save_two_rank_checkpoints(rank, world, ddp_dir, fsdp_dir):
    """DDP-style: replicated model (its entries spread over both ranks' files),
    a rank-local tensor, two steps whose every tensor differs. FSDP-style: a
    DTensor sharded over the two ranks, with the manifest's shard index."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    refs = {}
    with lazyckpt.Checkpointer(ddp_dir, distributed=lazyckpt.Distributed(identical_keys=["model"])) as ckpt:
        for step in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(step)
            state = {"model": model.state_dict(), "mine": torch.full((3,), float(rank + 10 * step))}
            ckpt.save(state, step=step).wait(60)
            refs[step] = {"model": type(state["model"])((k, v.clone()) for k, v in state["model"].items()),
                          "mine": state["mine"].clone()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with lazyckpt.Checkpointer(fsdp_dir) as ckpt:
        ckpt.save({"sharded": distribute_tensor(full, mesh, [Shard(0)]), "n": 1}, step=1).wait(60)
    return refs


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    base = tmp_path_factory.mktemp("two_rank")
    refs = run_ranks(2, _save_two_rank_checkpoints, str(base / "ddp"), str(base / "fsdp"), timeout=180)[0]
    ddp1, ddp2 = base / "ddp" / "step_0000000001", base / "ddp" / "step_0000000002"
    fsdp = base / "fsdp" / "step_0000000001"
    manifest = json.loads((ddp2 / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and sum(n for _, n in manifest["file_bytes"]) == 2
    # Both ranks' files hold some of the replicated entries.
    for f in ("rank_00000.lzc", "rank_00001.lzc"):
        assert (ddp2 / f).stat().st_size > 4096
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    return {"ddp1": ddp1, "ddp2": ddp2, "fsdp": fsdp, "refs": refs,
            "fsdp_ref": {"sharded": full, "n": 1}}


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(step_dir, mutate=None, raw=None, reseal=True):
    """Apply ``mutate`` to the manifest; with ``reseal`` its checksum is
    recomputed, so that the loader's own checks of the mutated member are what
    is tested (a forged manifest, not a damaged one)."""
    path = step_dir / "manifest.json"
    if raw is None:
        doc = json.loads(path.read_text())
        mutate(doc)
        if reseal:
            doc.pop("checksum", None)
            doc["checksum"] = lazyckpt.formats.manifest.checksum(doc)
        raw = json.dumps(doc, indent=1).encode()
    path.write_bytes(raw)


def _explicit(step_dir):
    """Turn the placement-derived index into the explicit one (every piece
    listed, as manifests before issue 12 and non-world process groups have it)."""
    from lazyckpt.state.walk import dtensor_nodes
    from lazyckpt.formats.placement import pieces
    from lazyckpt.loading.reader import CheckpointFile
    from lazyckpt.storage.stores import LOCAL

    def convert(m):
        shards = {}
        for key, info in m.pop("layouts").items():
            shards[key] = {"global_shape": info["global_shape"], "dtype": info["dtype"], "pieces": [
                {"rank": p["rank"], "offsets": p["offsets"], "tensor": dtensor_nodes(CheckpointFile(
                    str(step_dir / f"rank_{p['rank']:05d}.lzc"), lazyckpt.Options(), store=LOCAL).footer.tree)[key]["local"]}
                for p in pieces(info["global_shape"], info["layout"])]}
        m["shards"] = shards
    _rewrite_manifest(step_dir, convert)


def _outcome(path, **kwargs):
    """('ok', value) or ('error', exception); anything not a CheckpointError fails the test."""
    try:
        return "ok", lazyckpt.load(str(path), **kwargs)
    except lazyckpt.CheckpointError as exc:
        return "error", exc
    except BaseException as exc:        # noqa: BLE001 - the point of the test
        pytest.fail(f"{type(exc).__name__} escaped instead of a CheckpointError: {exc}")


def _same(a, b) -> bool:
    try:
        assert_same(a, b)
        return True
    except AssertionError:
        return False


# --------------------------------------------------------------------------- shard files


def test_the_fixture_loads_bit_exactly(two_rank):
    assert_same(lazyckpt.load(str(two_rank["ddp2"])), two_rank["refs"][2])
    assert_same(lazyckpt.load(str(two_rank["ddp1"])), two_rank["refs"][1])
    assert_same(lazyckpt.load(str(two_rank["fsdp"])), two_rank["fsdp_ref"])


@pytest.mark.parametrize("which", ["ddp2", "fsdp"])
def test_missing_shard_file_is_corrupt(two_rank, tmp_path, which):
    """A committed step whose manifest lists a file that is gone is damaged.
    It must not look like 'no checkpoint here' (CheckpointNotFoundError is a
    FileNotFoundError: the usual `except FileNotFoundError: start fresh` would
    silently throw the run's progress away)."""
    step = _copy(two_rank[which], tmp_path)
    os.unlink(step / "rank_00001.lzc")
    kind, err = _outcome(step)
    assert kind == "error"
    assert "rank_00001.lzc" in str(err)
    assert isinstance(err, lazyckpt.CorruptCheckpointError), type(err).__name__
    assert not isinstance(err, FileNotFoundError)


def test_missing_shard_file_partial_load_of_local_keys(two_rank, tmp_path):
    """Keys whose bytes all live in the remaining file still load (only their bytes are read)."""
    step = _copy(two_rank["ddp2"], tmp_path)
    os.unlink(step / "rank_00001.lzc")
    kind, value = _outcome(step, keys=["mine"])
    assert kind == "ok" and torch.equal(value["mine"], two_rank["refs"][2]["mine"])


def test_shard_file_from_another_step_is_refused(two_rank, tmp_path):
    """rank_00001.lzc of step 1 copied into step 2 (a partial copy, a botched
    restore): the files have the same layout and size, but mixing them gives a
    state that never existed. Each data file records its step in its
    checksummed footer; the loader must not return the mix."""
    step = _copy(two_rank["ddp2"], tmp_path)
    shutil.copyfile(two_rank["ddp1"] / "rank_00001.lzc", step / "rank_00001.lzc")
    kind, value = _outcome(step)
    if kind == "ok":
        assert _same(value, two_rank["refs"][2]), "a state mixing step 1 and step 2 was returned"
    else:
        assert isinstance(value, lazyckpt.CorruptCheckpointError)


def test_truncated_or_swapped_shard_file(two_rank, tmp_path):
    step = _copy(two_rank["ddp2"], tmp_path)
    data = (step / "rank_00001.lzc").read_bytes()
    (step / "rank_00001.lzc").write_bytes(data[:len(data) - 100])
    kind, err = _outcome(step)
    assert kind == "error" and isinstance(err, lazyckpt.CorruptCheckpointError)
    step = _copy(two_rank["ddp2"], tmp_path)
    shutil.copyfile(step / "rank_00000.lzc", step / "rank_00001.lzc")      # rank 0's file twice
    kind, err = _outcome(step)
    assert kind == "error" and isinstance(err, lazyckpt.CorruptCheckpointError)
    step = _copy(two_rank["fsdp"], tmp_path)
    a, b = (step / "rank_00000.lzc").read_bytes(), (step / "rank_00001.lzc").read_bytes()
    (step / "rank_00000.lzc").write_bytes(b)
    (step / "rank_00001.lzc").write_bytes(a)
    kind, value = _outcome(step)
    assert kind == "error" or _same(value, two_rank["fsdp_ref"]), "swapped shards loaded as wrong values"


# --------------------------------------------------------------------------- manifest versions


@pytest.mark.parametrize("version", [0, 3, 2**31, -1, "1", 1.0, True, None, [1], "missing"])
def test_manifest_naming_another_format_version(two_rank, tmp_path, version):
    step = _copy(two_rank["ddp2"], tmp_path)
    _rewrite_manifest(step, lambda m: m.pop("format_version") if version == "missing"
                      else m.update(format_version=version))
    kind, err = _outcome(step)
    assert kind == "error" and isinstance(err, lazyckpt.UnsupportedVersionError), err
    assert err.supported == (1, 2) and "versions 1, 2" in str(err)
    # Through a Checkpointer, and for the latest step of the directory, too.
    with lazyckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == []          # 'copy' is not a step_ name
    run = tmp_path / "run"
    shutil.copytree(step, run / "step_0000000002")
    with lazyckpt.Checkpointer(run) as ckpt:
        with pytest.raises(lazyckpt.UnsupportedVersionError):
            ckpt.load()


# --------------------------------------------------------------------------- world_size / files


def _files(m):
    """The manifest's per-file list, as manifests before issue 12 had it (the
    writer now lists only run-length sizes, ``file_bytes``): old manifests
    still load, so their checks are tested on the old form."""
    if "files" not in m:
        m["files"] = [{"rank": r, "name": f"rank_{r:05d}.lzc", "bytes": size}
                      for r, size in enumerate(s for s, n in m.pop("file_bytes") for _ in range(n))]
    return m["files"]


INCONSISTENT = {
    "world_size-3": lambda m: m.update(world_size=3),
    "world_size-1": lambda m: m.update(world_size=1),
    "world_size-0": lambda m: m.update(world_size=0),
    "world_size-negative": lambda m: m.update(world_size=-2),
    "world_size-str": lambda m: m.update(world_size="2"),
    "world_size-float": lambda m: m.update(world_size=2.0),
    "world_size-bool": lambda m: m.update(world_size=True),
    "world_size-null": lambda m: m.update(world_size=None),
    "world_size-missing": lambda m: m.pop("world_size"),
    "file-dropped": lambda m: _files(m).pop(1),
    "file-duplicated": lambda m: _files(m).__setitem__(1, dict(_files(m)[0])),
    "file-rank-renamed": lambda m: _files(m)[1].update(rank=2, name="rank_00002.lzc"),
    "name-rank-mismatch": lambda m: _files(m)[1].update(name="rank_00000.lzc"),
    "rank-bool": lambda m: _files(m)[1].update(rank=True),
    "rank-str": lambda m: _files(m)[1].update(rank="1"),
    "rank-negative": lambda m: _files(m)[1].update(rank=-1, name="rank_-0001.lzc"),
    "name-traversal": lambda m: _files(m)[1].update(name="../step_0000000001/rank_00001.lzc"),
    "name-absolute": lambda m: _files(m)[1].update(name="/etc/passwd"),
    "name-trailing": lambda m: _files(m)[1].update(name="rank_00001.lzc/"),
    "name-missing": lambda m: _files(m)[1].pop("name"),
    "file-not-object": lambda m: _files(m).__setitem__(1, "rank_00001.lzc"),
    "files-empty": lambda m: _files(m) and m.update(files=[]),
    "files-object": lambda m: m.update(files={"0": _files(m)[0]}),
    "files-null": lambda m: _files(m) and m.update(files=None),
    "files-missing": lambda m: _files(m) and m.pop("files"),
    "file_bytes-missing": lambda m: m.pop("file_bytes"),
    "file_bytes-short": lambda m: m.update(file_bytes=[[m["file_bytes"][0][0], 1]]),
    "file_bytes-long": lambda m: m.update(file_bytes=m["file_bytes"] + [[4096, 1]]),
    "file_bytes-zero-count": lambda m: m.update(file_bytes=m["file_bytes"] + [[4096, 0]]),
    "file_bytes-negative": lambda m: m.update(file_bytes=[[-1, 2]]),
    "file_bytes-bool": lambda m: m.update(file_bytes=[[True, 2]]),
    "file_bytes-float": lambda m: m.update(file_bytes=[[4096.0, 2]]),
    "file_bytes-flat": lambda m: m.update(file_bytes=[4096, 2]),
    "file_bytes-object": lambda m: m.update(file_bytes={"4096": 2}),
    "file_bytes-wrong-size": lambda m: m.update(file_bytes=[[s + 4096, n] for s, n in m["file_bytes"]]),
    "extra-file": lambda m: _files(m).append({"rank": 2, "name": "rank_00002.lzc", "bytes": 1}),
}


@pytest.mark.parametrize("mutate", list(INCONSISTENT.values()), ids=list(INCONSISTENT))
def test_manifest_world_size_and_files_inconsistent(two_rank, tmp_path, mutate):
    step = _copy(two_rank["ddp2"], tmp_path)
    _rewrite_manifest(step, mutate)
    kind, err = _outcome(step)
    assert kind == "error", "an inconsistent manifest loaded"
    assert isinstance(err, lazyckpt.CorruptCheckpointError), f"{type(err).__name__}: {err}"


NOT_A_MANIFEST = {
    "empty": b"",
    "not-utf8": b"\xff\xfe{}",
    "array": b"[1, 2]",
    "string": b'"manifest"',
    "truncated": None,
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "nan-version": b'{"format_version": NaN, "world_size": 1, "files": []}',
}


@pytest.mark.parametrize("raw", list(NOT_A_MANIFEST.values()), ids=list(NOT_A_MANIFEST))
def test_manifest_that_is_not_a_manifest(two_rank, tmp_path, raw):
    step = _copy(two_rank["ddp2"], tmp_path)
    if raw is None:
        raw = (step / "manifest.json").read_bytes()[:-40]
    _rewrite_manifest(step, raw=raw)
    kind, err = _outcome(step)
    assert kind == "error"
    assert isinstance(err, (lazyckpt.CorruptCheckpointError, lazyckpt.UnsupportedVersionError)), err


def test_manifest_over_the_size_limit_is_refused(two_rank, tmp_path, monkeypatch):
    # The real limit is 1 GiB; a smaller one keeps the test light, same code path.
    import lazyckpt.formats.manifest
    monkeypatch.setattr(lazyckpt.formats.manifest, "MAX_MANIFEST_BYTES", 1 << 20)
    step = _copy(two_rank["ddp2"], tmp_path)
    doc = json.loads((step / "manifest.json").read_text())
    doc["padding"] = "x" * (2 << 20)
    _rewrite_manifest(step, raw=json.dumps(doc).encode())
    kind, err = _outcome(step)
    assert kind == "error" and isinstance(err, lazyckpt.CorruptCheckpointError)
    assert "larger than" in str(err)


_BOUNDED_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import lazyckpt
    def vm():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize"):
                return int(line.split()[1]) * 1024
    # Everything after this point may allocate at most 256 MiB more address space.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm() + (256 << 20), hard))
    out = []
    for path in sys.argv[1:]:
        t = time.monotonic()
        try:
            lazyckpt.load(path)
            out.append(["loaded", "", 0])
        except BaseException as exc:
            out.append([type(exc).__name__, str(exc)[:300], time.monotonic() - t])
    print(json.dumps(out))
""")


def _load_under_memory_limit(paths):
    """Load each path in a child whose address space may grow by 256 MiB only:
    an allocation sized by a claim in the file fails there instead of taking
    the machine's memory."""
    r = subprocess.run([sys.executable, "-c", _BOUNDED_CHILD, *map(str, paths)], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


WORLD_SIZE_CLAIMS = [10**9, 10**12, 2**63, 10**4000]
GLOBAL_SHAPE_CLAIMS = [[1 << 15, 1 << 13], [1 << 40, 1 << 40], [6, 1 << 28]]


@pytest.fixture(scope="module")
def huge_claims(two_rank, tmp_path_factory):
    """Checkpoints whose manifest claims huge sizes, all loaded in one child
    process under the memory limit: {name: (exception type, message, seconds)}."""
    base = tmp_path_factory.mktemp("claims")
    paths = {}
    for i, ws in enumerate(WORLD_SIZE_CLAIMS):
        step = _copy(two_rank["ddp2"], base, f"world_size-{i}")
        text = re.sub(r"\"world_size\":\s*2", f"\"world_size\": {ws}", (step / "manifest.json").read_text())
        (step / "manifest.json").write_text(text)
        paths[f"world_size-{i}"] = step
    for i, shape in enumerate(GLOBAL_SHAPE_CLAIMS):
        step = _copy(two_rank["fsdp"], base, f"global_shape-{i}")
        _rewrite_manifest(step, lambda m: m["layouts"][SHARD_KEY].update(global_shape=shape))
        paths[f"global_shape-{i}"] = step
        step = _copy(two_rank["fsdp"], base, f"explicit-global_shape-{i}")
        _explicit(step)
        _rewrite_manifest(step, lambda m: m["shards"][SHARD_KEY].update(global_shape=shape))
        paths[f"explicit-global_shape-{i}"] = step
        paths[f"global_shape-{i}"] = step
    return dict(zip(paths, _load_under_memory_limit(list(paths.values()))))


@pytest.mark.parametrize("i", range(len(WORLD_SIZE_CLAIMS)))
def test_manifest_claiming_a_huge_world_size(huge_claims, i):
    """world_size is a claim: checking it against the file list must not build
    anything of that size (a list of 10^9 ranks is tens of GB)."""
    kind, message, seconds = huge_claims[f"world_size-{i}"]
    assert kind == "CorruptCheckpointError", f"world_size claim #{i}: {kind}: {message}"
    assert seconds < 5


@pytest.mark.parametrize("i", range(len(GLOBAL_SHAPE_CLAIMS)))
def test_shard_index_claiming_a_huge_tensor_allocates_nothing(huge_claims, i):
    """The manifest's global_shape is a claim, not covered by any checksum: a
    tiny checkpoint must not make the loader allocate what it claims."""
    for name in (f"global_shape-{i}", f"explicit-global_shape-{i}"):
        kind, message, seconds = huge_claims[name]
        assert kind == "CorruptCheckpointError", f"{name} {GLOBAL_SHAPE_CLAIMS[i]}: {kind}: {message}"
        assert "allocate" not in message, f"the loader tried to allocate the claimed size: {message}"


def _piece(m, i):
    return m["shards"][SHARD_KEY]["pieces"][i]


SHARD_INDEX_MUTATIONS = {
    "duplicate-piece": lambda m: m["shards"][SHARD_KEY]["pieces"].__setitem__(1, copy.deepcopy(_piece(m, 0))),
    "piece-dropped": lambda m: m["shards"][SHARD_KEY]["pieces"].pop(1),
    "offsets-shifted": lambda m: _piece(m, 1).update(offsets=[2, 0]),
    "offsets-negative": lambda m: _piece(m, 1).update(offsets=[-3, 0]),
    "offsets-huge": lambda m: _piece(m, 1).update(offsets=[1 << 62, 0]),
    "stride-zero": lambda m: _piece(m, 1)["tensor"].update(stride=[0, 0]),
    "stride-transposed": lambda m: _piece(m, 1)["tensor"].update(stride=[1, 3]),
    "shape-larger": lambda m: _piece(m, 1)["tensor"].update(shape=[3000, 4]),
    "storage-offset": lambda m: _piece(m, 1)["tensor"].update(offset=4),
    "storage-offset-huge": lambda m: _piece(m, 1)["tensor"].update(offset=1 << 62),
    "dtype-changed": lambda m: _piece(m, 1)["tensor"].update(dtype="int32"),
    "dtype-unknown": lambda m: _piece(m, 1)["tensor"].update(dtype="object"),
    "entry-out-of-range": lambda m: _piece(m, 1)["tensor"].update(e=99),
    "rank-out-of-range": lambda m: _piece(m, 1).update(rank=5),
    "global-shape-smaller": lambda m: m["shards"][SHARD_KEY].update(global_shape=[3, 4]),
    "global-shape-negative": lambda m: m["shards"][SHARD_KEY].update(global_shape=[-6, 4]),
    "pieces-not-a-list": lambda m: m["shards"][SHARD_KEY].update(pieces="x"),
    "index-not-an-object": lambda m: m.update(shards=[]),
    "index-missing": lambda m: m.pop("shards"),
}


@pytest.mark.parametrize("mutate", list(SHARD_INDEX_MUTATIONS.values()), ids=list(SHARD_INDEX_MUTATIONS))
def test_hostile_shard_index(two_rank, tmp_path, mutate):
    """The shard index says which bytes of which file form which rows of a
    sharded tensor. A wrong index must be refused; it must never assemble a
    tensor with wrong, duplicated or uninitialized rows."""
    step = _copy(two_rank["fsdp"], tmp_path)
    _explicit(step)
    _rewrite_manifest(step, mutate)
    kind, value = _outcome(step)
    if kind == "ok":
        assert _same(value, two_rank["fsdp_ref"]), f"wrong tensor returned:\n{value['sharded']}"
    else:
        assert isinstance(value, lazyckpt.CorruptCheckpointError), f"{type(value).__name__}: {value}"


def _layout(m):
    return m["layouts"][SHARD_KEY]["layout"]


LAYOUT_MUTATIONS = {
    "placement-dim-out-of-range": lambda m: _layout(m).update(placements=[["S", 5]]),
    "placement-unknown": lambda m: _layout(m).update(placements=[["X"]]),
    "placement-replicate": lambda m: _layout(m).update(placements=[["R"]]),
    "placement-other-dim": lambda m: _layout(m).update(placements=[["S", 1]]),
    "strided-split-zero": lambda m: _layout(m).update(placements=[["SS", 0, 0]]),
    "placements-too-many": lambda m: _layout(m).update(placements=[["S", 0], ["S", 1]]),
    "mesh-larger-than-world": lambda m: _layout(m)["mesh"].update(shape=[3]),
    "mesh-start-out-of-range": lambda m: _layout(m)["mesh"].update(start=7),
    "mesh-stride-out-of-range": lambda m: _layout(m)["mesh"].update(strides=[5]),
    "mesh-ranks-swapped": lambda m: _layout(m).update(mesh={"shape": [2], "ranks": [1, 0]}),
    "mesh-ranks-out-of-range": lambda m: _layout(m).update(mesh={"shape": [2], "ranks": [0, 9]}),
    "mesh-not-an-object": lambda m: _layout(m).update(mesh=[2]),
    "layout-missing": lambda m: m["layouts"][SHARD_KEY].pop("layout"),
    "global-shape-smaller": lambda m: m["layouts"][SHARD_KEY].update(global_shape=[3, 4]),
    "global-shape-larger": lambda m: m["layouts"][SHARD_KEY].update(global_shape=[8, 4]),
    "dtype-changed": lambda m: m["layouts"][SHARD_KEY].update(dtype="int32"),
    "layouts-not-an-object": lambda m: m.update(layouts=[]),
    "layouts-missing": lambda m: m.pop("layouts"),
}


@pytest.mark.parametrize("mutate", list(LAYOUT_MUTATIONS.values()), ids=list(LAYOUT_MUTATIONS))
def test_hostile_layout(two_rank, tmp_path, mutate):
    """The placement-derived index: a forged layout must be refused or give
    the right tensor, never wrong, duplicated or uninitialized rows."""
    step = _copy(two_rank["fsdp"], tmp_path)
    _rewrite_manifest(step, mutate)
    kind, value = _outcome(step)
    if kind == "ok":
        assert _same(value, two_rank["fsdp_ref"]), f"wrong tensor returned:\n{value['sharded']}"
    else:
        assert isinstance(value, lazyckpt.CorruptCheckpointError), f"{type(value).__name__}: {value}"


# --------------------------------------------------------------------------- bit flips


def _flip_all(step_src, reference, tmp_path, positions=None, seed=0):
    """Flip one bit at every byte of manifest.json (the bit varies with the
    position); collect every outcome that is neither the reference value nor a
    Corrupt/UnsupportedVersion error."""
    step = _copy(step_src, tmp_path, "flip")
    original = (step / "manifest.json").read_bytes()
    rng = random.Random(seed)
    bad = []
    counts = {"ok": 0, "corrupt": 0, "version": 0}
    if positions is None:       # whitespace flips only ever break the JSON: skip most of them
        positions = [i for i, b in enumerate(original) if b not in b" \n" or i % 16 == 0]
    for pos in positions:
        bit = rng.randrange(8)
        mutated = bytearray(original)
        mutated[pos] ^= 1 << bit
        (step / "manifest.json").write_bytes(bytes(mutated))
        try:
            value = lazyckpt.load(str(step))
        except lazyckpt.UnsupportedVersionError:
            counts["version"] += 1
            continue
        except lazyckpt.CorruptCheckpointError:
            counts["corrupt"] += 1
            continue
        except BaseException as exc:           # noqa: BLE001
            bad.append(f"byte {pos} bit {bit}: {type(exc).__name__}: {exc}"[:300])
            continue
        if _same(value, reference):
            counts["ok"] += 1
        else:
            context = original[max(0, pos - 30):pos + 10].decode(errors="replace")
            bad.append(f"byte {pos} bit {bit}: loaded WRONG values (near {context!r})")
    return bad, counts


def test_manifest_bit_flips_multi_rank(two_rank, tmp_path):
    bad, counts = _flip_all(two_rank["ddp2"], two_rank["refs"][2], tmp_path)
    assert not bad, f"{len(bad)} flips misbehaved ({counts}):\n" + "\n".join(bad[:20])
    assert counts["corrupt"] > 0 and counts["version"] > 0


def test_manifest_bit_flips_sharded(two_rank, tmp_path):
    bad, counts = _flip_all(two_rank["fsdp"], two_rank["fsdp_ref"], tmp_path)
    assert not bad, f"{len(bad)} flips misbehaved ({counts}):\n" + "\n".join(bad[:20])
