#!/usr/bin/env python3
"""Loading one DCP step, side by side: ckptfs against what a user runs
without it, on disk and in object storage, in the same run.

The state: a Llama-shaped bf16 model (default >= 1 GiB; --size-gib to
shrink) saved by 4 gloo ranks with stock `dcp.save` (every tensor
Shard(0), as FSDP2 saves), with a config.json beside it; the same tensors
as one real safetensors file. A SeaweedFS server (`weed`) on 127.0.0.1
holds both (run/step-1/ and hf/model.safetensors). Every measurement
starts cold: page cache dropped (echo 3 > /proc/sys/vm/drop_caches, the
server's files too), and each ckptfs row gets a fresh index and a fresh
mount (the mount's start, indexing included, is timed). Rows:

  disk  read the files         the step's files read at once, one thread
                              each, 8 MiB reads into one reused buffer:
                              what the disk gives, the floor of any load
  disk  dcp.load              stock dcp.load into a preallocated state dict
  disk  load_file (real)      safetensors.torch.load_file of the real file
  disk  ckptfs                mount + load_file(step/consolidated/*.safetensors)
  disk  ckptfs --fetch-direct the same, the planned ranges read with O_DIRECT
  s3    boto3                 the step's objects into memory, 8 threads
  s3    s3torchconnector      dcp.load with S3StorageReader (its
                              dcp_optimized reader, the 1.5 default)
  s3    Run:ai                SafetensorsStreamer over s3://.../hf/model.safetensors
  s3    ckptfs step           mount s3:// + load_file(consolidated/...)
  s3    ckptfs consolidated   mount s3://.../hf + load_file(consolidated/model.safetensors)
  s3    download+consolidate  boto3 download to disk, dcp.load, save_file,
        + from_pretrained     from_pretrained of the result
  s3    ckptfs from_pretrained  from_pretrained(MNT/consolidated) of the step

Best of --passes. The table gives each row's ratio (time / reference
time) against the references measured in the same run, next to its goal
(judged on the best passes), and in brackets the ratio of the rows'
median passes (is a miss one lucky pass of the reference?);
the load average at start and end; each ckptfs mount's daemon peak RSS
(VmHWM from /proc) and the bytes it fetched (its log) against the step's
size; for the disk rows, how their best pass split between the load call
(safetensors' load_file returns tensors on a mapping of the file) and
the first touch of every page after it. Every ckptfs load is checked
tensor by tensor against dcp.load's.

    sudo python3 bench/bench_dcp_load.py [--dir /tmp/ckptfs-bench-dcp] [--size-gib 1] [--passes 3]

Needs root (drop_caches, FUSE), `weed`, torch, safetensors, boto3,
s3torchconnector, runai-model-streamer, transformers.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "..", "tools"))
import common  # noqa: E402  (bench/common.py: drop_caches, Mounted, vm_field, from_pretrained_pass, write_hf_config)
import s3_server  # noqa: E402  (tools/s3_server.py: SeaweedFS)

RANKS = 4
STEP = "run/step-1"
HF_KEY = "hf/model.safetensors"
WRAP = "model"  # dcp.save({"model": sd}): consolidated/ drops the wrapper

# What the disk gives: every disk row is also shown against it.
DISK_FLOOR = "disk read the files"

# (row, reference, goal): row's time / reference's time should be <= goal.
GOALS = [
    ("disk ckptfs", "disk dcp.load", 0.9),
    ("disk ckptfs", "disk load_file (real)", 1.1),
    ("disk ckptfs --fetch-direct", "disk load_file (real)", 1.1),
    ("s3 ckptfs step", "s3 s3torchconnector", 0.9),
    ("s3 ckptfs step", "s3 boto3 (memory)", 1.2),
    ("s3 ckptfs consolidated", "s3 Run:ai", 0.9),
    ("s3 ckptfs from_pretrained", "s3 download+consolidate+from_pretrained", 0.35),
]


# ---------------------------------------------------------------------------
# the state
# ---------------------------------------------------------------------------


def llama_specs(size_gib: float) -> tuple[dict, dict]:
    """{hf name: shape} (all bf16) of at least size_gib, and the dims."""
    if size_gib >= 0.5:
        hidden, inter, vocab, kv = 2048, 5504, 32000, 512
    else:  # small enough to smoke-test on a busy machine
        hidden, inter, vocab, kv = 512, 1376, 8000, 128
    specs = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
             "model.norm.weight": (hidden,)}
    i = 0
    while i == 0 or sum(2 * _numel(s) for s in specs.values()) < size_gib * 2**30:
        p = f"model.layers.{i}."
        specs.update({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                      p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                      p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                      p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                      p + "post_attention_layernorm.weight": (hidden,)})
        i += 1
    return specs, {"hidden": hidden, "intermediate": inter, "vocab": vocab, "kv": kv, "layers": i}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensor(name: str, shape):
    import torch
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 + len(shape))
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def _save_worker(rank: int, world: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = {k: distribute_tensor(_tensor(k, tuple(s)), mesh, [Shard(0)], src_data_rank=None)
          for k, s in job["specs"].items()}
    dcp.save({WRAP: sd}, storage_writer=dcp.FileSystemWriter(job["out"], sync_files=False))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past torch's gloo teardown at interpreter exit


def save_step(out: str, specs: dict) -> None:
    """dcp.save by RANKS gloo ranks (this script as each rank)."""
    import json
    import subprocess
    import tempfile
    tmp = tempfile.mkdtemp(prefix="bench_dcp_pg_")
    job = os.path.join(tmp, "job.json")
    with open(job, "w") as f:
        json.dump({"out": out, "specs": {k: list(v) for k, v in specs.items()}}, f)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "_worker", str(r), str(RANKS),
                               os.path.join(tmp, "store"), job], env=env) for r in range(RANKS)]
    codes = [p.wait() for p in procs]
    shutil.rmtree(tmp, ignore_errors=True)
    if any(codes):
        raise RuntimeError(f"dcp.save ranks exited {codes}")


def prepare(top: str, size_gib: float) -> tuple[str, str, dict, dict]:
    """(step dir, real safetensors file, specs, dims), made once per size."""
    specs, dims = llama_specs(size_gib)
    tag = f"{size_gib:g}g"
    step, real = os.path.join(top, f"step-{tag}"), os.path.join(top, f"real-{tag}", "model.safetensors")
    if not os.path.exists(os.path.join(step, ".metadata")):
        shutil.rmtree(step, ignore_errors=True)
        print(f"saving the step with dcp.save on {RANKS} gloo ranks into {step}", flush=True)
        save_step(step, specs)
    common.write_hf_config(step, dims)
    if not os.path.exists(real):
        from safetensors.torch import save_file
        os.makedirs(os.path.dirname(real), exist_ok=True)
        save_file(dcp_load(step, specs), real + ".tmp", metadata={"format": "pt"})
        os.replace(real + ".tmp", real)
    return step, real, specs, dims


# ---------------------------------------------------------------------------
# the clients
# ---------------------------------------------------------------------------


def _empty(specs: dict) -> dict:
    import torch
    return {k: torch.empty(s, dtype=torch.bfloat16) for k, s in specs.items()}


def dcp_load(step: str, specs: dict, reader=None) -> dict:
    import torch.distributed.checkpoint as dcp
    sd = {WRAP: _empty(specs)}
    dcp.load(sd, storage_reader=reader or dcp.FileSystemReader(step))
    return sd[WRAP]


def read_files(step: str) -> None:
    """Every file of the step read at once, one thread each, 8 MiB per
    read into one reused buffer: the bytes off the disk and nothing else."""
    import mmap

    def read(path: str) -> None:
        buf = mmap.mmap(-1, 8 << 20)
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while n := os.preadv(fd, [buf], at):
                at += n
        finally:
            os.close(fd)
            buf.close()

    files = [os.path.join(step, f) for f in sorted(os.listdir(step))]
    with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
        list(pool.map(read, files))


def touch(sd):
    """Reads a byte of every page of every tensor (common.touch_pages):
    safetensors' load_file returns tensors on a private mapping of the
    file, read only when touched, so a load is timed with its bytes in
    memory."""
    import torch
    if isinstance(sd, dict):
        common.touch_pages(t for t in sd.values() if isinstance(t, torch.Tensor))
    return sd


def load_folder(folder: str) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def s3tc_load(specs: dict) -> dict:
    from s3torchconnector import S3ClientConfig, S3ReaderConstructor
    from s3torchconnector.dcp import S3StorageReader
    reader = S3StorageReader(s3_server.REGION, f"s3://{s3_server.BUCKET}/{STEP}",
                             s3client_config=S3ClientConfig(force_path_style=True),
                             reader_constructor=S3ReaderConstructor.dcp_optimized())
    return dcp_load("", specs, reader)


def runai_load() -> dict:
    from runai_model_streamer import SafetensorsStreamer
    out = {}
    with SafetensorsStreamer() as s:
        s.stream_file(f"s3://{s3_server.BUCKET}/{HF_KEY}")
        for name, t in s.get_tensors():
            out[name] = t
    return out


def boto3_memory(client, keys: list[str]) -> dict:
    """Every object into memory: 8 threads, 8 MiB ranged parts."""
    from boto3.s3.transfer import TransferConfig
    cfg = TransferConfig(max_concurrency=8, multipart_chunksize=8 << 20, multipart_threshold=8 << 20)
    out = {}
    for k in keys:
        buf = io.BytesIO()
        client.download_fileobj(s3_server.BUCKET, k, buf, Config=cfg)
        out[k] = buf.getbuffer()
    return out


def download_consolidate_load(client, keys: list[str], work: str, specs: dict) -> int:
    """An eval node without ckptfs: download the step, dcp.load it,
    save_file one safetensors file, from_pretrained of that folder."""
    from boto3.s3.transfer import TransferConfig
    from safetensors.torch import save_file
    cfg = TransferConfig(max_concurrency=8, multipart_chunksize=8 << 20, multipart_threshold=8 << 20)
    dl, hf = os.path.join(work, "download"), os.path.join(work, "hf")
    for d in (dl, hf):
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
    for k in keys:
        client.download_file(s3_server.BUCKET, k, os.path.join(dl, os.path.basename(k)), Config=cfg)
    save_file(dcp_load(dl, specs), os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(dl, "config.json"), hf)
    return common.from_pretrained_pass(hf)


# ---------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------


class Run:
    def __init__(self, args, work: str):
        self.args, self.work = args, work
        self.rss: dict[str, int] = {}       # row -> largest daemon VmHWM
        self.fetched: dict[str, str] = {}   # row -> "N ranged GETs, X GB received" (last pass)
        self.start_s: dict[str, float] = {}  # row -> least time a mount took to start (index included)
        self.cpu: dict[str, float] = {}  # row -> least CPU seconds the daemon used (user + system)
        self.n = 0
        self.last_split = (0.0, 0.0)  # the last timed load: (its call, the touch of its bytes after)
        self.splits: dict[str, list] = {}  # row -> [(seconds, last_split)] by pass

    def cold(self, fn):
        """fn() timed from a dropped page cache; (seconds, result)."""
        why = common.drop_caches()
        if why:
            raise RuntimeError(why + " (run as root)")
        t0 = time.monotonic()
        r = fn()
        t1 = time.monotonic()
        r = touch(r)
        self.last_split = (t1 - t0, time.monotonic() - t1)
        return time.monotonic() - t0, r

    def mounted(self, row: str, root: str, fn, want: dict | None, extra: tuple = ()):
        """A fresh index and mount of `root`, cold; fn(mount point) timed,
        the mount's start included; what it loaded checked against `want`
        (if given) while still mounted (its tensors may map the mount's
        files). Returns (seconds, None)."""
        self.n += 1
        d = os.path.join(self.work, f"mount-{self.n}")
        m = common.Mounted(self.args.bin, root, os.path.join(d, "mnt"), os.path.join(d, "index"),
                          os.path.join(d, "mount.log"), list(extra))
        common.drop_caches()
        t0 = time.monotonic()
        try:
            m.start()
            r = fn(m.mnt)
            t1 = time.monotonic()
            r = touch(r)
            secs = time.monotonic() - t0
            self.last_split = (t1 - t0 - m.seconds, secs - (t1 - t0))
            self.rss[row] = max(self.rss.get(row, 0), common.vm_field(m.proc.pid, "VmHWM") or 0)
            self.start_s[row] = min(self.start_s.get(row, m.seconds), m.seconds)
            cpu = common.process_cpu(m.proc.pid)
            self.cpu[row] = min(self.cpu.get(row, cpu), cpu)
            if want is not None and isinstance(r, dict):
                check(row, r, want)
            del r
        finally:
            m.stop()
        got = re.findall(r"s3: (\d+ ranged GETs, [\d.]+ GB received)", Path(m.log_file).read_text(errors="replace"))
        if got:
            self.fetched[row] = got[-1]
        return secs, None


def cpu_busy(window: float) -> float:
    """The share of all CPUs' time that was not idle (nor iowait) over the
    next `window` seconds, from /proc/stat."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    total0, idle0 = snap()
    time.sleep(window)
    total1, idle1 = snap()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def check(what: str, got: dict, want: dict) -> None:
    import torch
    if set(got) != set(want):
        raise AssertionError(f"{what}: tensor names differ: {sorted(set(got) ^ set(want))[:5]}")
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    if bad:
        raise AssertionError(f"{what}: tensors differ from dcp.load's: {bad[:5]}")


