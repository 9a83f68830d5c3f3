"""An HTTP proxy for tests, between ckptfs and a local S3 server, that
injects the failures object storage shows:

- ``slowdown``: 503 SlowDown;
- ``reset``: the connection reset in the middle of a body;
- ``truncate``: a body cut short with a matching Content-Length (only a
  client that checks the length it asked for sees it);
- ``stall_headers``: status and headers sent, then not one byte of the body;
- ``stall_body``: status, headers and the first half of the body sent, then
  nothing more, the connection held open;
- ``stall_silent``: the request read, then no answer at all;
- ``trickle``: status and headers, then one byte of the body every half
  second (never slow enough for a check of bytes per second to call it a
  stall);
- ``shift``: a ranged GET answered 206 with another range of the same
  length, named honestly in Content-Range (a cache or gateway that mixes
  up ranges); needs ``fetch``, which reads the other range upstream;
- ``forbidden`` (from a script only): 403 AccessDenied, as a bucket policy
  that denies some objects answers;
- ``drop`` (from a script only): the request read, never forwarded, and the
  connection reset (what an upload sees when its connection breaks);
- ``hold`` (from a script only): the request read and held, then forwarded
  and answered once ``release()`` is called (``held`` counts the requests
  that reached the hold), so a test acts while a client is known to be
  waiting mid-transfer.

A stall holds the connection open for ``stall_s`` seconds (longer than the
client's timeout), then closes it; with ``stall_once`` a stall is the fault
of one connection, not of the object: a request (request line and Range)
stalled once passes when it comes again (``stall_retried`` counts those), so
a client that gives up on a stalled answer and asks again gets the bytes; a trickle goes on until the body is sent
or the proxy is closed. The request bytes go upstream unchanged
(Host included), so SigV4 signatures still verify. Connections are kept
alive both ways, as S3's are, so a run of 10^5 requests does not cost 10^5
connects; a faulted connection is closed. 127.0.0.1 only.

Faults are drawn per request with the probabilities given (``set_faults``
changes them while running), or taken in order from ``script``
({substring of the request line: [kinds]}) first; with ``ranged_only`` only
GETs with a Range header are faulted, so a mount can list and open its
objects and only the reads of bytes fail.

``unconditional(key, range) -> (etag, content_range, body) | None`` makes
the proxy a server that ignores If-Match: a ranged GET the server refused
with 412 is answered 206 with what it returns (the test fetches the range
of the current version with its own client). ``fetch(key, range)`` has the
same form and serves ``shift``: it is asked for the shifted range.
"""

from __future__ import annotations

import random
import socket
import threading
import urllib.parse

KINDS = ("slowdown", "reset", "truncate", "stall_headers", "stall_silent", "trickle", "stall_body", "shift")
STALLS = ("stall_headers", "stall_silent", "stall_body")

FORBIDDEN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AccessDenied</Code>"
             b"<Message>Access Denied</Message></Error>")
SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")


def _read_head(sock: socket.socket, buffered: bytes = b"") -> tuple[bytes, bytes]:
    """(head, bytes after it); (b"", b"") when the peer closed first."""
    data = buffered
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
        if len(data) > 1 << 20:
            raise ValueError("header too long")
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


def _without(head: bytes, *names: bytes) -> list[bytes]:
    return [l for l in head.split(b"\r\n") if l.partition(b":")[0].strip().lower() not in names]


def _header(head: bytes, name: bytes) -> str | None:
    for line in head.split(b"\r\n")[1:]:
        n, _, value = line.partition(b":")
        if n.strip().lower() == name:
            return value.strip().decode()
    return None


