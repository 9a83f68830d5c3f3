#!/usr/bin/env python3
"""Saving a host state dict: ckptfs StorageWriter vs torch's FileSystemWriter
(thread_count 1 and 4) vs a raw write of the same bytes with fsync.

    python3 bench/bench_writer.py [--gib 2] [--dir /tmp/bench_writer] [--repeat 1] [--async]

One process, no torch.distributed (dcp.save(no_dist=True)). The state dict
is 2 GiB of float32/bfloat16 tensors of Llama-like shapes (embedding, MLP
and attention matrices, norms). Each run writes into a fresh directory and
drops it afterwards; the page cache is flushed (sync) between runs, and
every writer fsyncs its files, so each figure includes getting the bytes to
disk. Prints seconds, GB/s and the ratio to the raw write. Run it on a
quiet machine: it measures the disk and memory bandwidth it is given.

--async also times `dcp.async_save` (a gloo process group of one, in
this process) with StorageWriter and with torch's default (FileSystemWriter
and its stager, which copies the state dict into host memory): the
training thread's stall (until async_save returns) and the whole save
(until its future is done), best of --repeat each, and with
StorageWriter(snapshot=True) after one save that allocates the snapshot;
RSS growth of the process is printed for each (run torch's first: the
process's allocator may keep what it freed for the runs after it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch
import torch.distributed.checkpoint as dcp


def state_dict(gib: float) -> dict:
    g = torch.Generator().manual_seed(0)
    hidden, inter = 2048, 5632
    sd, total, layer = {}, 0, 0
    target = int(gib * (1 << 30))
    sd["embed.weight"] = torch.randn(32000, hidden, generator=g).to(torch.bfloat16)
    total += sd["embed.weight"].nbytes
    while total < target:
        for name, shape, dtype in ((f"layers.{layer}.mlp.up", (inter, hidden), torch.bfloat16),
                                   (f"layers.{layer}.mlp.down", (hidden, inter), torch.bfloat16),
                                   (f"layers.{layer}.attn.qkv", (3 * hidden, hidden), torch.float32),
                                   (f"layers.{layer}.norm", (hidden,), torch.float32)):
            if total >= target:
                break
            sd[name] = torch.randn(shape, generator=g).to(dtype)
            total += sd[name].nbytes
        layer += 1
    return sd


def raw_write(sd: dict, path: str) -> None:
    os.makedirs(path)
    fd = os.open(os.path.join(path, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in sd.values():
            view = memoryview(t.view(torch.uint8).numpy())
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def run(name: str, fn, sd: dict, base: str, nbytes: int, repeat: int) -> float:
    best = float("inf")
    for i in range(repeat):
        path = os.path.join(base, f"{name.replace(' ', '_')}_{i}")
        os.sync()
        t0 = time.perf_counter()
        fn(sd, path)
        best = min(best, time.perf_counter() - t0)
        shutil.rmtree(path)
    print(f"{name:34s} {best:7.2f} s  {nbytes / best / 1e9:6.2f} GB/s", flush=True)
    return best


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_async(name: str, writer_kwargs, sd: dict, base: str, repeat: int, warmup: bool = False) -> float:
    """Best stall and whole save of `repeat` async saves (after one save
    not counted, with `warmup`); prints them and the process's RSS growth."""
    rss0 = _rss()
    if warmup:
        path = os.path.join(base, f"async_{name.replace(' ', '_')}_warmup")
        dcp.async_save(sd, **writer_kwargs(path)).result()
        shutil.rmtree(path)
    stall = total = float("inf")
    for i in range(repeat):
        path = os.path.join(base, f"async_{name.replace(' ', '_')}_{i}")
        os.sync()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, **writer_kwargs(path))
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        stall, total = min(stall, t1 - t0), min(total, t2 - t0)
        shutil.rmtree(path)
    print(f"{name:34s} stall {stall:6.3f} s   whole save {total:6.2f} s   RSS +{(_rss() - rss0) / (1 << 30):.2f} GiB",
          flush=True)
    return stall


def async_figures(sd: dict, base: str, repeat: int) -> None:
    import tempfile
    import torch.distributed as dist
    from ckptfs.torch import StorageWriter
    init = os.path.join(tempfile.mkdtemp(prefix="bench_writer_pg_"), "store")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        print("\ndcp.async_save: the training thread's stall and the whole save (best of each):")
        torch_stall = run_async("async torch default", lambda p: {"checkpoint_id": p}, sd, base, repeat)
        ring = run_async("async ckptfs StorageWriter", lambda p: {"storage_writer": StorageWriter(p)}, sd, base,
                         repeat)
        snap = run_async("async ckptfs snapshot=True", lambda p: {"storage_writer": StorageWriter(p, snapshot=True)},
                         sd, base, repeat, warmup=True)
        print(f"stall relative to torch's default stager (lower is better): ring {ring / torch_stall:.2f}x, "
              f"snapshot (from the second save on) {snap / torch_stall:.2f}x")
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default="/tmp/bench_writer")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--async", dest="async_", action="store_true", help="also time dcp.async_save")
    args = ap.parse_args()
    from ckptfs.torch import StorageWriter

    sd = state_dict(args.gib)
    nbytes = sum(t.nbytes for t in sd.values())
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    print(f"state dict: {len(sd)} tensors, {nbytes / (1 << 30):.2f} GiB; load average {os.getloadavg()}")
    times = {
        "raw write + fsync": run("raw write + fsync", raw_write, sd, args.dir, nbytes, args.repeat),
        "ckptfs StorageWriter": run("ckptfs StorageWriter", lambda s, p: dcp.save(
            s, storage_writer=StorageWriter(p), no_dist=True), sd, args.dir, nbytes, args.repeat),
    }
    for threads in (1, 4):
        name = f"FileSystemWriter thread_count={threads}"
        times[name] = run(name, lambda s, p, t=threads: dcp.save(
            s, storage_writer=dcp.FileSystemWriter(p, thread_count=t), no_dist=True), sd, args.dir, nbytes,
            args.repeat)
    raw = times["raw write + fsync"]
    print("\nthroughput relative to the raw write (higher is better):")
    for name, t in times.items():
        print(f"  {name:34s} {raw / t:5.2f}x")
    if args.async_:
        async_figures(sd, args.dir, args.repeat)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
