"""Errors that say what to do, where the wrong input needs a server: an
s3:// URL with no credentials, no bucket, a wrong or malformed endpoint, on
the real S3 server (SeaweedFS, tests/conftest.py). The one-process cases:
test_errors_actionable.py."""

from __future__ import annotations

import pytest
import torch

import lazyckpt
from lazyckpt.errors import CheckpointError

pytestmark = pytest.mark.timeout(300)

AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_REGION", "AWS_DEFAULT_REGION")


@pytest.fixture
def bare_env(monkeypatch, tmp_path):
    """No AWS credentials anywhere this process could find them."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def test_credentials_set_after_a_refusal_are_used_by_the_next_call(s3_server, s3_bucket, bare_env):
    """A notebook user told "no credentials" sets them and retries in the same
    process: the retry used the client made without them and said the same."""
    bare_env.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    url = f"s3://{s3_bucket}/a.lzc"
    with pytest.raises(CheckpointError, match="no credentials.*AWS_ACCESS_KEY_ID"):
        lazyckpt.save({"w": torch.ones(2)}, url)
    for name, value in s3_server.env().items():
        bare_env.setenv(name, value)
    lazyckpt.save({"w": torch.ones(2)}, url)
    assert lazyckpt.load(url)["w"].tolist() == [1.0, 1.0]


def test_a_missing_bucket_says_to_create_it_or_fix_the_name(s3_server, bare_env):
    for name, value in s3_server.env().items():
        bare_env.setenv(name, value)
    with pytest.raises(CheckpointError, match=r"no such bucket.*(create it|bucket name)"):
        lazyckpt.load("s3://no-such-bucket-here/a.lzc")


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:1", "https-instead-of-http"])
def test_an_unreachable_endpoint_names_it_and_where_it_came_from(s3_server, s3_bucket, bare_env, endpoint):
    """Was "object store error while checking the bucket: EndpointConnectionError: ..."
    (or SSLError: WRONG_VERSION_NUMBER for https against a plain-HTTP server)."""
    for name, value in s3_server.env().items():
        bare_env.setenv(name, value)
    if endpoint == "https-instead-of-http":
        endpoint = s3_server.endpoint.replace("http://", "https://")
    bare_env.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(CheckpointError) as info:
        lazyckpt.load(f"s3://{s3_bucket}/a.lzc", storage_options={"max_attempts": 1, "connect_timeout": 2})
    text = str(info.value)
    assert "cannot reach the object store at " + endpoint in text, text
    assert "AWS_ENDPOINT_URL" in text and "endpoint_url" in text, text


def test_a_malformed_endpoint_is_the_library_error_naming_the_setting(s3_server, s3_bucket, bare_env):
    """Was botocore's bare ValueError "Invalid endpoint: not a url"."""
    for name, value in s3_server.env().items():
        bare_env.setenv(name, value)
    bare_env.setenv("AWS_ENDPOINT_URL", "not a url")
    with pytest.raises(CheckpointError, match=r"not a url.*AWS_ENDPOINT_URL.*http://"):
        lazyckpt.load(f"s3://{s3_bucket}/a.lzc")
