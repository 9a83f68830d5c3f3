#!/usr/bin/env python3
"""End to end: from a sharded checkpoint on disk to every tensor loaded,
through ckptfs vs through torch's own consolidation (docs/BENCHMARKS.md).

The checkpoint is bench/common.py's (torch's sharded safetensors layout with
DCP_SHARDING_INFO, RANKS ranks, BF16 and F32, split on dim 0 and dim 1).
Each pass starts with the page cache dropped and no index, then times:

- ckptfs: `ckptfs mount -f` (which indexes the checkpoint) until
  consolidated/ answers, then `safe_open(...).get_tensor(k).clone()` of
  every tensor of consolidated/ (what transformers does);
- torch: `consolidate_safetensors_files(ckpt, out, every fqn -> file 1,
  num_threads=1)` (torch's defaults), then the same load of its output,
  and the extra disk the output takes;
- the floor: the same load of already-consolidated real files (the
  output of the torch pass, its cache dropped).

Prints the best of --repeat for each and the ratios (ckptfs ÷ torch: the
target is <= 0.3), with the load average. Run it on a quiet machine.

    python3 bench/bench_e2e.py [--dir DIR] [--size-gib 2] [--ranks 4] [--repeat 3] [--bin build/ckptfs]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py: the checkpoint, the mount, the load pattern)


def safetensors_in(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def ckptfs_pass(args, ckpt: str, work: str) -> tuple[float, int]:
    index, mnt = os.path.join(work, "index"), os.path.join(work, "mnt")
    shutil.rmtree(index, ignore_errors=True)
    common.drop_caches()
    mount = common.Mounted(args.bin, ckpt, mnt, index, os.path.join(work, "mount.log"))
    t0 = time.monotonic()
    try:
        mount.start()
        n = common.safe_open_pass(safetensors_in(os.path.join(mnt, "consolidated")))
        return time.monotonic() - t0, n
    finally:
        mount.stop()


def torch_pass(ckpt: str, out: str, fqns: list[str]) -> tuple[float, int, int]:
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    common.drop_caches()
    t0 = time.monotonic()
    consolidate_safetensors_files(input_dir=ckpt, output_dir=out, fqn_to_index_mapping=dict.fromkeys(fqns, 1),
                                  num_threads=1)
    n = common.safe_open_pass(safetensors_in(out))
    secs = time.monotonic() - t0
    return secs, n, sum(os.path.getsize(p) for p in safetensors_in(out))


def real_pass(out: str) -> tuple[float, int]:
    common.drop_caches()
    t0 = time.monotonic()
    n = common.safe_open_pass(safetensors_in(out))
    return time.monotonic() - t0, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-e2e")
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", os.path.join(common.REPO, "build", "ckptfs")))
    args = ap.parse_args()
    if common.drop_caches() is not None:
        sys.exit("bench_e2e: needs /proc/sys/vm/drop_caches (root) for cold passes")

    def log(msg: str, end: str = "\n") -> None:
        print(msg, end=end, file=sys.stderr, flush=True)

    ckpt, work = os.path.join(args.dir, "checkpoint"), os.path.join(args.dir, "work")
    manifest = common.ensure_checkpoint(ckpt, args.size_gib, args.ranks, 0, log)
    os.makedirs(work, exist_ok=True)
    load = os.getloadavg()
    best = {"ckptfs": float("inf"), "torch": float("inf"), "real": float("inf")}
    loaded, extra = {}, 0
    for i in range(args.repeat):
        for name, run in (("ckptfs", lambda: ckptfs_pass(args, ckpt, work)),
                          ("torch", lambda: torch_pass(ckpt, os.path.join(work, "torch-out"), sorted(manifest["specs"]))),
                          ("real", lambda: real_pass(os.path.join(work, "torch-out")))):
            secs, n, *rest = run()
            extra = rest[0] if rest else extra
            loaded[name] = n
            best[name] = min(best[name], secs)
            log(f"  pass {i + 1}: {name:7s} {secs:6.2f} s")
    if len(set(loaded.values())) != 1:
        sys.exit(f"bench_e2e: the passes loaded different byte counts: {loaded}")
    shutil.rmtree(os.path.join(work, "torch-out"), ignore_errors=True)
    print(json.dumps({
        "checkpoint_bytes": manifest["tensor_bytes"], "ranks": args.ranks, "repeat": args.repeat,
        "best_s": {k: round(v, 3) for k, v in best.items()},
        "ckptfs_over_torch": round(best["ckptfs"] / best["torch"], 3),
        "ckptfs_over_real_files": round(best["ckptfs"] / best["real"], 3),
        "torch_extra_disk_bytes": extra, "loadavg_start": load, "loadavg_end": os.getloadavg()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
