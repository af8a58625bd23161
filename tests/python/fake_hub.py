"""A fake Hugging Face Hub on 127.0.0.1, answering the requests shardstream
makes the way the Hub does (the shapes huggingface_hub's ``HfApi`` reads):

- ``GET /api/datasets/ORG/NAME/revision/REV``: ``{"id": ..., "sha": COMMIT}``;
  ``404`` for an unknown revision; ``401`` for an unknown repository, or a
  private one without its token.
- ``GET /api/datasets/ORG/NAME/tree/REV/PATH?recursive=...``: a JSON list of
  ``{"type": "file"|"directory", "path", "size", "oid"}``, ``page_size``
  entries a page, the next page in a ``Link: <...>; rel="next"`` header.
- ``GET /datasets/ORG/NAME/resolve/REV/PATH``: a ``302`` to a second server
  (the "CDN", an ``http_server.HttpServer`` serving ranges) at ``/ORG/NAME/PATH``.

Files live under ``root/ORG/NAME/``; every repository has one commit, which
``main`` and ``v1`` point at.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REVISIONS = {"main": COMMIT, "v1": COMMIT, COMMIT: COMMIT}


@dataclass
class FakeHub:
    """The fake Hub's repositories (``ORG/NAME`` folders of ``root``),
    which of them are private, the token they take, and what was asked."""

    root: Path
    cdn_url: str
    private: set[str] = field(default_factory=set)
    token: str = "hf_test_token"
    page_size: int = 3
    base_url: str = ""
    # Where the listing's next pages are linked to (another server, for the
    # test that none is followed there); ``None``: this Hub.
    next_origin: str | None = None
    # The cursor every next-page link gives (``None``: the page after), as
    # a server whose links lose their cursor; and paths listed without a
    # size.
    next_cursor: int | None = None
    no_size: set[str] = field(default_factory=set)
    requests: Counter[str] = field(default_factory=Counter)
    authorizations: list[str | None] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def entries(self, repo: str, path: str, recursive: bool) -> list[dict] | None:
        base = self.root / repo
        folder = base / path if path else base
        if not folder.is_dir():
            return None
        found = folder.rglob("*") if recursive else folder.iterdir()
        out = []
        for item in sorted(found):
            relative = item.relative_to(base).as_posix()
            if item.is_dir():
                out.append({"type": "directory", "oid": "0" * 40, "size": 0, "path": relative})
            else:
                size = item.stat().st_size
                out.append({"type": "file", "oid": "1" * 40, "size": size, "path": relative})
                if relative in self.no_size:
                    del out[-1]["size"]
        return out


def make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def send(self, status: int, body: object = None, headers: dict | None = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            auth = self.headers.get("Authorization")
            with hub.lock:
                hub.authorizations.append(auth)
            if parts[:2] == ["api", "datasets"] and len(parts) >= 6:
                kind, repo, rest = parts[4], f"{parts[2]}/{parts[3]}", parts[5:]
            elif parts[:1] == ["datasets"] and len(parts) >= 6 and parts[3] == "resolve":
                kind, repo, rest = "resolve", f"{parts[1]}/{parts[2]}", parts[4:]
            else:
                self.send(404, {"error": "Not Found"})
                return
            with hub.lock:
                hub.requests[kind] += 1
            exists = (hub.root / repo).is_dir()
            allowed = repo not in hub.private or auth == f"Bearer {hub.token}"
            if not exists or not allowed:
                self.send(401, {"error": "Repository Not Found"})
                return
            revision = REVISIONS.get(rest[0])
            if revision is None:
                self.send(404, {"error": f"Invalid rev id: {rest[0]}"})
                return
            path = "/".join(rest[1:])
            if kind == "revision":
                self.send(200, {"id": repo, "sha": revision, "private": repo in hub.private})
            elif kind == "tree":
                query = parse_qs(url.query)
                recursive = query.get("recursive", ["false"])[0] == "true"
                entries = hub.entries(repo, path, recursive)
                if entries is None:
                    self.send(404, {"error": f"{path} does not exist on {rest[0]}"})
                    return
                cursor = int(query.get("cursor", ["0"])[0])
                page = entries[cursor : cursor + hub.page_size]
                headers = {}
                if cursor + hub.page_size < len(entries):
                    origin = hub.next_origin or hub.base_url
                    following = cursor + hub.page_size
                    following = following if hub.next_cursor is None else hub.next_cursor
                    nxt = (
                        f"{origin}/api/datasets/{repo}/tree/{quote(rest[0], safe='')}/"
                        f"{quote(path)}?recursive={str(recursive).lower()}&expand=false"
                        f"&cursor={following}"
                    )
                    headers["Link"] = f'<{nxt}>; rel="next"'
                self.send(200, page, headers)
            elif kind == "resolve":
                if not (hub.root / repo / path).is_file():
                    self.send(404, {"error": "Entry not found"})
                    return
                self.send(302, None, {"Location": f"{hub.cdn_url}/{repo}/{quote(path)}"})
            else:
                self.send(404, {"error": "Not Found"})

    return Handler


@contextmanager
def running_fake_hub(root: Path, cdn_url: str) -> Iterator[FakeHub]:
    """A ``FakeHub`` of ``root`` on a free port of 127.0.0.1, stopped after."""
    hub = FakeHub(root=root, cdn_url=cdn_url)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub))
    httpd.daemon_threads = True
    hub.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
