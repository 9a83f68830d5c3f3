#!/usr/bin/env python3
"""What one load of a DCP step asks of the S3 server: ckptfs against
s3torchconnector, on the same objects, in the same run.

On a machine where the server shares the CPUs with the client (the
benchmarks' SeaweedFS on 127.0.0.1), the server's work is part of every
load's time: a load that makes the server read more, or answer more
requests, is slower for it. Rows (each cold: page cache dropped):

  s3tc             dcp.load with s3torchconnector's S3StorageReader
                   (dcp_optimized reader)
  ckptfs BIN       mount s3:// (a fresh index: its framing reads count)
                   + load_file(consolidated/...) + a touch of every page

For each row, one pass with `strace -f -e trace=read` on the server
counts, from the requests it reads:
  GETs             the client's requests to the bucket
  chunk reads      the S3 gateway's reads of a whole stored chunk from its
                   volume server (SeaweedFS keeps an uploaded object as
                   chunks of its parts; a GET whose range crosses a chunk
                   boundary reads both chunks)
  ranged reads     the gateway's ranged reads of a chunk
and --passes passes without strace give the load's wall time and the
server's CPU seconds (user + system of `weed`): best and median.

    sudo python3 bench/bench_s3_server_work.py [--size-gib 1] [--passes 5] [--bin build/ckptfs ...]

--bin may be given more than once (an A/B of two builds). The state is
bench_dcp_load.py's (made there once, kept in --dir). Needs root
(drop_caches, FUSE), `weed`, strace, torch, safetensors, s3torchconnector.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "tools"))
import bench_dcp_load as dcp  # noqa: E402  (prepare, the loads, STEP)
import common  # noqa: E402
import s3_server  # noqa: E402


def count_requests(trace: str) -> dict:
    """The requests the server read, by kind (see the module's doc)."""
    text = Path(trace).read_text(errors="replace")
    heads = re.findall(r'"GET (\S+) HTTP/1\.1\\r\\n((?:[^"\\]|\\.)*)"', text)
    chunks = [h for path, h in heads if re.match(r"/\d+,", path)]
    ranged = sum(1 for h in chunks if re.search(r"[Rr]ange: bytes=", h))
    return {"GETs": sum(1 for path, _ in heads if path.startswith(f"/{s3_server.BUCKET}/")),
            "chunk reads": len(chunks) - ranged, "ranged reads": ranged}


def traced(server: s3_server.Server, load) -> dict:
    """load() once with strace on the server; the requests it made."""
    with tempfile.NamedTemporaryFile(suffix=".strace") as out:
        st = subprocess.Popen(["strace", "-f", "-e", "trace=read", "-s", "400", "-o", out.name,
                               "-p", str(server.proc.pid)], stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread
        try:
            load()
            time.sleep(0.5)
        finally:
            st.terminate()
            st.wait()
        return count_requests(out.name)


def timed(server: s3_server.Server, load) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of one cold load()."""
    common.drop_caches()
    cpu0, t0 = common.process_cpu(server.proc.pid), time.monotonic()
    load()
    return time.monotonic() - t0, common.process_cpu(server.proc.pid) - cpu0


def ckptfs_load(binary: str, work: str):
    def load():
        d = tempfile.mkdtemp(dir=work)
        m = common.Mounted(binary, f"s3://{s3_server.BUCKET}/{dcp.STEP}", os.path.join(d, "mnt"),
                           os.path.join(d, "index"), os.path.join(d, "mount.log"))
        try:
            m.start()
            sd = dcp.touch(dcp.load_folder(os.path.join(m.mnt, "consolidated")))
            del sd
        finally:
            m.stop()
            shutil.rmtree(d, ignore_errors=True)
    return load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-dcp", help="bench_dcp_load.py's work directory")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--passes", type=int, default=5, help="timed passes per row (without strace)")
    ap.add_argument("--bin", action="append", help="ckptfs binary (repeat for an A/B; default build/ckptfs)")
    args = ap.parse_args()
    bins = [os.path.abspath(b) for b in (args.bin or [os.path.join(HERE, "..", "build", "ckptfs")])]
    top = os.path.abspath(args.dir)
    os.makedirs(top, exist_ok=True)
    step, _, specs, _ = dcp.prepare(top, args.size_gib)
    work = os.path.join(top, "server-work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(os.path.join(work, "weed"))
    server = s3_server.Server(Path(work, "weed"), volumes=int(args.size_gib * 2 * 1024 / 64) + 16,
                              max_attempts=None, pool=32)
    try:
        os.environ.update(server.env())
        for f in sorted(os.listdir(step)):
            server.client.upload_file(os.path.join(step, f), s3_server.BUCKET, f"{dcp.STEP}/{f}")
        rows = {"s3tc": lambda: dcp.touch(dcp.s3tc_load(specs))}
        for b in bins:
            rows[f"ckptfs {b}"] = ckptfs_load(b, work)
        for load in rows.values():
            load()  # imports and first connections out of the timed passes
        load0 = os.getloadavg()[0]
        counts = {name: traced(server, load) for name, load in rows.items()}
        times: dict[str, list] = {name: [] for name in rows}
        for _ in range(args.passes):
            for name, load in rows.items():  # interleaved: a slow spell of the machine hits every row
                times[name].append(timed(server, load))
        print(f"\nload average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; {args.passes} cold passes")
        print(f"{'row':<40} {'GETs':>6} {'chunk reads':>12} {'ranged reads':>13}   "
              f"{'wall best/median s':>19}   {'server CPU best/median s':>25}")
        for name in rows:
            c, t = counts[name], times[name]
            walls, cpus = [x[0] for x in t], [x[1] for x in t]
            label = name if len(name) <= 40 else "..." + name[-37:]
            print(f"{label:<40} {c['GETs']:>6} {c['chunk reads']:>12} {c['ranged reads']:>13}   "
                  f"{min(walls):>8.2f} / {statistics.median(walls):<8.2f}   "
                  f"{min(cpus):>11.2f} / {statistics.median(cpus):<11.2f}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
