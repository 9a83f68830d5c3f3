#!/usr/bin/env python3
"""A/B of ckptfs binaries (or mount options) on one checkpoint, cold.

Each configuration is mounted at once on the same source tree (its own index
and mountpoint); every pass then drops the page cache and reads one virtual
file through each mount in turn, alternating the order, so that a noisy disk
or a busy machine hits every configuration alike. Reported per configuration:
wall time of the pass (best and median) and the CPU the mount daemon spent
on it (utime + stime from /proc/PID/stat), which is far steadier than wall
time on a shared 2-core machine.

    python3 tools/bench_ab.py --root /tmp/ckptfs-bench/checkpoint \\
        --config old=/tmp/ckptfs-old --config new=build/ckptfs --passes 7

A configuration is NAME=BINARY[,MOUNT_ARG...]. `--pattern` picks sequential
1 MiB read() calls (default) or safe_open + get_tensor of every tensor.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the mount, cache and client helpers)


def daemon_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_config(text: str) -> tuple[str, str, list[str]]:
    name, _, rest = text.partition("=")
    if not name or not rest:
        raise argparse.ArgumentTypeError(f"--config {text!r}: expected NAME=BINARY[,MOUNT_ARG...]")
    binary, *extra = rest.split(",")
    return name, os.path.abspath(binary), extra


def one_pass(mount: bench.Mounted, rel: str, pattern: str) -> tuple[float, float, int]:
    path = os.path.join(mount.mnt, rel)
    how = bench.make_cold([path])
    if how != "drop_caches":
        raise SystemExit("bench_ab needs root to drop the page cache (cold passes)")
    cpu0 = daemon_cpu_seconds(mount.proc.pid)
    t0 = time.monotonic()
    n = bench.read_pass([path]) if pattern == "read" else bench.safe_open_pass([path])
    wall = time.monotonic() - t0
    return wall, daemon_cpu_seconds(mount.proc.pid) - cpu0, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="the checkpoint tree to mount (e.g. bench.py's --dir/checkpoint)")
    ap.add_argument("--file", default="consolidated/model.safetensors", help="virtual file to read (relative)")
    ap.add_argument("--config", type=parse_config, action="append", required=True,
                    help="NAME=BINARY[,MOUNT_ARG...] (repeat for each side)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--pattern", choices=["read", "safe_open"], default="read")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="ckptfs-ab-")
    mounts = {}
    try:
        for name, binary, extra in args.config:
            d = os.path.join(work, name)
            os.makedirs(d)
            m = bench.Mounted(binary, args.root, os.path.join(d, "mnt"), os.path.join(d, "index"),
                              os.path.join(d, "mount.log"), extra)
            m.start()
            mounts[name] = m
        print(f"load average {os.getloadavg()[0]:.2f} at start; {args.passes} cold passes of "
              f"{args.file} ({args.pattern})", flush=True)
        results = {name: [] for name in mounts}
        sizes = set()
        for i in range(args.passes):
            order = list(mounts) if i % 2 == 0 else list(reversed(mounts))
            for name in order:
                wall, cpu, n = one_pass(mounts[name], args.file, args.pattern)
                sizes.add(n)
                results[name].append((wall, cpu))
                print(f"  pass {i + 1} {name:>10}: {wall:6.3f} s, daemon CPU {cpu:6.3f} s", flush=True)
        if len(sizes) != 1:
            raise SystemExit(f"configurations read different byte counts: {sorted(sizes)}")
        print(f"load average {os.getloadavg()[0]:.2f} at end")
        print(f"{'config':>10}  {'wall best':>9}  {'median':>7}  {'daemon CPU best':>15}  {'median':>7}")
        for name, rows in results.items():
            walls, cpus = [w for w, _ in rows], [c for _, c in rows]
            print(f"{name:>10}  {min(walls):8.3f}s  {statistics.median(walls):6.3f}s  "
                  f"{min(cpus):14.3f}s  {statistics.median(cpus):6.3f}s")
    finally:
        for m in mounts.values():
            m.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
