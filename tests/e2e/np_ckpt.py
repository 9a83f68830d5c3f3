"""Sharded safetensors checkpoints written with numpy and the `safetensors`
package, for the fault, access and symlink tests.

No torch and no gloo ranks: each "rank" file is written directly in the
layout torch's HuggingFaceStorageWriter(save_distributed=True) produces
(docs/FORMATS.md): ``shard-{rank+1:05}-model-00001-of-00001.safetensors``
whose ``__metadata__.DCP_SHARDING_INFO`` gives each chunk's saved_offsets.
Split tensors follow torch.chunk sizes; replicated tensors are written once,
by rank 0.

Tensor bytes are drawn uniformly from 1..255, so no tensor holds a zero byte:
a read that returns a zero byte where tensor data belongs is wrong, and a
zero-filled page is told apart from real data.

The oracle is independent of ckptfs: ``Synth.tensors`` holds the full arrays,
``check_consolidated`` / ``check_npy`` parse a virtual file with the
safetensors package / numpy and compare every tensor byte for byte.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field

import numpy as np
import safetensors.numpy as stnp

# name -> (shape, numpy dtype, split dim or None for replicated)
Spec = dict[str, tuple[tuple[int, ...], type, int | None]]

# About 0.9 MB in all: row splits (contiguous chunks in the consolidated
# file), column splits (one piece per row and rank, so a page mixes ranks),
# a replicated tensor held by rank 0 only, and 1-, 2-, 4- and 8-byte dtypes.
FAULT_SPECS: Spec = {
    "model.embed_tokens.weight": ((512, 192), np.float32, 0),
    "model.layers.0.mlp.down_proj.weight": ((256, 300), np.float16, 1),
    "model.layers.0.self_attn.o_proj.weight": ((64, 1031), np.float32, 1),
    "model.layers.0.ids": ((1000, 9), np.int32, 0),
    "model.layers.0.bytes": ((333, 17), np.uint8, 0),
    "model.layers.0.steps": ((250, 3), np.int64, 0),
    "model.norm.weight": ((4096,), np.float32, None),
}

# Every tensor split over dim 0: each rank's chunk is one contiguous byte
# range of the consolidated tensor and of its .npy file.
ROW_SPECS: Spec = {
    "model.embed_tokens.weight": ((300, 64), np.float32, 0),
    "model.layers.0.mlp.up_proj.weight": ((200, 33), np.float16, 0),
    "model.layers.0.ids": ((100, 5), np.int64, 0),
}


def shard_name(rank: int) -> str:
    return f"shard-{rank + 1:05}-model-00001-of-00001.safetensors"


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk bounds: ceil(n/parts) per part, the last parts smaller or empty."""
    size = -(-n // parts)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = rng.integers(1, 256, size=nbytes, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


@dataclass
class Synth:
    """A written checkpoint: its directory, the full tensors, and for each
    rank the chunks it holds ({fqn: (offsets, array)})."""
    path: str
    world_size: int
    specs: Spec
    tensors: dict[str, np.ndarray]
    chunks: list[dict[str, tuple[list[int], np.ndarray]]] = field(default_factory=list)

    def shard(self, rank: int) -> str:
        return os.path.join(self.path, shard_name(rank))


def _rank_chunks(full: dict[str, np.ndarray], specs: Spec, rank: int, world: int):
    out = {}
    for fqn, (shape, _dtype, dim) in specs.items():
        if dim is None:
            if rank == 0:
                out[fqn] = ([0] * len(shape), full[fqn])
            continue
        lo, hi = chunk_bounds(shape[dim], world)[rank]
        index = [slice(None)] * len(shape)
        index[dim] = slice(lo, hi)
        offsets = [0] * len(shape)
        offsets[dim] = lo
        out[fqn] = (offsets, np.ascontiguousarray(full[fqn][tuple(index)]))
    return out


def write(path: str, world_size: int = 4, specs: Spec | None = None, seed: int = 0,
          mode: int = 0o644) -> Synth:
    """Writes the checkpoint into the new directory ``path`` (mode 0755,
    files ``mode``) and returns what it holds."""
    specs = FAULT_SPECS if specs is None else specs
    rng = np.random.default_rng(seed)
    full = {fqn: random_array(rng, shape, dtype) for fqn, (shape, dtype, _) in specs.items()}
    os.makedirs(path)
    os.chmod(path, 0o755)
    synth = Synth(path, world_size, specs, full)
    for rank in range(world_size):
        chunks = _rank_chunks(full, specs, rank, world_size)
        info = {fqn: {"saved_offsets": off} for fqn, (off, _) in chunks.items()}
        meta = {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
        stnp.save_file({fqn: a for fqn, (_, a) in chunks.items()}, synth.shard(rank),
                       metadata=meta)
        os.chmod(synth.shard(rank), mode)
        synth.chunks.append(chunks)
    return synth


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_consolidated(data: bytes, synth: Synth) -> None:
    """Asserts that ``data`` (a whole consolidated model.safetensors) parses
    with the safetensors package into exactly the original tensors."""
    loaded = stnp.load(data)
    assert sorted(loaded) == sorted(synth.tensors), (sorted(loaded), sorted(synth.tensors))
    for fqn, want in synth.tensors.items():
        assert _same(loaded[fqn], want), f"consolidated tensor {fqn} differs from the original"


def check_npy(data: bytes, want: np.ndarray, what: str) -> None:
    got = np.load(io.BytesIO(data), allow_pickle=False)
    assert _same(got, want), f"{what}: numpy loads {got.dtype} {got.shape}, not the original"


def npy_name(fqn: str) -> str:
    """tensors/<name>.npy for an fqn without '%' or '/' (docs/SEMANTICS.md)."""
    return fqn + ".npy"


def virtual_files(synth: Synth) -> list[str]:
    """Paths, relative to the checkpoint, of the virtual files the fault
    harness reads."""
    return ["consolidated/model.safetensors"] + [
        "tensors/" + npy_name(fqn) for fqn in sorted(synth.tensors)]


def check_virtual(rel: str, data: bytes, synth: Synth) -> None:
    """Independent check of one whole virtual file (see virtual_files)."""
    if rel.startswith("consolidated/"):
        check_consolidated(data, synth)
    else:
        fqn = rel[len("tensors/"):-len(".npy")]
        check_npy(data, synth.tensors[fqn], rel)


def rank_ranges(data: bytes, synth: Synth, rank: int) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of a consolidated file ``data`` that hold rank
    ``rank``'s chunks of dim-0 split tensors (contiguous in C order), found
    from the file's own header offsets (checked by check_consolidated)."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = []
    for fqn, (shape, dtype, dim) in synth.specs.items():
        if dim != 0:
            continue
        row = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
        lo, hi = chunk_bounds(shape[0], synth.world_size)[rank]
        base = 8 + n + header[fqn]["data_offsets"][0]
        if hi > lo:
            out.append((base + lo * row, base + hi * row))
    return out


def rewritten(data: bytes, start: int) -> bytes:
    """``data`` with every byte from ``start`` on changed and still non-zero
    (1..255 -> 2..255, 1): the same size, a different value at each byte."""
    tail = np.frombuffer(data, dtype=np.uint8, offset=start)
    changed = (tail.astype(np.uint16) % 255 + 1).astype(np.uint8)
    return data[:start] + changed.tobytes()


def data_start(path: str) -> int:
    """Offset of a safetensors file's data buffer (8 + header length)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
