#!/usr/bin/env python3
"""Write real sharded checkpoints with real torch, for ckptfs end-to-end tests.

Everything here runs on CPU (gloo backend), offline (HF_HUB_OFFLINE=1), and
each generator takes a few seconds on 2 cores.

Layout convention (the same for every generator)
------------------------------------------------
out_dir must be new or hold no .safetensors files (else FileExistsError).
``out_dir`` receives ONLY what the real writer produced (plus ``config.json``
and the optional ``.hf_metadata/`` sidecar), so it can be mounted by ckptfs
as-is.  Oracle data goes NEXT TO it, never inside it:

    <parent>/<name>/                 the checkpoint (name = basename(out_dir))
    <parent>/<name>-expected.pt      torch.save({fqn: full original tensor})
    <parent>/<name>-logits.pt        (llama only) {"input_ids", "logits"}

Every generator returns a dict (JSON-serialisable except for the "expected"
entry, which holds the full original tensors in memory)::

    {
      "out_dir": str, "world_size": int,
      "files": [file names in out_dir, sorted; .hf_metadata/... included],
      "expected_path": str,                 # <parent>/<name>-expected.pt
      "tensors": {fqn: {"shape": [...], "dtype": "BF16", "placement": "Shard(0)"}},
      "headers": {file: parsed safetensors header (incl. "__metadata__")},
      "expected": {fqn: torch.Tensor},      # dropped by the CLI
    }

Tests compare with e.g.::

    exp = torch.load(info["expected_path"])
    with safetensors.safe_open(mounted_file, "pt") as f:
        assert torch.equal(f.get_tensor(fqn), exp[fqn])

CLI (prints the returned dict as JSON, without "expected" and "headers")::

    python3 ckpt_gen.py hf-sharded OUT [--world-size N] [--num-files K]
                                      [--no-int] [--extra] [--hf-metadata]
    python3 ckpt_gen.py llama OUT [--world-size N] [--dtype float32|bfloat16]
    python3 ckpt_gen.py torch-consolidate IN OUT [--skip-unsupported]
                                      [--order canonical|name|mapping]
    python3 ckpt_gen.py dump FILE_OR_DIR       # print safetensors headers
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
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
}

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def read_header(path: str) -> tuple[int, dict]:
    """Return (N, header_json) of a safetensors file (N = JSON byte length)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def _sidecar_paths(out_dir: str) -> tuple[str, str]:
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)
    return (os.path.join(parent, f"{name}-expected.pt"),
            os.path.join(parent, f"{name}-logits.pt"))


def _list_files(out_dir: str) -> list[str]:
    res = []
    for root, _dirs, files in os.walk(out_dir):
        for fn in files:
            res.append(os.path.relpath(os.path.join(root, fn), out_dir))
    return sorted(res)


def _headers(out_dir: str) -> dict[str, dict]:
    return {fn: read_header(os.path.join(out_dir, fn))[1]
            for fn in sorted(os.listdir(out_dir)) if fn.endswith(".safetensors")}


def _placement_str(p: str) -> str:
    return {"shard0": "Shard(0)", "shard1": "Shard(1)",
            "replicate": "Replicate()", "plain": "plain tensor"}[p]


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------
# worker (runs in each spawned rank)
# ---------------------------------------------------------------------------


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        full = torch.load(job["expected_path"])
        sd: dict[str, Any] = {}
        for fqn, placement in job["placements"].items():
            t = full[fqn]
            if placement == "plain":
                sd[fqn] = t.clone()
                continue
            pl = {"shard0": Shard(0), "shard1": Shard(1),
                  "replicate": Replicate()}[placement]
            # src_data_rank=None: every rank already holds the full tensor, so
            # no communication is needed (and the result is deterministic).
            sd[fqn] = distribute_tensor(t, mesh, [pl], src_data_rank=None)
        writer = HuggingFaceStorageWriter(
            path=job["out_dir"], save_distributed=True,
            fqn_to_index_mapping=job.get("fqn_to_index_mapping"))
        dcp.save(sd, storage_writer=writer)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_empty(out_dir: str) -> None:
    if os.path.isdir(out_dir) and any(f.endswith(".safetensors")
                                      for f in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} already holds .safetensors files; "
                              "use a fresh directory")


