#!/usr/bin/env python3
"""Two threads pwrite()ing 2 GiB into one file vs into two files, each
followed by fsync: whether a rank's writes should be spread over several
files (docs/BENCHMARKS.md, "The writer on the host").

    python3 bench/bench_pwrite_files.py [--dir /tmp/bench_pwrite] [--repeat 3]

Each thread writes 64 MiB blocks of random bytes; in the one-file case the
threads take alternate blocks of the same file, in the two-file case each
thread fills its own file. Prints seconds per pass and the best of each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time

BLOCK = 64 << 20
BLOCKS = 32  # 2 GiB


def one_pass(directory: str, files: int, buf: memoryview) -> float:
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    os.sync()
    fds = [os.open(os.path.join(directory, f"f{i}"), os.O_WRONLY | os.O_CREAT, 0o644) for i in range(files)]
    t0 = time.perf_counter()

    def worker(k: int) -> None:
        fd = fds[k % files]
        for j in range(k, BLOCKS, 2):
            os.pwrite(fd, buf, (j // files) * BLOCK)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    elapsed = time.perf_counter() - t0
    shutil.rmtree(directory)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/bench_pwrite")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    buf = memoryview(os.urandom(BLOCK))
    print(f"load average {os.getloadavg()}")
    best = {1: float("inf"), 2: float("inf")}
    for _ in range(args.repeat):
        for files in (1, 2):
            t = one_pass(args.dir, files, buf)
            best[files] = min(best[files], t)
            print(f"{files} file(s): {t:.2f} s", flush=True)
    print(f"best: one file {best[1]:.2f} s, two files {best[2]:.2f} s ({best[1] / best[2]:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