def one_pass(r: Run, ctx: dict, first: bool) -> dict:
    step, real, specs, client, keys = ctx["step"], ctx["real"], ctx["specs"], ctx["client"], ctx["keys"]
    want = ctx["want"] if first else None
    root_step, root_hf = f"s3://{s3_server.BUCKET}/{STEP}", f"s3://{s3_server.BUCKET}/{os.path.dirname(HF_KEY)}"
    rows = {
        "disk read the files": lambda: r.cold(lambda: read_files(step)),
        "disk dcp.load": lambda: r.cold(lambda: dcp_load(step, specs)),
        "disk load_file (real)": lambda: r.cold(lambda: load_folder(os.path.dirname(real))),
        "disk ckptfs": lambda: r.mounted("disk ckptfs", step,
                                         lambda m: load_folder(os.path.join(m, "consolidated")), want),
        "disk ckptfs --fetch-direct": lambda: r.mounted(
            "disk ckptfs --fetch-direct", step, lambda m: load_folder(os.path.join(m, "consolidated")), want,
            ("--fetch-direct",)),
        "s3 boto3 (memory)": lambda: r.cold(lambda: boto3_memory(client, keys)),
        "s3 s3torchconnector": lambda: r.cold(lambda: s3tc_load(specs)),
        "s3 Run:ai": lambda: r.cold(runai_load),
        "s3 ckptfs step": lambda: r.mounted("s3 ckptfs step", root_step,
                                            lambda m: load_folder(os.path.join(m, "consolidated")), want),
        "s3 ckptfs consolidated": lambda: r.mounted("s3 ckptfs consolidated", root_hf,
                                                    lambda m: load_folder(os.path.join(m, "consolidated")), want),
        "s3 download+consolidate+from_pretrained": lambda: r.cold(
            lambda: download_consolidate_load(client, keys, r.work, specs)),
        "s3 ckptfs from_pretrained": lambda: r.mounted(
            "s3 ckptfs from_pretrained", root_step,
            lambda m: common.from_pretrained_pass(os.path.join(m, "consolidated")), None),
    }
    out = {}
    for name, fn in rows.items():
        if r.args.busy_check:
            print(f"    CPUs busy over the 0.5 s before the row: {cpu_busy(0.5):.0%}", flush=True)
        secs, result = fn()
        out[name] = secs
        r.splits.setdefault(name, []).append((secs, r.last_split))
        if first and isinstance(result, dict) and name != "s3 boto3 (memory)":
            check(name, result, ctx["want"])  # (mounted rows check while mounted)
        del result
        print(f"  {name:<42} {secs:8.2f} s", flush=True)
    return out


