#!/usr/bin/env python3
"""A/B of ckptfs binaries (or mount options) on one checkpoint, cold.

Each configuration is mounted at once on the same source tree (its own index
and mountpoint); every pass then drops the page cache and reads one virtual
file through each mount in turn, alternating the order, so that a noisy disk
or a busy machine hits every configuration alike. Reported per configuration:
wall time of the pass (best and median) and the CPU the mount daemon spent
on it (utime + stime from /proc/PID/stat), which is far steadier than wall
time on a shared 2-core machine.

    python3 bench/bench_ab.py --root /tmp/ckptfs-bench/checkpoint \\
        --config old=/tmp/ckptfs-old --config new=build/ckptfs --passes 7

`--fresh-mount` starts each configuration's daemon anew (same index)
before each of its passes: a first load, with no buffers kept from the last.
A configuration is NAME=BINARY[,MOUNT_ARG...]. `--pattern` picks sequential
1 MiB read() calls (default), safe_open + get_tensor of every tensor, or
safetensors' load_file and then a byte of every page of what it returned
(the disk row of bench_dcp_load.py, without its fresh index and mount).
`--file` repeated reads several virtual files at once, one thread each (the
rank files of `mesh/tp4/`, as four ranks of an inference engine load them).
`--reference` adds a configuration "real": the same bytes as real files on
the source's filesystem, read the same way and cold, and prints each
configuration's speed as a ratio of theirs.
"""
import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py: the mount, cache and client helpers)


def parse_config(text: str) -> tuple[str, str, list[str]]:
    name, _, rest = text.partition("=")
    if not name or not rest:
        raise argparse.ArgumentTypeError(f"--config {text!r}: expected NAME=BINARY[,MOUNT_ARG...]")
    binary, *extra = rest.split(",")
    return name, os.path.abspath(binary), extra


def one_pass(mount: common.Mounted, rels: list[str], pattern: str) -> tuple[float, float, int]:
    paths = [os.path.join(mount.mnt, rel) for rel in rels]
    how = common.make_cold(paths)
    if how != "drop_caches":
        raise SystemExit("bench_ab needs root to drop the page cache (cold passes)")
    cpu0 = common.process_cpu(mount.proc.pid)
    wall, n = timed_read(paths, pattern)
    return wall, common.process_cpu(mount.proc.pid) - cpu0, n


def timed_read(paths: list[str], pattern: str) -> tuple[float, int]:
    """Reads every path, one reader thread per path (one file: the calling
    thread), and returns (wall seconds, bytes)."""
    fn = {"read": common.read_pass, "safe_open": common.safe_open_pass, "load_file": common.load_file_pass}[pattern]
    t0 = time.monotonic()
    if len(paths) == 1:
        n = fn(paths)
    else:
        with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:
            n = sum(pool.map(lambda p: fn([p]), paths))
    return time.monotonic() - t0, n


def reference_pass(paths: list[str], pattern: str) -> tuple[float, float, int]:
    """The same read of real files holding the same bytes, cold."""
    if common.make_cold(paths) != "drop_caches":
        raise SystemExit("bench_ab needs root to drop the page cache (cold passes)")
    wall, n = timed_read(paths, pattern)
    return wall, 0.0, n


def remount(m: common.Mounted) -> common.Mounted:
    """A new daemon for `m`'s root, mount point and index, started."""
    fresh = common.Mounted(m.binary, m.root, m.mnt, m.index, m.log_file, m.extra)
    fresh.start()
    return fresh


