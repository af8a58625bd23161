"""A real S3-compatible server for the tests: moto's server, started as a
subprocess on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

START_TIMEOUT = 60.0
BUCKET = "train"
TEST_KEY_ID = "testing"
TEST_SECRET = "testing"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    """A running server: its endpoint and a boto3 client for it."""

    endpoint_url: str
    process: subprocess.Popen[bytes]

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=TEST_KEY_ID,
            aws_secret_access_key=TEST_SECRET,
        )


def s3_config(endpoint: S3Server | str, **options: Any) -> Any:
    """An ``S3Config`` for a server on loopback (path-style, us-east-1)."""
    from shardstream import S3Config

    url = endpoint if isinstance(endpoint, str) else endpoint.endpoint_url
    return S3Config(endpoint_url=url, region="us-east-1", path_style=True, **options)


@contextmanager
def running_s3_server(env: dict[str, str] | None = None) -> Iterator[S3Server]:
    """Starts moto's server on 127.0.0.1 and stops it afterwards; fails
    loudly if it does not come up within START_TIMEOUT seconds."""
    port = free_port()
    # The server logs every request: to a file, since a pipe nobody reads
    # fills up and then stalls the server.
    with tempfile.TemporaryFile() as log:
        yield from _serve(port, log, env)


def _serve(port: int, log: Any, env: dict[str, str] | None) -> Iterator[S3Server]:
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={**os.environ, **(env or {})},
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if process.poll() is not None:
                log.seek(0)
                err = log.read().decode(errors="replace")[-5000:]
                raise RuntimeError(f"moto server exited with {process.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not listen on port {port}") from None
                time.sleep(0.1)
        yield S3Server(f"http://127.0.0.1:{port}", process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