def report(passes: list[dict], r: Run, ctx: dict, load: tuple[float, float]) -> None:
    best = {k: min(p[k] for p in passes) for k in passes[0]}
    median = {k: statistics.median(p[k] for p in passes) for k in passes[0]}
    gb = ctx["step_bytes"] / 1e9
    print(f"\nload average {load[0]:.2f} at start, {load[1]:.2f} at end; best of {len(passes)} cold passes; "
          f"step {gb:.2f} GB ({RANKS} ranks), {len(ctx['specs'])} bf16 tensors")
    print(f"{'row':<42} {'best s':>8} {'median':>8} {'GB/s':>6}  ratio of the best vs reference (goal), "
          f"[ratio of the medians]")
    for name, secs in best.items():
        ratios = [f"{secs / best[ref]:.2f}x {ref} (goal <= {goal}: {'met' if secs / best[ref] <= goal else 'MISSED'})"
                  f" [{median[name] / median[ref]:.2f}x]"
                  for row, ref, goal in GOALS if row == name]
        if name.startswith("disk ") and name != DISK_FLOOR:
            ratios.insert(0, f"{secs / best[DISK_FLOOR]:.2f}x the floor")
        print(f"{name:<42} {secs:8.2f} {median[name]:8.2f} {gb / secs:6.2f}  " + "; ".join(ratios))
    print("  where the disk loads spent their best pass: the load call (mount start not included), then the "
          "first touch of every page of what it returned")
    for row, by_pass in r.splits.items():
        if row.startswith("disk ") and row != DISK_FLOOR:
            call, after = min(by_pass)[1]
            print(f"    {row}: {call:.2f} s in the call, {after:.2f} s touching")
    for row in r.rss:
        fetched = r.fetched.get(row)
        extra = ""
        if fetched:
            got = float(re.search(r"([\d.]+) GB", fetched).group(1))
            size = ctx["hf_bytes"] if row == "s3 ckptfs consolidated" else ctx["step_bytes"]
            extra = f"; fetched {fetched} = {got * 1e9 / size:.2f}x the {size / 1e9:.2f} GB source"
        print(f"  {row}: mount start (fresh index) {r.start_s[row]:.2f} s of it; daemon peak RSS "
              f"{r.rss[row] / 2**20:.0f} MiB, CPU {r.cpu[row]:.2f} s{extra}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-dcp", help="work directory (the saved state is kept)")
    ap.add_argument("--size-gib", type=float, default=1.0, help="bytes of bf16 tensors (default 1)")
    ap.add_argument("--passes", type=int, default=3, help="cold passes; the best of them is reported")
    ap.add_argument("--busy-check", action="store_true",
                    help="before each row, sample /proc/stat for 0.5 s and print the share of the CPUs that "
                         "was busy (is the machine quiet when the row starts?)")
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", os.path.join(HERE, "..", "build", "ckptfs")))
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    top = os.path.abspath(args.dir)
    os.makedirs(top, exist_ok=True)
    step, real, specs, dims = prepare(top, args.size_gib)
    work = os.path.join(top, "work")
    shutil.rmtree(work, ignore_errors=True)
    weed = os.path.join(top, "weed")
    shutil.rmtree(weed, ignore_errors=True)
    os.makedirs(weed)
    step_files = sorted(f for f in os.listdir(step) if f.endswith(".distcp") or f in (".metadata", "config.json"))
    step_bytes = sum(os.path.getsize(os.path.join(step, f)) for f in step_files)
    # 64 MB volumes: the step, the real file and the download's copy.
    server = s3_server.Server(Path(weed), volumes=int(args.size_gib * 3 * 1024 / 64) + 16,
                              max_attempts=None, pool=32)
    try:
        os.environ.update(server.env())
        os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"  # SeaweedFS: path-style only
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda f: server.client.upload_file(os.path.join(step, f), s3_server.BUCKET,
                                                               f"{STEP}/{f}"), step_files))
        server.client.upload_file(real, s3_server.BUCKET, HF_KEY)
        server.client.upload_file(os.path.join(step, "config.json"), s3_server.BUCKET,
                                  os.path.dirname(HF_KEY) + "/config.json")
        ctx = {"step": step, "real": real, "specs": specs, "client": server.client,
               "keys": [f"{STEP}/{f}" for f in step_files], "want": dcp_load(step, specs),
               "step_bytes": step_bytes, "hf_bytes": os.path.getsize(real)}
        r = Run(args, work)
        load0 = os.getloadavg()[0]
        passes = []
        for i in range(args.passes):
            print(f"pass {i + 1}", flush=True)
            passes.append(one_pass(r, ctx, first=i == 0))
        report(passes, r, ctx, (load0, os.getloadavg()[0]))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        import json
        with open(sys.argv[5]) as f:
            _save_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
    else:
        sys.exit(main())
