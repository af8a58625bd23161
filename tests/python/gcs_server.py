"""Google Cloud Storage for the tests, on 127.0.0.1.

``running_gcs_emulator`` starts gcp-storage-emulator (the PyPI emulator of
the GCS JSON API) in a subprocess. It lists a prefix in one page and does
not check credentials, so ``running_gcs_api`` serves the subset of the JSON
API shardstream uses itself, the way GCS does: object listings in pages of
``page_size`` (``pageToken``/``nextPageToken``), object resources with
their ``generation``, media downloads with ``Range`` (pinned to
``generation``), ``Authorization: Bearer`` checked when a token is
required, an OAuth2 token endpoint (``/token``) that verifies the RS256
signature of a service account's JWT with the account's public key, and the
token endpoint of a metadata server.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_gcs_emulator(bucket: str) -> Iterator[str]:
    """gcp-storage-emulator on a free port with ``bucket`` made; yields its
    endpoint (``http://127.0.0.1:PORT``). Fails loudly if it does not start."""
    port = free_port()
    command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--in-memory", "--quiet", "--default-bucket", bucket]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}", timeout=2).close()
                break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise RuntimeError(
                        f"gcp-storage-emulator did not start: {err[-2000:]}"
                    ) from exc
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def upload(endpoint: str, bucket: str, key: str, data: bytes) -> None:
    """Uploads one object through the JSON API's media upload."""
    name = urllib.parse.quote(key, safe="")
    url = f"{endpoint}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}"
    request = urllib.request.Request(url, data=data, method="POST")
    request.add_header("Content-Type", "application/octet-stream")
    urllib.request.urlopen(request, timeout=30).close()


def b64url(data: bytes) -> bytes:
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


@dataclass
class GcsApi:
    """State of a running ``running_gcs_api`` server (thread-safe counters)."""

    endpoint: str
    objects: dict[str, dict[str, tuple[bytes, int]]]
    page_size: int = 3
    #: The public key a JWT must be signed with (``None``: no token endpoint).
    public_key: rsa.RSAPublicKey | None = None
    #: The access token ``/token`` hands out and, when ``required``, every
    #: request must carry.
    token: str = "ya29.secret-access-token"
    required: bool = False
    authorizations: list[str | None] = field(default_factory=list)
    page_tokens: list[str | None] = field(default_factory=list)
    token_requests: int = 0
    media_gets: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.authorizations.clear()
            self.page_tokens.clear()
            self.token_requests = self.media_gets = 0


def _handler(api: GcsApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            pass

        def send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {"Content-Type": "application/json"}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def error(self, status: int, message: str) -> None:
            body = {"error": {"code": status, "message": message}}
            self.send(status, json.dumps(body).encode())

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            if self.path != "/token" or api.public_key is None:
                return self.error(404, "no such endpoint")
            with api.lock:
                api.token_requests += 1
            grant = form.get("grant_type", [""])[0]
            if grant != "urn:ietf:params:oauth:grant-type:jwt-bearer":
                return self.send(400, b'{"error": "unsupported_grant_type"}')
            try:
                header, claims, signature = form["assertion"][0].encode().split(b".")
                api.public_key.verify(
                    b64url(signature),
                    header + b"." + claims,
                    padding.PKCS1v15(),
                    hashes.SHA256(),
                )
                payload = json.loads(b64url(claims))
                assert json.loads(b64url(header))["alg"] == "RS256"
                assert payload["aud"].endswith("/token") and "devstorage" in payload["scope"]
                assert payload["exp"] > time.time()
            except Exception:
                return self.send(400, b'{"error": "invalid_grant"}')
            body = {"access_token": api.token, "expires_in": 3600, "token_type": "Bearer"}
            self.send(200, json.dumps(body).encode())

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            if url.path == "/computeMetadata/v1/instance/service-accounts/default/token":
                # The metadata server of a Google Cloud machine.
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self.error(403, "Missing Metadata-Flavor header")
                with api.lock:
                    api.token_requests += 1
                body = {"access_token": api.token, "expires_in": 3600, "token_type": "Bearer"}
                return self.send(200, json.dumps(body).encode())
            authorization = self.headers.get("Authorization")
            with api.lock:
                api.authorizations.append(authorization)
            if api.required and authorization != f"Bearer {api.token}":
                return self.error(401, "Anonymous caller does not have storage.objects.get access.")
            media = re.fullmatch(r"/download/storage/v1/b/([^/]+)/o/([^/]+)", url.path)
            meta = re.fullmatch(r"/storage/v1/b/([^/]+)/o/([^/]+)", url.path)
            listing = re.fullmatch(r"/storage/v1/b/([^/]+)/o", url.path)
            bucket = re.fullmatch(r"/storage/v1/b/([^/]+)", url.path)
            found = media or meta or listing or bucket
            if not found or found.group(1) not in api.objects:
                return self.error(404, "The specified bucket does not exist.")
            objects = api.objects[found.group(1)]
            if bucket:
                return self.send(200, json.dumps({"name": bucket.group(1)}).encode())
            if listing:
                prefix = query.get("prefix", [""])[0]
                token = query.get("pageToken", [None])[0]
                with api.lock:
                    api.page_tokens.append(token)
                keys = sorted(k for k in objects if k.startswith(prefix))
                start = int(token or 0)
                page = keys[start : start + api.page_size]
                items = [self.resource(k, *objects[k]) for k in page]
                body: dict[str, Any] = {"kind": "storage#objects", "items": items}
                if start + api.page_size < len(keys):
                    body["nextPageToken"] = str(start + api.page_size)
                return self.send(200, json.dumps(body).encode())
            key = urllib.parse.unquote(found.group(2))
            if key not in objects:
                return self.error(404, f"No such object: {found.group(1)}/{key}")
            data, generation = objects[key]
            if meta:
                return self.send(200, json.dumps(self.resource(key, data, generation)).encode())
            with api.lock:
                api.media_gets += 1
            if query.get("generation", [str(generation)])[0] != str(generation):
                return self.error(404, "No such object (generation)")
            ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
            headers = {"Content-Type": "application/octet-stream", "ETag": f'"{generation}"'}
            if not ranged:
                return self.send(200, data, headers)
            first = int(ranged.group(1))
            last = min(int(ranged.group(2) or len(data) - 1), len(data) - 1)
            if first >= len(data):
                return self.send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
            self.send(206, data[first : last + 1], headers)

        @staticmethod
        def resource(key: str, data: bytes, generation: int) -> dict[str, str]:
            return {"name": key, "size": str(len(data)), "generation": str(generation)}

    return Handler


@contextmanager
def running_gcs_api(objects: dict[str, dict[str, tuple[bytes, int]]]) -> Iterator[GcsApi]:
    """The JSON API subset above over ``objects`` (bucket -> key -> (data, generation))."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), None)  # type: ignore[arg-type]
    api = GcsApi(endpoint=f"http://127.0.0.1:{server.server_address[1]}", objects=objects)
    server.RequestHandlerClass = _handler(api)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
