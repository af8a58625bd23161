"""Credentials against a server that checks request signatures: moto's
server in its IAM auth mode, where only an IAM user's access key, signed with
its own secret, gets in. Static keys from the environment and a named
profile from temporary shared config files work; a wrong secret, an unknown
key or no credentials at all is a ``StorageAuthError`` naming the URL (and
never the secret), at once: credentials that do not work are not retried."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from _shardtest import tar_bytes
from s3_server import S3Server, running_s3_server, s3_config

import shardstream
from shardstream import StreamingDataset

BUCKET = "private"
KEY = "data/shard-000000.tar"
URL = f"s3://{BUCKET}/{KEY}"
SAMPLES = [(f"s{i}.txt", f"value {i}".encode()) for i in range(5)]
# The requests the fixture makes before moto starts to check signatures:
# create_user, put_user_policy, create_access_key, create_bucket, put_object,
# then create_user and create_access_key of a user without rights.
SETUP_ACTIONS = 7
# A credentials error comes at once (no retries); well within this bound.
FAST = 5.0
# Marks of a Rust Debug dump of an error struct, never in a message.
DEBUG_DUMP = ("{", "}", "DispatchFailure", "ConnectorError", "Error {", "Some(", "source:")
CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ENDPOINT_URL",
)


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[S3Server, dict[str, str]]]:
    """A signature-checking server with one object and the access key of an
    IAM user allowed to read it."""
    env = {"INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_ACTIONS)}
    with running_s3_server(env=env) as server:
        setup: dict[str, Any] = {
            "endpoint_url": server.endpoint_url,
            "region_name": "us-east-1",
            "aws_access_key_id": "setup",
            "aws_secret_access_key": "setup",
        }
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="reader")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        s3 = boto3.client("s3", **setup)
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key=KEY, Body=tar_bytes(SAMPLES))
        iam.create_user(UserName="nobody")
        other = iam.create_access_key(UserName="nobody")["AccessKey"]
        yield (
            server,
            {
                "id": key["AccessKeyId"],
                "secret": key["SecretAccessKey"],
                "other_id": other["AccessKeyId"],
                "other_secret": other["SecretAccessKey"],
            },
        )


@pytest.fixture
def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No credentials anywhere the default chain looks (empty shared files,
    no environment variables); returns a folder for config files."""
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


def assert_a_sentence(message: str) -> None:
    """No Debug dump of an error struct in ``message``."""
    for mark in DEBUG_DUMP:
        assert mark not in message, f"{mark!r} in {message!r}"


def keys_of(ds: StreamingDataset) -> list[str]:
    return sorted(sample["__key__"] for sample in ds)


EXPECTED_KEYS = sorted(name.split(".")[0] for name, _ in SAMPLES)


def test_static_keys_from_the_environment(auth_server, no_credentials, monkeypatch):
    server, key = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["secret"])
    assert keys_of(StreamingDataset(URL, s3=s3_config(server))) == EXPECTED_KEYS
    listed = StreamingDataset(f"s3://{BUCKET}/data/", s3=s3_config(server))
    assert [url for url, _ in listed.shards] == [URL]