def _spawn_save(out_dir: str, world_size: int, expected_path: str,
                placements: dict[str, str],
                fqn_to_index_mapping: dict[str, int] | None,
                timeout: float = 300.0) -> None:
    """Run `world_size` ranks as fresh `python3 ckpt_gen.py _worker ...`
    processes (harness.spawn_ranks)."""
    job = {"out_dir": out_dir, "expected_path": expected_path,
           "placements": placements,
           "fqn_to_index_mapping": fqn_to_index_mapping}
    spawn_ranks(__file__, world_size, job, name="ckpt_gen", timeout=timeout,
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def _write_hf_metadata(out_dir: str, config: dict | None,
                       mapping: dict[str, int]) -> None:
    d = os.path.join(out_dir, ".hf_metadata")
    os.makedirs(d, exist_ok=True)
    if config is not None:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
    with open(os.path.join(d, "fqn_to_file_index_mapping.json"), "w") as f:
        json.dump(mapping, f, indent=2)


def _mapping(fqns: list[str], num_files: int) -> dict[str, int]:
    """Round-robin fqn -> 1-based output file index."""
    return {fqn: 1 + i % num_files for i, fqn in enumerate(fqns)}


def _result(out_dir, world_size, expected_path, full, placements, **extra):
    res = {
        "out_dir": out_dir, "world_size": world_size,
        "files": _list_files(out_dir), "expected_path": expected_path,
        "tensors": {fqn: {"shape": list(t.shape), "dtype": ST_DTYPE[t.dtype],
                          "placement": _placement_str(placements[fqn])}
                    for fqn, t in full.items()},
        "headers": _headers(out_dir),
    }
    res.update(extra)
    res["expected"] = full
    return res


# ---------------------------------------------------------------------------
# 1. synthetic HF-sharded checkpoint
# ---------------------------------------------------------------------------

# name -> (shape, dtype, placement). Placement "shard0"/"shard1" = DTensor
# Shard(0)/Shard(1) on a 1-d cpu mesh, "replicate" = DTensor Replicate(),
# "plain" = a plain torch.Tensor in the state dict (DCP treats it as replicated).
BASE_SPECS: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {
    "model.embed_tokens.weight": ((7, 6), torch.bfloat16, "shard0"),     # uneven rows
    "model.layers.0.mlp.up_proj.weight": ((8, 10), torch.float32, "shard0"),
    "model.layers.0.mlp.down_proj.weight": ((6, 9), torch.bfloat16, "shard1"),  # uneven cols
    "model.layers.0.self_attn.o_proj.weight": ((4, 8), torch.float32, "shard1"),
    "model.norm.weight": ((6,), torch.float32, "replicate"),
    "model.layers.0.input_layernorm.weight": ((5,), torch.bfloat16, "replicate"),
}
INT_SPECS = {
    "model.position_ids": ((3, 5), torch.int64, "shard0"),               # uneven rows
    "model.token_type_ids": ((4,), torch.int32, "replicate"),
}
# Edge cases (off by default): 3-d Shard(1), fewer rows than ranks (empty
# chunk on the last rank), 0-d scalar, F16/F64, a plain (non-DTensor) tensor.
EXTRA_SPECS = {
    "extra.three_d": ((3, 5, 4), torch.float32, "shard1"),
    "extra.one_row": ((1, 4), torch.float32, "shard0"),
    "extra.scalar": ((), torch.float32, "replicate"),
    "extra.half": ((5, 3), torch.float16, "shard0"),
    "extra.double": ((2, 3), torch.float64, "shard1"),
    "extra.plain": ((3,), torch.float32, "plain"),
}


def make_tensors(specs: dict, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Deterministic full tensors for `specs` (seeded, sorted by name)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for fqn in sorted(specs):
        shape, dtype, _ = specs[fqn]
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            t = torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64).to(dtype)
        out[fqn] = t
    return out


def write_hf_sharded(out_dir: str, world_size: int = 2, *, include_int: bool = True,
                     extra: bool = False, num_files: int = 1,
                     hf_metadata: bool = False, seed: int = 1234,
                     specs: dict | None = None) -> dict:
    """Save a synthetic state dict with HuggingFaceStorageWriter(save_distributed=True).

    `world_size` gloo ranks on a 1-d cpu DeviceMesh each save their DTensor
    shards. Default tensors: BASE_SPECS (BF16/F32, Shard(0) incl. 7 rows over
    2 ranks, Shard(1) incl. 9 cols over 2 ranks, Replicate) + INT_SPECS (I64
    sharded, I32 replicated) when include_int; EXTRA_SPECS when extra.
    num_files > 1 passes a round-robin fqn_to_index_mapping to the writer
    (each rank then writes up to num_files files). hf_metadata=True also writes
    the NeMo-style sidecar out_dir/.hf_metadata/{config.json,
    fqn_to_file_index_mapping.json}; the mapping is always returned under
    "fqn_to_index_mapping".
    Full tensors -> <parent>/<name>-expected.pt (torch.save dict) and "expected".
    """
    out_dir = os.path.abspath(out_dir)
    _check_empty(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if specs is None:
        specs = dict(BASE_SPECS)
        if include_int:
            specs.update(INT_SPECS)
        if extra:
            specs.update(EXTRA_SPECS)
    full = make_tensors(specs, seed)
    expected_path, _ = _sidecar_paths(out_dir)
    torch.save(full, expected_path)
    placements = {fqn: specs[fqn][2] for fqn in full}
    mapping = _mapping(list(full), num_files)
    _spawn_save(out_dir, world_size, expected_path, placements,
                mapping if num_files > 1 else None)
    if hf_metadata:
        _write_hf_metadata(out_dir, {"model_type": "synthetic",
                                     "architectures": ["Synthetic"]}, mapping)
    return _result(out_dir, world_size, expected_path, full, placements,
                   fqn_to_index_mapping=mapping)


# ---------------------------------------------------------------------------
# 2. tiny Llama
# ---------------------------------------------------------------------------

LLAMA_CONFIG = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
)
LLAMA_INPUT_IDS = [[1, 17, 42, 99, 200, 3, 7, 128, 255, 0, 64, 33]]


def _llama_placement(fqn: str) -> str:
    if fqn.endswith(("o_proj.weight", "down_proj.weight")):
        return "shard1"            # row-parallel
    if fqn.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                     "gate_proj.weight", "up_proj.weight",
                     "embed_tokens.weight", "lm_head.weight")):
        return "shard0"            # column-parallel / vocab-parallel
    return "replicate"             # norms