class _Upstream:
    """One kept-alive connection to the server, opened again when it broke."""

    def __init__(self, port: int):
        self.port = port
        self.sock: socket.socket | None = None

    def exchange(self, request: bytes, is_head: bool) -> tuple[bytes, bytes]:
        """(status line and headers, without Connection, and without
        Content-Length but for a HEAD; the body)."""
        for attempt in (1, 2):
            if self.sock is None:
                self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=60)
            try:
                self.sock.sendall(request)
                rhead, body = _read_head(self.sock)
                if not rhead:
                    raise ConnectionError("upstream closed")
                # A HEAD's answer, a 204 (DELETE) and a 304 have no body, whatever their headers say.
                status = rhead.split(b" ", 2)[1] if rhead.count(b" ") >= 1 else b""
                n = 0 if is_head or status in (b"204", b"304") else _content_length(rhead)
                keep = n is not None and b"connection: close" not in rhead.lower()
                while n is None or len(body) < n:
                    chunk = self.sock.recv(1 << 20)
                    if not chunk:
                        break
                    body += chunk
                if not keep:
                    self.close()
                drop = (b"connection",) if is_head else (b"connection", b"content-length")
                return b"\r\n".join(_without(rhead, *drop)), body[:n]
            except (OSError, ConnectionError):
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class LocalListener:
    """A TCP listener on a free port of 127.0.0.1 that hands each connection
    to ``self._serve(conn)`` on a thread of its own; ``close()`` stops it."""

    def _listen(self) -> None:
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(128)
        self.port = self.server.getsockname()[1]
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.stopped.set()
        self.server.close()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError


