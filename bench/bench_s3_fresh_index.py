#!/usr/bin/env python3
"""What a fresh index costs a load of a DCP step from object storage, split
into the mount's start and the load after it.

bench_dcp_load.py's S3 step row times a fresh index and the load together.
Here, on the same state (its --dir: the step saved by 4 gloo ranks),
uploaded to a new local SeaweedFS (tools/s3_server.py), each pass mounts
the step three ways, in alternating order, cold (page cache dropped before
each mount):

  fresh         a new index, as the S3 step row does
  stored        an index built by `ckptfs index` before the passes
  fresh+sleep   a new index, then 1 s idle before the load: whatever the
                index leaves running (the server's work, the store's
                background writes) has ended when the load begins

and times, for each, the mount's start (index included) and then
safetensors' `load_file(consolidated/model.safetensors)` with a touch of
every page, as bench_dcp_load.py does, with the daemon's CPU seconds in
each phase. If the fresh rows' loads match the stored row's, a fresh index
costs its start and nothing after it.

    python3 bench/bench_s3_fresh_index.py [--dir /tmp/ckptfs-bench-dcp] [--size-gib 1] [--passes 4]

Needs root (drop_caches, FUSE), `weed`, torch, safetensors, boto3.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))
import bench_dcp_load as dcp_bench  # noqa: E402  (its state, load and touch)
import common  # noqa: E402
import s3_server  # noqa: E402  (tools/s3_server.py: SeaweedFS)

KINDS = ("fresh", "stored", "fresh+sleep")


def upload_step(server, step: str) -> str:
    files = sorted(f for f in os.listdir(step) if f.endswith(".distcp") or f in (".metadata", "config.json"))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda f: server.client.upload_file(os.path.join(step, f), s3_server.BUCKET,
                                                          f"{dcp_bench.STEP}/{f}"), files))
    return f"s3://{s3_server.BUCKET}/{dcp_bench.STEP}"


def one_load(binary: str, root: str, work: Path, n: int, kind: str, stored: Path) -> dict:
    """One cold mount of `root` and load: its phases' seconds and CPU."""
    d = work / f"mount-{n}"
    index = stored if kind == "stored" else d / "index"
    m = common.Mounted(binary, root, str(d / "mnt"), str(index), str(d / "mount.log"), [])
    common.drop_caches()
    t0 = time.monotonic()
    m.start()
    out = {"start": time.monotonic() - t0, "start_cpu": common.process_cpu(m.proc.pid)}
    try:
        if kind == "fresh+sleep":
            time.sleep(1.0)
        idle_cpu = common.process_cpu(m.proc.pid)
        t1 = time.monotonic()
        r = dcp_bench.touch(dcp_bench.load_folder(os.path.join(m.mnt, "consolidated")))
        out["load"] = time.monotonic() - t1
        out["load_cpu"] = common.process_cpu(m.proc.pid) - idle_cpu
        del r
    finally:
        m.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-dcp", help="bench_dcp_load.py's state (made if missing)")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--bin", default=os.path.join(HERE, "..", "build", "ckptfs"))
    args = ap.parse_args()
    binary = os.path.abspath(args.bin)
    top = os.path.abspath(args.dir)
    os.makedirs(top, exist_ok=True)
    step = dcp_bench.prepare(top, args.size_gib)[0]
    weed, work = Path(top) / "weed-fresh-index", Path(top) / "work-fresh-index"
    for d in (weed, work):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    server = s3_server.Server(weed, volumes=int(args.size_gib * 1024 / 64) + 16, max_attempts=None, pool=32)
    try:
        os.environ.update(server.env())
        root = upload_step(server, step)
        stored = work / "stored-index"
        subprocess.run([binary, "index", root, "--index", str(stored), "-q"], check=True)
        load0 = os.getloadavg()[0]
        runs: dict[str, list[dict]] = {k: [] for k in KINDS}
        n = 0
        for p in range(args.passes):
            for kind in KINDS if p % 2 == 0 else KINDS[::-1]:
                n += 1
                r = one_load(binary, root, work, n, kind, stored)
                runs[kind].append(r)
                print(f"pass {p + 1}  {kind:<12} start {r['start']:.3f} s (daemon CPU {r['start_cpu']:.2f} s)  "
                      f"load {r['load']:.3f} s (daemon CPU {r['load_cpu']:.2f} s)", flush=True)
        print(f"\nload average {load0:.2f} at start, {os.getloadavg()[0]:.2f} at end; {args.passes} passes")
        print(f"{'mount':<12} {'start best':>10} {'median':>7} {'load best':>10} {'median':>7}")
        for kind, rs in runs.items():
            starts, loads = sorted(r["start"] for r in rs), sorted(r["load"] for r in rs)
            print(f"{kind:<12} {starts[0]:10.3f} {starts[len(rs) // 2]:7.3f} {loads[0]:10.3f} {loads[len(rs) // 2]:7.3f}")
    finally:
        server.stop()
        shutil.rmtree(weed, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
