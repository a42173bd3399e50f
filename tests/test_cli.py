"""The ``lazyckpt`` command line, run as a user would: in a subprocess
(``python -m lazyckpt.cli``) on real checkpoints made here."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import lazyckpt
from lazyckpt.loading.reader import CheckpointFile
from lazyckpt.storage.stores import LOCAL

EXPECTED_BENCH_ROWS = {"raw", "raw_buffered", "raw_mmap", "torch", "safetensors", "dcp1", "dcp2", "dcp_async",
                       "torchsnapshot", "torchsnapshot_async", "torch_checkpointing", "torch_checkpointing_async",
                       "deepspeed", "lazyckpt", "lazyckpt_async"}


def run_cli(*args, cwd=None, timeout=180) -> subprocess.CompletedProcess:
    return run_many([args], cwd=cwd, timeout=timeout)[0]


def run_many(commands, cwd=None, timeout=180):
    """Run independent CLI invocations concurrently (each pays for importing torch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYCKPT_")}
    env["PYTHONWARNINGS"] = "ignore"
    procs = [subprocess.Popen([sys.executable, "-m", "lazyckpt.cli", *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=cwd) for args in commands]
    results = []
    try:
        for args, p in zip(commands, procs):
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def make_state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 8, generator=g)
    return {"model": {"w": w, "b": torch.randn(8, generator=g).to(torch.bfloat16), "w_t": w.t()},
            "optim": {"state": {0: {"exp_avg": torch.randn(4, 8, generator=g), "step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
            "step": 7, "name": "run"}


def flat_tensors(state, prefix="") -> dict:
    out = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def assert_same_tensors(a, b) -> None:
    fa, fb = flat_tensors(a), flat_tensors(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name].dtype == fb[name].dtype, name
        assert fa[name].shape == fb[name].shape, name
        assert torch.equal(fa[name], fb[name]), name


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A single file and a Checkpointer directory (steps 10, 20, 30) with the same
    state, and a leftover of an interrupted save in the directory."""
    root = tmp_path_factory.mktemp("cli")
    state = make_state()
    lazyckpt.save(state, str(root / "state.lzc"))
    run = root / "run"
    with lazyckpt.Checkpointer(str(run)) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(state, step=step, metadata={"epoch": step // 10}).wait()
    leftover = run / ".tmp-step_0000000040-0123abcd4567"
    leftover.mkdir()
    (leftover / "rank_00000.lzc").write_bytes(b"\0" * 100)
    old = time.time() - 3600                # no lease held, no heartbeat for an hour: dead
    for p in (leftover / "rank_00000.lzc", leftover):
        os.utime(p, (old, old))
    return {"root": root, "file": root / "state.lzc", "run": run, "state": state,
            "leftover": leftover.name}


def copy_run(made, tmp_path, name="run") -> str:
    dst = tmp_path / name
    shutil.copytree(made["run"], dst)
    return str(dst)


def test_ls_lists_steps_and_leftovers(made):
    r, rj = run_many([("ls", made["run"]), ("ls", "--json", made["run"])])
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "3 committed steps" in out and "latest 30" in out
    for step in (10, 20, 30):
        assert any(line.split()[:1] == [str(step)] for line in out.splitlines()), out
    committed, _, leftovers = out.partition("leftovers")
    assert made["leftover"] not in committed
    assert made["leftover"] in leftovers and "interrupted save" in leftovers

    assert rj.returncode == 0, rj.stderr
    doc = json.loads(rj.stdout)
    assert [s["step"] for s in doc["steps"]] == [10, 20, 30]
    for s in doc["steps"]:
        assert s["world_size"] == 1 and s["files"] == 1 and s["bytes"] > 0
        assert isinstance(s["created_unix"], float) and s["metadata"]["epoch"] == s["step"] // 10
    assert [lo["name"] for lo in doc["leftovers"]] == [made["leftover"]]
    assert doc["leftovers"][0]["kind"] == "interrupted-save"


def test_inspect_text_and_json(made, tmp_path):
    # A Checkpointer directory resolves to its latest step; a shard index in the
    # manifest (as multi-rank saves of DTensors write it) is reported.
    run = copy_run(made, tmp_path)
    manifest_path = os.path.join(run, "step_0000000030", "manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    local = {"$": "tensor", "dtype": "float32", "shape": [4, 8], "stride": [8, 1], "offset": 0,
             "device": "cpu", "e": 0}
    manifest["shards"] = {json.dumps(["model", "w"]): {"global_shape": [8, 8], "dtype": "float32", "pieces": [
        {"rank": 0, "offsets": [0, 0], "tensor": local}, {"rank": 1, "offsets": [4, 0], "tensor": local}]}}
    from lazyckpt.formats.manifest import checksum as manifest_checksum
    manifest["checksum"] = manifest_checksum(manifest)     # a consistent edit, not damage
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    r, rj = run_many([("inspect", made["file"]), ("inspect", "--json", run)])
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines() if line.startswith("  ")}
    assert rows["model/w"][1:4] == ["tensor", "float32", "[4,"]
    assert rows["model/b"][1:3] == ["tensor", "bfloat16"]
    assert rows["step"][1] == "value" and "= 7" in " ".join(rows["step"])
    assert "format version 1" in r.stdout and "world size 1" in r.stdout

    assert rj.returncode == 0, rj.stderr
    doc = json.loads(rj.stdout)
    assert doc["kind"] == "directory" and doc["step"] == 30 and doc["committed_steps"] == [10, 20, 30]
    assert doc["format_version"] == 1 and doc["world_size"] == 1 and doc["metadata"]["epoch"] == 3
    (f,) = doc["files"]
    leaves = {leaf["path"]: leaf for leaf in f["leaves"]}
    assert leaves["model/w"] == {**leaves["model/w"], "type": "tensor", "dtype": "float32", "shape": [4, 8],
                                 "bytes": 128, "entry": 0}
    assert leaves["model/w_t"]["shape"] == [8, 4] and leaves["model/w_t"]["entry"] == 0   # a view: same storage
    assert leaves["optim/state/0/step"]["shape"] == [] and leaves["name"]["value"] == "'run'"
    assert f["entry_count"] == len(f["entries"]) == 4
    assert {e["name"] for e in f["entries"]} == {"model/w", "model/b", "optim/state/0/exp_avg",
                                                 "optim/state/0/step"}
    (shard,) = doc["shards"]
    assert shard["path"] == "model/w" and shard["global_shape"] == [8, 8]
    assert [(p["rank"], p["offsets"], p["shape"]) for p in shard["pieces"]] == [(0, [0, 0], [4, 8]),
                                                                            (1, [4, 0], [4, 8])]


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_verify_good_and_damaged(made, tmp_path):
    bad = tmp_path / "bad.lzc"
    shutil.copy(made["file"], bad)
    entries = {e.name: e for e in CheckpointFile(str(bad), lazyckpt.Options(), store=LOCAL).entries}
    _flip(bad, entries["optim/state/0/exp_avg"].offset + 37)     # inside the tensor's data
    _flip(bad, entries["model/b"].offset + 3)                    # a second damaged entry
    good, r = run_many([("verify", made["run"]), ("verify", bad)])
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith("OK")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DAMAGED" in r.stdout and "Traceback" not in r.stdout + r.stderr
    damaged = [line for line in r.stdout.splitlines() if "checksum mismatch" in line]
    assert len(damaged) == 2, r.stdout
    assert any("'optim/state/0/exp_avg'" in line for line in damaged)
    assert any("'model/b'" in line for line in damaged)
    assert "'model/w'" not in r.stdout


def test_convert_round_trips(made, tmp_path):
    state = made["state"]

    def convert(*commands):
        results = run_many([("convert", *c) for c in commands])
        for r in results:
            assert r.returncode == 0, r.stderr
        return results

    pt, st, lzc, st2, lzc2 = (tmp_path / n for n in ("a.pt", "b.safetensors", "c.lzc", "d.safetensors", "e.lzc"))
    convert((made["file"], pt),                                  # lazyckpt -> torch.save
            (made["run"], st2, "--batch-bytes", "4096"))          # lazyckpt dir -> safetensors, in batches
    assert_same_tensors(torch.load(pt, weights_only=True), state)
    assert torch.load(pt, weights_only=True)["step"] == 7         # whole state, not only tensors
    from safetensors.torch import load_file
    assert_same_tensors(load_file(st2), flat_tensors(state))

    r, _ = convert((pt, st),                                     # torch.save -> safetensors
                   (pt, lzc2))                                   # torch.save -> lazyckpt
    assert "skipped" in r.stderr and "param_groups" in r.stderr  # non-tensors reported
    assert_same_tensors(load_file(st), flat_tensors(state))

    convert((st, lzc))                                           # safetensors -> lazyckpt
    assert_same_tensors(lazyckpt.load(str(lzc)), flat_tensors(state))

    back = lazyckpt.load(str(lzc2))
    assert_same_tensors(back, state)
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"] and back["name"] == "run"


@pytest.mark.filterwarnings("ignore::UserWarning")      # DCP: "assuming ... a single process"
def test_convert_from_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp
    state = make_state()
    del state["model"]["w_t"]                  # DCP saves no overlapping views of one storage
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = run_cli("convert", tmp_path / "dcp", tmp_path / "from_dcp.lzc")
    assert r.returncode == 0, r.stderr
    back = lazyckpt.load(str(tmp_path / "from_dcp.lzc"))
    assert_same_tensors(back, state)
    assert back["step"] == 7 and back["name"] == "run"


def test_prune_keeps_newest_and_removes_leftovers(made, tmp_path):
    run = copy_run(made, tmp_path)
    os.makedirs(os.path.join(run, ".deleting-step_0000000005-0badf00d"))
    r = run_cli("prune", run, "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert "deleted step 10" in r.stdout and "deleted step 20" in r.stdout
    assert sorted(os.listdir(run)) == ["history.json", "latest", "step_0000000030"]
    assert lazyckpt.Checkpointer(run).steps() == [30]
    assert_same_tensors(lazyckpt.load(run), made["state"])


def test_errors_are_one_line(made, tmp_path):
    import argparse
    pickled = tmp_path / "pickled.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)}, pickled)
    r, rp = run_many([("inspect", tmp_path / "missing.lzc"), ("convert", pickled, tmp_path / "out.lzc")])
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [f"lazyckpt: error: {tmp_path / 'missing.lzc'}: no such file or "
                                             f"directory"]

    # torch.save files are loaded with weights_only=True unless --allow-pickle.
    assert rp.returncode == 2 and "Traceback" not in rp.stderr, rp.stderr
    (line,) = rp.stderr.strip().splitlines()
    assert line.startswith("lazyckpt: error: ") and "--allow-pickle" in line and "Namespace" in line
    assert not (tmp_path / "out.lzc").exists()


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


def test_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    extra = []
    if importlib.util.find_spec("matplotlib") is not None:      # the optional `plot` extra
        extra = ["--png", tmp_path / "bench.png", "--timeline", tmp_path / "timeline.png"]
    r = run_cli("bench", "--quick", "--json", out, *extra, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    rows = {row["key"]: row for row in doc["rows"]}
    assert set(rows) == EXPECTED_BENCH_ROWS
    for key, row in rows.items():
        assert row["status"] in ("ok", "skipped"), (key, row)
        if row["status"] == "skipped":
            assert row["reason"] and row["install"], row
            assert f"skipped: {row['method']}" in r.stdout
            continue
        assert row["method"] in r.stdout
        saves = key != "raw_mmap"                     # a read method: its file is written untimed
        for name in ("blocking_s", "durable_s", "load_s") if saves else ("load_s",):
            assert len(row[name]["values"]) == doc["config"]["reps"] == 2
        figures = [row["load_s"], row["load_gbps"], row["of_raw_read"], row["of_best_read"]]
        if saves:
            figures += [row["blocking_s"], row["durable_s"], row["save_gbps"], row["of_raw_write"],
                        row["of_best_write"]]
            assert row["blocking_s"]["median"] <= row["durable_s"]["median"] + 1e-9
        else:
            assert "durable_s" not in row and "save_gbps" not in row
        numbers = list(_numbers(figures))
        assert numbers and all(math.isfinite(x) and x > 0 for x in numbers), (key, figures)
    for key in ("raw", "raw_buffered", "raw_mmap", "torch", "dcp1", "dcp2", "dcp_async", "lazyckpt",
                "lazyckpt_async"):
        assert rows[key]["status"] == "ok", rows[key]
    assert rows["raw"]["of_raw_write"] == pytest.approx(1.0)
    # The ceiling is the best raw method of the run: one raw row is at 100%, none above.
    ceiling = doc["ceiling"]
    assert set(ceiling["write"]["methods"]) == {"O_DIRECT", "buffered"}
    assert set(ceiling["read"]["methods"]) == {"O_DIRECT", "buffered", "mmap"}
    for kind, field in (("write", "of_best_write"), ("read", "of_best_read")):
        raws = [rows[k][field] for k in ("raw", "raw_buffered", "raw_mmap") if field in rows[k]]
        assert max(raws) == pytest.approx(1.0) and ceiling[kind]["gbps"] > 0
    header = next(line for line in r.stdout.splitlines() if line.startswith("| method"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "method", "save call s", "durable s", "GB/s", "of best write", "load s", "load GB/s", "of best read"]
    assert "best raw write: " in r.stdout and "best raw read: " in r.stdout
    assert "lazyckpt.save (sync): save (durable)" in r.stdout and "fastest peer, load: " in r.stdout
    if extra:
        assert (tmp_path / "bench.png").stat().st_size > 0 and (tmp_path / "timeline.png").stat().st_size > 0
        tl = doc["timeline"]
        assert len(tl["iterations"]) == 12 and len(tl["checkpoints"]) == 3
        for c in tl["checkpoints"]:
            assert c["save_call"][0] <= c["capture"][1] <= c["durable_at"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".lazyckpt-")]   # cleaned up
