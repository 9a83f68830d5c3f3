#!/usr/bin/env python3
"""Figures for DCP indexing and mesh views, measured in one run.

1. Real torch writes a DCP checkpoint of a Llama-shaped state dict with
   >= 1,000 tensors over 8 gloo ranks on CPU (FileSystemWriter, DTensors
   sharded on dim 0). Printed: `ckptfs index` time, index size on disk, and
   mount time (until the mountpoint answers).
2. Mesh views on it: for `mesh/tp4/rank-00002/`, the view open time (first
   lookup builds the views), the bytes the daemon read from the shard files
   to serve the whole rank folder (from /proc/<daemon>/io rchar) next to the
   size of that folder, and the same for one pipeline stage (`tp2-pp2`).

    python3 bench/bench_views.py [--dir DIR] [--layers 120] [--hidden 256] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    rank, world, init, out, layers, hidden = sys.argv[1:7]
    rank, world, layers, hidden = int(rank), int(world), int(layers), int(hidden)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    def t(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)
    sd = {"model.embed_tokens.weight": t(1024, hidden), "lm_head.weight": t(1024, hidden),
          "model.norm.weight": t(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + "self_attn." + n + ".weight"] = t(hidden, hidden)
        for n in ("gate_proj", "up_proj"):
            sd[p + "mlp." + n + ".weight"] = t(2 * hidden, hidden)
        sd[p + "mlp.down_proj.weight"] = t(hidden, 2 * hidden)
        sd[p + "input_layernorm.weight"] = t(hidden)
        sd[p + "post_attention_layernorm.weight"] = t(hidden)
    # The training job's own tensor-parallel layout: row-parallel weights
    # (o_proj, down_proj) sharded on dim 1, the rest on dim 0.
    def placement(k, v):
        if v.dim() == 1:
            return Replicate()
        return Shard(1) if ("o_proj" in k or "down_proj" in k) else Shard(0)
    sd = {k: distribute_tensor(v, mesh, [placement(k, v)]) for k, v in sd.items()}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(out, thread_count=1))
    dist.destroy_process_group()
    # Done: exit before the interpreter's finalization, where torch's gloo
    # threads have aborted finished ranks (tools/ranks.py, end_rank).
    sys.stdout.flush()
    os._exit(0)
""")


def write_checkpoint(out: Path, world: int, layers: int, hidden: int) -> float:
    init = out.parent / "init-file"
    init.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(init), str(out), str(layers),
                               str(hidden)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    for p in procs:
        o, _ = p.communicate(timeout=900)
        if p.returncode:
            sys.exit(f"save failed:\n{o.decode()[-3000:]}")
    return time.perf_counter() - t0


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def rchar(pid: int) -> int:
    for line in open(f"/proc/{pid}/io"):
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", str(ROOT / "build" / "ckptfs")))
    ap.add_argument("--dir", help="work directory (default: a new temp dir, removed at the end)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--layers", type=int, default=120)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="ckptfs-bench-views-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, index, mnt = work / "dcp", work / "index", work / "mnt"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(index, ignore_errors=True)
    r = {}
    r["save_s"] = write_checkpoint(ckpt, args.ranks, args.layers, args.hidden)
    r["ranks"] = args.ranks
    r["checkpoint_bytes"] = dir_bytes(ckpt)
    r["distcp_files"] = len(list(ckpt.glob("*.distcp")))

    t0 = time.perf_counter()
    p = subprocess.run([args.bin, "index", str(ckpt), "--index", str(index)], capture_output=True, text=True)
    r["index_s"] = time.perf_counter() - t0
    if p.returncode:
        sys.exit(p.stderr)
    r["index_bytes"] = dir_bytes(index)
    ls = json.loads(subprocess.run([args.bin, "ls", str(ckpt), "--index", str(index), "--json"],
                                   capture_output=True, text=True, check=True).stdout)
    r["tensors"] = len(ls)
    r["chunks"] = sum(t["chunks"] for t in ls)

    mnt.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    daemon = subprocess.Popen([args.bin, "mount", "-f", str(ckpt), str(mnt), "--index", str(index)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not (mnt / "consolidated").exists():
        if daemon.poll() is not None:
            sys.exit(daemon.stderr.read().decode())
        time.sleep(0.005)
    r["mount_s"] = time.perf_counter() - t0
    try:
        for spec, rank in (("tp4", 2), ("tp2-pp2", 3)):
            folder = mnt / "mesh" / spec / f"rank-{rank:05d}"
            t0 = time.perf_counter()
            os.listdir(mnt / "mesh" / spec)
            r[f"{spec}_open_s"] = time.perf_counter() - t0
            size = sum((folder / f).stat().st_size for f in os.listdir(folder))
            before = rchar(daemon.pid)
            for f in sorted(os.listdir(folder)):  # O_DIRECT-free reads: page cache is cold for new files
                with open(folder / f, "rb") as fh:
                    while fh.read(1 << 20):
                        pass
            r[f"{spec}_rank_bytes"] = size
            r[f"{spec}_source_bytes_read"] = rchar(daemon.pid) - before
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        daemon.wait(timeout=30)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    mb = lambda b: f"{b / 1e6:,.1f} MB"
    print(f"DCP checkpoint: {r['tensors']} tensors, {r['chunks']} chunks, {r['ranks']} ranks, "
          f"{r['distcp_files']} .distcp files, {mb(r['checkpoint_bytes'])} (saved by torch in {r['save_s']:.1f} s)")
    print(f"  ckptfs index        {r['index_s']:.2f} s   index size {mb(r['index_bytes'])}")
    print(f"  mount until ready   {r['mount_s']:.3f} s")
    for spec, rank in (("tp4", 2), ("tp2-pp2", 3)):
        ratio = r[f"{spec}_source_bytes_read"] / max(1, r[f"{spec}_rank_bytes"])
        print(f"  mesh/{spec}/rank-{rank:05d}: open {r[f'{spec}_open_s'] * 1e3:.1f} ms; read the whole folder "
              f"({mb(r[f'{spec}_rank_bytes'])}) -> daemon read {mb(r[f'{spec}_source_bytes_read'])} "
              f"from shard files ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
