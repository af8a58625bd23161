"""A threaded HTTP server for tests: it serves a directory on 127.0.0.1 with
what real servers and CDNs do (ranges, ETags, Last-Modified, conditional
requests, redirects) and what they do when they misbehave (503s, cut bodies,
a Range ignored, an object replaced mid-read, a request never answered, a
body shorter than its Content-Length, 401/403/404). It counts requests and
body bytes per path, and keeps the headers of every request, so a test can
check read amplification and what was sent where.

``/redirect/N/PATH`` answers with a redirect to ``/redirect/N-1/PATH`` down
to ``/PATH``; ``redirect_to`` sends every request to another server.
"""

from __future__ import annotations

import email.utils
import gzip
import hashlib
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

# A request that is never answered is held at most this long.
MAX_HANG = 30.0
WRITE_CHUNK = 16 << 10


@dataclass
class Faults:
    """What the server does wrong; the defaults do nothing wrong.

    Attributes:
        fail_first: answer the first k GETs with ``fail_status``.
        fail_status: the status of those answers.
        cut_first: cut the body of each of the first k GETs after
            ``cut_after`` bytes (the connection closes).
        cut_after: body bytes sent before a cut.
        change_on_cut: after a cut, replace the file by other bytes of the
            same size (a new ETag and Last-Modified).
        ignore_range: answer every GET with ``200`` and the whole file.
        hang: read requests and never answer them.
        short_by: announce this many bytes more than the file holds, send
            the file and close.
        no_etag: send no ETag (Last-Modified only).
        no_validator: send neither ETag nor Last-Modified (conditional
            request headers are ignored, as such a server has nothing to
            compare them with).
        replace_after: once this many GETs were answered in full, replace
            the file by ``replacement`` (bytes of the same size).
        replacement: the file's bytes after ``replace_after`` GETs.
        gzip: send the file gzip-compressed (``Content-Encoding: gzip``,
            ranges of the compressed form), whatever the request accepts.
        require: ``(header, value)`` a request must carry, else ``401``.
        forbidden: answer every request with ``403``.
    """

    fail_first: int = 0
    fail_status: int = 503
    cut_first: int = 0
    cut_after: int = 1000
    change_on_cut: bool = False
    ignore_range: bool = False
    hang: bool = False
    short_by: int = 0
    no_etag: bool = False
    no_validator: bool = False
    replace_after: int = 0
    replacement: bytes | None = None
    gzip: bool = False
    require: tuple[str, str] | None = None
    forbidden: bool = False


@dataclass
class Served:
    """What the server did, counted as it happened."""

    gets: int = 0
    whole_answers: int = 0
    bytes_by_path: Counter[str] = field(default_factory=Counter)
    gets_by_path: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    headers: list[dict[str, str]] = field(default_factory=list)

    @property
    def body_bytes(self) -> int:
        return sum(self.bytes_by_path.values())


