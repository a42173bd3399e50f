"""The ``lazyckpt`` command line on an object store (``s3://`` URLs): ls,
inspect, verify and prune, run in-process against a real S3 server
(SeaweedFS, tests/_s3server.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch

import lazyckpt
import lazyckpt.cli

STEPS = (10, 20, 30)


def make_state(step: int = 0) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 256, generator=g), "b": torch.randn(256, generator=g)},
            "step": step}


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    for k in ("LAZYCKPT_LEASE_EXPIRY_S", "LAZYCKPT_STORAGE_OPTIONS"):
        monkeypatch.delenv(k, raising=False)
    return s3_server


@pytest.fixture
def run(s3_env, s3_bucket):
    """A Checkpointer directory on the object store with steps 10, 20, 30."""
    url = f"s3://{s3_bucket}/run"
    with lazyckpt.Checkpointer(url, keep=None) as ckpt:
        for step in STEPS:
            ckpt.save(make_state(step), step=step, metadata={"epoch": step // 10}).wait()
    return url


def cli(capsys, *args):
    """(exit status, stdout, stderr) of ``lazyckpt ARGS`` run in this process."""
    capsys.readouterr()
    code = lazyckpt.cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def committed_key(client, bucket, step):
    """The key of step ``step``'s rank-0 object (its save id is random)."""
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"run/step_{step:010d}/")["Contents"]]
    (key,) = [k for k in keys if k.endswith("/rank_00000.lzc")]
    return key


def test_ls_lists_steps_and_leftovers(run, s3_bucket, s3_server, capsys, monkeypatch):
    code, out, err = cli(capsys, "ls", run)
    assert code == 0, err
    assert "3 committed steps" in out and "latest 30" in out
    for step in STEPS:
        assert any(line.split()[:1] == [str(step)] for line in out.splitlines()), out
    assert "leftovers" not in out

    code, out, err = cli(capsys, "ls", "--json", run)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["directory"] == run and doc["latest"] == 30 and doc["latest_file"] == 30
    assert [s["step"] for s in doc["steps"]] == list(STEPS)
    client = s3_server.client()
    for s in doc["steps"]:
        assert s["world_size"] == 1 and s["files"] == 1 and s["metadata"]["epoch"] == s["step"] // 10
        assert s["name"].startswith(f"step_{s['step']:010d}/") and s["url"] == f"{run}/{s['name']}"
        objects = client.list_objects_v2(Bucket=s3_bucket, Prefix=f"run/{s['name']}/")["Contents"]
        assert s["bytes"] == sum(o["Size"] for o in objects) > 64 * 256 * 4
        manifest = client.head_object(Bucket=s3_bucket, Key=f"run/{s['name']}/manifest.json")
        assert s["mtime"] == manifest["LastModified"].timestamp()
    assert doc["bytes"] == sum(s["bytes"] for s in doc["steps"]) and doc["leftovers"] == []

    # A save prefix without a manifest: never a committed step; a leftover once
    # older than the lease expiry (young, it may be a save in progress).
    client.put_object(Bucket=s3_bucket, Key="run/step_0000000009/deadbeef/rank_00000.lzc", Body=b"\0" * 100)
    code, out, err = cli(capsys, "ls", "--json", run)
    assert code == 0, err
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == list(STEPS) and doc["leftovers"] == []

    time.sleep(1.2)           # LastModified has a resolution of one second
    monkeypatch.setenv("LAZYCKPT_LEASE_EXPIRY_S", "0.001")
    code, out, err = cli(capsys, "ls", run)
    assert code == 0, err
    assert "3 committed steps" in out
    committed, _, leftovers = out.partition("leftovers")
    assert "deadbeef" not in committed and not any(line.split()[:1] == ["9"] for line in committed.splitlines())
    assert "step_0000000009/deadbeef" in leftovers and "interrupted save" in leftovers
    code, out, err = cli(capsys, "ls", "--json", run)
    (lo,) = json.loads(out)["leftovers"]
    assert lo["name"] == "step_0000000009/deadbeef" and lo["step"] == 9 and lo["bytes"] == 100
    assert lo["kind"] == "interrupted-save"

    # Errors as for local paths: one line, exit status 2.
    for args in (("ls", f"s3://{s3_bucket}/no-such-run"), ("ls", f"{run}/{doc['steps'][0]['name']}"),
                 ("ls", f"{run}/step_0000000010")):
        code, out, err = cli(capsys, *args)
        assert code == 2 and err.startswith("lazyckpt: error: ") and "Traceback" not in err, (args, err)


