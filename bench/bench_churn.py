#!/usr/bin/env python3
"""A long-running mount under load/unload churn: memory and errors over time.

Builds a root of STEPS small sharded checkpoints (two row-split safetensors
ranks, TENSORS tensors of 4x3 float32 each, whose values are known here),
mounts it with `--max-loaded 1` and has THREADS threads open files across
all checkpoints for SECONDS: `tensors/<name>.npy` loaded and compared with
the expected values, `consolidated/model.safetensors` headers parsed,
`tensors/` listed. Every open therefore unloads one checkpoint and loads
another. Each EVERY seconds it prints one line:

    t_s  rss_mib  opens  errors  wrong  unloads

(rss of the daemon, from /proc). At the end: errors by errno, and the RSS
growth after the warm-up (the first EVERY seconds). Exit status 1 when any
open failed or returned wrong values.

    python3 bench/bench_churn.py --bin build/ckptfs --seconds 3600 --every 60

The e2e test tests/e2e/test_long_mount.py runs the same churn for seconds.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def full_tensor(step: int, k: int) -> np.ndarray:
    return np.arange(12, dtype=np.float32).reshape(4, 3) + 100 * step + k


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def make_root(root: Path, steps: int, tensors: int) -> None:
    """step_000 .. step_{steps-1}, each two ranks holding rows [2r, 2r+2)."""
    names = [f"layer.{k}.w" for k in range(tensors)]
    for s in range(steps):
        d = root / f"step_{s:03d}"
        d.mkdir(parents=True)
        for r in range(2):
            part = {n: full_tensor(s, k)[2 * r:2 * r + 2] for k, n in enumerate(names)}
            info = {n: {"saved_offsets": [2 * r, 0]} for n in names}
            write_safetensors(d / f"shard-0000{r + 1}-model-00001-of-00001.safetensors", part,
                              {"DCP_SHARDING_INFO": json.dumps(info)})


def daemon_pid(mnt: str) -> int:
    """The pid of the ckptfs process serving `mnt` (its command line names it)."""
    mnt = os.path.realpath(mnt)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == "ckptfs" and "mount" in argv and \
                any(os.path.realpath(a) == mnt for a in argv[1:] if a.startswith("/")):
            return int(entry)
    raise RuntimeError(f"no ckptfs process serves {mnt}")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Stats:
    opens: int = 0
    wrong: int = 0
    errors: dict = field(default_factory=dict)  # errno name -> count
    examples: list = field(default_factory=list)

    def error_count(self) -> int:
        return sum(self.errors.values())


class Churn:
    """THREADS threads opening files of random checkpoints of `mnt` until stop()."""

    def __init__(self, mnt: str, steps: int, tensors: int, threads: int, seed: int = 0):
        self.mnt, self.steps, self.tensors = mnt, steps, tensors
        self.stats = Stats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed + t,), daemon=True) for t in range(threads)]

    def start(self) -> "Churn":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> Stats:
        self._stop.set()
        for t in self._threads:
            t.join()
        return self.stats

    def _record(self, what: str, err: OSError | None = None, wrong: bool = False) -> None:
        with self._lock:
            self.stats.opens += 1
            if err is not None:
                name = errno.errorcode.get(err.errno, str(err.errno))
                self.stats.errors[name] = self.stats.errors.get(name, 0) + 1
            self.stats.wrong += wrong
            if (err is not None or wrong) and len(self.stats.examples) < 5:
                self.stats.examples.append(f"{what}: {err or 'wrong bytes'}")

    def _one(self, rng: random.Random) -> None:
        s = rng.randrange(self.steps)
        step = os.path.join(self.mnt, f"step_{s:03d}")
        op = rng.random()
        if op < 0.6:
            k = rng.randrange(self.tensors)
            path = os.path.join(step, "tensors", f"layer.{k}.w.npy")
            try:
                got = np.load(path)
            except OSError as e:
                return self._record(path, err=e)
            self._record(path, wrong=not np.array_equal(got, full_tensor(s, k)))
        elif op < 0.9:
            path = os.path.join(step, "consolidated", "model.safetensors")
            try:
                with open(path, "rb") as f:
                    n = struct.unpack("<Q", f.read(8))[0]
                    header = json.loads(f.read(n))
            except OSError as e:
                return self._record(path, err=e)
            self._record(path, wrong=len(header) != self.tensors + 1)
        else:
            path = os.path.join(step, "tensors")
            try:
                names = os.listdir(path)
            except OSError as e:
                return self._record(path, err=e)
            self._record(path, wrong=len(names) != self.tensors)

    def _run(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            self._one(rng)


def count_unloads(log_path: str) -> int:
    try:
        with open(log_path, errors="replace") as f:
            return sum(1 for line in f if ": unloaded (" in line)
    except FileNotFoundError:
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=str(Path(__file__).resolve().parents[1] / "build" / "ckptfs"))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--every", type=float, default=60, help="seconds between lines (the first is the warm-up)")
    ap.add_argument("--workdir", help="where the root, index and mount go (default: a temporary directory)")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="ckptfs-churn-"))
    root, mnt, index, log = work / "root", work / "mnt", work / "index", work / "mount.log"
    shutil.rmtree(root, ignore_errors=True)
    make_root(root, a.steps, a.tensors)
    mnt.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([a.bin, "mount", str(root), str(mnt), "--index", str(index), "--max-loaded", "1",
                        "--log-file", str(log)], capture_output=True, text=True)
    if p.returncode != 0:
        print(f"mount failed ({p.returncode}): {p.stderr}", file=sys.stderr)
        return 2
    try:
        pid = daemon_pid(str(mnt))
        churn = Churn(str(mnt), a.steps, a.tensors, a.threads).start()
        print("t_s\trss_mib\topens\terrors\twrong\tunloads", flush=True)
        t0, warm = time.monotonic(), None
        peak_after = 0
        while (t := time.monotonic() - t0) < a.seconds:
            time.sleep(min(a.every, a.seconds - t))
            rss = rss_bytes(pid)
            if warm is None:
                warm = rss
            peak_after = max(peak_after, rss)
            st = churn.stats
            print(f"{time.monotonic() - t0:.0f}\t{rss / 2**20:.1f}\t{st.opens}\t{st.error_count()}\t{st.wrong}\t"
                  f"{count_unloads(str(log))}", flush=True)
        st = churn.stop()
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
    print(f"errors by errno: {st.errors or 'none'}; wrong: {st.wrong}; examples: {st.examples}")
    print(f"RSS after warm-up {warm / 2**20:.1f} MiB, peak after {peak_after / 2**20:.1f} MiB "
          f"(+{(peak_after - warm) / 2**20:.1f} MiB over {count_unloads(str(log))} unloads)")
    return 1 if st.error_count() or st.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
