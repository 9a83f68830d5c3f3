#!/usr/bin/env python3
"""Live-mount latency: time from a step's commit point to its consolidated/
being listable through a mount of the training root (docs/BENCHMARKS.md).

Mounts an empty root (`ckptfs mount -f`), then writes STEPS checkpoints into
it one after another: each is two ranks' row shards in torch's sharded
safetensors layout (DCP_SHARDING_INFO), written under temporary names and
renamed into place, the second rename being the commit point. With
--writer each step is instead saved by `dcp.save` through ckptfs's
`StorageWriter` (one process; its commit record, renamed into place just
before the save returns, is the commit point). Polls
MNT/step_N/consolidated/ every millisecond and prints each latency and the
median, with the load average.

    python3 bench/bench_live.py [--steps 10] [--tensors 200] [--writer] [--bin build/ckptfs] [--rescan-ms 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time


def write_shard(path: str, names: list[str], rank: int) -> None:
    rows, cols = 2, 64
    header, blobs, offset = {}, [], 0
    for n in names:
        raw = bytes([rank]) * (rows * cols * 4)
        header[n] = {"dtype": "F32", "shape": [rows, cols], "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"DCP_SHARDING_INFO": json.dumps({n: {"saved_offsets": [rank * rows, 0]} for n in names})}
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def save_renamed(step: str, names: list[str]) -> None:
    """Two ranks' shards, each written as NAME.tmp, then both renamed."""
    finals = []
    for r in range(2):
        final = os.path.join(step, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors")
        write_shard(final + ".tmp", names, r)
        finals.append(final)
    for final in finals:
        os.rename(final + ".tmp", final)


def save_with_writer(step: str, names: list[str]) -> None:
    """The same tensors saved by dcp.save through ckptfs's StorageWriter."""
    import torch
    import torch.distributed.checkpoint as dcp
    from ckptfs.torch import StorageWriter
    sd = {n: torch.full((4, 64), float(i)) for i, n in enumerate(names)}
    dcp.save(sd, storage_writer=StorageWriter(step), no_dist=True)


def is_mounted(mnt: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == mnt for line in f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--bin", default="build/ckptfs")
    ap.add_argument("--rescan-ms", default="2000")
    ap.add_argument("--writer", action="store_true", help="save each step with ckptfs.torch.StorageWriter")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckptfs-bench-live-")
    root, mnt = os.path.join(base, "run"), os.path.join(base, "mnt")
    os.makedirs(root)
    os.makedirs(mnt)
    proc = subprocess.Popen([args.bin, "mount", "-f", root, mnt, "--index", os.path.join(base, "index"),
                             "--rescan-ms", args.rescan_ms, "--log-file", os.path.join(base, "mount.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latencies = []
    try:
        while not is_mounted(mnt):
            if proc.poll() is not None:
                sys.exit("mount failed")
            time.sleep(0.01)
        names = [f"model.layers.{i}.w" for i in range(args.tensors)]
        load = os.getloadavg()
        for s in range(args.steps):
            step = os.path.join(root, f"step_{s}")
            os.makedirs(step)
            (save_with_writer if args.writer else save_renamed)(step, names)
            committed = time.monotonic()
            view = os.path.join(mnt, f"step_{s}", "consolidated")
            while not os.path.isdir(view):
                if time.monotonic() - committed > 30:
                    sys.exit(f"step_{s}: consolidated/ did not appear in 30 s")
                time.sleep(0.001)
            latencies.append(time.monotonic() - committed)
            time.sleep(0.2)
        print(json.dumps({"latencies_s": [round(x, 4) for x in latencies],
                          "median_s": round(statistics.median(latencies), 4), "max_s": round(max(latencies), 4),
                          "tensors_per_step": args.tensors,
                          "commit": "StorageWriter commit record" if args.writer else "rename of the last shard", "loadavg_start": load,
                          "loadavg_end": os.getloadavg()}, indent=2))
    finally:
        subprocess.run(["fusermount3", "-u", mnt], check=False)
        proc.wait(timeout=60)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
