#!/usr/bin/env python3
"""How soon a DCP step in object storage can be read through ckptfs, and
what ckptfs asks the server before the first byte, when every request
costs a distant server's round trip.

A local S3 server (SeaweedFS, tools/s3_server.py) holds a DCP step saved by
4 gloo ranks with stock dcp.save (bench/bench_dcp_load.py's state; default
0.1 GiB: what is measured here grows with the number of items and files,
not with the bytes). Between ckptfs and the server, the tests' proxy
(tools/s3_fault_proxy.py) holds each request --latency-ms before
passing it on and records every request line. Rows, per latency and build:

  index          `ckptfs index s3://...` into a fresh index
  first MiB      a fresh mount (fresh index): from `ckptfs mount` to the
                 first MiB of consolidated/model.safetensors read
  first MiB, stored index
                 the same over the index the first row built (what a
                 mount of a known root pays)
  reference      boto3, through the same proxy: LIST of the step, then GET
                 of its .metadata, which any DCP loader reads before a
                 tensor (the floor of two round trips)

With --index-threads N..., only the index row runs instead, straight to the
server (no proxy, no added latency), once per `--max-threads` N: whether
more GETs in flight shorten the reads of the items' framing, or the
server's CPU bounds them (on the 2-core test machine it does).

Each row gives its best time of --passes, its ratio to the reference's
best, and the requests of its last pass by kind (HEAD, LIST, GET). With
--bin-old, the rows run for both builds in each pass, the builds taking
turns going first. Exactness is the test suite's (test_s3_mount.py pins
the same paths); this script times them.

    python3 bench/bench_s3_start.py [--dir /tmp/ckptfs-bench-start] [--size-gib 0.1] \\
        [--latency-ms 20 50] [--passes 3] [--bin build/ckptfs] [--bin-old OTHER]
    python3 bench/bench_s3_start.py --size-gib 1 --index-threads 1 4 16 64

Needs root (FUSE), `weed`, torch (to save the step), boto3.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "tools"))
import bench_dcp_load  # noqa: E402  (the DCP step, saved by 4 gloo ranks)
import common  # noqa: E402  (Mounted)
import s3_server  # noqa: E402  (SeaweedFS)
from s3_fault_proxy import FaultProxy  # noqa: E402  (latency and the request log)

PREFIX = "start/step_1/"
FIRST = 1 << 20


def kinds(requests: list[str]) -> str:
    """'H HEAD, L LIST, G GET' of request lines."""
    heads = sum(q.startswith("HEAD ") for q in requests)
    lists = sum(q.startswith("GET ") and "list-type=" in q for q in requests)
    gets = sum(q.startswith("GET ") for q in requests) - lists
    return f"{heads} HEAD, {lists} LIST, {gets} GET"


class Bench:
    def __init__(self, args, server: s3_server.Server, work: str):
        self.args, self.server, self.work = args, server, work
        self.env = os.environ  # the server's identity (main); Mounted's daemons inherit it too
        self.n = 0

    def proxy(self, latency_s: float) -> FaultProxy:
        return FaultProxy(self.server.port, seed=0, p_slowdown=0, p_reset=0, p_truncate=0, latency_s=latency_s)

    def index(self, binary: str, proxy: FaultProxy | None, index_dir: str, *extra: str) -> float:
        endpoint = f"http://127.0.0.1:{proxy.port}" if proxy else self.server.endpoint
        t0 = time.monotonic()
        p = subprocess.run([binary, "index", "-q", "--index", index_dir, "--endpoint-url", endpoint,
                            f"s3://{s3_server.BUCKET}/{PREFIX}", *extra],
                           env=self.env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"ckptfs index failed: {p.stderr}")
        return time.monotonic() - t0

    def first_mib(self, binary: str, proxy: FaultProxy, index_dir: str) -> float:
        self.n += 1
        mnt = os.path.join(self.work, f"mnt-{self.n}")
        m = common.Mounted(binary, f"s3://{s3_server.BUCKET}/{PREFIX}", mnt, index_dir,
                           os.path.join(self.work, f"mount-{self.n}.log"),
                           ["--endpoint-url", f"http://127.0.0.1:{proxy.port}"])
        t0 = time.monotonic()
        try:
            m.start()
            with open(os.path.join(mnt, "consolidated", "model.safetensors"), "rb") as f:
                got = len(f.read(FIRST))
            if got != FIRST:
                raise RuntimeError(f"read {got} bytes of the first MiB")
            return time.monotonic() - t0
        finally:
            m.stop()

    def reference(self, proxy: FaultProxy) -> float:
        client = s3_server.client_for(f"http://127.0.0.1:{proxy.port}")
        t0 = time.monotonic()
        listed = client.list_objects_v2(Bucket=s3_server.BUCKET, Prefix=PREFIX, Delimiter="/")
        assert any(o["Key"].endswith("/.metadata") for o in listed["Contents"])
        client.get_object(Bucket=s3_server.BUCKET, Key=PREFIX + ".metadata")["Body"].read()
        return time.monotonic() - t0

    def rows_of(self, binary: str, latency_s: float, results: dict, tag: str) -> None:
        """The three ckptfs rows, through one proxy (one endpoint: the
        stored index is of the same root)."""
        index_dir = tempfile.mkdtemp(prefix="index-", dir=self.work)
        proxy = self.proxy(latency_s)
        try:
            for row, run in (("index", lambda: self.index(binary, proxy, index_dir)),
                             ("first MiB, stored index", lambda: self.first_mib(binary, proxy, index_dir)),
                             ("first MiB", lambda: self.first_mib(binary, proxy, tempfile.mkdtemp(dir=self.work)))):
                before = len(proxy.requests)
                seconds = run()
                best, _ = results.get((tag, row), (float("inf"), ""))
                results[(tag, row)] = (min(best, seconds), kinds(proxy.requests[before:]))
        finally:
            proxy.close()
            shutil.rmtree(index_dir, ignore_errors=True)


def index_threads(bench: Bench, builds: list, threads: list[int], passes: int) -> None:
    """The index row straight to the server, per --max-threads value."""
    results: dict = {}
    for p in range(passes):
        for n in threads:
            for tag, binary in (builds if p % 2 == 0 else builds[::-1]):
                index_dir = tempfile.mkdtemp(prefix="index-", dir=bench.work)
                seconds = bench.index(binary, None, index_dir, "--max-threads", str(n))
                shutil.rmtree(index_dir, ignore_errors=True)
                results[(tag, n)] = min(results.get((tag, n), float("inf")), seconds)
    print(f"\n== fresh index, no proxy, best of {passes}")
    print(f"{'build':6} {'--max-threads':>13} {'best s':>8}")
    for (tag, n), best in results.items():
        print(f"{tag:6} {n:13d} {best:8.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-start")
    ap.add_argument("--size-gib", type=float, default=0.1)
    ap.add_argument("--latency-ms", type=float, nargs="+", default=[20, 50])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "ckptfs"))
    ap.add_argument("--bin-old", help="another build, measured in the same passes")
    ap.add_argument("--index-threads", type=int, nargs="+",
                    help="time only a fresh index, straight to the server, at each of these --max-threads")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    step, _, specs, _ = bench_dcp_load.prepare(args.dir, args.size_gib)
    files = sorted(os.listdir(step))
    print(f"step: {len(specs)} tensors in {len(files)} files ({', '.join(files)})", flush=True)
    builds = [("new", os.path.abspath(args.bin))] + ([("old", os.path.abspath(args.bin_old))] if args.bin_old else [])
    load = os.getloadavg()[0]
    work = tempfile.mkdtemp(prefix="run-", dir=args.dir)
    (Path(work) / "seaweedfs").mkdir()
    server = s3_server.Server(Path(work) / "seaweedfs", volumes=int(args.size_gib * 1.5 * 1024 / 64) + 16)
    try:
        s3_server.upload_tree(server.client, step, PREFIX)
        os.environ.update(server.env())
        bench = Bench(args, server, work)
        if args.index_threads:
            index_threads(bench, builds, args.index_threads, args.passes)
        latencies = [] if args.index_threads else args.latency_ms  # --index-threads: that row alone
        for latency in latencies:
            results: dict = {}
            for p in range(args.passes):
                order = builds if p % 2 == 0 else builds[::-1]
                for tag, binary in order:
                    bench.rows_of(binary, latency / 1000, results, tag)
                proxy = bench.proxy(latency / 1000)
                try:
                    ref = bench.reference(proxy)
                finally:
                    proxy.close()
                best, _ = results.get(("ref", "reference"), (float("inf"), ""))
                results[("ref", "reference")] = (min(best, ref), kinds(proxy.requests))
            ref_best = results[("ref", "reference")][0]
            print(f"\n== {latency:g} ms per request, best of {args.passes}")
            print(f"{'build':6} {'row':26} {'best s':>8} {'x ref':>7}  requests (last pass)")
            for (tag, row), (best, req) in results.items():
                print(f"{tag:6} {row:26} {best:8.3f} {best / ref_best:7.2f}  {req}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nload average {load:.2f} at start, {os.getloadavg()[0]:.2f} at end; build {common.git_rev()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