class FaultProxy(LocalListener):
    def __init__(self, upstream_port: int, seed: int, p_slowdown=0.1, p_reset=0.1, p_truncate=0.1,
                 p_stall_headers=0.0, p_stall_silent=0.0, stall_s: float = 60, ranged_only=False,
                 p_stall_body=0.0, stall_once=False,
                 script: dict[str, list[str]] | None = None, unconditional=None, strip_etag=False,
                 bucket_region: str | None = None, latency_s: float = 0.0, p_shift=0.0, fetch=None):
        self.upstream_port = upstream_port
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.set_faults(p_slowdown, p_reset, p_truncate, p_stall_headers, p_stall_silent, p_stall_body=p_stall_body,
                        p_shift=p_shift)
        self.fetch = fetch
        self.stall_s = stall_s
        self.stall_once = stall_once
        self.stalled: set[tuple[bytes, str | None]] = set()  # (request line, Range) stalled so far
        self.stall_retried = 0  # requests that came again after their stall
        self.ranged_only = ranged_only
        self.script = {k: list(v) for k, v in (script or {}).items()}
        self.unconditional = unconditional
        self.strip_etag = strip_etag  # a gateway that drops the ETag header of every answer
        # As AWS answers a request signed for another region than the
        # bucket's: 301 PermanentRedirect naming the bucket's region.
        self.bucket_region = bucket_region
        self.latency_s = latency_s  # waited before each request, as for a distant server
        self.redirected = 0  # requests answered so
        self.signed_for: dict[str, int] = {}  # region in the credential scope -> requests
        self.ignored_if_match = 0  # 412s answered with the current version
        self.counts = {k: 0 for k in (*KINDS, "forbidden", "drop", "hold", "passed")}
        self.held = 0  # requests that reached a scripted hold
        self._released = threading.Event()
        self.requests: list[str] = []  # every request line (method and path), in arrival order
        self.ranged_gets = 0  # GETs with a Range header, faulted or not
        self.ranged_in_flight = 0
        self.peak_ranged_in_flight = 0  # most ranged GETs answered at once
        self._listen()

    def set_faults(self, p_slowdown=0.0, p_reset=0.0, p_truncate=0.0, p_stall_headers=0.0, p_stall_silent=0.0,
                   p_trickle=0.0, p_stall_body=0.0, p_shift=0.0):
        with self.lock:
            self.p = dict(zip(KINDS, (p_slowdown, p_reset, p_truncate, p_stall_headers, p_stall_silent, p_trickle,
                                      p_stall_body, p_shift)))

    def release(self) -> None:
        """Held requests, and any later ones scripted to be held, go on."""
        self._released.set()

    def set_script(self, script: dict[str, list[str]]) -> None:
        with self.lock:
            self.script = {k: list(v) for k, v in script.items()}

    def _choose(self, line: bytes, faultable: bool, has_body: bool, range_: str | None = None) -> str:
        """The fault for one request, counted; a fault that needs a body
        (reset, truncate, stall_headers, stall_body) passes a request
        without one, and with ``stall_once`` a stall passes a request
        stalled before."""
        with self.lock:
            kind = "passed"
            seen = (line, range_) in self.stalled
            self.stall_retried += seen
            scripted = next((v for k, v in self.script.items() if k.encode() in line and v), None)
            if faultable and scripted:
                kind = scripted.pop(0)
            elif faultable:
                x, acc = self.rng.random(), 0.0
                for k in KINDS:
                    acc += self.p[k]
                    if x < acc:
                        kind = k
                        break
            if kind in ("reset", "truncate", "stall_headers", "trickle", "stall_body", "shift") and not has_body:
                kind = "passed"
            if kind in STALLS and self.stall_once and seen:
                kind = "passed"
            if kind in STALLS:
                self.stalled.add((line, range_))
            self.counts[kind] += 1
            return kind

    def _serve(self, conn: socket.socket) -> None:
        upstream = _Upstream(self.upstream_port)
        with conn:
            conn.settimeout(120)
            try:
                rest = b""
                while not self.stopped.is_set():
                    head, rest = _read_head(conn, rest)
                    if not head:
                        return
                    body_len = _content_length(head) or 0
                    # As an HTTP/1.1 server does: a client that asked waits
                    # for this before sending the body (curl's large PUTs).
                    if (_header(head, b"expect") or "").lower() == "100-continue":
                        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    while len(rest) < body_len:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        rest += chunk
                    body, rest = rest[:body_len], rest[body_len:]
                    if not self._answer(conn, upstream, head, body):
                        return
            except (OSError, ValueError, ConnectionError):
                return
            finally:
                upstream.close()

    def _answer(self, conn: socket.socket, upstream: _Upstream, head: bytes, body: bytes) -> bool:
        """Answers one request; False when the connection is to be closed."""
        ranged = head.startswith(b"GET ") and b"\r\nrange:" in head.lower()
        if not ranged:
            return self._answer_one(conn, upstream, head, body, ranged, lambda: None)
        # A GET is in flight from its arrival until its answer is in hand
        # (not until sent: the client may ask again as soon as it has it).
        left = [False]

        def answered() -> None:
            with self.lock:
                if not left[0]:
                    left[0] = True
                    self.ranged_in_flight -= 1

        with self.lock:
            self.ranged_gets += 1
            self.ranged_in_flight += 1
            self.peak_ranged_in_flight = max(self.peak_ranged_in_flight, self.ranged_in_flight)
        try:
            return self._answer_one(conn, upstream, head, body, ranged, answered)
        finally:
            answered()

    def _answer_one(self, conn: socket.socket, upstream: _Upstream, head: bytes, body: bytes, ranged: bool,
                    answered) -> bool:
        if self.latency_s:
            self.stopped.wait(self.latency_s)
        is_head = head.startswith(b"HEAD ")
        if self.bucket_region and not self._signed_for_bucket_region(head):
            body = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>PermanentRedirect</Code><Message>"
                    b"The bucket you are attempting to access must be addressed using the specified endpoint."
                    b"</Message></Error>")
            conn.sendall(b"HTTP/1.1 301 Moved Permanently\r\nx-amz-bucket-region: " + self.bucket_region.encode()
                         + b"\r\nContent-Type: application/xml\r\nContent-Length: "
                         + (b"0" if is_head else str(len(body)).encode()) + b"\r\n\r\n" + (b"" if is_head else body))
            return True
        # Whether the answer will have a body of 2 bytes or more is known
        # only from upstream; a fault drawn for one without passes it.
        line = head.partition(b"\r\n")[0]
        with self.lock:
            self.requests.append(line.decode(errors="replace").rsplit(" ", 1)[0])
        kind = self._choose(line, ranged or not self.ranged_only, has_body=not is_head,
                            range_=_header(head, b"range"))
        if kind == "slowdown":
            conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                         + str(len(SLOWDOWN)).encode() + b"\r\nConnection: close\r\n\r\n" + SLOWDOWN)
            return False
        if kind == "stall_silent":
            self.stopped.wait(self.stall_s)
            return False
        if kind == "drop":  # scripted only
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return False
        if kind == "hold":  # scripted only: answered as passed once released
            with self.lock:
                self.held += 1
            while not self._released.wait(0.05) and not self.stopped.is_set():
                pass
            kind = "passed"
        if kind == "forbidden":  # scripted only: as a bucket policy that denies one object
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\nContent-Length: "
                         + str(len(FORBIDDEN)).encode() + b"\r\n\r\n" + FORBIDDEN)
            return True
        # The body goes with the head: upstream has nothing to continue.
        request = b"\r\n".join(_without(head, b"connection", b"expect")) + b"\r\n\r\n" + body
        status, rbody = upstream.exchange(request, is_head)
        answered()
        if ranged and self.unconditional and status.startswith((b"HTTP/1.1 412", b"HTTP/1.0 412")):
            status, rbody = self._ignore_if_match(line, head, status, rbody)
        if self.strip_etag:
            status = b"\r\n".join(_without(status, b"etag"))
        length = b"" if is_head else b"\r\nContent-Length: " + str(len(rbody)).encode()
        if kind != "passed" and len(rbody) < 2:
            with self.lock:  # nothing to cut: passed after all
                self.counts[kind] -= 1
                self.counts["passed"] += 1
            kind = "passed"
        if kind == "shift":
            status, rbody = self._shifted(line, head, status, rbody)
            length = b"\r\nContent-Length: " + str(len(rbody)).encode()
        if kind in ("passed", "shift"):
            conn.sendall(status + length + b"\r\n\r\n" + rbody)
            return True
        if kind == "stall_headers":
            conn.sendall(status + length + b"\r\n\r\n")
            self.stopped.wait(self.stall_s)
        elif kind == "stall_body":
            conn.sendall(status + length + b"\r\n\r\n" + rbody[: len(rbody) // 2])
            self.stopped.wait(self.stall_s)
        elif kind == "trickle":
            conn.sendall(status + length + b"\r\n\r\n")
            for i in range(len(rbody)):
                if self.stopped.wait(0.5):
                    break
                conn.sendall(rbody[i:i + 1])
        elif kind == "reset":
            conn.sendall(status + length + b"\r\n\r\n" + rbody[: len(rbody) // 2])
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        else:  # truncate, consistently: Content-Length says the short length
            short = rbody[: len(rbody) // 2]
            conn.sendall(status + b"\r\nContent-Length: " + str(len(short)).encode() + b"\r\nConnection: close"
                         + b"\r\n\r\n" + short)
        return False

    def _signed_for_bucket_region(self, head: bytes) -> bool:
        """Whether the request's SigV4 credential scope names the bucket's
        region (Credential=KEY/DATE/REGION/s3/aws4_request); counted."""
        auth = _header(head, b"authorization") or ""
        scope = auth.partition("Credential=")[2].split(",")[0].split("/")
        region = scope[2] if len(scope) > 2 else ""
        with self.lock:
            self.signed_for[region] = self.signed_for.get(region, 0) + 1
            if region != self.bucket_region:
                self.redirected += 1
        return region == self.bucket_region

    def _shifted(self, line: bytes, head: bytes, status: bytes, body: bytes) -> tuple[bytes, bytes]:
        """The answer to a ranged GET as for the range 4 KiB later (or
        earlier, at the object's end), with that range's bytes and an
        honest Content-Range; unchanged when no such range fits."""
        content_range = _header(status, b"content-range") or ""
        first, _, rest = content_range.removeprefix("bytes ").partition("-")
        last, _, size = rest.partition("/")
        if not (status.startswith(b"HTTP/1.1 206") and first.isdigit() and last.isdigit() and size.isdigit()):
            return status, body
        first, last, size = int(first), int(last), int(size)
        shift = 4096 if last + 4096 < size else -4096
        if first + shift < 0:
            return status, body
        path = urllib.parse.unquote(line.split(b" ")[1].split(b"?")[0].decode())
        key = path.lstrip("/").partition("/")[2]  # path style: /BUCKET/KEY
        etag, shifted_range, data = self.fetch(key, f"bytes={first + shift}-{last + shift}")
        return (f"HTTP/1.1 206 Partial Content\r\nETag: {etag}\r\nContent-Range: {shifted_range}\r\n"
                "Content-Type: application/octet-stream").encode(), data

    def _ignore_if_match(self, line: bytes, head: bytes, status: bytes, body: bytes) -> tuple[bytes, bytes]:
        path = urllib.parse.unquote(line.split(b" ")[1].split(b"?")[0].decode())
        key = path.lstrip("/").partition("/")[2]  # path style: /BUCKET/KEY
        got = self.unconditional(key, _header(head, b"range"))
        if got is None:
            return status, body
        etag, content_range, data = got
        with self.lock:
            self.ignored_if_match += 1
        return (f"HTTP/1.1 206 Partial Content\r\nETag: {etag}\r\nContent-Range: {content_range}\r\n"
                "Content-Type: application/octet-stream").encode(), data

