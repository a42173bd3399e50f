"""A process killed in the middle of a PUT leaves no object at all.

RELIABILITY.md finding 23: SeaweedFS (4.48) stores an EMPTY object when the
client of a PUT dies after the server's ``100 Continue`` and before any byte
of the body (botocore sends ``Expect: 100-continue`` and then the body in its
own write; the signed payload hash does not stop it). A kill that lands
there -- the crash-point test's kills land on one thread while another
uploads -- left a zero-byte Lightning checkpoint file on the store (it loads
as ``EOFError``), and the same cut would leave an empty manifest,
``head.json`` or lease. Real S3 refuses an incomplete body; the store's PUT
now sends ``Content-MD5``, which every S3-compatible server checks, so an
empty or cut body is refused by any of them.

Each test runs a child that arms a kill on the socket at the chosen PUT's
body; a marker file written just before the kill proves the headers went out
and the body did not. The parent then looks at the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import lazyckpt

pytestmark = pytest.mark.timeout(180)

# The child's kill: wraps socket.sendall; the write that carries a PUT request
# line whose path contains CUT_KEY is let through, the next one (its body) is not.
_ARM = textwrap.dedent("""
    import os, signal, socket, sys, urllib.parse
    _send = socket.socket.sendall
    _path = urllib.parse.quote(os.environ["CUT_KEY"], safe="/~").encode()
    _sent = {"headers": 0}
    def _sendall(self, data, *a, **k):
        head = bytes(data[:400])
        if head.startswith(b"PUT ") and _path in head.split(b"\\r\\n", 1)[0]:
            _sent["headers"] = len(data)
            return _send(self, data, *a, **k)
        if _sent["headers"]:
            # The next write on the socket is the body, sent once the server said
            # "100 Continue": the process dies before any byte of it leaves.
            with open(os.environ["CUT_MARKER"], "w") as f:
                f.write(str(_sent["headers"]))
            os.kill(os.getpid(), signal.SIGKILL)
        return _send(self, data, *a, **k)
    socket.socket.sendall = _sendall
""")


def _options(server):
    return {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
            "secret_access_key": server.secret_key, "region": server.region}


def _run_killed(tmp_path, body: str, cut_key: str, **env) -> int:
    """Run ``body`` in a child with the kill armed on ``cut_key``; the number of
    bytes the fatal write carried (the headers alone: checked by the caller)."""
    marker = tmp_path / "cut-marker"
    script = _ARM + "\n" + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "CUT_KEY": cut_key, "CUT_MARKER": str(marker),
                               **{k: str(v) for k, v in env.items()}})
    assert proc.returncode == -9, f"the child was not killed at the PUT (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    assert marker.exists(), "the child died before the PUT"
    return int(marker.read_text())


def test_a_put_cut_before_its_body_leaves_no_object(s3_server, s3_bucket, tmp_path):
    """The store's small-object PUT (a Lightning file under a part's size, a
    manifest, ``head.json``, a lease): killed with its headers sent and its
    body not, the object is absent, never empty."""
    payload = bytes(range(256)) * 800
    sent = _run_killed(tmp_path, f"""
        from lazyckpt.knobs import resolve
        from lazyckpt.storage.s3 import store_for
        options = resolve(storage_options={_options(s3_server)!r}).storage_options
        store, key = store_for("s3://{s3_bucket}/cut/object.bin", options)
        store.put(key, bytes(range(256)) * 800)
    """, cut_key="cut/object.bin")
    assert sent < len(payload), "the headers carried the body: nothing was cut"
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="cut/").get("Contents", [])
    assert listed == [], f"a PUT killed before its body left an object: {listed}"


def test_a_lightning_file_uploaded_by_a_killed_mirror_is_absent_not_empty(s3_server, s3_bucket, tmp_path):
    """Finding 23 itself: ``LazyCheckpointIO(persist_to=)`` mirrors a small
    checkpoint file with one PUT; the process killed between the PUT's headers
    and its body leaves no object under the file's name (on main: an empty
    object, which ``torch.load`` refuses with EOFError)."""
    local = tmp_path / "run"
    url = f"s3://{s3_bucket}/mirror"
    _run_killed(tmp_path, f"""
        import torch
        from lazyckpt.integrations.lightning import LazyCheckpointIO
        io = LazyCheckpointIO(persist_to="{url}", local_root="{local}",
                              storage_options={_options(s3_server)!r})
        io.save_checkpoint({{"w": torch.arange(1000.0), "step": 2}}, "{local}/ck/epoch=0-step=2.ckpt")
        io.teardown()
    """, cut_key="mirror/ck/epoch=0-step=2.ckpt")
    assert torch.load(local / "ck" / "epoch=0-step=2.ckpt", weights_only=True)["step"] == 2
    keys = {o["Key"]: o["Size"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="mirror/")
            .get("Contents", [])}
    assert "mirror/ck/epoch=0-step=2.ckpt" not in keys, f"the killed upload left an object: {keys}"


def test_a_manifest_put_cut_before_its_body_leaves_the_previous_step_loading(s3_server, s3_bucket, tmp_path):
    """The same cut on a Checkpointer's commit point on ``s3://`` (the
    manifest's PUT): step 2 does not exist, step 1 loads whole, and the next
    save commits."""
    url = f"s3://{s3_bucket}/ck"
    opts = _options(s3_server)
    # The dead writer's lease lapses in 3 s, not the default minute (the reopen waits it out).
    io = lazyckpt.IO(storage_options=opts, lease_expiry=3.0)
    first = {"w": torch.arange(10_000.0), "step": 1}
    with lazyckpt.Checkpointer(url, io=io) as ck:
        ck.save(first, 1).wait()
    _run_killed(tmp_path, f"""
        import torch, lazyckpt
        with lazyckpt.Checkpointer("{url}", io=lazyckpt.IO(storage_options={opts!r}, lease_expiry=3.0)) as ck:
            ck.save({{"w": torch.arange(10_000.0) + 2, "step": 2}}, 2).wait()
    """, cut_key="manifest.json")
    got = lazyckpt.load(url, storage_options=opts)
    assert got["step"] == 1 and torch.equal(got["w"], first["w"])
    with lazyckpt.Checkpointer(url, io=io) as ck:
        assert ck.steps() == [1]
        ck.save({"w": torch.arange(10_000.0) + 3, "step": 3}, 3).wait()
    assert lazyckpt.load(url, storage_options=opts)["step"] == 3
