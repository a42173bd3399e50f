"""The S3 test server fixture (SeaweedFS) and the fault-injecting proxy work."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

boto3 = pytest.importorskip("boto3")
from botocore.exceptions import ClientError  # noqa: E402

from _s3proxy import S3FaultProxy  # noqa: E402


def test_multipart_roundtrip_10mb(s3_server, s3_bucket):
    from boto3.s3.transfer import TransferConfig
    data = os.urandom(10 << 20)
    client = s3_server.client()
    cfg = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=2)
    import io
    client.upload_fileobj(io.BytesIO(data), s3_bucket, "big.bin", Config=cfg)
    head = client.head_object(Bucket=s3_bucket, Key="big.bin")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-2")  # really multipart
    got = client.get_object(Bucket=s3_bucket, Key="big.bin")["Body"].read()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    # credentials are enforced
    bad = boto3.client("s3", endpoint_url=s3_server.endpoint, aws_access_key_id=s3_server.access_key,
                       aws_secret_access_key="wrong", region_name=s3_server.region)
    with pytest.raises(ClientError) as e:
        bad.get_object(Bucket=s3_bucket, Key="big.bin")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


def test_proxy_injected_503_are_retried(s3_server, s3_bucket):
    with S3FaultProxy(s3_server.endpoint) as proxy:
        client = s3_server.client(endpoint=proxy.endpoint, retries=4)
        body = os.urandom(3 << 20)
        client.put_object(Bucket=s3_bucket, Key="k", Body=body)
        proxy.fail_next(2, status=503)
        assert client.get_object(Bucket=s3_bucket, Key="k")["Body"].read() == body
        # The log is appended once a response is fully sent: the client may have read the
        # body before the proxy thread records the 200 (and the PUT's entry may land late).
        deadline = time.monotonic() + 5
        while len([1 for m, _, _ in proxy.requests if m == "GET"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s for m, p, s in proxy.requests if m == "GET"][-3:] == [503, 503, 200]
        # matching faults, without retries the error surfaces as SlowDown
        proxy.fail_matching(lambda method, path, headers: method == "PUT", status=503)
        no_retry = s3_server.client(endpoint=proxy.endpoint, retries=0)
        with pytest.raises(ClientError) as e:
            no_retry.put_object(Bucket=s3_bucket, Key="k2", Body=b"x")
        assert e.value.response["Error"]["Code"] == "SlowDown"
        proxy.reset()
        no_retry.put_object(Bucket=s3_bucket, Key="k2", Body=b"x")


def test_kill_and_restart_keeps_data(s3_server, s3_bucket):
    client = s3_server.client()
    data = os.urandom(1 << 20)
    client.put_object(Bucket=s3_bucket, Key="persist", Body=data)
    endpoint = s3_server.endpoint
    s3_server.kill()
    assert not s3_server.running
    s3_server.start()
    assert s3_server.endpoint == endpoint
    assert client.get_object(Bucket=s3_bucket, Key="persist")["Body"].read() == data