def write_llama_sharded(out_dir: str, world_size: int = 2, *, dtype: str = "float32",
                        num_files: int = 1, hf_metadata: bool = False,
                        seed: int = 0) -> dict:
    """Tiny random LlamaForCausalLM, state dict saved as sharded DTensors.

    q/k/v/gate/up/embed_tokens/lm_head -> Shard(0); o_proj/down_proj ->
    Shard(1); norms -> Replicate(). out_dir gets the shard files plus
    config.json (config.save_pretrained), so that a consolidated folder
    (shards + config.json) loads with AutoModelForCausalLM.from_pretrained.
    Next to out_dir: <name>-expected.pt (full state dict) and <name>-logits.pt
    = {"input_ids": LongTensor[1, 12], "logits": model(input_ids).logits (F32)}.
    dtype="bfloat16" builds the model in bf16 (logits computed in bf16, then
    stored as F32). Reloading via from_pretrained reproduced the logits
    bit-exactly in both dtypes here; tests may still prefer allclose.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    out_dir = os.path.abspath(out_dir)
    _check_empty(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    tdtype = getattr(torch, dtype)
    config = LlamaConfig(**LLAMA_CONFIG)
    config.dtype = dtype
    # _from_config(dtype=) keeps the rotary inv_freq buffers in float32, as
    # from_pretrained does (model.to(bf16) would cast them and change logits).
    model = LlamaForCausalLM._from_config(config, dtype=tdtype).eval()
    full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    expected_path, logits_path = _sidecar_paths(out_dir)
    torch.save(full, expected_path)
    input_ids = torch.tensor(LLAMA_INPUT_IDS, dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    torch.save({"input_ids": input_ids, "logits": logits}, logits_path)
    placements = {fqn: _llama_placement(fqn) for fqn in full}
    mapping = _mapping(list(full), num_files)
    _spawn_save(out_dir, world_size, expected_path, placements,
                mapping if num_files > 1 else None)
    config.save_pretrained(out_dir)
    if hf_metadata:
        _write_hf_metadata(out_dir, config.to_dict(), mapping)
    return _result(out_dir, world_size, expected_path, full, placements,
                   logits_path=logits_path, fqn_to_index_mapping=mapping)


# ---------------------------------------------------------------------------
# 3. torch's own consolidator (the oracle)
# ---------------------------------------------------------------------------


_ALIGN = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4,
          "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def consolidate_with_torch(in_dir: str, out_dir: str, *,
                           fqn_to_index_mapping: dict[str, int] | None = None,
                           order: str = "canonical",
                           skip_unsupported: bool = False,
                           copy_config: bool = True) -> dict:
    """Run torch.distributed.checkpoint._consolidate_hf_safetensors.

    Calls ``consolidate_safetensors_files(input_dir, output_dir,
    fqn_to_index_mapping: dict[str, int], num_threads=1) -> None``, which
    writes model-XXXXX-of-YYYYY.safetensors (no __metadata__, unpadded header,
    tensors in MAPPING ORDER) + model.safetensors.index.json.
    The mapping defaults to in_dir/.hf_metadata/fqn_to_file_index_mapping.json
    if present, else every fqn in the shard headers -> file 1. Its order is
    then set by `order`: "canonical" = safetensors writer order (dtype
    alignment desc, then name), "name" = sorted by name, "mapping" = keep
    the given/sidecar order (first-seen header order if no sidecar).
    torch raises TypeError (torch.finfo) on integer/bool dtypes, writes C64
    with the wrong size and writes 0-d tensors as zeros;
    skip_unsupported=True drops non-float fqns (returned under "skipped").
    copy_config copies in_dir/config.json into out_dir if present.
    Returns {"out_dir", "files", "headers", "mapping", "skipped"}.
    """
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files,
    )
    in_dir, out_dir = os.path.abspath(in_dir), os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    headers = _headers(in_dir)
    dtypes: dict[str, str] = {}
    for h in headers.values():
        for k, v in h.items():
            if k != "__metadata__":
                dtypes.setdefault(k, v["dtype"])
    if fqn_to_index_mapping is None:
        side = os.path.join(in_dir, ".hf_metadata", "fqn_to_file_index_mapping.json")
        if os.path.exists(side):
            with open(side) as f:
                fqn_to_index_mapping = json.load(f)
        else:
            fqn_to_index_mapping = dict.fromkeys(dtypes, 1)
    if order == "canonical":
        keys = sorted(fqn_to_index_mapping,
                      key=lambda k: (-_ALIGN.get(dtypes[k], 1), k))
    elif order == "name":
        keys = sorted(fqn_to_index_mapping)
    else:
        keys = list(fqn_to_index_mapping)
    fqn_to_index_mapping = {k: fqn_to_index_mapping[k] for k in keys}
    skipped = []
    if skip_unsupported:
        skipped = [k for k in fqn_to_index_mapping
                   if not dtypes[k].startswith(("F", "BF"))]
        fqn_to_index_mapping = {k: v for k, v in fqn_to_index_mapping.items()
                                if k not in skipped}
    consolidate_safetensors_files(input_dir=in_dir, output_dir=out_dir,
                                  fqn_to_index_mapping=fqn_to_index_mapping,
                                  num_threads=1)
    if copy_config and os.path.exists(os.path.join(in_dir, "config.json")):
        shutil.copy(os.path.join(in_dir, "config.json"), out_dir)
    return {"out_dir": out_dir, "files": _list_files(out_dir),
            "headers": _headers(out_dir), "mapping": fqn_to_index_mapping,
            "skipped": skipped}


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _dump(path: str) -> None:
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path))
              if f.endswith(".safetensors")] if os.path.isdir(path) else [path])
    for p in files:
        n, h = read_header(p)
        with open(p, "rb") as f:
            raw = f.read(8 + n)[8:]
        print(f"== {os.path.basename(p)}  size={os.path.getsize(p)} N={n} "
              f"N%8={n % 8} trailing_spaces={len(raw) - len(raw.rstrip(b' '))}")
        print(raw.decode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("hf-sharded")
    a.add_argument("out")
    a.add_argument("--world-size", type=int, default=2)
    a.add_argument("--num-files", type=int, default=1)
    a.add_argument("--no-int", action="store_true")
    a.add_argument("--extra", action="store_true")
    a.add_argument("--hf-metadata", action="store_true")
    a.add_argument("--seed", type=int, default=1234)
    b = sub.add_parser("llama")
    b.add_argument("out")
    b.add_argument("--world-size", type=int, default=2)
    b.add_argument("--num-files", type=int, default=1)
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--hf-metadata", action="store_true")
    c = sub.add_parser("torch-consolidate")
    c.add_argument("inp")
    c.add_argument("out")
    c.add_argument("--skip-unsupported", action="store_true")
    c.add_argument("--order", default="canonical",
                   choices=["canonical", "name", "mapping"])
    d = sub.add_parser("dump")
    d.add_argument("path")
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":          # internal: one rank
        with open(argv[4]) as f:
            _worker(int(argv[1]), int(argv[2]), argv[3], json.load(f))
        from harness import end_rank
        end_rank()
    args = ap.parse_args(argv)

    if args.cmd == "hf-sharded":
        res = write_hf_sharded(args.out, args.world_size, include_int=not args.no_int,
                               extra=args.extra, num_files=args.num_files,
                               hf_metadata=args.hf_metadata, seed=args.seed)
    elif args.cmd == "llama":
        res = write_llama_sharded(args.out, args.world_size, dtype=args.dtype,
                                  num_files=args.num_files,
                                  hf_metadata=args.hf_metadata)
    elif args.cmd == "torch-consolidate":
        res = consolidate_with_torch(args.inp, args.out, order=args.order,
                                     skip_unsupported=args.skip_unsupported)
    else:
        _dump(args.path)
        return 0
    res.pop("expected", None)
    res.pop("headers", None)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
