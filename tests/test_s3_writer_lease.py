"""One writer per object-store prefix (issue 22, README "One writer per
directory"): the writer lease of ``Checkpointer("s3://...")``, against the
real SeaweedFS of the ``s3_server`` fixture."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError


def _options(server):
    return {"endpoint_url": server.endpoint, "access_key_id": server.access_key,
            "secret_access_key": server.secret_key, "region": server.region}


def _writers(server, bucket, prefix="run"):
    out = []
    for page in server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                           Prefix=f"{prefix}/.writers/"):
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _state(v):
    return {"w": torch.full((1000,), float(v)), "step": v}


def test_second_writer_on_a_prefix_is_refused_naming_the_holder(s3_server, s3_bucket):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    first = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts))
    first.save(_state(1), 1).wait()
    second = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts))
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=rf"another Checkpointer is saving.*pid {os.getpid()} on "
                                              rf"{socket.gethostname()}.*takeover=True"):
        second.save(_state(2), 2)
    print(f"a live holder refused the second writer in {time.monotonic() - t0:.2f} s (lease_expiry_s=60)")
    assert second.load()["step"] == 1              # loading needs no lease
    first.save(_state(3), 3).wait()                 # the holder is unaffected by the refusal
    assert first.steps() == [1, 3]
    second.close()
    first.close()


def test_takeover_displaces_the_writer(s3_server, s3_bucket):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    first = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts))
    first.save(_state(1), 1).wait()
    second = lazyckpt.Checkpointer(url, distributed=lazyckpt.Distributed(takeover=True),
                                   io=lazyckpt.IO(storage_options=opts))
    second.save(_state(2), 2).wait()
    with pytest.raises(CheckpointError, match="another Checkpointer took over"):
        first.save(_state(3), 3)
    second.save(_state(3), 3).wait()
    assert second.steps() == [1, 2, 3] and second.load()["step"] == 3
    first.close()
    second.close()
    assert _writers(s3_server, s3_bucket) == []


def test_displaced_writer_commits_nothing(s3_server, s3_bucket):
    """The check before publishing: a lease lost between save() and the commit
    (here: taken over while the save is queued behind a held snapshot)."""
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    first = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts))
    first.save(_state(1), 1).wait()
    second = lazyckpt.Checkpointer(url, distributed=lazyckpt.Distributed(takeover=True),
                                   io=lazyckpt.IO(storage_options=opts))
    second.save(_state(2), 2).wait()
    with pytest.raises(CheckpointError, match="another Checkpointer took over"):
        first.layout.commit(9, "displaced", b"{}")  # the manifest PUT of a save queued before the takeover
    assert second.steps() == [1, 2]
    first.close()
    second.close()


def test_close_releases_the_lease(s3_server, s3_bucket):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts)) as first:
        first.save(_state(1), 1).wait()
        assert len(_writers(s3_server, s3_bucket)) == 2      # the holder and its heartbeat
    assert _writers(s3_server, s3_bucket) == []
    t0 = time.monotonic()
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts)) as second:
        second.save(_state(2), 2).wait()            # at once: no expiry to wait for
    assert time.monotonic() - t0 < 10


def test_collected_checkpointer_releases_the_lease(s3_server, s3_bucket):
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    first = lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts))
    first.save(_state(1), 1).wait()
    del first
    gc.collect()
    assert _writers(s3_server, s3_bucket) == []
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(storage_options=opts)) as second:
        second.save(_state(2), 2).wait()


def test_crashed_writer_lease_expires(s3_server, s3_bucket):
    """A writer killed without close() leaves its lease; it stops blocking once
    its heartbeat is lease_expiry_s old by the server's clock, and a restart
    waits for that instead of failing."""
    url, opts = f"s3://{s3_bucket}/run", _options(s3_server)
    expiry = 3.0
    script = textwrap.dedent(f"""
        import os, torch, lazyckpt
        c = lazyckpt.Checkpointer({url!r}, io=lazyckpt.IO(storage_options={opts!r}, lease_expiry={expiry}))
        c.save({{"w": torch.zeros(10), "step": 1}}, 1).wait()
        os._exit(0)          # killed: no close(), no release
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    left = _writers(s3_server, s3_bucket)
    assert left, "the crashed writer left its lease"
    holder = json.loads(s3_server.client().get_object(Bucket=s3_bucket, Key=min(left, key=len))["Body"].read())
    assert holder["pid"] != os.getpid()
    t0 = time.monotonic()
    with lazyckpt.Checkpointer(url, io=lazyckpt.IO(lease_expiry=expiry, storage_options=opts)) as restarted:
        restarted.save(_state(2), 2).wait()
        waited = time.monotonic() - t0
        print(f"restart after a crash waited {waited:.2f} s (lease_expiry_s={expiry})")
        assert restarted.steps() == [1, 2]
        assert not any(holder["id"] in k for k in _writers(s3_server, s3_bucket))   # the dead lease is gone
    assert waited < expiry + 5                      # at most the expiry (1 s server stamps, one poll)
