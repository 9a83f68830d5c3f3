#!/usr/bin/env python3
"""Benchmark ckptfs on a generated sharded safetensors checkpoint.

Generates (numpy + safetensors, no torch) a checkpoint in the format of
torch's HuggingFaceStorageWriter(save_distributed=True): one
`shard-RRRRR-model-00001-of-00001.safetensors` per rank, each holding that
rank's chunks, placed by `saved_offsets` in `__metadata__.DCP_SHARDING_INFO`.
A Llama-like model: BF16 matrices split on dim 0 (q/k/v/gate/up/embed) or on
dim 1 (o_proj/down_proj: every row of the consolidated tensor is gathered
from all ranks), an F32 lm_head split on dim 0, F32 norms replicated (stored
by one rank, as torch does).

Then, in one run, it measures:
  - `ckptfs index` wall time (page cache dropped first, and again warm);
  - mount time: from starting `ckptfs mount -f` until the mountpoint answers
    (stat of consolidated/ entries succeeds);
  - `ckptfs export` of consolidated/ (the same read path, no FUSE);
  - sequential read throughput of every file in consolidated/ through the
    mount, cold (page cache dropped: source files and FUSE pages) and warm,
    next to the same bytes as real files written by `ckptfs export`;
  - the clients that load models, each next to the same bytes as real files
    (ckptfs export) in the same run, cold (best of --repeat, page cache
    dropped or the files evicted before each pass) and warm: sequential
    read(), safetensors `safe_open(...).get_tensor(k).clone()` of every
    tensor (page faults of a mapped file), `transformers.from_pretrained`;
    the tensors/ view of row-sharded vs column-sharded tensors; and a DCP
    checkpoint (.distcp, saved by torch over gloo ranks) the same way;
  - the mount daemon's peak RSS (VmHWM of the `ckptfs mount -f` process);
and checks that the virtual and exported files are identical (sha256) and
that every tensor in them equals what the generator wrote.

    python3 tools/bench.py [--dir DIR] [--size-gib 2.0] [--ranks 4] [--json]

Cold figures drop the page cache (`echo 3 > /proc/sys/vm/drop_caches`, root);
where that is refused (a container) every file involved (shards, exported
files, and the virtual files through the mount) is evicted with
posix_fadvise(DONTNEED) instead, and the run says so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = "bench-manifest.json"
GEN_VERSION = 1
READ_CHUNK = 1 << 20  # bytes per read() call when measuring throughput

ALIGN = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2}
ITEM = {"F32": 4, "BF16": 2}


# ---------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------


def model_specs(size_gib: float, ranks: int) -> tuple[dict, dict]:
    """{fqn: (shape, dtype, split_dim or None)} with at least size_gib of
    tensor bytes, and the dimensions chosen."""
    hidden, inter, vocab, kv = 2048, 5504, 32000, 512
    for d in (hidden, inter, vocab, kv):
        assert d % ranks == 0, f"--ranks {ranks} must divide {d}"
    fixed = {
        "model.embed_tokens.weight": ((vocab, hidden), "BF16", 0),
        "lm_head.weight": ((vocab, hidden), "F32", 0),
        "model.norm.weight": ((hidden,), "F32", None),
    }

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        return {
            p + "self_attn.q_proj.weight": ((hidden, hidden), "BF16", 0),
            p + "self_attn.k_proj.weight": ((kv, hidden), "BF16", 0),
            p + "self_attn.v_proj.weight": ((kv, hidden), "BF16", 0),
            p + "self_attn.o_proj.weight": ((hidden, hidden), "BF16", 1),
            p + "mlp.gate_proj.weight": ((inter, hidden), "BF16", 0),
            p + "mlp.up_proj.weight": ((inter, hidden), "BF16", 0),
            p + "mlp.down_proj.weight": ((hidden, inter), "BF16", 1),
            p + "input_layernorm.weight": ((hidden,), "F32", None),
            p + "post_attention_layernorm.weight": ((hidden,), "F32", None),
        }

    def nbytes(specs: dict) -> int:
        return sum(int(np.prod(s)) * ITEM[d] for s, d, _ in specs.values())

    specs = dict(fixed)
    specs.update(layer(0))  # at least one layer: the dim-1 (column-gather) tensors live there
    i = 1
    while nbytes(specs) < size_gib * 2**30:
        specs.update(layer(i))
        i += 1
    dims = {"hidden": hidden, "intermediate": inter, "vocab": vocab, "kv": kv, "layers": i}
    return specs, dims


def random_tensor(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    x = rng.standard_normal(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    if dtype == "F32":
        return x
    # BF16 = the top 16 bits of the F32 pattern (round to nearest even).
    u = x.view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def split(n: int, ranks: int) -> list[tuple[int, int]]:
    """torch's Shard(dim) rule: ceil-sized pieces, the last ones smaller/empty."""
    step = -(-n // ranks)
    return [(min(r * step, n), min((r + 1) * step, n)) for r in range(ranks)]


def header_bytes(entries: list[tuple[str, str, list[int], int, int]], metadata: dict) -> bytes:
    h = {"__metadata__": metadata}
    for name, dtype, shape, b, e in entries:
        h[name] = {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text


def generate(out: str, size_gib: float, ranks: int, seed: int, log) -> dict:
    """Writes the checkpoint into `out`; returns the manifest (incl. the
    sha256 of every full tensor's bytes, for verification)."""
    specs, dims = model_specs(size_gib, ranks)
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    # Which rank stores each replicated tensor (round-robin, as torch dedups).
    replicated = sorted(f for f, (_, _, d) in specs.items() if d is None)
    owner = {f: i % ranks for i, f in enumerate(replicated)}
    # Per rank: [(fqn, dtype, local shape, saved_offsets, slices)].
    per_rank: list[list] = [[] for _ in range(ranks)]
    for fqn, (shape, dtype, dim) in specs.items():
        if dim is None:
            per_rank[owner[fqn]].append((fqn, dtype, list(shape), [0] * len(shape), None))
            continue
        for r, (a, b) in enumerate(split(shape[dim], ranks)):
            local = list(shape)
            local[dim] = b - a
            offs = [0] * len(shape)
            offs[dim] = a
            sl = tuple(slice(a, b) if d == dim else slice(None) for d in range(len(shape)))
            per_rank[r].append((fqn, dtype, local, offs, sl))
    # Writer order inside a file: descending dtype alignment, then name.
    for items in per_rank:
        items.sort(key=lambda it: (-ALIGN[it[1]], it[0]))

    # Open every rank file, reserve its header, then stream tensors: each full
    # tensor is generated once and its pieces are appended to the rank files.
    files, layout = [], []
    for r, items in enumerate(per_rank):
        at, entries = 0, []
        for fqn, dtype, local, offs, _ in items:
            n = int(np.prod(local)) * ITEM[dtype]
            entries.append((fqn, dtype, local, at, at + n))
            at += n
        info = {fqn: {"saved_offsets": offs} for fqn, _, _, offs, _ in items}
        meta = {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
        hb = header_bytes(entries, meta)
        path = os.path.join(out, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors")
        f = open(path, "wb")
        f.write(hb)
        files.append(f)
        layout.append({e[0]: len(hb) + e[3] for e in entries})
    digests = {}
    t0 = time.monotonic()
    done = 0
    total = sum(int(np.prod(s)) * ITEM[d] for s, d, _ in specs.values())
    try:
        for fqn in sorted(specs):
            shape, dtype, dim = specs[fqn]
            full = random_tensor(rng, shape, dtype)
            digests[fqn] = hashlib.sha256(full.tobytes()).hexdigest()
            for r, items in enumerate(per_rank):
                for it in items:
                    if it[0] != fqn:
                        continue
                    piece = full if it[4] is None else np.ascontiguousarray(full[it[4]])
                    files[r].seek(layout[r][fqn])
                    files[r].write(piece.tobytes())
            done += full.nbytes
            log(f"\r  generating: {done / 2**30:.2f} / {total / 2**30:.2f} GiB", end="")
        log(f"\r  generated {total / 2**30:.2f} GiB in {time.monotonic() - t0:.1f} s" + " " * 20)
    finally:
        for f in files:
            f.close()
    # The files must parse with the reference library.
    try:
        from safetensors import safe_open
        for r in range(ranks):
            p = os.path.join(out, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors")
            with safe_open(p, "numpy") as st:
                assert set(st.keys()) == {it[0] for it in per_rank[r]}
                assert "DCP_SHARDING_INFO" in st.metadata()
    except ImportError:
        log("  (safetensors not installed: generated files not cross-checked)")
    return {"version": GEN_VERSION, "size_gib": size_gib, "ranks": ranks, "seed": seed,
            "dims": dims, "tensor_bytes": total, "tensors": len(specs),
            "specs": {k: [list(s), d, dim] for k, (s, d, dim) in specs.items()},
            "sha256": digests}


def ensure_checkpoint(ckpt: str, size_gib: float, ranks: int, seed: int, log) -> dict:
    mf = os.path.join(ckpt, MANIFEST)
    want = {"version": GEN_VERSION, "size_gib": size_gib, "ranks": ranks, "seed": seed}
    if os.path.exists(mf):
        with open(mf) as f:
            m = json.load(f)
        if all(m.get(k) == v for k, v in want.items()):
            log(f"  reusing the checkpoint in {ckpt}")
            return m
    if os.path.exists(ckpt):  # another size, or a run interrupted while generating
        shutil.rmtree(ckpt)
    m = generate(ckpt, size_gib, ranks, seed, log)
    # The manifest lives next to the shards; ckptfs ignores non-safetensors files.
    with open(mf, "w") as f:
        json.dump(m, f)
    return m


# ---------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------


def drop_caches() -> str | None:
    """Drops the page cache; returns None or why it could not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"drop_caches failed: {e.strerror}"


def read_files(paths: list[str], digest: bool = False) -> tuple[int, float, str | None]:
    """Reads the files sequentially; (bytes, seconds, sha256 of the
    concatenation when digest)."""
    buf = bytearray(READ_CHUNK)
    mv = memoryview(buf)
    h = hashlib.sha256() if digest else None
    total = 0
    t0 = time.monotonic()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(mv)
                if not n:
                    break
                total += n
                if h:
                    h.update(mv[:n])
    return total, time.monotonic() - t0, h.hexdigest() if h else None


def file_digests(paths: list[str]) -> dict[str, str]:
    out = {}
    for p in paths:
        out[os.path.basename(p)] = read_files([p], digest=True)[2]
    return out


def verify_tensors(folder: str, manifest: dict) -> list[str]:
    """Compares every tensor in the safetensors files of `folder` with the
    generator's sha256; returns mismatches (empty = all equal)."""
    seen, bad = set(), []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
            for fqn, e in h.items():
                if fqn == "__metadata__":
                    continue
                spec = manifest["specs"].get(fqn)
                if spec is None or e["shape"] != spec[0] or e["dtype"] != spec[1]:
                    bad.append(f"{fqn}: {e['dtype']}{e['shape']} vs generated {spec}")
                    continue
                b, end = e["data_offsets"]
                f.seek(8 + n + b)
                hh = hashlib.sha256()
                left = end - b
                while left:
                    chunk = f.read(min(left, 16 << 20))
                    if not chunk:
                        break
                    hh.update(chunk)
                    left -= len(chunk)
                if hh.hexdigest() != manifest["sha256"][fqn]:
                    bad.append(f"{fqn}: bytes differ from the generated tensor")
                seen.add(fqn)
    missing = set(manifest["sha256"]) - seen
    bad += [f"{fqn}: missing" for fqn in sorted(missing)]
    return bad


def is_mounted(mnt: str) -> bool:
    mnt = os.path.realpath(mnt)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == mnt for line in f)


def proc_io(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def vm_field(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Mounted:
    """`ckptfs mount -f` in a child process we own; always unmounted."""

    def __init__(self, binary: str, root: str, mnt: str, index: str, log_file: str, extra: list[str] = ()):
        self.binary, self.root, self.mnt, self.index, self.log_file = binary, root, mnt, index, log_file
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.seconds = 0.0

    def start(self, probe: str = "consolidated") -> None:
        os.makedirs(self.mnt, exist_ok=True)
        self.stderr = open(self.log_file + ".stderr", "wb")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [self.binary, "mount", "-f", self.root, self.mnt, "--index", self.index,
             "--log-file", self.log_file, *self.extra], stdout=subprocess.DEVNULL, stderr=self.stderr)
        deadline = t0 + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ckptfs mount exited {self.proc.returncode}; see {self.log_file}.stderr")
            if is_mounted(self.mnt):
                try:
                    os.listdir(os.path.join(self.mnt, probe))
                    break
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError("the mount did not answer within 120 s")
            time.sleep(0.002)
        self.seconds = time.monotonic() - t0

    def stop(self) -> None:
        for i in range(50):
            if not is_mounted(self.mnt):
                break
            subprocess.run(["fusermount3", "-u", self.mnt], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            if is_mounted(self.mnt):
                time.sleep(0.1)
        if is_mounted(self.mnt):
            subprocess.run(["fusermount3", "-uz", self.mnt], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        if self.proc and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


def run_timed(cmd: list[str], env=None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    return time.monotonic() - t0, p


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mp = parts[1]
            if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                best, kind = mp, f"{parts[2]} ({parts[0]} on {mp})"
    return kind


def git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or "?"
    except OSError:
        return "?"


# ---------------------------------------------------------------------------
# clients that load models: virtual vs the same bytes as real files
# ---------------------------------------------------------------------------


def evict(paths: list[str]) -> None:
    """Drops the clean cached pages of each file (works through the FUSE
    mount too: the kernel drops the virtual file's pages)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_cold(paths: list[str]) -> str:
    """Empties the page cache of `paths`: "drop_caches", or "fadvise" when
    only the files themselves could be evicted."""
    if drop_caches() is None:
        return "drop_caches"
    evict(paths)
    return "fadvise"


def files_under(d: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(d):
        out += [os.path.join(dirpath, n) for n in names]
    return sorted(out)


def safe_open_pass(paths: list[str]) -> int:
    """safe_open + get_tensor(k).clone() of every tensor: what transformers
    does, page faults on a mapping of each file. Returns tensor bytes."""
    from safetensors import safe_open
    n = 0
    for p in paths:
        with safe_open(p, framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k).clone()
                n += t.numel() * t.element_size()
    return n


def from_pretrained_pass(folder: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, low_cpu_mem_usage=True)
    # Parameters may stay on a mapping of the files until used (transformers
    # 5 keeps tensors whose dtype matches on the mmap): one byte of every
    # page is read so that the load includes all of them.
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            b = p.detach().reshape(-1).view(torch.uint8)
            int(b[::4096].sum())
            n += b.numel()
    del model
    return n


def read_pass(paths: list[str]) -> int:
    return read_files(paths)[0]


def compare(label: str, run_v, run_r, cold_paths: list[str], repeat: int, log) -> dict:
    """Times run_v() (virtual) and run_r() (real files), alternately: cold
    (best of `repeat`, cache emptied before each) then warm (best of
    `repeat`). Each returns the bytes it loaded; ratios are virtual speed /
    real speed."""
    out = {"cold_v_s": [], "cold_r_s": [], "warm_v_s": [], "warm_r_s": []}
    nbytes = {}
    for _ in range(max(1, repeat)):
        for key, fn in (("cold_v_s", run_v), ("cold_r_s", run_r)):
            out["cold_how"] = make_cold(cold_paths)
            t0 = time.monotonic()
            nbytes[key[-3]] = fn()
            out[key].append(time.monotonic() - t0)
    run_v(), run_r()  # both fully cached (the cold passes emptied the cache after each other)
    for _ in range(max(1, repeat)):
        for key, fn in (("warm_v_s", run_v), ("warm_r_s", run_r)):
            t0 = time.monotonic()
            fn()
            out[key].append(time.monotonic() - t0)
    best = {k: min(v) for k, v in out.items() if k.endswith("_s")}
    # Speed ratios: the two sides may move different bytes (tensors/ rows vs columns).
    per = nbytes["v"] / nbytes["r"]
    out.update({"bytes_v": nbytes["v"], "bytes_r": nbytes["r"], "best": best,
                "cold_ratio": per * best["cold_r_s"] / best["cold_v_s"],
                "warm_ratio": per * best["warm_r_s"] / best["warm_v_s"]})
    log(f"  {label}: cold {best['cold_v_s']:.2f} s vs {best['cold_r_s']:.2f} s ({out['cold_ratio']:.2f}x), "
        f"warm {best['warm_v_s']:.2f} s vs {best['warm_r_s']:.2f} s ({out['warm_ratio']:.2f}x)")
    return out


def write_hf_config(ckpt: str, dims: dict) -> None:
    """config.json of the generated Llama shape: consolidated/ passes it
    through, so transformers can load the mount's folder."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": dims["hidden"], "intermediate_size": dims["intermediate"],
           "num_hidden_layers": dims["layers"], "num_attention_heads": dims["hidden"] // 128,
           "num_key_value_heads": dims["kv"] // 128, "vocab_size": dims["vocab"],
           "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    path = os.path.join(ckpt, "config.json")
    text = json.dumps(cfg, indent=1)
    if os.path.exists(path) and open(path).read() == text:
        return  # unchanged: rewriting it would make an earlier index stale
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def client_patterns(args, manifest: dict, ckpt: str, mnt: str, export: str, log) -> dict:
    """Sequential read(), safe_open, from_pretrained and the row/column
    tensors/ split, each virtual vs real, in the mounted checkpoint."""
    vdir = os.path.join(mnt, "consolidated")
    v_st = sorted(os.path.join(vdir, f) for f in os.listdir(vdir) if f.endswith(".safetensors"))
    r_st = sorted(os.path.join(export, os.path.basename(p)) for p in v_st)
    cold = v_st + r_st + files_under(ckpt)
    out = {"read": compare("sequential read()", lambda: read_pass(v_st), lambda: read_pass(r_st), cold,
                           args.repeat, log)}
    try:
        import torch  # noqa: F401
        out["safe_open"] = compare("safe_open + get_tensor", lambda: safe_open_pass(v_st),
                                   lambda: safe_open_pass(r_st), cold, args.repeat, log)
    except ImportError as e:
        out["safe_open"] = {"skipped": f"torch not importable: {e}"}
    if args.no_transformers:
        out["from_pretrained"] = {"skipped": "--no-transformers"}
    else:
        try:
            import transformers  # noqa: F401
            shutil.copy(os.path.join(vdir, "config.json"), os.path.join(export, "config.json"))
            from_pretrained_pass(export)  # untimed: the first call imports the model code (seconds)
            out["from_pretrained"] = compare("from_pretrained", lambda: from_pretrained_pass(vdir),
                                             lambda: from_pretrained_pass(export), cold, args.repeat, log)
        except ImportError as e:
            out["from_pretrained"] = {"skipped": f"transformers not importable: {e}"}
    # tensors/<fqn>.npy of row-sharded vs column-sharded BF16 matrices (virtual only).
    tdir = os.path.join(mnt, "tensors")
    rows = [os.path.join(tdir, f + ".npy") for f, (s, d, dim) in manifest["specs"].items()
            if d == "BF16" and dim == 0 and "embed" not in f]
    cols = [os.path.join(tdir, f + ".npy") for f, (s, d, dim) in manifest["specs"].items() if dim == 1]
    out["tensors_rows_vs_cols"] = compare("tensors/ columns vs rows (virtual)", lambda: read_pass(cols),
                                          lambda: read_pass(rows), cold + rows + cols, args.repeat, log)
    return out


def dcp_checkpoint(args, top: str, work: str, log) -> dict:
    """A DCP checkpoint saved by torch over gloo ranks (tools/bench_views.py's
    writer): consolidated/ read and safe_open'd, virtual vs exported."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_views
    from pathlib import Path
    ckpt = os.path.join(top, f"dcp-{args.dcp_layers}x{args.dcp_hidden}")
    if not os.path.exists(os.path.join(ckpt, ".metadata")):
        shutil.rmtree(ckpt, ignore_errors=True)
        log(f"  saving a DCP checkpoint with torch ({args.ranks} gloo ranks) in {ckpt}")
        secs = bench_views.write_checkpoint(Path(ckpt), args.ranks, args.dcp_layers, args.dcp_hidden)
        log(f"  saved in {secs:.1f} s")
    index, mnt, export = (os.path.join(work, "dcp-" + n) for n in ("index", "mnt", "export"))
    p = subprocess.run([args.bin, "export", ckpt, "consolidated", export, "--index", index],
                       capture_output=True)
    if p.returncode != 0:
        raise RuntimeError(f"ckptfs export (DCP) exited {p.returncode}: {p.stderr.decode()}")
    mount = Mounted(args.bin, ckpt, mnt, index, os.path.join(work, "dcp-mount.log"), args.mount_arg)
    out = {"dir": ckpt, "bytes": sum(os.path.getsize(f) for f in files_under(ckpt))}
    try:
        mount.start()
        vdir = os.path.join(mnt, "consolidated")
        v_st = sorted(os.path.join(vdir, f) for f in os.listdir(vdir) if f.endswith(".safetensors"))
        r_st = sorted(os.path.join(export, os.path.basename(f)) for f in v_st)
        cold = v_st + r_st + files_under(ckpt)
        out["read"] = compare("DCP sequential read()", lambda: read_pass(v_st), lambda: read_pass(r_st), cold,
                              args.repeat, log)
        out["safe_open"] = compare("DCP safe_open + get_tensor", lambda: safe_open_pass(v_st),
                                   lambda: safe_open_pass(r_st), cold, args.repeat, log)
        out["identical"] = file_digests(v_st) == file_digests(r_st)
        out["daemon_peak_rss_bytes"] = vm_field(mount.proc.pid, "VmHWM")
    finally:
        mount.stop()
    return out


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See docs/BENCHMARKS.md for how to read the figures.")
    ap.add_argument("--dir", help="work directory (the checkpoint is kept and reused there); "
                                  "default: a temporary directory, removed afterwards")
    ap.add_argument("--size-gib", type=float, default=2.0, help="tensor bytes to generate (default 2.0)")
    ap.add_argument("--ranks", type=int, default=4, help="ranks (shard files) (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", os.path.join(REPO, "build", "ckptfs")),
                    help="ckptfs binary (default $CKPTFS_BIN or build/ckptfs)")
    ap.add_argument("--repeat", type=int, default=1, help="warm read passes; the best is reported")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the index and exported files")
    ap.add_argument("--mount-arg", action="append", default=[],
                    help="extra argument for `ckptfs mount` (repeatable), e.g. --mount-arg=--readahead-mib=0")
    ap.add_argument("--no-clients", action="store_true",
                    help="skip the safe_open / from_pretrained / tensors/ comparisons")
    ap.add_argument("--no-transformers", action="store_true", help="skip from_pretrained")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP checkpoint")
    ap.add_argument("--dcp-layers", type=int, default=12, help="layers of the DCP checkpoint (default 12)")
    ap.add_argument("--dcp-hidden", type=int, default=1024, help="hidden size of the DCP checkpoint (default 1024)")
    args = ap.parse_args(argv)

    def log(msg: str, end: str = "\n") -> None:
        print(msg, end=end, file=sys.stderr, flush=True)

    if not os.access(args.bin, os.X_OK):
        log(f"bench: no ckptfs binary at {args.bin} (build it, or pass --bin / set CKPTFS_BIN)")
        return 2

    # Ctrl-C and SIGTERM both unwind through the finally blocks below.
    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    own_dir = args.dir is None
    top = os.path.abspath(args.dir) if args.dir else tempfile.mkdtemp(prefix="ckptfs-bench-")
    ckpt = os.path.join(top, "checkpoint")
    work = os.path.join(top, "work")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    index = os.path.join(work, "index")
    mnt = os.path.join(work, "mnt")
    export = os.path.join(work, "export")
    mount = Mounted(args.bin, ckpt, mnt, index, os.path.join(work, "mount.log"), args.mount_arg)
    version = subprocess.run([args.bin, "--version"], capture_output=True, text=True).stdout.strip()
    res: dict = {"machine": machine(), "ckptfs": {"bin": args.bin, "version": version, "repo_head": git_rev()},
                 "dir": top, "fs": fs_type(top), "notes": []}
    try:
        log(f"bench: checkpoint in {ckpt}")
        manifest = ensure_checkpoint(ckpt, args.size_gib, args.ranks, args.seed, log)
        write_hf_config(ckpt, manifest["dims"])
        shards = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))
        shard_paths = [os.path.join(ckpt, f) for f in shards]
        res["checkpoint"] = {
            "tensor_bytes": manifest["tensor_bytes"], "tensors": manifest["tensors"],
            "ranks": manifest["ranks"], "dims": manifest["dims"],
            "files": len(shards), "file_bytes": sum(os.path.getsize(os.path.join(ckpt, f)) for f in shards)}

        cold_note = drop_caches()
        if cold_note:
            res["notes"].append(cold_note + ": for 'cold' figures the files involved were evicted with "
                                "posix_fadvise(DONTNEED) instead (index and mount times ran warm)")
        res["cold_cache"] = True
        res["cold_how"] = "drop_caches" if cold_note is None else "fadvise"

        # 1. index, cold then warm.
        secs, p = run_timed([args.bin, "index", ckpt, "--index", index, "-q"])
        if p.returncode != 0:
            raise RuntimeError(f"ckptfs index exited {p.returncode}: {p.stderr.decode()}")
        res["index_cold_s"] = secs
        secs, p = run_timed([args.bin, "index", ckpt, "--index", index, "-q"])
        res["index_warm_s"] = secs
        log(f"  index: {res['index_cold_s']:.3f} s cold, {res['index_warm_s']:.3f} s warm")

        # 2. export (the read path without FUSE) -> the real files to compare with.
        make_cold(shard_paths)
        secs, p = run_timed([args.bin, "export", ckpt, "consolidated", export, "--index", index])
        if p.returncode != 0:
            raise RuntimeError(f"ckptfs export exited {p.returncode}: {p.stderr.decode()}")
        exported = sorted(os.path.join(export, f) for f in os.listdir(export))
        res["export_s"] = secs
        res["consolidated_bytes"] = sum(os.path.getsize(p) for p in exported)
        res["export_MBps"] = res["consolidated_bytes"] / secs / 1e6
        log(f"  export: {secs:.2f} s ({res['export_MBps']:.0f} MB/s, cache dropped first)")

        # 3. cat > /dev/null: the read path (plan + pread + gather) without FUSE
        #    and without writing anything.
        names = [os.path.basename(p) for p in exported]
        cat = {}
        for label in ("cold", "warm"):
            if label == "cold":
                make_cold(shard_paths)
            t0 = time.monotonic()
            for name in names:
                p = subprocess.run([args.bin, "cat", ckpt, "consolidated/" + name, "--index", index],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                if p.returncode != 0:
                    raise RuntimeError(f"ckptfs cat exited {p.returncode}: {p.stderr.decode()}")
            cat[label + "_MBps"] = res["consolidated_bytes"] / (time.monotonic() - t0) / 1e6
        res["cat"] = cat
        log(f"  cat > /dev/null: {cat['cold_MBps']:.0f} MB/s cold, {cat['warm_MBps']:.0f} MB/s warm")

        # 4. mount.
        make_cold(shard_paths)
        mount.start()
        res["mount_s"] = mount.seconds
        log(f"  mount: {mount.seconds:.3f} s until the mountpoint answered")
        virtual = sorted(os.path.join(mnt, "consolidated", os.path.basename(p)) for p in exported)
        for v, e in zip(virtual, exported):
            if os.path.getsize(v) != os.path.getsize(e):
                raise RuntimeError(f"{v}: size {os.path.getsize(v)} != exported {os.path.getsize(e)}")

        # 5. reads: cold, then warm, virtual vs real.
        reads = {}
        for label, paths in (("virtual", virtual), ("exported", exported)):
            make_cold(virtual + exported + shard_paths)
            n, secs, _ = read_files(paths)
            cold = n / secs / 1e6
            passes = []
            rchar0 = proc_io(mount.proc.pid, "rchar")
            for _ in range(max(1, args.repeat)):
                n, secs, _ = read_files(paths)
                passes.append(n / secs / 1e6)
            warm = max(passes)
            reads[label] = {"bytes": n, "cold_MBps": cold, "warm_MBps": warm, "warm_passes_MBps": passes}
            if label == "virtual":
                # Bytes the daemon read from the shard files during the warm
                # passes: ~0 when the page cache served them (keep_cache).
                reads[label]["daemon_read_during_warm_bytes"] = proc_io(mount.proc.pid, "rchar") - rchar0
            log(f"  read {label}: {cold:.0f} MB/s cold, {warm:.0f} MB/s warm")
        res["read"] = reads
        if not args.no_clients:
            res["clients"] = client_patterns(args, manifest, ckpt, mnt, export, log)
        res["daemon_peak_rss_bytes"] = vm_field(mount.proc.pid, "VmHWM")
        res["daemon_rss_bytes"] = vm_field(mount.proc.pid, "VmRSS")

        res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]

        # 6. correctness: virtual == exported, and both == generated tensors.
        dv, de = file_digests(virtual), file_digests(exported)
        res["sha256_virtual"] = dv
        res["identical"] = dv == de
        bad = verify_tensors(export, manifest)
        res["tensors_verified"] = not bad
        if bad:
            res["notes"].append("tensor mismatches: " + "; ".join(bad[:5]))
        with open(mount.log_file) as f:
            errors = [l.strip() for l in f if l.strip()]
        if errors:
            res["notes"].append(f"mount log has {len(errors)} line(s), first: {errors[0]}")
        mount.stop()
        if not args.no_dcp:
            try:
                res["dcp"] = dcp_checkpoint(args, top, work, log)
            except ImportError as e:
                res["dcp"] = {"skipped": f"torch not importable: {e}"}
        res["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    except KeyboardInterrupt:
        log("\nbench: interrupted; cleaning up")
        mount.stop()
        return 130
    finally:
        mount.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        if own_dir and not args.keep:
            shutil.rmtree(top, ignore_errors=True)

    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(format_table(res, args))
    ok = res["identical"] and res["tensors_verified"] and res.get("dcp", {}).get("identical", True)
    return 0 if ok else 1


def format_table(r: dict, args) -> str:
    ck = r["checkpoint"]
    m = r["machine"]
    mb = lambda b: f"{b / 1e6:,.0f} MB"
    rss = r.get("daemon_peak_rss_bytes")
    lines = [
        f"ckptfs benchmark  ({r['ckptfs']['bin']}, repo at {r['ckptfs']['repo_head']})",
        f"machine: {m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB RAM, kernel {m['kernel']}; "
        f"load average {m['loadavg_start'][0]:.2f} at start, {m.get('loadavg_end', ['?'])[0]} at end",
        f"checkpoint: {ck['tensors']} tensors, {ck['tensor_bytes'] / 2**30:.2f} GiB in {ck['files']} shard files "
        f"({ck['ranks']} ranks; BF16 split on dim 0 and dim 1, F32 dim 0 and replicated), on {r['fs']}",
        f"consolidated/: {mb(r['consolidated_bytes'])}; cold runs: "
        f"{'page cache dropped' if r['cold_how'] == 'drop_caches' else 'files evicted with fadvise(DONTNEED)'}"
        f"; mount args: {' '.join(args.mount_arg) or '(defaults)'}",
        "",
        f"{'step':<44}{'time':>10}",
        f"{'ckptfs index (cold cache)':<44}{r['index_cold_s']:>9.3f}s",
        f"{'ckptfs index (warm)':<44}{r['index_warm_s']:>9.3f}s",
        f"{'ckptfs mount -f until the mountpoint answers':<44}{r['mount_s']:>9.3f}s",
        f"{'ckptfs export consolidated (cold cache)':<44}{r['export_s']:>9.2f}s"
        f"   ({r['export_MBps']:,.0f} MB/s, incl. writing the copy)",
        "",
        f"{'sequential read, ' + str(READ_CHUNK >> 20) + ' MiB read() calls':<44}{'cold':>11}{'warm':>11}",
        f"{'  consolidated/ via the FUSE mount':<44}{r['read']['virtual']['cold_MBps']:>6,.0f} MB/s"
        f"{r['read']['virtual']['warm_MBps']:>6,.0f} MB/s",
        f"{'  same bytes as real files (ckptfs export)':<44}{r['read']['exported']['cold_MBps']:>6,.0f} MB/s"
        f"{r['read']['exported']['warm_MBps']:>6,.0f} MB/s",
        f"{'  ckptfs cat > /dev/null (no FUSE)':<44}{r['cat']['cold_MBps']:>6,.0f} MB/s"
        f"{r['cat']['warm_MBps']:>6,.0f} MB/s",
        "",
        f"mount daemon peak RSS (VmHWM): {rss / 2**20:,.1f} MiB" if rss else "mount daemon peak RSS: unknown",
        f"bytes the daemon read from shard files during the warm passes: "
        f"{r['read']['virtual']['daemon_read_during_warm_bytes'] / 1e6:,.1f} MB (0 = served by the page cache)",
        f"virtual == exported (sha256): {'yes' if r['identical'] else 'NO'}; "
        f"every tensor == generated: {'yes' if r['tensors_verified'] else 'NO'}",
    ]
    lines += format_ratios(r)
    for n in r["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def format_ratios(r: dict) -> list[str]:
    """The virtual-vs-real comparisons: seconds and the ratio of speeds
    (bytes/s virtual / bytes/s real; the same bytes on both sides except for
    tensors/ rows vs columns)."""
    rows = []
    for key, label in (("read", "sequential 1 MiB read()"), ("safe_open", "safe_open + get_tensor().clone()"),
                       ("from_pretrained", "transformers from_pretrained"),
                       ("tensors_rows_vs_cols", "tensors/ column- vs row-sharded")):
        rows.append((label, r.get("clients", {}).get(key)))
    for key, label in (("read", "DCP: sequential 1 MiB read()"), ("safe_open", "DCP: safe_open + get_tensor")):
        rows.append((label, r.get("dcp", {}).get(key)))
    lines = ["", f"{'virtual vs real file (best s, ratio of speeds)':<40}{'cold':>24}{'warm':>24}"]
    for label, c in rows:
        if c is None:
            continue
        if "skipped" in c:
            lines.append(f"  {label:<38}skipped: {c['skipped']}")
            continue
        b = c["best"]
        lines.append(f"  {label:<38}{b['cold_v_s']:>7.2f} / {b['cold_r_s']:<6.2f}{c['cold_ratio']:>6.2f}x"
                     f"{b['warm_v_s']:>10.2f} / {b['warm_r_s']:<6.2f}{c['warm_ratio']:>6.2f}x")
    if "dcp" in r and "bytes" in r["dcp"]:
        lines.append(f"  (DCP checkpoint: {r['dcp']['bytes'] / 1e6:,.0f} MB of .distcp; "
                     f"virtual == exported: {'yes' if r['dcp'].get('identical') else 'NO'})")
    if "tensors_rows_vs_cols" in r.get("clients", {}):
        lines.append("  (tensors/ row: 'virtual' = column-sharded matrices, 'real' = row-sharded ones, both virtual)")
    return lines


if __name__ == "__main__":
    sys.exit(main())
