"""An HTTP proxy for tests, between ckptfs and a local S3 server, that
injects the failures object storage shows: 503 SlowDown, connections reset
in the middle of a body, and bodies cut short with a matching
Content-Length (only a client that checks the length it asked for sees
them). The request bytes go upstream unchanged (Host included), so SigV4
signatures still verify. One request per connection; 127.0.0.1 only.
"""

from __future__ import annotations

import random
import socket
import threading

SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")


def _read_head(sock: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return b"", b""
        data += chunk
        if len(data) > 1 << 20:
            raise ValueError("header too long")
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


class FaultProxy:
    def __init__(self, upstream_port: int, seed: int, p_slowdown=0.1, p_reset=0.1, p_truncate=0.1):
        self.upstream_port = upstream_port
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.p = (p_slowdown, p_reset, p_truncate)
        self.counts = {"slowdown": 0, "reset": 0, "truncate": 0, "passed": 0}
        self.ranged_gets = 0  # GETs with a Range header, faulted or not
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.port = self.server.getsockname()[1]
        self.stopped = False
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _choose(self) -> str:
        with self.lock:
            x = self.rng.random()
            ps, pr, pt = self.p
            kind = "slowdown" if x < ps else "reset" if x < ps + pr else "truncate" if x < ps + pr + pt else "passed"
            self.counts[kind] += 1
            return kind

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                head, rest = _read_head(conn)
                if not head:
                    return
                if head.startswith(b"GET ") and b"\r\nrange:" in head.lower():
                    with self.lock:
                        self.ranged_gets += 1
                kind = self._choose()
                if kind == "slowdown":
                    conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: "
                                 + str(len(SLOWDOWN)).encode() + b"\r\nConnection: close\r\n\r\n" + SLOWDOWN)
                    return
                status, body = self._forward(head + b"\r\n\r\n" + rest)
                is_head = head.startswith(b"HEAD ")
                if kind == "passed" or is_head or len(body) < 2:
                    conn.sendall(status + body)
                elif kind == "reset":
                    conn.sendall(status + body[: len(body) // 2])
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                else:  # truncate, consistently: Content-Length says the short length
                    short = body[: len(body) // 2]
                    lines = [l for l in status.split(b"\r\n") if l and not l.lower().startswith(b"content-length")]
                    conn.sendall(b"\r\n".join(lines) + b"\r\nContent-Length: " + str(len(short)).encode()
                                 + b"\r\n\r\n" + short)
            except (OSError, ValueError):
                return

    def _forward(self, request: bytes) -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30) as up:
            # One request per connection, both ways.
            head, _, rest = request.partition(b"\r\n\r\n")
            lines = [l for l in head.split(b"\r\n") if not l.lower().startswith(b"connection:")]
            up.sendall(b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n" + rest)
            rhead, body = _read_head(up)
            n = 0 if request.startswith(b"HEAD ") else _content_length(rhead)
            while len(body) < n:
                chunk = up.recv(1 << 20)
                if not chunk:
                    break
                body += chunk
            lines = [l for l in rhead.split(b"\r\n") if not l.lower().startswith(b"connection:")]
            return b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n", body[:n]

    def close(self) -> None:
        self.stopped = True
        self.server.close()
