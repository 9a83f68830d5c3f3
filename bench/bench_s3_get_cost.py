#!/usr/bin/env python3
"""What one ranged GET costs the local S3 server's CPU, by the size of the
range, and whether `If-Match` (which ckptfs sends on every GET, pinning a
read to the indexed ETag) adds to it.

A fresh SeaweedFS (tools/s3_server.py) holds one random object uploaded in
8 MiB parts, as the benchmarks' checkpoints are. For each row, --gets
ranged GETs at the same random offsets, one at a time, each checked
against the uploaded bytes; the row's wall time and the CPU seconds the
server's `weed` process used meanwhile (from /proc), best of --passes. Rows:

  4 KiB            a GET the size of two items' framing (the indexer's
                   torch.save head and tail, indexer/torch_zip.h)
  4 KiB, If-Match  the same, with the object's ETag in If-Match
  64 KiB, 4 MiB    larger ranges, for the per-byte part of the cost

What it answers: whether the fresh index's framing GETs could be made
cheaper for the server by asking for fewer bytes or by leaving If-Match
out, or whether each costs a fixed amount per request (then only fewer
requests help; docs/ARCHITECTURE.md, "Decisions and why").

    python3 bench/bench_s3_get_cost.py [--dir /tmp/ckptfs-bench-get-cost] [--mib 256] [--gets 300] [--passes 3]

Needs `weed` and boto3.
"""
from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import common  # noqa: E402  (bench/common.py)
import s3_server  # noqa: E402  (tools/s3_server.py: SeaweedFS)
from boto3.s3.transfer import TransferConfig  # noqa: E402

KEY = "object"
ROWS = [("4 KiB", 4 << 10, False), ("4 KiB, If-Match", 4 << 10, True),
        ("64 KiB", 64 << 10, False), ("4 MiB", 4 << 20, False)]


def one_row(server, data: bytes, etag: str, offsets: list[int], size: int, if_match: bool) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of one GET per offset."""
    extra = {"IfMatch": etag} if if_match else {}
    cpu0, t0 = common.process_cpu(server.proc.pid), time.monotonic()
    for off in offsets:
        off = min(off, len(data) - size)
        body = server.client.get_object(Bucket=s3_server.BUCKET, Key=KEY,
                                        Range=f"bytes={off}-{off + size - 1}", **extra)["Body"].read()
        if body != data[off:off + size]:
            raise RuntimeError(f"GET of {size} bytes at {off}: wrong bytes")
    return time.monotonic() - t0, common.process_cpu(server.proc.pid) - cpu0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-get-cost", help="the server's data (recreated)")
    ap.add_argument("--mib", type=int, default=256, help="size of the object (MiB)")
    ap.add_argument("--gets", type=int, default=300, help="GETs per row and pass")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()

    top = Path(args.dir)
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir(parents=True)
    server = s3_server.Server(top, volumes=16)
    try:
        data = os.urandom(args.mib << 20)
        parts = TransferConfig(multipart_chunksize=8 << 20, multipart_threshold=8 << 20)
        server.client.upload_fileobj(io.BytesIO(data), s3_server.BUCKET, KEY, Config=parts)
        etag = server.client.head_object(Bucket=s3_server.BUCKET, Key=KEY)["ETag"]
        rng = random.Random(1)
        offsets = [rng.randrange(0, len(data)) for _ in range(args.gets)]
        load0 = os.getloadavg()[0]
        best: dict[str, tuple[float, float]] = {}
        for p in range(args.passes):
            for name, size, if_match in ROWS:
                wall, cpu = one_row(server, data, etag, offsets, size, if_match)
                print(f"pass {p + 1}  {name:<16} wall {wall:.3f} s  server CPU {cpu:.3f} s", flush=True)
                old = best.get(name)
                best[name] = (min(wall, old[0]), min(cpu, old[1])) if old else (wall, cpu)
        print(f"\nload average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; "
              f"{args.gets} GETs per row, best of {args.passes}")
        print(f"{'row':<16} {'wall s':>8} {'server CPU s':>13} {'CPU ms per GET':>15}")
        for name, _, _ in ROWS:
            wall, cpu = best[name]
            print(f"{name:<16} {wall:8.3f} {cpu:13.3f} {1000 * cpu / args.gets:15.2f}")
    finally:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
