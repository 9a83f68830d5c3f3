"""What the benchmarks of bench/ share: the generated checkpoint, mounts,
page-cache control and the clients that load models.

- the checkpoint: `ensure_checkpoint` generates (numpy + safetensors, no
  torch) a sharded safetensors checkpoint in the format of torch's
  HuggingFaceStorageWriter(save_distributed=True), or reuses one already
  generated with the same parameters; `verify_tensors` checks what a folder
  holds against it (bench_read.py describes the model);
- measuring: `drop_caches` / `make_cold` (cold figures), `read_files`,
  `Mounted` (a `ckptfs mount -f` and its daemon), `vm_field`, `proc_io`,
  `machine()`;
- clients: `read_pass`, `safe_open_pass`, `from_pretrained_pass`, and
  `compare`, a virtual file against the same bytes as a real file, cold and
  warm.

Imported by path: each script of bench/ runs with bench/ first on sys.path.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
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


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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


def touch_pages(tensors) -> int:
    """Reads one byte of every page of each tensor, so that tensors still on
    a mapping of a file (safetensors' load_file, transformers 5) are in
    memory when a load is timed. Returns their bytes."""
    import torch
    n = 0
    with torch.no_grad():
        for t in tensors:
            b = t.detach().reshape(-1).view(torch.uint8)
            if b.numel():
                int(b[::4096].sum())
            n += b.numel()
    return n


def load_file_pass(paths: list[str]) -> int:
    """safetensors' load_file of each file, then a byte of every page of what
    it returned (touch_pages). Returns tensor bytes."""
    from safetensors.torch import load_file
    return sum(touch_pages(load_file(p).values()) for p in paths)


def from_pretrained_pass(folder: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, low_cpu_mem_usage=True)
    # Parameters may stay on a mapping of the files until used (transformers
    # 5 keeps tensors whose dtype matches on the mmap).
    n = touch_pages(model.parameters())
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
