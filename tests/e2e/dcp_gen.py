#!/usr/bin/env python3
"""Write real PyTorch DCP checkpoints and torch.save folders with real torch,
plus torch's own reading of each (the oracle), for ckptfs end-to-end tests.

Everything runs on CPU, offline (HF_HUB_OFFLINE=1). Multi-rank saves use
gloo ranks started as subprocesses (`python3 dcp_gen.py _worker ...`, the
pattern of ckpt_gen.py, copied rather than imported). One worker batch saves
several checkpoints, so the torch import and process-group set-up are paid
once per world size.

Layout (the same for every checkpoint)
--------------------------------------
    <base>/<name>/               only what the writer produced, plus
                                 config.json for the Llama/HF folders, so
                                 the directory can be mounted as-is
    <base>/<name>-oracle.pt      torch's own reading of the checkpoint:
                                 DCP: format_utils.dcp_to_torch_save(<name>)
                                 (nested, as saved); torch.save folders:
                                 {name: tensor} from torch.load of each file
    <base>/<name>-logits.pt      (Llama only) {"input_ids", "logits"} (F32)
    <base>/<name>-info.json      the info dict below

Oracles are never inside the checkpoint directory (a `*-oracle.pt` inside it
would itself be a torch.save checkpoint to ckptfs).

Info dict (JSON-serialisable), one per checkpoint::

    {"name", "kind": "dcp" | "torch_save", "out_dir", "oracle_path",
     "world_size", "mesh": [2] | [2, 2] | None, "writer": {...} | None,
     "files": [files in out_dir, sorted],
     "tensors": {name: {"dtype": "BF16", "shape": [..]}},   # from .metadata
     "bytes": [BYTE_IO keys, sorted],                       # DCP only
     "model_keys": [names consolidated/ must hold] | None,
     "logits_path": str | None, "zstd_impl": str | None}

Names are exactly the keys of `Metadata.state_dict_metadata` (DCP) or the
nested dict keys joined by '.' (torch.save).

zstd: torch's ZStandard extension needs the `zstandard` or `pyzstd` module;
when neither is installed, ensure_zstd() plugs in a stand-in backed by
libzstd (ctypes) that writes frames the way zstandard's stream_writer does
(no content size, no checksum), in the ranks and in the oracle's process.

Library use::

    infos = dcp_gen.generate_all(base_dir)      # every checkpoint below
    flat = dcp_gen.load_oracle_flat(infos["nested"])   # {name: value}

CLI::

    python3 dcp_gen.py all OUT_BASE             # generate + verify, print summary
    python3 dcp_gen.py dump DIR [--pickletools] # print a .metadata's structure
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import io
import json
import os
import pickle
import pickletools
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

from harness import spawn_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

ST_DTYPE = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32",
    torch.int64: "I64", torch.uint64: "U64", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
# dtypes numpy lacks: ckptfs presents them as float32 in tensors/*.npy
AS_FLOAT32 = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}

LLAMA_CONFIG = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    rms_norm_eps=1e-5, rope_theta=10000.0,
)
LLAMA_INPUT_IDS = [[1, 17, 42, 99, 120, 3, 7, 127, 0, 64, 33, 5]]


# ---------------------------------------------------------------------------
# small helpers shared with the tests
# ---------------------------------------------------------------------------


def escape_name(name: str) -> str:
    """File name ckptfs uses for a tensor / byte item (docs/SEMANTICS.md)."""
    if name == "":
        return "%"
    if name == ".":
        return "%2E"
    if name == "..":
        return "%2E%2E"
    return name.replace("%", "%25").replace("/", "%2F")


def flatten(obj: Any, prefix: tuple = ()) -> dict[str, Any]:
    """DCP's flattening (torch.distributed.checkpoint._traverse, restated):
    every mapping is walked (an empty one leaves nothing); a list is walked
    only when it holds a tensor, a mapping or a walked list, else it is one
    leaf (one BYTE_IO item); tuples and everything else are leaves. Keys are
    str(key) / the list index, joined by '.'. generate_all checks these keys
    against every .metadata it writes."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, prefix + (str(k),)))
    elif isinstance(obj, list) and not _is_terminal(obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, prefix + (i,)))
    else:
        out[".".join(str(p) for p in prefix)] = obj
    return out


def _is_terminal(obj: Any) -> bool:
    if isinstance(obj, dict):
        return False
    if not isinstance(obj, list):
        return True
    return not any(isinstance(v, torch.Tensor)
                   or (isinstance(v, (dict, list)) and not _is_terminal(v)) for v in obj)


