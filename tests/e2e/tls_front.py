"""A TLS front for the test S3 server: accepts https on 127.0.0.1 with a
certificate made for the test (``make_certificate``, by the openssl
command) and passes the bytes through to the server's plain port. The
server checks signatures against the Host header as sent, so requests
signed for the front's address verify as they would behind a real TLS
terminator.

Only traffic to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

from s3_fault_proxy import LocalListener


def make_certificate(d: Path) -> tuple[Path, Path]:
    """A self-signed certificate for IP 127.0.0.1 and its key, as PEM files
    (the certificate is also the CA that a client must trust)."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl not found: apt-get install openssl (tools/setup.sh)"
    cert, key = d / "front-cert.pem", d / "front-key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


class TlsFront(LocalListener):
    def __init__(self, upstream_port: int, cert: Path, key: Path):
        self.upstream_port = upstream_port
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(cert), str(key))
        self.handshakes_failed = 0
        self._listen()
        self.endpoint = f"https://127.0.0.1:{self.port}"

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(60)
        try:
            tls = self.context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            self.handshakes_failed += 1  # a client that does not trust the certificate
            conn.close()
            return
        with tls, socket.create_connection(("127.0.0.1", self.upstream_port), timeout=60) as up:
            back = threading.Thread(target=self._pump, args=(up, tls), daemon=True)
            back.start()
            self._pump(tls, up)
            back.join(timeout=60)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
