"""A process killed in the middle of a PUT leaves no object at all.

Found while chasing RELIABILITY.md finding 23 (an object that loaded as
empty): SeaweedFS (4.48) stores an EMPTY object when a PUT's connection
closes after its headers and before any byte of its body, if the request
neither waits for ``100 Continue`` nor signs its payload's SHA-256 (a raw
probe, recorded in the finding). The store's PUT does both today (botocore
adds ``Expect: 100-continue`` and, on ``http://``, the payload hash), so the
test passes: it guards the request shape, e.g. against a switch to unsigned
payloads for speed, which would make every kill between a PUT's two writes
a zero-byte manifest, ``head.json``, lease or framework file.

The child arms a kill on the socket: the write that sends the chosen PUT's
headers is its last (SIGKILL right after it); a marker file written before
the kill proves the headers went out alone. The parent then lists the store.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

# The child's kill: wraps socket.sendall; the write that carries a PUT request
# line whose path contains CUT_KEY is let through, then the process dies.
_ARM = textwrap.dedent("""
    import os, signal, socket, sys, urllib.parse
    _send = socket.socket.sendall
    _path = urllib.parse.quote(os.environ["CUT_KEY"], safe="/~").encode()
    def _sendall(self, data, *a, **k):
        head = bytes(data[:400])
        if head.startswith(b"PUT ") and _path in head.split(b"\\r\\n", 1)[0]:
            _send(self, data, *a, **k)
            with open(os.environ["CUT_MARKER"], "w") as f:
                f.write(str(len(data)))
            if os.environ.get("CUT_DEBUG"):
                open(os.environ["CUT_MARKER"] + ".head", "wb").write(bytes(data))
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


def test_a_put_cut_after_its_headers_leaves_no_object(s3_server, s3_bucket, tmp_path):
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
    assert sent < len(payload), "the headers and the body went out in one write: nothing was cut"
    client = s3_server.client()
    listed = client.list_objects_v2(Bucket=s3_bucket, Prefix="cut/").get("Contents", [])
    assert listed == [], f"a PUT killed before its body left an object: {listed}"