def export_reference(mount: common.Mounted, rels: list[str], out: str) -> list[str]:
    """Copies each virtual file to a real file under `out` (same bytes)."""
    paths = []
    for i, rel in enumerate(rels):
        dst = os.path.join(out, f"{i:02d}-" + os.path.basename(rel))
        shutil.copyfile(os.path.join(mount.mnt, rel), dst)
        paths.append(dst)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True,
                    help="the checkpoint tree to mount (e.g. bench_read.py's --dir/checkpoint), or an s3:// root "
                         "(the server and credentials from the AWS_* environment, as ckptfs takes them)")
    ap.add_argument("--file", action="append",
                    help="virtual file to read (relative; default consolidated/model.safetensors); "
                         "repeat it for concurrent readers, one thread per file")
    ap.add_argument("--reference", action="store_true",
                    help="also read real files of the same bytes (copied from the first mount) in "
                         "every pass, and report each configuration's speed as a ratio of theirs")
    ap.add_argument("--config", type=parse_config, action="append", required=True,
                    help="NAME=BINARY[,MOUNT_ARG...] (repeat for each side)")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--pattern", choices=["read", "safe_open", "load_file"], default="read")
    ap.add_argument("--fresh-mount", action="store_true",
                    help="unmount and mount each configuration again (same index) before each of its passes, "
                         "so that every pass is a new daemon's first load (no buffers kept from the last)")
    args = ap.parse_args(argv)

    files = args.file or ["consolidated/model.safetensors"]
    # Beside a local root (the same filesystem); in /tmp for an s3:// one.
    local = "://" not in args.root
    work = tempfile.mkdtemp(prefix="ckptfs-ab-", dir=os.path.dirname(os.path.abspath(args.root)) if local else None)
    mounts = {}
    try:
        for name, binary, extra in args.config:
            d = os.path.join(work, name)
            os.makedirs(d)
            m = common.Mounted(binary, args.root, os.path.join(d, "mnt"), os.path.join(d, "index"),
                              os.path.join(d, "mount.log"), extra)
            m.start()
            mounts[name] = m
        def run(name: str):
            if args.fresh_mount:
                mounts[name].stop()
                mounts[name] = remount(mounts[name])
            return one_pass(mounts[name], files, args.pattern)

        runs = {name: (lambda name=name: run(name)) for name in mounts}
        if args.reference:
            ref = export_reference(next(iter(mounts.values())), files, work)
            runs["real"] = lambda: reference_pass(ref, args.pattern)
        print(f"load average {os.getloadavg()[0]:.2f} at start; {args.passes} cold passes of "
              f"{', '.join(files)} ({args.pattern}, {len(files)} reader(s))", flush=True)
        results = {name: [] for name in runs}
        sizes = set()
        for i in range(args.passes):
            order = list(runs) if i % 2 == 0 else list(reversed(runs))
            for name in order:
                wall, cpu, n = runs[name]()
                sizes.add(n)
                results[name].append((wall, cpu))
                print(f"  pass {i + 1} {name:>10}: {wall:6.3f} s, daemon CPU {cpu:6.3f} s", flush=True)
        if len(sizes) != 1:
            raise SystemExit(f"configurations read different byte counts: {sorted(sizes)}")
        print(f"load average {os.getloadavg()[0]:.2f} at end")
        report(results, sizes.pop(), args.reference)
    finally:
        for m in mounts.values():
            m.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def report(results: dict, nbytes: int, with_reference: bool) -> None:
    gb = nbytes / 1e9
    print(f"{'config':>10}  {'wall best':>9}  {'median':>7}  {'GB/s':>5}  {'daemon CPU best':>15}  "
          f"{'median':>7}  {'CPU s/GB':>8}" + ("  speed vs real (best)" if with_reference else ""))
    ref_best = min(w for w, _ in results["real"]) if with_reference else None
    for name, rows in results.items():
        walls, cpus = [w for w, _ in rows], [c for _, c in rows]
        line = (f"{name:>10}  {min(walls):8.3f}s  {statistics.median(walls):6.3f}s  {gb / min(walls):5.2f}  "
                f"{min(cpus):14.3f}s  {statistics.median(cpus):6.3f}s  {min(cpus) / gb:8.3f}")
        if ref_best is not None:
            line += f"  {ref_best / min(walls):.2f}x"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
