"""Credentials against a server that checks request signatures: moto's
server in its IAM auth mode, where only an IAM user's access key, signed with
its own secret, gets in. Static keys from the environment and a named
profile from temporary shared config files work; a wrong secret or an
unknown key is a ``StorageAuthError`` naming the URL and never the secret."""

from __future__ import annotations

import json
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
# create_user, put_user_policy, create_access_key, create_bucket, put_object.
SETUP_ACTIONS = 5
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
        yield server, {"id": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


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
    with pytest.raises(shardstream.StorageAuthError, match=URL) as info:
        next(iter(ds))
    assert secret not in str(info.value) and secret not in repr(ds)
    with pytest.raises(shardstream.StorageAuthError, match=f"s3://{BUCKET}/data/"):
        StreamingDataset(f"s3://{BUCKET}/data/", s3=s3_config(server))


def test_no_credentials_at_all_is_a_clear_error(auth_server, no_credentials):
    server, _ = auth_server
    ds = StreamingDataset(URL, s3=s3_config(server, max_attempts=2))
    with pytest.raises(shardstream.ShardStreamError, match=URL) as info:
        next(iter(ds))
    assert "credential" in str(info.value).lower()


def test_unsigned_requests_are_refused_by_a_private_bucket(auth_server, no_credentials):
    server, _ = auth_server
    ds = StreamingDataset(URL, s3=s3_config(server, unsigned=True))
    with pytest.raises(shardstream.StorageAuthError, match=URL):
        next(iter(ds))