def test_inspect_object_and_directory(s3_env, s3_bucket, run, capsys):
    file_url = f"s3://{s3_bucket}/state.lzc"
    lazyckpt.save(make_state(7), file_url)
    code, out, err = cli(capsys, "inspect", file_url)
    assert code == 0, err
    assert f"{file_url} (checkpoint file)" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["model/w"][1:4] == ["tensor", "float32", "[64,"]
    assert rows["step"][1] == "value" and "= 7" in " ".join(rows["step"])

    code, out, err = cli(capsys, "inspect", "--json", run)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == "directory" and doc["step"] == 30 and doc["committed_steps"] == list(STEPS)
    assert doc["step_dir"].startswith(f"{run}/step_0000000030/") and doc["metadata"]["epoch"] == 3
    (f,) = doc["files"]
    assert f["path"] == f"{doc['step_dir']}/rank_00000.lzc" and f["rank"] == 0 and "size_mismatch" not in f
    leaves = {leaf["path"]: leaf for leaf in f["leaves"]}
    assert leaves["model/w"]["shape"] == [64, 256] and leaves["model/b"]["bytes"] == 256 * 4

    # A committed save prefix, given with or without its save id.
    for url in (doc["step_dir"], f"{run}/step_0000000020"):
        code, out, err = cli(capsys, "inspect", "--json", url)
        assert code == 0, err
        step_doc = json.loads(out)
        assert step_doc["kind"] == "step" and step_doc["step"] == (30 if url == doc["step_dir"] else 20)

    code, out, err = cli(capsys, "inspect", run)
    assert code == 0, err
    assert f"{run} (Checkpointer directory)" in out and "latest of 3 committed steps" in out
    assert "rank_00000.lzc:" in out

    code, out, err = cli(capsys, "inspect", f"s3://{s3_bucket}/nothing-here")
    assert code == 2 and "lazyckpt: error:" in err and "Traceback" not in err


def test_verify_intact_and_damaged(run, s3_bucket, s3_server, capsys):
    client = s3_server.client()
    code, out, err = cli(capsys, "verify", "--no-progress", run)
    assert code == 0, out + err
    assert out.startswith("OK") and "step_0000000030" in out

    key = committed_key(client, s3_bucket, 30)
    original = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()

    flipped = bytearray(original)
    for i in range(4096, 4100):
        flipped[i] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(flipped))
    code, out, err = cli(capsys, "verify", "--no-progress", run)
    assert code == 1, out + err
    assert out.startswith("DAMAGED") and "Traceback" not in out + err
    damaged = [line for line in out.splitlines() if "checksum mismatch" in line]
    assert len(damaged) == 1 and "rank_00000.lzc" in damaged[0] and "offset(s) 4096" in damaged[0], out
    code, out, err = cli(capsys, "verify", "--json", run)
    assert code == 1
    (problem,) = json.loads(out)["problems"]
    assert problem["what"] == "entry" and problem["offsets"] == [4096]

    client.put_object(Bucket=s3_bucket, Key=key, Body=original[:len(original) // 2])
    code, out, err = cli(capsys, "verify", "--no-progress", run)
    assert code == 1, out + err
    assert out.startswith("DAMAGED") and "rank_00000.lzc" in out and "Traceback" not in out + err
    assert "truncated" in out, out

    client.delete_object(Bucket=s3_bucket, Key=key)
    code, out, err = cli(capsys, "verify", "--no-progress", run)
    assert code == 1, out + err
    assert out.startswith("DAMAGED") and "rank_00000.lzc" in out and "no such checkpoint object" in out, out

    # Another step, untouched, is still intact (named by its save prefix).
    step20 = f"s3://{s3_bucket}/" + committed_key(client, s3_bucket, 20).rsplit("/", 1)[0]
    code, out, err = cli(capsys, "verify", "--no-progress", step20)
    assert code == 0 and out.startswith("OK"), out + err

    # A lone object, damaged.
    file_url = f"s3://{s3_bucket}/state.lzc"
    lazyckpt.save(make_state(1), file_url)
    code, out, err = cli(capsys, "verify", "--no-progress", file_url)
    assert code == 0, out + err
    client.put_object(Bucket=s3_bucket, Key="state.lzc", Body=bytes(flipped))
    code, out, err = cli(capsys, "verify", "--no-progress", file_url)
    assert code == 1 and "DAMAGED" in out, out + err


def test_prune_keeps_latest(run, s3_bucket, s3_server, capsys, monkeypatch):
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="run/step_0000000009/deadbeef/rank_00000.lzc", Body=b"\0" * 100)
    time.sleep(1.2)
    monkeypatch.setenv("LAZYCKPT_LEASE_EXPIRY_S", "0.001")
    before = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]}

    code, out, err = cli(capsys, "prune", "--keep", "1", "--dry-run", run)
    assert code == 0, err
    assert "would delete step 10" in out and "would delete step 20" in out and "step 30" not in out.split("kept")[0]
    assert "would delete leftover step_0000000009/deadbeef" in out
    assert {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]} == before

    code, out, err = cli(capsys, "prune", "--keep", "1", "--force", "--json", run)
    assert code == 0, err
    result = json.loads(out)
    assert result["kept"] == [30] and not result["dry_run"]
    assert sorted((a["what"], a["step"]) for a in result["actions"]) == [
        ("interrupted-save", 9), ("step", 10), ("step", 20)]
    assert all(a["done"] and a["error"] is None for a in result["actions"])
    assert result["freed_bytes"] == sum(a["bytes"] for a in result["actions"])
    left = {o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]}
    # The newest commit event stays (it keeps the numbering of the line of history, FORMAT.md §11.10).
    assert all(k.startswith("run/step_0000000030/") or k in ("run/latest", "run/head.json") for k in left
               if not k.startswith("run/history/")), left
    assert [k.split("-")[1] for k in left if k.startswith("run/history/")] == ["0000000030"], left

    code, out, err = cli(capsys, "ls", "--json", run)
    doc = json.loads(out)
    assert [s["step"] for s in doc["steps"]] == [30] and doc["leftovers"] == []
    state = lazyckpt.load(run)
    assert state["step"] == 30 and torch.equal(state["model"]["w"], make_state(30)["model"]["w"])

    code, out, err = cli(capsys, "prune", "--keep", "1", run)
    assert code == 0 and "kept 1 committed step (30)" in out, out + err
