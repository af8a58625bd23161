"""A fault-injecting HTTP proxy for S3 tests and benchmarks.

It sits between a client and an S3-compatible server on 127.0.0.1 and
forwards every request unchanged (Host header included, so signatures still
match), while it can answer some GETs with 503 SlowDown, reset connections
before answering, delay the first byte, answer GETs one at a time, cut or
stall bodies mid-way, cap each connection's bandwidth, and answer a Range request (a resume, a part)
with what a broken server or proxy might send: the whole object, bytes from
another offset, or fewer bytes than asked for. Faults hit every k-th GET, counted in arrival
order, and every fault injected is counted, so a test can compare the
client's own retry and resume counters with what really happened.
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
INTERNAL_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>"
)
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
UPSTREAM_TIMEOUT = 60.0
WRITE_CHUNK = 16 << 10
# A stall never lasts longer than this, whatever a test asks.
MAX_STALL = 30.0


@dataclass
class Faults:
    """What the proxy does to GET and HEAD requests ("GETs" below); 0 turns
    a fault off.

    Attributes:
        slowdown_every: answer every k-th GET with 503 SlowDown.
        slowdown_first: answer the first k GETs with 503 SlowDown.
        reset_every: close the connection of every k-th GET without answering.
        cut_every: cut the body of every k-th GET after ``cut_after`` bytes.
        cut_first: cut the body of each of the first k GETs after
            ``cut_after`` bytes.
        cut_after: body bytes sent before a cut or a stall.
        stall_every: stop sending the body of every k-th GET for
            ``stall_seconds`` after ``cut_after`` bytes, then close.
        stall_seconds: how long a stall lasts.
        first_byte_delay: seconds to wait before every GET's response.
        delay_every: only every k-th GET gets ``first_byte_delay`` (0: all).
        serial: answer GETs one at a time: each waits for the GETs before it
            to get their answer (``first_byte_delay`` and the upstream's
            answer) before its own begins, as a server that does not serve
            requests in parallel, each at a fixed cost; bodies are still
            sent at once.
        bandwidth: bytes per second per connection (0: no cap).
        on_cut: called with the request path after a body is cut, before
            the connection closes (a test may replace the object here).
        whole_on_range: answer each of the first k GETs whose Range starts
            after byte 0 with ``200`` and the whole object.
        shifted_on_range: answer each of the first k GETs whose Range
            starts after byte 0 with the ``206`` for a range starting
            ``shift_bytes`` earlier (its Content-Range says so).
        shift_bytes: how much earlier a shifted range starts.
        short_on_range: answer each of the first k GETs whose Range starts
            after byte 0 with a ``206`` holding the first half of the bytes
            asked for, its Content-Range and Content-Length saying so.
        write_slowdown_every: answer every k-th PUT or POST (uploads,
            counted apart from GETs) with 503 SlowDown, after reading its body.
        write_delay: seconds to wait before forwarding every PUT or POST
            (the store's latency to answer an upload).
        fail_part: answer every upload of the part of this number
            (``partNumber=k``) with 500 InternalError, after reading its body.
        status_first: answer the first k GETs and HEADs with ``status``
            (an empty body), whatever the store would answer.
        status: the status of those answers (404, 403, 401, 416, ...).
        cut_bodies: cut each of the first k GET bodies longer than
            ``cut_after`` after ``cut_after`` bytes, whatever shorter
            answers (a store's metadata) came before them; only GETs that
            came after these faults were set count.
        gzip: send every GET's body gzip-compressed with
            ``Content-Encoding: gzip``, as a misconfigured proxy or CDN
            might, whatever the request accepts.
        listing: rewrites the body of every answer to a ListObjectsV2 GET
            (``list-type`` in its query), which is then sent as ``200``:
            a server whose pages cannot be followed.
    """

    slowdown_every: int = 0
    slowdown_first: int = 0
    reset_every: int = 0
    cut_every: int = 0
    cut_after: int = 0
    stall_every: int = 0
    stall_seconds: float = 0.0
    first_byte_delay: float = 0.0
    delay_every: int = 0
    serial: bool = False
    bandwidth: float = 0.0
    on_cut: Callable[[str], None] | None = None
    cut_first: int = 0
    whole_on_range: int = 0
    shifted_on_range: int = 0
    shift_bytes: int = 1000
    short_on_range: int = 0
    write_slowdown_every: int = 0
    write_delay: float = 0.0
    fail_part: int = 0
    status_first: int = 0
    status: int = 404
    gzip: bool = False
    cut_bodies: int = 0
    listing: Callable[[bytes], bytes] | None = None


@dataclass
class Injected:
    """How many of each fault the proxy injected, how many GETs it saw (and
    how many at once at most), and the ``(Range, If-Match)`` headers of the
    ranged ones."""

    gets: int = 0
    # GETs whose Range starts after byte 0, and the bad answers to them.
    later_ranges: int = 0
    whole_answers: int = 0
    shifted_answers: int = 0
    short_answers: int = 0
    slowdowns: int = 0
    resets: int = 0
    cuts: int = 0
    stalls: int = 0
    delays: int = 0
    active: int = 0
    max_active: int = 0
    ranged_gets: list[tuple[str, str | None]] = field(default_factory=list)
    # PUTs and POSTs, and the ones answered with 503 SlowDown.
    writes: int = 0
    write_slowdowns: int = 0
    # PUTs and POSTs being answered now, and the most at once.
    writes_active: int = 0
    max_writes_active: int = 0
    # Every PUT, POST and DELETE as (method, path with query), in arrival
    # order, and the uploads answered with 500 (``fail_part``).
    write_requests: list[tuple[str, str]] = field(default_factory=list)
    failed_parts: int = 0
    # Every GET and HEAD as (method, path with query), in arrival order.
    reads: list[tuple[str, str]] = field(default_factory=list)
    # GET bodies longer than ``cut_after`` seen (for ``cut_bodies``).
    long_bodies: int = 0
    # Body bytes sent to the client in answers to GETs.
    body_bytes: int = 0
    statuses: int = 0


@dataclass
class FaultProxy:
    """A running proxy: its endpoint, the faults it injects (change them at
    any time) and the counts of what it injected."""

    endpoint_url: str
    faults: Faults
    injected: Injected
    lock: threading.Lock
    # Held by each GET's answer under ``Faults.serial``.
    serial: threading.Lock = field(default_factory=threading.Lock)

    def reset(self, faults: Faults | None = None) -> None:
        """New faults and zeroed counts."""
        with self.lock:
            self.faults = faults or Faults()
            self.injected = Injected()


def _every(k: int, n: int) -> bool:
    return k > 0 and n % k == 0


def _range_start(header: str) -> int:
    """The first byte of a ``bytes=FIRST-[LAST]`` Range header (0 if unreadable)."""
    first = header.removeprefix("bytes=").split("-", 1)[0].strip()
    return int(first) if first.isdigit() else 0


def _handler(proxy_ref: list[FaultProxy], upstream: tuple[str, int]) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out as separate writes: without TCP_NODELAY the
        # body waits for the client's delayed ACK of the headers (40 ms).
        disable_nagle_algorithm = True
        upstream_conn: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: object) -> None:
            pass

        def _upstream(self) -> http.client.HTTPConnection:
            if self.upstream_conn is None:
                self.upstream_conn = http.client.HTTPConnection(*upstream, timeout=UPSTREAM_TIMEOUT)
            return self.upstream_conn

        def _forward(
            self, replace: dict[str, str | None] | None = None
        ) -> tuple[int, str, list[tuple[str, str]], bytes]:
            """Forwards the request upstream, with the headers of ``replace``
            set to new values (``None``: left out)."""
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            replace = {k.lower(): v for k, v in (replace or {}).items()}
            headers = {
                k: v
                for k, v in self.headers.items()
                if k.lower() not in HOP_BY_HOP and k.lower() not in replace
            }
            headers.update({k: v for k, v in replace.items() if v is not None})
            for attempt in range(2):
                conn = self._upstream()
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    return response.status, response.reason, response.getheaders(), data
                except (OSError, http.client.HTTPException):
                    conn.close()
                    self.upstream_conn = None
                    if attempt == 1:
                        raise
            raise AssertionError("unreachable")

        def _decide(self) -> tuple[Faults, int, int]:
            """The faults, this GET's number, and its number among the GETs
            whose Range starts after byte 0 and that are neither reset nor
            slowed down (0 for the others)."""
            proxy = proxy_ref[0]
            with proxy.lock:
                if self.command in ("PUT", "POST", "DELETE"):
                    proxy.injected.write_requests.append((self.command, self.path))
                if self.command in ("PUT", "POST"):
                    proxy.injected.writes += 1
                    faults = Faults(
                        bandwidth=proxy.faults.bandwidth,
                        write_slowdown_every=proxy.faults.write_slowdown_every,
                        write_delay=proxy.faults.write_delay,
                        fail_part=proxy.faults.fail_part,
                    )
                    return faults, proxy.injected.writes, 0
                if self.command not in ("GET", "HEAD"):
                    return Faults(bandwidth=proxy.faults.bandwidth), 0, 0
                proxy.injected.gets += 1
                proxy.injected.reads.append((self.command, self.path))
                n = proxy.injected.gets
                faults = proxy.faults
                # A GET that is reset or slowed down gets no wrong range
                # either, so the first k wrong ranges are all given.
                failed = (
                    _every(faults.reset_every, n)
                    or _every(faults.slowdown_every, n)
                    or n <= faults.slowdown_first
                )
                later = 0
                if "Range" in self.headers:
                    ranged = (self.headers["Range"], self.headers.get("If-Match"))
                    proxy.injected.ranged_gets.append(ranged)
                    if _range_start(self.headers["Range"]) > 0 and not failed:
                        proxy.injected.later_ranges += 1
                        later = proxy.injected.later_ranges
                return proxy.faults, proxy.injected.gets, later

        def _count(self, name: str) -> None:
            proxy = proxy_ref[0]
            with proxy.lock:
                setattr(proxy.injected, name, getattr(proxy.injected, name) + 1)

        def _send_body(self, data: bytes, faults: Faults, n: int) -> None:
            long_body = 0
            if self.command == "GET" and faults.cut_after < len(data):
                with proxy_ref[0].lock:
                    # Only a GET that came after the last reset counts: one
                    # still answering a request made before it (a read-ahead
                    # its client dropped) must not take the first cut.
                    if faults is proxy_ref[0].faults:
                        proxy_ref[0].injected.long_bodies += 1
                        long_body = proxy_ref[0].injected.long_bodies
            cut = (
                _every(faults.cut_every, n)
                or n <= faults.cut_first
                or 0 < long_body <= faults.cut_bodies
            ) and (faults.cut_after < len(data))
            stall = _every(faults.stall_every, n) and faults.cut_after < len(data)
            limit = faults.cut_after if cut or stall else len(data)
            sent = 0
            started = time.monotonic()
            while sent < limit:
                chunk = data[sent : min(limit, sent + WRITE_CHUNK)]
                self.wfile.write(chunk)
                self.wfile.flush()
                sent += len(chunk)
                if self.command == "GET":
                    with proxy_ref[0].lock:
                        proxy_ref[0].injected.body_bytes += len(chunk)
                if faults.bandwidth > 0:
                    ahead = sent / faults.bandwidth - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
            if stall:
                self._count("stalls")
                time.sleep(min(faults.stall_seconds, MAX_STALL))
            if cut:
                self._count("cuts")
                if faults.on_cut is not None:
                    faults.on_cut(self.path)
            if cut or stall:
                # A clean end of the stream (FIN) after the bytes sent, so
                # the client sees a short body, not a reset losing them.
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_WR)

        def _bad_range_answer(
            self, faults: Faults, later: int
        ) -> tuple[int, str, list[tuple[str, str]], bytes] | None:
            """A wrong answer to a GET whose Range starts after byte 0, if
            the faults ask for one."""
            if later == 0 or self.command != "GET":
                return None
            start = _range_start(self.headers["Range"])
            if later <= faults.whole_on_range:
                self._count("whole_answers")
                return self._forward({"Range": None, "If-Match": None})
            if later <= faults.shifted_on_range:
                self._count("shifted_answers")
                shifted = max(0, start - faults.shift_bytes)
                rest = self.headers["Range"].split("-", 1)[1]
                return self._forward({"Range": f"bytes={shifted}-{rest}"})
            if later <= faults.short_on_range:
                status, reason, headers, data = self._forward()
                if status != 206 or len(data) < 2:
                    return status, reason, headers, data
                self._count("short_answers")
                data = data[: len(data) // 2]
                total = dict((k.lower(), v) for k, v in headers).get("content-range", "")
                total = total.rsplit("/", 1)[-1]
                headers = [(k, v) for k, v in headers if k.lower() != "content-range"]
                last = start + len(data) - 1
                headers.append(("Content-Range", f"bytes {start}-{last}/{total}"))
                return status, reason, headers, data
            return None

        def _is_failed_part(self, faults: Faults) -> bool:
            query = parse_qs(urlsplit(self.path).query)
            return self.command == "PUT" and query.get("partNumber") == [str(faults.fail_part)]

        def _refuse_write(self, count: str, status: int, reason: str, body: bytes) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            self._count(count)
            self.send_response_only(status, reason)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _handle(self) -> None:
            faults, n, later = self._decide()
            if self.command in ("PUT", "POST") and faults.write_delay > 0:
                time.sleep(faults.write_delay)
            if self.command in ("PUT", "POST") and _every(faults.write_slowdown_every, n):
                self._refuse_write("write_slowdowns", 503, "Slow Down", SLOWDOWN_BODY)
                return
            if faults.fail_part > 0 and self._is_failed_part(faults):
                self._refuse_write("failed_parts", 500, "Internal Server Error", INTERNAL_BODY)
                return
            if _every(faults.reset_every, n):
                self._count("resets")
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            serial = faults.serial and self.command == "GET"
            with proxy_ref[0].serial if serial else contextlib.nullcontext():
                answer = self._answer(faults, n, later)
            self._finish(faults, n, answer)

        def _answer(
            self, faults: Faults, n: int, later: int
        ) -> tuple[int, str, list[tuple[str, str]], bytes]:
            """The answer to a request that is not refused or reset: after
            the first-byte delay, an injected status or the upstream's."""
            if faults.first_byte_delay > 0 and (
                faults.delay_every == 0 or _every(faults.delay_every, n)
            ):
                self._count("delays")
                time.sleep(faults.first_byte_delay)
            # n is 0 for a request that is not a GET (a DELETE): never slowed down.
            if _every(faults.slowdown_every, n) or 0 < n <= faults.slowdown_first:
                self._count("slowdowns")
                status, reason, headers, data = 503, "Slow Down", [], SLOWDOWN_BODY
                headers = [("Content-Type", "application/xml")]
            elif 0 < n <= faults.status_first:
                self._count("statuses")
                status, reason, headers, data = faults.status, "Injected", [], b""
                if status == 416:
                    # Of a resource that is not empty (an empty one's is */0).
                    headers = [("Content-Range", "bytes */1048576")]
            else:
                bad = self._bad_range_answer(faults, later)
                status, reason, headers, data = bad or self._forward()
            return status, reason, headers, data

        def _finish(
            self,
            faults: Faults,
            n: int,
            answer: tuple[int, str, list[tuple[str, str]], bytes],
        ) -> None:
            status, reason, headers, data = answer
            query = parse_qs(urlsplit(self.path).query)
            if faults.listing is not None and self.command == "GET" and "list-type" in query:
                status, reason, data = 200, "OK", faults.listing(data)
            if faults.gzip and self.command == "GET" and status in (200, 206):
                data = gzip.compress(data, mtime=0)
                headers = [(k, v) for k, v in headers if k.lower() != "content-encoding"]
                headers.append(("Content-Encoding", "gzip"))
            self.send_response_only(status, reason)
            for name, value in headers:
                if name.lower() in HOP_BY_HOP:
                    continue
                if name.lower() == "content-length" and self.command != "HEAD":
                    continue
                self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self._send_body(data, faults, n)

        def _safely(self) -> None:
            proxy = proxy_ref[0]
            write = self.command in ("PUT", "POST")
            with proxy.lock:
                # The counts in force when the request came: a reset while it
                # is answered leaves the new counts' ``active`` alone.
                injected = proxy.injected
                injected.active += 1
                injected.max_active = max(injected.max_active, injected.active)
                if write:
                    injected.writes_active += 1
                    injected.max_writes_active = max(
                        injected.max_writes_active, injected.writes_active
                    )
            try:
                self._handle()
            except OSError:
                self.close_connection = True
            finally:
                with proxy.lock:
                    injected.active -= 1
                    if write:
                        injected.writes_active -= 1

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _safely

    return Handler


@contextmanager
def running_fault_proxy(upstream_url: str, faults: Faults | None = None) -> Iterator[FaultProxy]:
    """Starts a proxy to ``upstream_url`` on a free loopback port and stops it
    afterwards."""
    target = urlsplit(upstream_url)
    if target.hostname is None or target.port is None:
        raise ValueError(f"upstream needs a host and port: {upstream_url}")
    proxy_ref: list[FaultProxy] = []
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), _handler(proxy_ref, (target.hostname, target.port))
    )
    server.daemon_threads = True
    port = server.server_address[1]
    proxy_ref.append(
        FaultProxy(f"http://127.0.0.1:{port}", faults or Faults(), Injected(), threading.Lock())
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1})
    thread.daemon = True
    thread.start()
    try:
        yield proxy_ref[0]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