def test_named_profile_from_shared_config_files(auth_server, no_credentials, monkeypatch):
    server, key = auth_server
    config = no_credentials / "config"
    config.write_text("[profile reader]\nregion = us-east-1\n")
    credentials = no_credentials / "credentials"
    credentials.write_text(
        f"[reader]\naws_access_key_id = {key['id']}\naws_secret_access_key = {key['secret']}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    options = s3_config(server, profile="reader")
    assert keys_of(StreamingDataset(URL, s3=options)) == EXPECTED_KEYS
    # The same profile chosen through AWS_PROFILE.
    monkeypatch.setenv("AWS_PROFILE", "reader")
    assert keys_of(StreamingDataset(URL, s3=s3_config(server))) == EXPECTED_KEYS


@pytest.mark.parametrize("wrong", ["secret", "key id"])
def test_wrong_credentials_raise_the_auth_error(auth_server, no_credentials, monkeypatch, wrong):
    server, key = auth_server
    secret = "WRONG" + key["secret"][5:] if wrong == "secret" else key["secret"]
    key_id = key["id"] if wrong == "secret" else "AKIAUNKNOWNKEY000000"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    ds = StreamingDataset(URL, s3=s3_config(server))
    started = time.monotonic()
    with pytest.raises(shardstream.StorageAuthError, match=URL) as info:
        next(iter(ds))
    message = str(info.value)
    assert secret not in message and secret not in repr(ds)
    code = "SignatureDoesNotMatch" if wrong == "secret" else "InvalidAccessKeyId"
    assert code in message and "AWS_ACCESS_KEY_ID" in message, message
    assert_a_sentence(message)
    # The listing at construction, and the HEAD a Parquet file's size takes.
    with pytest.raises(shardstream.StorageAuthError, match=f"s3://{BUCKET}/data/") as info:
        StreamingDataset(f"s3://{BUCKET}/data/", s3=s3_config(server))
    assert_a_sentence(str(info.value))
    parquet = f"s3://{BUCKET}/data/table.parquet"
    with pytest.raises(shardstream.StorageAuthError, match=parquet) as info:
        StreamingDataset(parquet, s3=s3_config(server), format="parquet")
    assert_a_sentence(str(info.value))
    assert time.monotonic() - started < FAST


def test_a_key_without_rights_is_access_denied(auth_server, no_credentials, monkeypatch):
    server, key = auth_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["other_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["other_secret"])
    with pytest.raises(shardstream.StorageAuthError, match=URL) as info:
        next(iter(StreamingDataset(URL, s3=s3_config(server))))
    assert "access denied" in str(info.value) and "AccessDenied" in str(info.value)
    assert_a_sentence(str(info.value))


def assert_says_where_credentials_were_looked_for(message: str) -> None:
    assert "no usable AWS credentials" in message, message
    for source in ("environment variables", "shared config", "IMDS"):
        assert source in message, message
    assert "AWS_ACCESS_KEY_ID" in message and "unsigned=True" in message, message
    assert_a_sentence(message)


def test_no_credentials_at_all_fail_fast_with_a_sentence(auth_server, no_credentials):
    """With the default 10 attempts: no retry, no Debug dump of the SDK's
    error, and the sources of credentials tried are named. The same at
    construction, for a listing and for a Parquet file's HEAD."""
    server, _ = auth_server
    ds = StreamingDataset(URL, s3=s3_config(server))
    started = time.monotonic()
    with pytest.raises(shardstream.StorageAuthError, match=URL) as info:
        next(iter(ds))
    assert time.monotonic() - started < FAST
    assert_says_where_credentials_were_looked_for(str(info.value))
    assert ds.stats()["retries"] == 0
    started = time.monotonic()
    with pytest.raises(shardstream.StorageAuthError, match=f"s3://{BUCKET}/data/") as info:
        StreamingDataset(f"s3://{BUCKET}/data/", s3=s3_config(server))
    assert_says_where_credentials_were_looked_for(str(info.value))
    with pytest.raises(shardstream.StorageAuthError, match=r"table\.parquet") as info:
        StreamingDataset(f"s3://{BUCKET}/table.parquet", s3=s3_config(server), format="parquet")
    assert_says_where_credentials_were_looked_for(str(info.value))
    assert time.monotonic() - started < FAST


def test_no_credentials_under_warn_policy_raise_rather_than_skip_every_shard(
    auth_server, no_credentials
):
    """Every shard would fail the same way: skipping them all would make an
    empty epoch out of a configuration error."""
    server, _ = auth_server
    urls = [URL, URL.replace("000000", "000001")]
    ds = StreamingDataset(urls, s3=s3_config(server), on_error="warn")
    with pytest.raises(shardstream.StorageAuthError, match=r"data/shard-00000[01]\.tar"):
        next(iter(ds))
    assert ds.stats()["errors_skipped"] == 0


def test_a_silent_instance_metadata_service_costs_one_timeout(
    auth_server, no_credentials, monkeypatch
):
    """Off EC2, with IMDS left enabled, the chain asks the instance metadata
    service; one that never answers costs its own short timeout once, not a
    timeout per retry of every request."""
    server, _ = auth_server
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", f"http://127.0.0.1:{port}")
        ds = StreamingDataset(URL, s3=s3_config(server))
        started = time.monotonic()
        with pytest.raises(shardstream.StorageAuthError, match=URL) as info:
            next(iter(ds))
        assert time.monotonic() - started < FAST
    assert_says_where_credentials_were_looked_for(str(info.value))


def test_unsigned_requests_are_refused_by_a_private_bucket(auth_server, no_credentials):
    server, _ = auth_server
    ds = StreamingDataset(URL, s3=s3_config(server, unsigned=True))
    with pytest.raises(shardstream.StorageAuthError, match=URL):
        next(iter(ds))