def flatten_tensors(obj: Any, prefix: tuple = ()) -> dict[str, torch.Tensor]:
    """torch.save naming: nested dict keys joined by '.', tensors only."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_tensors(v, prefix + (k,)))
    elif isinstance(obj, torch.Tensor):
        out[".".join(str(p) for p in prefix)] = obj
    return out


def comparable(t: torch.Tensor) -> torch.Tensor:
    """What tensors/*.npy holds: BF16/F8 as float32 (exact), else the same."""
    t = t.detach()
    if t.dtype in AS_FLOAT32:
        t = t.float()
    return t.contiguous()


def raw_bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of a tensor (any dtype, any strides)."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def read_metadata(ckpt_dir: str):
    """The .metadata object, unpickled by real pickle (our own files only)."""
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        return pickle.load(f)


def metadata_summary(ckpt_dir: str) -> tuple[dict, list]:
    """({tensor fqn: {"dtype", "shape"}}, [BYTE_IO keys]) from .metadata."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, TensorStorageMetadata)
    md = read_metadata(ckpt_dir)
    tensors, byte_keys = {}, []
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            tensors[k] = {"dtype": ST_DTYPE[v.properties.dtype], "shape": list(v.size)}
        elif isinstance(v, BytesStorageMetadata):
            byte_keys.append(k)
        else:
            raise TypeError(f"{ckpt_dir}: {k}: unexpected {type(v)}")
    return tensors, sorted(byte_keys)


def item_bytes(ckpt_dir: str, key: str) -> bytes:
    """The bytes of one BYTE_IO item as torch's reader sees them: the
    `_StorageInfo` slice of its .distcp file, zstd-decoded when its
    transform_descriptors say "stream.zstd/1"."""
    md = read_metadata(ckpt_dir)
    hits = [s for idx, s in md.storage_data.items() if idx.fqn == key]
    if len(hits) != 1:
        raise KeyError(f"{ckpt_dir}: {key!r} has {len(hits)} storage items")
    s = hits[0]
    with open(os.path.join(ckpt_dir, s.relative_path), "rb") as f:
        f.seek(s.offset)
        data = f.read(s.length)
    for desc in reversed(list(s.transform_descriptors or ())):
        if desc.partition("/")[0] != "stream.zstd":
            raise ValueError(f"unknown transform {desc}")
        data = _LibZstd.decompress(data)
    return data


def load_oracle_flat(info: dict) -> dict[str, Any]:
    """{name: value} from <name>-oracle.pt (DCP: flattened like .metadata)."""
    obj = torch.load(info["oracle_path"], weights_only=False)
    return flatten(obj) if info["kind"] == "dcp" else obj


# ---------------------------------------------------------------------------
# zstd for torch's ZStandard extension when neither zstandard nor pyzstd is
# installed: the same API subset, backed by libzstd through ctypes.
# ---------------------------------------------------------------------------


class _LibZstd:
    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            name = ctypes.util.find_library("zstd") or "libzstd.so.1"
            lib = ctypes.CDLL(name)
            lib.ZSTD_compressBound.restype = ctypes.c_size_t
            lib.ZSTD_compressBound.argtypes = [ctypes.c_size_t]
            lib.ZSTD_createCCtx.restype = ctypes.c_void_p
            lib.ZSTD_freeCCtx.argtypes = [ctypes.c_void_p]
            lib.ZSTD_CCtx_setParameter.restype = ctypes.c_size_t
            lib.ZSTD_CCtx_setParameter.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.ZSTD_compress2.restype = ctypes.c_size_t
            lib.ZSTD_compress2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_void_p, ctypes.c_size_t]
            lib.ZSTD_decompress.restype = ctypes.c_size_t
            lib.ZSTD_decompress.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                            ctypes.c_void_p, ctypes.c_size_t]
            lib.ZSTD_isError.restype = ctypes.c_uint
            lib.ZSTD_isError.argtypes = [ctypes.c_size_t]
            lib.ZSTD_getErrorName.restype = ctypes.c_char_p
            lib.ZSTD_getErrorName.argtypes = [ctypes.c_size_t]
            lib.ZSTD_getFrameContentSize.restype = ctypes.c_ulonglong
            lib.ZSTD_getFrameContentSize.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            cls._lib = lib
        return cls._lib

    @classmethod
    def compress(cls, data: bytes, level: int = 3) -> bytes:
        """One zstd frame like python-zstandard's stream_writer writes (the
        writer torch uses): no content size in the frame header, no checksum."""
        lib = cls.lib()
        cap = lib.ZSTD_compressBound(len(data))
        dst = ctypes.create_string_buffer(cap)
        cctx = lib.ZSTD_createCCtx()
        try:
            for param, value in ((100, level),    # ZSTD_c_compressionLevel
                                 (200, 0),        # ZSTD_c_contentSizeFlag
                                 (201, 0)):       # ZSTD_c_checksumFlag
                r = lib.ZSTD_CCtx_setParameter(cctx, param, value)
                if lib.ZSTD_isError(r):
                    raise RuntimeError("ZSTD_CCtx_setParameter: " + lib.ZSTD_getErrorName(r).decode())
            n = lib.ZSTD_compress2(cctx, dst, cap, data, len(data))
        finally:
            lib.ZSTD_freeCCtx(cctx)
        if lib.ZSTD_isError(n):
            raise RuntimeError("ZSTD_compress2: " + lib.ZSTD_getErrorName(n).decode())
        return dst.raw[:n]

    @classmethod
    def decompress(cls, data: bytes) -> bytes:
        lib = cls.lib()
        size = lib.ZSTD_getFrameContentSize(data, len(data))
        cap = size if size < (1 << 62) else max(1 << 16, 4 * len(data))
        while True:
            dst = ctypes.create_string_buffer(max(cap, 1))
            n = lib.ZSTD_decompress(dst, cap, data, len(data))
            if not lib.ZSTD_isError(n):
                return dst.raw[:n]
            err = lib.ZSTD_getErrorName(n).decode()
            if "too small" not in err.lower() or cap > (1 << 34):
                raise RuntimeError("ZSTD_decompress: " + err)
            cap *= 4


class _ShimWriter(io.RawIOBase):
    def __init__(self, output):
        self._out, self._buf = output, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        mv = memoryview(b).cast("B")
        self._buf += mv
        return len(mv)

    def close(self) -> None:
        if not self.closed:
            self._out.write(_LibZstd.compress(bytes(self._buf)))
            self._out.close()   # cascades, as zstandard's stream_writer does
        super().close()


class _ShimReader(io.RawIOBase):
    def __init__(self, inp):
        self._in, self._data, self._pos = inp, None, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def read(self, n: int = -1) -> bytes:
        if self._data is None:
            self._data = _LibZstd.decompress(self._in.read())
        end = len(self._data) if n is None or n < 0 else self._pos + n
        out = self._data[self._pos:end]
        self._pos += len(out)
        return out

    def readall(self) -> bytes:
        return self.read(-1)


class _ZstandardShim:
    """`zstandard` as far as torch.distributed.checkpoint._extension uses it."""

    class ZstdCompressor:
        def stream_writer(self, output):
            return _ShimWriter(output)

    class ZstdDecompressor:
        def stream_reader(self, inp):
            return _ShimReader(inp)


def ensure_zstd() -> str:
    """Makes torch's ZStandard extension usable; returns which backend."""
    from torch.distributed.checkpoint import _extension as ext
    if ext.zstandard is not None:
        return "zstandard"
    if ext.pyzstd is not None:
        return "pyzstd"
    _LibZstd.lib()
    ext.zstandard = _ZstandardShim()
    return "libzstd-ctypes"


# ---------------------------------------------------------------------------
# worker (one gloo rank; saves every task of the batch)
# ---------------------------------------------------------------------------


def _parse_placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard
    return [{"S0": Shard(0), "S1": Shard(1), "S2": Shard(2), "R": Replicate()}[p]
            for p in spec.split(",")]


def _distribute(obj: Any, prefix: tuple, placements: dict, mesh) -> Any:
    from torch.distributed.tensor import distribute_tensor
    if isinstance(obj, dict):
        return {k: _distribute(v, prefix + (k,), placements, mesh) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_distribute(v, prefix + (i,), placements, mesh) for i, v in enumerate(obj)]
    if isinstance(obj, torch.Tensor):
        spec = placements.get(".".join(str(p) for p in prefix), "plain")
        if spec == "plain":
            return obj.clone()
        # src_data_rank=None: every rank holds the full tensor already, so no
        # communication (and no dependence on collectives for odd dtypes).
        return distribute_tensor(obj, mesh, _parse_placements(spec), src_data_rank=None)
    return obj


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        meshes = {}
        for task in job["tasks"]:
            shape = tuple(task["mesh"])
            if shape not in meshes:
                meshes[shape] = init_device_mesh(
                    "cpu", shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(shape))))
            full = torch.load(task["input_path"], weights_only=False)
            sd = _distribute(full, (), task["placements"], meshes[shape])
            w = task["writer"]
            extensions = None
            if w.get("zstd"):
                ensure_zstd()
                from torch.distributed.checkpoint._extension import ZStandard
                extensions = [ZStandard()]
            writer = dcp.FileSystemWriter(
                task["out_dir"], single_file_per_rank=w["single_file_per_rank"],
                thread_count=w["thread_count"], sync_files=False, _extensions=extensions)
            dcp.save(sd, storage_writer=writer)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn_save(world_size: int, tasks: list[dict], timeout: float = 300.0) -> None:
    """Runs `world_size` ranks as fresh `python3 dcp_gen.py _worker ...`
    processes (harness.spawn_ranks); each saves every task in order."""
    spawn_ranks(__file__, world_size, {"tasks": tasks}, name="dcp_gen", timeout=timeout,
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


# ---------------------------------------------------------------------------
# state dicts
# ---------------------------------------------------------------------------


def _rand(shape, dtype, g) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(dtype)
    if dtype == torch.uint16:
        return torch.randint(0, 65536, shape, generator=g, dtype=torch.int64).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)


# name -> (shape, dtype, placement on a 1-d mesh of 2 ranks)
SYNTH_SPECS: dict[str, tuple] = {
    "layers.0.wq": ((8, 6), torch.float32, "S0"),
    "layers.0.wo": ((6, 9), torch.bfloat16, "S1"),      # 9 cols over 2 ranks
    "embed": ((7, 5), torch.bfloat16, "S0"),            # 7 rows over 2 ranks
    "norm": ((6,), torch.float32, "R"),
    "ids": ((3, 5), torch.int64, "S0"),
    "mask": ((5,), torch.bool, "R"),
    "half": ((5, 3), torch.float16, "S0"),
    "double": ((2, 3), torch.float64, "S1"),
    "u8": ((7, 2), torch.uint8, "S0"),
    "i8": ((4, 3), torch.int8, "R"),
    "i16": ((3, 5), torch.int16, "S1"),
    "i32": ((4,), torch.int32, "plain"),
    "u16": ((5, 3), torch.uint16, "S0"),
    "f8_e4m3": ((6, 4), torch.float8_e4m3fn, "S0"),
    "f8_e5m2": ((4, 4), torch.float8_e5m2, "R"),
    "scalar": ((), torch.float32, "plain"),
    "empty": ((0, 3), torch.float32, "plain"),
    "one_row": ((1, 4), torch.float32, "S0"),            # rank 1 holds nothing
    "three_d": ((3, 5, 4), torch.float32, "S1"),
    "wide": ((33, 257), torch.float32, "S1"),            # many row pieces
    "w/e%ird.name": ((2, 2), torch.float32, "plain"),    # escaping
}
SYNTH_BYTES = {"meta": {"step": 100, "name": "run-1 αβ", "lrs": [0.1, 0.2],
                        "flags": {"a": True, "b": None}, "cfg/path": "x/y%z",
                        "shape": (3, 4)}}

# 2x2 mesh (4 ranks): name -> (shape, dtype, "p0,p1")
MESH2D_SPECS: dict[str, tuple] = {
    "a": ((7, 6), torch.float32, "S0,S1"),
    "b": ((7, 5), torch.bfloat16, "S0,S0"),     # 7 rows over 4 ranks: 2,2,2,1
    "c": ((6, 7), torch.float32, "R,S1"),
    "d": ((5, 4), torch.float32, "S1,R"),
    "e": ((9,), torch.float32, "R,R"),
    "f": ((4, 10), torch.int64, "S1,S0"),
    "g": ((3,), torch.float32, "S0,S0"),        # 3 over 4: one empty shard
    "h": ((7, 9), torch.float16, "S1,S1"),      # 9 cols over 4 ranks
    "i": ((2, 7, 3), torch.float32, "S1,S0"),
}


def _synthetic(specs: dict, seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    sd, placements = {}, {}
    for name in sorted(specs):
        shape, dtype, pl = specs[name]
        sd[name] = _rand(shape, dtype, g)
        placements[name] = pl
    return sd, placements


def _toy_model_nested(seed: int = 7) -> tuple[dict, dict, list[str]]:
    """{"model", "optim" (AdamW after one real step), "lr_scheduler",
    "dataloader", "rng", "train_state", "extra"} and placements."""
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.attn = nn.Linear(d, d)
            self.out = nn.Linear(d, d, bias=False)

        def forward(self, x):
            return x + self.out(torch.relu(self.attn(x)))

    class Toy(nn.Module):
        def __init__(self, vocab=11, d=6):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList([Block(d), Block(d)])
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, ids):
            x = self.embed(ids)
            for b in self.layers:
                x = b(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    model = Toy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ids = torch.randint(0, 11, (3, 5))
    loss = nn.functional.cross_entropy(model(ids).reshape(-1, 11), ids.reshape(-1))
    loss.backward()
    opt.step()
    sched.step()
    msd, osd = get_state_dict(model, opt)
    msd = {k: v.detach().clone() for k, v in msd.items()}
    pyrng = random.Random(seed)
    sd = {
        "model": msd,
        "optim": osd,
        "lr_scheduler": sched.state_dict(),
        "dataloader": {"epoch": 1, "sampler_offset": 96, "order": [3, 1, 2]},
        "rng": {"cpu": torch.get_rng_state(), "python": pyrng.getstate()},
        "train_state": {"step": 1, "tokens_seen": 15, "loss": loss.item()},
        "extra": {"w/e%ird.name": torch.arange(6, dtype=torch.int32).reshape(2, 3),
                  "slash/key": "value/with%", "tl": [torch.ones(3), 5]},
    }
    rules = {"embed.weight": "S0", "layers.0.attn.weight": "S0", "layers.0.attn.bias": "S0",
             "layers.0.out.weight": "S1", "layers.1.attn.weight": "S1",
             "layers.1.out.weight": "S0", "norm.weight": "R", "head.weight": "S0"}
    placements = {}
    for fqn, pl in rules.items():
        placements[f"model.{fqn}"] = pl
        placements[f"optim.state.{fqn}.exp_avg"] = pl
        placements[f"optim.state.{fqn}.exp_avg_sq"] = pl
    return sd, placements, list(msd)


def _llama_placement(fqn: str) -> str:
    if fqn.endswith(("o_proj.weight", "down_proj.weight")):
        return "S1"            # row-parallel
    if fqn.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                     "gate_proj.weight", "up_proj.weight",
                     "embed_tokens.weight", "lm_head.weight")):
        return "S0"            # column-parallel / vocab-parallel
    return "R"                 # norms


def _llama(tied: bool, seed: int, with_optim: bool, dtype=torch.float32):
    """Tiny random LlamaForCausalLM after one AdamW step (when with_optim).
    Returns (model, config, model_sd, optim_sd | None, logits dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_CONFIG, tie_word_embeddings=tied)
    config.dtype = str(dtype).replace("torch.", "")
    model = LlamaForCausalLM._from_config(config, dtype=dtype)
    ids = torch.tensor(LLAMA_INPUT_IDS, dtype=torch.long)
    osd = None
    if with_optim:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        _, osd = get_state_dict(model, opt)
    model.eval()
    msd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if tied:
        # what save_pretrained writes for tied embeddings: no lm_head.weight
        msd.pop("lm_head.weight", None)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return model, config, msd, osd, {"input_ids": ids, "logits": logits}


# ---------------------------------------------------------------------------
# checkpoint plans
# ---------------------------------------------------------------------------

WRITER_VARIANTS = {
    "w_sfpr1_t1": {"single_file_per_rank": True, "thread_count": 1},
    "w_sfpr0_t1": {"single_file_per_rank": False, "thread_count": 1},
    "w_sfpr1_t3": {"single_file_per_rank": True, "thread_count": 3},
    "w_sfpr0_t3": {"single_file_per_rank": False, "thread_count": 3},
}
DCP_NAMES = list(WRITER_VARIANTS) + ["mesh2d", "nested", "llama", "llama_tied",
                                     "llama_flat", "zstd"]
TSAVE_NAMES = ["tsave_bin", "tsave_sharded", "tsave_pt"]


def _paths(base: str, name: str) -> dict[str, str]:
    return {"out_dir": os.path.join(base, name),
            "oracle_path": os.path.join(base, f"{name}-oracle.pt"),
            "logits_path": os.path.join(base, f"{name}-logits.pt"),
            "info_path": os.path.join(base, f"{name}-info.json")}


def _plan_dcp(base: str, inputs_dir: str) -> tuple[dict, dict]:
    """Builds every DCP state dict. Returns (plans by name, inputs kept for
    verification {name: nested state dict})."""
    plans, inputs = {}, {}

    def add(name, sd, placements, mesh, writer, **extra):
        p = _paths(base, name)
        input_path = os.path.join(inputs_dir, f"{name}.pt")
        torch.save(sd, input_path)
        inputs[name] = sd
        plans[name] = dict(name=name, out_dir=p["out_dir"], input_path=input_path,
                           placements=placements, mesh=mesh, writer=writer,
                           world_size=int(torch.tensor(mesh).prod()), **extra)

    synth, synth_pl = _synthetic(SYNTH_SPECS, seed=1234)
    # plain tensors whose storage is exactly their bytes but not row-major:
    # DCP saves them as they are (torch.save keeps the strides)
    g = torch.Generator().manual_seed(4321)
    synth["transposed"] = _rand((5, 3), torch.float32, g).t()
    synth["permuted"] = _rand((2, 3, 4), torch.bfloat16, g).permute(2, 0, 1)
    for name, w in WRITER_VARIANTS.items():
        add(name, {**synth, **SYNTH_BYTES}, synth_pl, [2], dict(w, zstd=False))

    m2, m2_pl = _synthetic(MESH2D_SPECS, seed=99)
    add("mesh2d", m2, m2_pl, [2, 2], {"single_file_per_rank": True, "thread_count": 1,
                                     "zstd": False})

    nested, nested_pl, model_keys = _toy_model_nested()
    add("nested", nested, nested_pl, [2], {"single_file_per_rank": True, "thread_count": 1,
                                          "zstd": False}, model_keys=model_keys)

    for name, tied in (("llama", False), ("llama_tied", True)):
        _, config, msd, osd, logits = _llama(tied, seed=3 if tied else 2, with_optim=True)
        sd = {"model": msd, "optim": osd}
        pl = {}
        for fqn in msd:
            pl[f"model.{fqn}"] = _llama_placement(fqn)
        for fqn in osd["state"]:
            pl[f"optim.state.{fqn}.exp_avg"] = _llama_placement(fqn)
            pl[f"optim.state.{fqn}.exp_avg_sq"] = _llama_placement(fqn)
        add(name, sd, pl, [2], {"single_file_per_rank": True, "thread_count": 1,
                                "zstd": False},
            model_keys=list(msd), config=config.to_dict(), logits=logits)

    # a plain HF state dict saved as is (no {"model": ...} wrapper), bf16
    _, config, msd, _, logits = _llama(False, seed=4, with_optim=False, dtype=torch.bfloat16)
    add("llama_flat", msd, {k: _llama_placement(k) for k in msd}, [2],
        {"single_file_per_rank": True, "thread_count": 1, "zstd": False},
        model_keys=list(msd), config=config.to_dict(), logits=logits)

    # zstd: compressible data spanning several zstd blocks, plus byte items
    g = torch.Generator().manual_seed(5)
    big = torch.zeros(300, 257)
    big[::7] = torch.randn(43, 257, generator=g)
    zsd = {"big": big, "embed": _rand((7, 5), torch.bfloat16, g),
           "w": _rand((6, 9), torch.float32, g), "ids": _rand((3, 5), torch.int64, g),
           "f8": _rand((6, 4), torch.float8_e4m3fn, g), "scalar": torch.tensor(2.5),
           "meta": {"step": 9, "note": "zstd " * 100}}
    add("zstd", zsd, {"big": "S1", "embed": "S0", "w": "S1", "ids": "S0", "f8": "S0"}, [2],
        {"single_file_per_rank": True, "thread_count": 1, "zstd": True})
    return plans, inputs


# ---------------------------------------------------------------------------
# torch.save folders
# ---------------------------------------------------------------------------


def _write_tsave(base: str) -> dict[str, dict]:
    """tsave_bin: pytorch_model.bin + config.json with BF16, F8_E4M3, U16,
    a transposed (non-contiguous) view sharing storage with another tensor,
    a view with a storage offset, ints, bool, a 0-d tensor.
    tsave_sharded: a tiny Llama as pytorch_model-0000i-of-00002.bin +
    pytorch_model.bin.index.json + config.json (+ logits).
    tsave_pt: training_state.pt = {"model": OrderedDict, "optimizer":
    optimizer.state_dict() (int keys), "epoch", nested dicts, a Parameter}."""
    infos: dict[str, dict] = {}
    g = torch.Generator().manual_seed(11)

    # --- tsave_bin
    p = _paths(base, "tsave_bin")
    os.makedirs(p["out_dir"])
    proj = _rand((4, 6), torch.float32, g)
    base_buf = _rand((5, 3), torch.float32, g)
    sd = {
        "embed.weight": _rand((7, 5), torch.bfloat16, g),
        "proj.weight": proj,
        "proj_t.weight": proj.t(),                 # non-contiguous, shares storage
        "view.weight": base_buf[1:3],              # storage offset 3
        "f8.weight": _rand((3, 4), torch.float8_e4m3fn, g),
        "u16.buf": _rand((5,), torch.uint16, g),
        "ids": _rand((2, 3), torch.int64, g),
        "mask": _rand((4,), torch.bool, g),
        "scalar": torch.tensor(1.5),
        "half.weight": _rand((3, 2), torch.float16, g).t(),  # non-contiguous F16
    }
    assert not sd["proj_t.weight"].is_contiguous()
    torch.save(sd, os.path.join(p["out_dir"], "pytorch_model.bin"))
    with open(os.path.join(p["out_dir"], "config.json"), "w") as f:
        json.dump({"model_type": "synthetic", "architectures": ["Synthetic"]}, f, indent=2)
    infos["tsave_bin"] = dict(name="tsave_bin", files_loaded=["pytorch_model.bin"],
                              model_keys=list(sd), logits=None, **p)

    # --- tsave_sharded (tiny Llama, F32)
    p = _paths(base, "tsave_sharded")
    os.makedirs(p["out_dir"])
    _, config, msd, _, logits = _llama(False, seed=6, with_optim=False)
    keys = list(msd)
    half = len(keys) // 2
    weight_map, total = {}, 0
    for i, part in enumerate((keys[:half], keys[half:]), 1):
        fn = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({k: msd[k] for k in part}, os.path.join(p["out_dir"], fn))
        for k in part:
            weight_map[k] = fn
            total += msd[k].numel() * msd[k].element_size()
    with open(os.path.join(p["out_dir"], "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config.save_pretrained(p["out_dir"])
    infos["tsave_sharded"] = dict(
        name="tsave_sharded", model_keys=keys, logits=logits,
        files_loaded=[f"pytorch_model-0000{i}-of-00002.bin" for i in (1, 2)], **p)

    # --- tsave_pt (a training script's torch.save)
    import collections
    import torch.nn as nn
    p = _paths(base, "tsave_pt")
    os.makedirs(p["out_dir"])
    torch.manual_seed(12)
    lin = nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    obj = {
        "model": collections.OrderedDict(
            [("encoder", {"layer": {"weight": _rand((3, 4), torch.bfloat16, g)}}),
             ("head.weight", lin.weight.detach().clone()),
             ("head.bias", lin.bias.detach().clone())]),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "param": nn.Parameter(_rand((2, 2), torch.float32, g)),
        "notes": ["a", "b"],
    }
    torch.save(obj, os.path.join(p["out_dir"], "training_state.pt"))
    infos["tsave_pt"] = dict(name="tsave_pt", files_loaded=["training_state.pt"],
                             model_keys=None, logits=None, **p)

    for name, info in infos.items():
        flat: dict[str, torch.Tensor] = {}
        for fn in info.pop("files_loaded"):
            loaded = torch.load(os.path.join(info["out_dir"], fn), weights_only=False)
            for k, v in flatten_tensors(loaded).items():
                if k in flat:
                    raise ValueError(f"{name}: {k} in two files")
                flat[k] = v
        torch.save(flat, info["oracle_path"])
        if info["logits"] is not None:
            torch.save(info["logits"], info["logits_path"])
        info.update(kind="torch_save", world_size=1, mesh=None, writer=None, zstd_impl=None,
                    bytes=[], files=_list_files(info["out_dir"]),
                    tensors={k: {"dtype": ST_DTYPE[v.dtype], "shape": list(v.shape)}
                             for k, v in flat.items()})
        info["logits_path"] = info["logits_path"] if info.pop("logits") is not None else None
    # the expected contents, checked against what torch.load returned
    exp_bin = flatten_tensors(sd)
    got = torch.load(infos["tsave_bin"]["oracle_path"])
    assert set(got) == set(exp_bin) and all(
        raw_bytes(got[k]) == raw_bytes(exp_bin[k]) for k in got), "tsave_bin oracle"
    assert set(infos["tsave_pt"]["tensors"]) == {
        "model.encoder.layer.weight", "model.head.weight", "model.head.bias",
        "optimizer.state.0.step", "optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq",
        "optimizer.state.1.step", "optimizer.state.1.exp_avg", "optimizer.state.1.exp_avg_sq",
        "param"}, sorted(infos["tsave_pt"]["tensors"])
    return infos


# ---------------------------------------------------------------------------
# the whole suite
# ---------------------------------------------------------------------------


def _list_files(d: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(d):
        out.extend(os.path.relpath(os.path.join(root, f), d) for f in files)
    return sorted(out)


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and raw_bytes(a) == raw_bytes(b))
    return type(a) is type(b) and a == b


def _full(v: Any) -> Any:
    from torch.distributed.tensor import DTensor
    return v.full_tensor() if isinstance(v, DTensor) else v


def generate_all(base: str, *, verify: bool = True, names: list[str] | None = None) -> dict:
    """Writes every checkpoint (DCP_NAMES + TSAVE_NAMES, or `names`) under
    `base` with its oracle, and returns {name: info}. verify=True checks each
    oracle against the state dict that was saved (exact), the .metadata keys
    against the DCP flattening, and (Llama) that transformers reproduces the
    logits from the oracle's weights."""
    base = os.path.abspath(base)
    os.makedirs(base, exist_ok=True)
    want = set(names or DCP_NAMES + TSAVE_NAMES)
    zstd_impl = ensure_zstd()
    inputs_dir = tempfile.mkdtemp(prefix="dcp_gen_inputs_")
    infos: dict[str, dict] = {}
    try:
        plans, inputs = _plan_dcp(base, inputs_dir)
        plans = {k: v for k, v in plans.items() if k in want}
        by_ws: dict[int, list[dict]] = {}
        for plan in plans.values():
            if os.path.exists(plan["out_dir"]):
                raise FileExistsError(plan["out_dir"])
            by_ws.setdefault(plan["world_size"], []).append(plan)
        errors: list[BaseException] = []

        def run(ws, tasks):
            try:
                _spawn_save(ws, [{k: t[k] for k in ("out_dir", "input_path", "placements",
                                                     "mesh", "writer")} for t in tasks])
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=run, args=item) for item in by_ws.items()]
        for t in threads:
            t.start()
        tsave = _write_tsave(base) if want & set(TSAVE_NAMES) else {}
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        for name, plan in plans.items():
            p = _paths(base, name)
            if "config" in plan:
                with open(os.path.join(plan["out_dir"], "config.json"), "w") as f:
                    json.dump(plan["config"], f, indent=2, sort_keys=True)
            if "logits" in plan:
                torch.save(plan["logits"], p["logits_path"])
            dcp_to_torch_save(plan["out_dir"], p["oracle_path"])
            tensors, byte_keys = metadata_summary(plan["out_dir"])
            infos[name] = dict(
                name=name, kind="dcp", out_dir=plan["out_dir"], oracle_path=p["oracle_path"],
                world_size=plan["world_size"], mesh=plan["mesh"], writer=plan["writer"],
                files=_list_files(plan["out_dir"]), tensors=tensors, bytes=byte_keys,
                model_keys=plan.get("model_keys"),
                logits_path=p["logits_path"] if "logits" in plan else None,
                zstd_impl=zstd_impl if plan["writer"].get("zstd") else None)
            if verify:
                _verify_dcp(infos[name], inputs[name])
        infos.update({k: v for k, v in tsave.items() if k in want})
        if verify:
            for info in infos.values():
                if info["logits_path"]:
                    _verify_logits(info)
        for info in infos.values():
            with open(_paths(base, info["name"])["info_path"], "w") as f:
                json.dump(info, f, indent=1, sort_keys=True)
    finally:
        shutil.rmtree(inputs_dir, ignore_errors=True)
    return infos


def _verify_dcp(info: dict, saved: dict) -> None:
    name = info["name"]
    flat_saved = {k: _full(v) for k, v in flatten(saved).items()}
    oracle = load_oracle_flat(info)
    md_keys = set(info["tensors"]) | set(info["bytes"])
    if set(flat_saved) != md_keys:
        raise AssertionError(f"{name}: flatten() keys != .metadata keys: "
                             f"{sorted(set(flat_saved) ^ md_keys)}")
    if set(oracle) != md_keys:
        raise AssertionError(f"{name}: oracle keys != .metadata keys: "
                             f"{sorted(set(oracle) ^ md_keys)}")
    for k, v in flat_saved.items():
        if isinstance(v, torch.Tensor) != (k in info["tensors"]):
            raise AssertionError(f"{name}: {k}: tensor/BYTE_IO mismatch")
        if not _values_equal(oracle[k], v):
            raise AssertionError(f"{name}: oracle[{k!r}] != saved value")
        if isinstance(v, torch.Tensor):
            t = info["tensors"][k]
            if t["dtype"] != ST_DTYPE[v.dtype] or t["shape"] != list(v.shape):
                raise AssertionError(f"{name}: {k}: metadata {t} vs {v.dtype} {list(v.shape)}")
    if info["model_keys"] is not None:
        prefix = "model." if name != "llama_flat" else ""
        missing = [k for k in info["model_keys"] if prefix + k not in info["tensors"]]
        if missing:
            raise AssertionError(f"{name}: model keys not saved: {missing}")
    files = [f for f in info["files"] if f.endswith(".distcp")]
    if not files or ".metadata" not in info["files"]:
        raise AssertionError(f"{name}: files {info['files']}")
    md = read_metadata(info["out_dir"])
    descs = {tuple(s.transform_descriptors or ()) for s in md.storage_data.values()}
    if info["writer"].get("zstd") != (descs == {("stream.zstd/1",)}):
        raise AssertionError(f"{name}: transform descriptors {descs}")


def model_state_from_oracle(info: dict) -> dict[str, torch.Tensor]:
    """The weights consolidated/ must hold, from torch's own reading."""
    flat = load_oracle_flat(info)
    if info["kind"] == "dcp" and info["name"] != "llama_flat":
        return {k: flat["model." + k] for k in info["model_keys"]}
    return {k: flat[k] for k in info["model_keys"]}


def _verify_logits(info: dict) -> None:
    """transformers on the oracle's weights reproduces the saved logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    tmp = tempfile.mkdtemp(prefix="dcp_gen_hf_")
    try:
        sd = {k: v.contiguous() for k, v in model_state_from_oracle(info).items()}
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        shutil.copy(os.path.join(info["out_dir"], "config.json"), tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp).eval()
        ref = torch.load(info["logits_path"])
        with torch.no_grad():
            got = model(input_ids=ref["input_ids"]).logits.float()
        if not torch.equal(got, ref["logits"]):
            raise AssertionError(f"{info['name']}: logits from the oracle's weights differ "
                                 f"(max {float((got - ref['logits']).abs().max())})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------
# hostile .metadata
# ---------------------------------------------------------------------------


class _Payload:
    """Unpickling this runs os.system(cmd)."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


HOSTILE_VARIANTS = {
    # the whole pickle is GLOBAL 'os system' + MARK + UNICODE + TUPLE + REDUCE
    "bare_global": ("os", "system"),
    # a real Metadata (protocol 2: every class by GLOBAL) whose storage_meta
    # is replaced by GLOBAL 'os system' ... REDUCE
    "embedded_global": ("os", "system"),
    # a real Metadata, protocol 4 (STACK_GLOBAL), with posix.system in
    # planner_data
    "embedded_stack_global": ("posix", "system"),
}


def hostile_metadata_bytes(variant: str, valid_metadata, marker: str) -> bytes:
    cmd = f"touch {marker}"
    if variant == "bare_global":
        return b"cos\nsystem\n(V" + cmd.encode() + b"\ntR."
    import copy
    md = copy.deepcopy(valid_metadata)
    if variant == "embedded_global":
        md.storage_meta = _Payload(cmd)
        data = pickle.dumps(md, protocol=2)
        assert data.count(b"cposix\nsystem\n") == 1, data
        return data.replace(b"cposix\nsystem\n", b"cos\nsystem\n")
    if variant == "embedded_stack_global":
        md.planner_data = dict(md.planner_data or {})
        md.planner_data["zz.payload"] = _Payload(cmd)
        return pickle.dumps(md, protocol=4)
    raise ValueError(variant)


def write_hostile(src_dir: str, out_dir: str, variant: str, marker: str,
                  verify: bool = True) -> dict:
    """Copies the DCP checkpoint src_dir to out_dir and replaces its .metadata
    by a pickle that would run `touch marker`. verify=True proves the payload
    is live: real pickle.load of the same bytes (with another marker path) in
    a subprocess creates that file."""
    shutil.copytree(src_dir, out_dir)
    md = read_metadata(src_dir)
    data = hostile_metadata_bytes(variant, md, marker)
    with open(os.path.join(out_dir, ".metadata"), "wb") as f:
        f.write(data)
    if verify:
        probe = marker + ".probe"
        probe_data = hostile_metadata_bytes(variant, md, probe)
        assert len(probe) > len(marker)
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            f.write(probe_data)
        try:
            subprocess.run([sys.executable, "-c",
                            "import pickle,sys; pickle.load(open(sys.argv[1],'rb'))", f.name],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=120)
            if not os.path.exists(probe):
                raise AssertionError(f"hostile payload {variant} did not run under pickle")
            os.unlink(probe)
        finally:
            os.unlink(f.name)
        if os.path.exists(marker):
            raise AssertionError(f"{marker} exists before any test ran")
    module, name = HOSTILE_VARIANTS[variant]
    return {"out_dir": out_dir, "marker": marker, "variant": variant,
            "global": (module, name)}


def write_hostile_torch_save(out_dir: str, marker: str, verify: bool = True) -> dict:
    """A folder with pytorch_model.bin (+ config.json) whose data.pkl holds,
    next to a real tensor, GLOBAL 'posix system' + REDUCE (torch.save's own
    pickler, protocol 2). verify=True proves it is live under torch.load."""
    os.makedirs(out_dir)
    path = os.path.join(out_dir, "pytorch_model.bin")
    torch.save({"w": torch.arange(4.0), "evil": _Payload(f"touch {marker}")}, path)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"model_type": "synthetic"}, f)
    if verify:
        probe_dir = tempfile.mkdtemp(prefix="dcp_gen_probe_")
        probe = os.path.join(probe_dir, "probe")
        try:
            probe_path = os.path.join(probe_dir, "p.bin")
            torch.save({"evil": _Payload(f"touch {probe}")}, probe_path)
            subprocess.run([sys.executable, "-c",
                            "import torch,sys; torch.load(sys.argv[1], weights_only=False)",
                            probe_path], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=120)
            if not os.path.exists(probe):
                raise AssertionError("hostile torch.save payload did not run under torch.load")
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
        if os.path.exists(marker):
            raise AssertionError(f"{marker} exists before any test ran")
    return {"out_dir": out_dir, "marker": marker, "variant": "torch_save",
            "global": ("posix", "system")}


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def dump(ckpt_dir: str, with_pickletools: bool = False) -> None:
    md = read_metadata(ckpt_dir)
    print(f"== {ckpt_dir}: {type(md).__module__}.{type(md).__name__}, "
          f"version={getattr(md, 'version', None)}")
    for k, v in md.state_dict_metadata.items():
        if hasattr(v, "chunks"):
            chunks = [(list(c.offsets), list(c.sizes)) for c in v.chunks]
            print(f"  T {k!r} {v.properties.dtype} {list(v.size)} chunks={chunks}")
        else:
            print(f"  B {k!r} {type(v).__name__}")
    print("  planner_data:", md.planner_data)
    for idx, s in md.storage_data.items():
        print(f"  storage {idx.fqn!r} off={list(idx.offset) if idx.offset is not None else None}"
              f" -> {s.relative_path} [{s.offset}, +{s.length}] {s.transform_descriptors}")
    if with_pickletools:
        with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
            pickletools.dis(f.read())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":          # internal: one rank
        with open(argv[4]) as f:
            _worker(int(argv[1]), int(argv[2]), argv[3], json.load(f))
        from harness import end_rank
        end_rank()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all")
    a.add_argument("out")
    a.add_argument("--only", nargs="*")
    d = sub.add_parser("dump")
    d.add_argument("dir")
    d.add_argument("--pickletools", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        dump(args.dir, args.pickletools)
        return 0
    infos = generate_all(args.out, names=args.only)
    for name, info in infos.items():
        print(f"{name}: {info['kind']} ws={info['world_size']} files={len(info['files'])} "
              f"tensors={len(info['tensors'])} bytes={len(info['bytes'])} "
              f"model_keys={len(info['model_keys'] or [])} zstd={info['zstd_impl']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
