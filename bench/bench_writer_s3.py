#!/usr/bin/env python3
"""Saving a host state dict to S3: ckptfs's StorageWriter("s3://...") vs
s3torchconnector's S3StorageWriter vs a boto3 upload of the same bytes with
8 threads (TransferConfig: multipart, 8 parts in flight).

    python3 bench/bench_writer_s3.py --seaweedfs /tmp/bench-s3 [--gib 2]
    python3 bench/bench_writer_s3.py --endpoint http://minio:9000 --bucket ckpts [--gib 2]

One process per contender (dcp.save(no_dist=True); the same state dict,
built from a fixed seed, the same server and bucket, each under its own
prefix, deleted afterwards), so each one's host memory is its own: the
figure is the peak RSS (VmHWM) minus the RSS once the state dict is built
and the writer made (imports and set-up are outside the clock too).
With --seaweedfs DIR a local SeaweedFS is started in DIR
(tools/s3_server.py) and stopped at the end; otherwise the AWS_* environment (or
--endpoint, --bucket) says where. Prints seconds, GB/s and the ratio to
boto3's upload, best of --repeat. Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONTENDERS = ("ckptfs", "s3torchconnector", "boto3")


def state_dict(gib: float) -> dict:
    import torch
    g = torch.Generator().manual_seed(0)
    sd, total, i = {}, 0, 0
    target = int(gib * (1 << 30))
    while total < target:  # Llama-like matrices, bf16 and f32
        shape, dtype = ((5632, 2048), torch.bfloat16) if i % 3 else ((2048, 2048), torch.float32)
        n = min(shape[0] * shape[1], max(1, (target - total) // (2 if dtype == torch.bfloat16 else 4)))
        sd[f"layers.{i}.w"] = torch.randn(n, generator=g).to(dtype)
        total += sd[f"layers.{i}.w"].nbytes
        i += 1
    return sd


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _TensorStream:
    """A file-like object over the tensors' bytes, read in order, no copy
    of the whole (boto3 reads it part by part)."""

    def __init__(self, sd: dict):
        import torch
        self.views = [memoryview(t.view(torch.uint8).numpy()) for t in sd.values()]
        self.i, self.at = 0, 0

    def read(self, n: int = -1) -> bytes:
        out = []
        while (n < 0 or n > 0) and self.i < len(self.views):
            v = self.views[self.i]
            take = len(v) - self.at if n < 0 else min(n, len(v) - self.at)
            out.append(bytes(v[self.at:self.at + take]))
            self.at += take
            n -= take if n > 0 else 0
            if self.at == len(v):
                self.i, self.at = self.i + 1, 0
        return b"".join(out)


def _s3tc_writer(url: str, endpoint: str):
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageWriter
    from s3torchconnector.dcp.s3_file_system import S3FileSystem
    config = S3ClientConfig(force_path_style=True)
    writer = S3StorageWriter("us-east-1", url, s3client_config=config, thread_count=8)
    writer.fs = S3FileSystem("us-east-1", s3_client=S3Client("us-east-1", endpoint=endpoint, s3client_config=config))
    return writer


def child(which: str, gib: float, endpoint: str, bucket: str, prefix: str) -> dict:
    import torch.distributed.checkpoint as dcp
    sd = state_dict(gib)
    nbytes = sum(t.nbytes for t in sd.values())
    url = f"s3://{bucket}/{prefix}"
    # Everything is imported and made before the clock starts.
    if which == "ckptfs":
        from ckptfs.torch import StorageWriter
        writer = StorageWriter(url, endpoint_url=endpoint, force_path_style=True)
    elif which == "s3torchconnector":
        writer = _s3tc_writer(url, endpoint)
    else:
        import boto3
        from boto3.s3.transfer import TransferConfig
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        config = TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8)
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    if which == "boto3":
        client.upload_fileobj(_TensorStream(sd), bucket, f"{prefix}/raw.bin", Config=config)
    else:
        dcp.save(sd, storage_writer=writer, no_dist=True)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": nbytes, "rss_growth_mib": (_rss_kib("VmHWM") - base) / 1024}


def _delete_prefix(endpoint: str, bucket: str, prefix: str) -> None:
    import boto3
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=o["Key"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seaweedfs", help="start a local SeaweedFS in this directory")
    ap.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL", ""))
    ap.add_argument("--bucket", default="ckpts")
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--prefix", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.gib, args.endpoint, args.bucket, args.prefix)))
        return
    server = None
    if args.seaweedfs:
        sys.path.insert(0, os.path.join(HERE, "..", "tools"))
        import s3_server
        from pathlib import Path
        os.makedirs(args.seaweedfs, exist_ok=True)
        # 64 MB volumes; a deleted prefix's space comes back only once the
        # server compacts, so every save of every pass needs room of its own.
        volumes = int(args.gib * len(CONTENDERS) * args.repeat * 16 * 1.25) + 16
        server = s3_server.Server(Path(args.seaweedfs), volumes=volumes, max_attempts=None, pool=32)
        args.endpoint, args.bucket = server.endpoint, s3_server.BUCKET
        os.environ.update(AWS_ACCESS_KEY_ID=s3_server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3_server.SECRET_KEY)
    os.environ["AWS_ENDPOINT_URL"] = args.endpoint
    env = dict(os.environ)
    try:
        best: dict[str, dict] = {}
        for r in range(args.repeat):
            for which in CONTENDERS:
                prefix = f"bench-writer-s3/{which}-{r}"
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", which, "--gib",
                                      str(args.gib), "--endpoint", args.endpoint, "--bucket", args.bucket,
                                      "--prefix", prefix], env=env, capture_output=True, text=True)
                _delete_prefix(args.endpoint, args.bucket, prefix)
                if out.returncode != 0:
                    sys.exit(f"{which} failed:\n{out.stderr[-4000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                if which not in best or res["seconds"] < best[which]["seconds"]:
                    best[which] = res
        base = best["boto3"]["seconds"]
        print(f"{'writer':<18}{'seconds':>9}{'GB/s':>8}{'vs boto3':>10}{'host MiB':>10}")
        for which in CONTENDERS:
            b = best[which]
            print(f"{which:<18}{b['seconds']:>9.2f}{b['bytes'] / b['seconds'] / 1e9:>8.2f}"
                  f"{base / b['seconds']:>9.2f}x{b['rss_growth_mib']:>10.0f}")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
