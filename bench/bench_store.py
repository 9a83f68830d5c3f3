#!/usr/bin/env python3
"""Benchmark of the index store at MoE scale (docs/BENCHMARKS.md, "The store").

Builds a synthetic source root holding one checkpoint of TENSORS tensors,
each row-split over RANKS ranks (TENSORS x RANKS chunks): torch's sharded
safetensors layout, `shard-RRRRR-model-FFFFF-of-NNNNN.safetensors` with
DCP_SHARDING_INFO, PER_FILE tensors per file. Then reports:

- `ckptfs index`: wall time, peak RSS, store size on disk;
- `Store::List()` + `Load()` of the result in a fresh process (`store_bench
  load`): time and RSS;
- the store alone, without parsing any file (`store_bench synth`): commit,
  size, List + Load of a synthetic checkpoint of the same shape;
- `ckptfs mount -f` of the indexed root: time until the mountpoint answers,
  the first `ls` of the checkpoint (its rows loaded, views built), `ls` of
  its consolidated/, the first consolidated/ header read and every header
  read, then `ls` of tensors/ (whose files are made on first use), and the
  daemon's RSS along the way;
- with --v1-bin (a ckptfs of schema 1): its `ckptfs index` time and index size
  on the same root, for comparison.

    python3 bench/bench_store.py [--tensors 100000] [--ranks 10] [--per-file 1000]
        [--bin build/ckptfs] [--store-bench build/store_bench] [--v1-bin PATH] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time


def write_shard(path: str, names: list[str], rank: int, rows_per_rank: int, cols: int) -> None:
    chunk = rows_per_rank * cols * 4  # F32
    header, offset = {}, 0
    for n in names:
        header[n] = {"dtype": "F32", "shape": [rows_per_rank, cols], "data_offsets": [offset, offset + chunk]}
        offset += chunk
    info = {n: {"saved_offsets": [rank * rows_per_rank, 0]} for n in names}
    header["__metadata__"] = {"DCP_SHARDING_INFO": json.dumps(info)}
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(bytes([rank]) * offset)


def make_root(root: str, tensors: int, ranks: int, per_file: int) -> None:
    ckpt = os.path.join(root, "step_1000")
    os.makedirs(ckpt)
    names = sorted(f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w" for i in range(tensors))
    files = (tensors + per_file - 1) // per_file
    for f in range(files):
        group = names[f * per_file:(f + 1) * per_file]
        for r in range(ranks):
            write_shard(os.path.join(ckpt, f"shard-{r + 1:05d}-model-{f + 1:05d}-of-{files:05d}.safetensors"),
                        group, r, rows_per_rank=1, cols=4)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def run_one(cmd: list[str]) -> tuple[float, float, str, str, int]:
    """(wall s, peak RSS MiB, stdout, stderr, exit status), via wait4 for this child's own rusage."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return wall, usage.ru_maxrss / 1024, out.read().decode(), err.read().decode(), proc.returncode


def rss_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def is_mounted(mnt: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == mnt for line in f)


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return round(time.monotonic() - t0, 3)


def read_header(path: str) -> int:
    """Reads a safetensors file's 8-byte length and JSON header; its length."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return len(f.read(n))


def bench_mount(binary: str, root: str, index: str, mnt: str) -> dict:
    """The already indexed root mounted in the foreground (our child, so its
    pid is known): mount until answering, then the first listings."""
    os.makedirs(mnt, exist_ok=True)
    log = mnt + ".log"
    t0 = time.monotonic()
    proc = subprocess.Popen([binary, "mount", "-f", root, mnt, "--index", index, "--log-file", log],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not is_mounted(mnt):
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                return {"error": f"mount did not come up (exit {proc.poll()})"}
            time.sleep(0.005)
        os.listdir(mnt)
        out = {"mount_answers_s": round(time.monotonic() - t0, 3), "rss_mounted_mib": rss_mib(proc.pid, "VmRSS")}
        ckpt = os.path.join(mnt, "step_1000")
        out["first_ls_checkpoint_s"] = timed(lambda: os.listdir(ckpt))
        out["ls_consolidated_s"] = timed(lambda: os.listdir(os.path.join(ckpt, "consolidated")))
        out["rss_loaded_mib"] = round(rss_mib(proc.pid, "VmRSS"), 1)
        cons = os.path.join(ckpt, "consolidated")
        weights = sorted(os.path.join(cons, f) for f in os.listdir(cons) if f.endswith(".safetensors"))
        out["consolidated_files"] = len(weights)
        out["first_header_read_s"] = timed(lambda: read_header(weights[0]))
        out["all_headers_read_s"] = timed(lambda: [read_header(w) for w in weights])
        out["rss_after_headers_mib"] = round(rss_mib(proc.pid, "VmRSS"), 1)
        # tensors/ last: its files are made on its first listing.
        out["ls_tensors_s"] = timed(lambda: os.listdir(os.path.join(ckpt, "tensors")))
        out["rss_after_ls_tensors_mib"] = round(rss_mib(proc.pid, "VmRSS"), 1)
        out["peak_rss_mib"] = round(rss_mib(proc.pid, "VmHWM"), 1)
        return out
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=10)
    ap.add_argument("--per-file", type=int, default=1000,
                    help="tensors per shard file (headers stay small enough to parse quickly)")
    ap.add_argument("--bin", default="build/ckptfs")
    ap.add_argument("--store-bench", default="build/store_bench")
    ap.add_argument("--v1-bin", default="")
    ap.add_argument("--keep", default="", help="build the root here and keep it")
    args = ap.parse_args()

    base = args.keep or tempfile.mkdtemp(prefix="ckptfs-bench-store-")
    root, index = os.path.join(base, "root"), os.path.join(base, "index")
    report: dict = {"tensors": args.tensors, "chunks": args.tensors * args.ranks, "loadavg": os.getloadavg()}
    try:
        if not os.path.isdir(root):
            t0 = time.monotonic()
            make_root(root, args.tensors, args.ranks, args.per_file)
            report["generate_s"] = round(time.monotonic() - t0, 2)
        shutil.rmtree(index, ignore_errors=True)
        wall, rss, _, err, rc = run_one([args.bin, "index", root, "--index", index, "-q"])
        if rc != 0:
            sys.exit(f"ckptfs index failed ({rc}): {err}")
        report["index"] = {"wall_s": round(wall, 2), "peak_rss_mib": round(rss, 1), "store_bytes": du(index)}
        _, rss, out, err, rc = run_one([args.store_bench, "load", os.path.realpath(root), index])
        report["list_and_load"] = json.loads(out) if rc == 0 else err
        synth = os.path.join(base, "synth-index")
        shutil.rmtree(synth, ignore_errors=True)
        _, _, out, err, rc = run_one([args.store_bench, "synth", str(args.tensors), str(args.ranks), synth])
        report["synthetic_commit"] = json.loads(out) if rc == 0 else err
        _, _, out, err, rc = run_one([args.store_bench, "load", "/bench-root", synth])
        report["synthetic_load"] = json.loads(out) if rc == 0 else err
        report["mount"] = bench_mount(args.bin, root, index, os.path.join(base, "mnt"))
        if args.v1_bin:
            v1 = os.path.join(base, "v1-index")
            shutil.rmtree(v1, ignore_errors=True)
            wall, rss, _, err, rc = run_one([args.v1_bin, "index", root, "--index", v1, "-q"])
            report["v1_index"] = {"wall_s": round(wall, 2), "peak_rss_mib": round(rss, 1), "store_bytes": du(v1),
                                  "exit": rc}
        report["loadavg_after"] = os.getloadavg()
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