class HttpServer:
    """The server's state: its directory, faults and counts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.faults = Faults()
        self.served = Served()
        self.redirect_to: str | None = None
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.base_url = ""

    def reset(self, faults: Faults | None = None) -> None:
        with self.lock:
            self.faults = faults or Faults()
            self.served = Served()

    def shard_spec(self, shards: int) -> str:
        """The brace spec of `shards` shards named `shard-000000.tar` on."""
        return self.url(f"shard-{{000000..{shards - 1:06d}}}.tar")

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"


def etag_of(data: bytes) -> str:
    return '"' + hashlib.md5(data).hexdigest() + '"'


def parse_range(text: str, size: int) -> tuple[int, int] | None:
    """``bytes=A-B`` or ``bytes=A-`` as ``(first, last)``; ``None`` unparsable."""
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", text.strip())
    if not match:
        return None
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else size - 1
    return first, min(last, size - 1)


def make_handler(server: HttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def answer(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            path = unquote(urlsplit(self.path).path)
            with server.lock:
                faults = server.faults
                served = server.served
                served.headers.append({k.lower(): v for k, v in self.headers.items()})
            match = re.fullmatch(r"/redirect/(\d+)(/.*)", path)
            if match:
                hops = int(match.group(1))
                target = match.group(2) if hops == 0 else f"/redirect/{hops - 1}{match.group(2)}"
                self.answer(302, headers={"Location": target})
                return
            if server.redirect_to:
                self.answer(302, headers={"Location": server.redirect_to + self.path})
                return
            if faults.hang:
                server.stopping.wait(MAX_HANG)
                self.close_connection = True
                return
            if faults.forbidden:
                self.answer(403, b"Forbidden")
                return
            if faults.require:
                name, value = faults.require
                if self.headers.get(name) != value:
                    self.answer(401, b"Unauthorized")
                    return
            with server.lock:
                served.gets += 1
                served.gets_by_path[path] += 1
                nth = served.gets
            if nth <= faults.fail_first:
                with server.lock:
                    served.faults["fail"] += 1
                self.answer(faults.fail_status, b"try again")
                return
            file = server.root / path.lstrip("/")
            if not file.is_file() or ".." in Path(path).parts:
                self.answer(404, b"Not Found")
                return
            data = file.read_bytes()
            if faults.gzip:
                data = gzip.compress(data, mtime=0)
            size = len(data)
            etag = etag_of(data)
            mtime = file.stat().st_mtime
            last_modified = email.utils.formatdate(mtime, usegmt=True)
            headers = {"Accept-Ranges": "bytes"}
            if faults.gzip:
                headers["Content-Encoding"] = "gzip"
            if not faults.no_validator:
                headers["Last-Modified"] = last_modified
            if not faults.no_etag and not faults.no_validator:
                headers["ETag"] = etag
            if_match = self.headers.get("If-Match")
            if if_match and if_match != "*" and if_match != etag and not faults.no_validator:
                self.answer(412, b"Precondition Failed")
                return
            since = self.headers.get("If-Unmodified-Since")
            if since and not faults.no_validator:
                parsed = email.utils.parsedate_to_datetime(since).timestamp()
                if int(mtime) > parsed:
                    self.answer(412, b"Precondition Failed")
                    return
            first, last, status = 0, size - 1, 200
            wanted = self.headers.get("Range")
            if wanted and not faults.ignore_range:
                bounds = parse_range(wanted, size)
                if bounds is None or bounds[0] >= size:
                    self.answer(416, headers={"Content-Range": f"bytes */{size}"})
                    return
                first, last = bounds
                status = 206
                headers["Content-Range"] = f"bytes {first}-{last}/{size}"
            body = data[first : last + 1]
            cut = None
            if nth <= faults.cut_first:
                cut = min(faults.cut_after, len(body))
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body) + faults.short_by))
            self.end_headers()
            if self.command == "HEAD":
                return
            sent = 0
            limit = len(body) if cut is None else cut
            while sent < limit:
                piece = body[sent : min(limit, sent + WRITE_CHUNK)]
                try:
                    self.wfile.write(piece)
                except OSError:
                    break
                sent += len(piece)
                with server.lock:
                    served.bytes_by_path[path] += len(piece)
            if cut is None and faults.replacement is not None:
                with server.lock:
                    served.whole_answers += 1
                    replace = served.whole_answers == faults.replace_after
                if replace:
                    file.write_bytes(faults.replacement)
            if cut is not None or faults.short_by:
                with server.lock:
                    served.faults["cut" if cut is not None else "short"] += 1
                if cut is not None and faults.change_on_cut:
                    changed = bytes(b ^ 0xFF for b in data)
                    file.write_bytes(changed)
                    stamp = time.time() + 5
                    os.utime(file, (stamp, stamp))
                self.wfile.flush()
                self.close_connection = True

    return Handler


@contextmanager
def running_http_server(root: Path) -> Iterator[HttpServer]:
    """An ``HttpServer`` of ``root`` on a free port of 127.0.0.1, stopped after."""
    state = HttpServer(root)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    httpd.daemon_threads = True
    state.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.stopping.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
