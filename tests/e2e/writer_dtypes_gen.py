#!/usr/bin/env python3
"""Ranks that save a state of chosen dtypes with ckptfs.torch.StorageWriter,
for tests/e2e/test_writer_dtypes.py and test_writer_sidecars.py. Real
torch, CPU, gloo.

The state (``state(dtypes, world, seed)``, the same on every rank), for
each dtype name ``D`` of ``job["dtypes"]``:

- ``D.row``: a DTensor of shape (2 * world, 3) sharded on dim 0 (world
  chunks, none empty);
- ``D.col``: a DTensor of shape (2, 2 * world) sharded on dim 1, the last
  (world chunks; for float4_e2m1fn_x2 each element is two F4 values, so
  its F4 boxes start at twice torch's offsets);
- ``D.plain``: a plain tensor of shape (5,) (one chunk: saved by one rank);
- with ``job["scalars"]``, ``D.scalar``: a 0-d plain tensor.

Every value is random bytes viewed as the dtype (bool: 0 or 1), so every
bit pattern of the dtype occurs (NaNs included): comparisons are of bytes.
DTensors are made from their local shards (``DTensor.from_local``), with no
collective, so dtypes gloo cannot move are saved too.

Job (``spawn_ranks(__file__, world, job)``): rank 0 writes the full values
(``{fqn: tensor}``, torch.save) to ``job["oracle"]``; every rank saves
into ``job["dir"]`` with ``job["writer"]``: "ckptfs" (StorageWriter,
``job["layout"]``, ``job["mode"]`` "sync" or "async"), "stock" (torch's
FileSystemWriter) or "stock-hf" (torch's HuggingFaceStorageWriter,
save_distributed=True). With ``job["torch_dir"]`` the ranks then save the
same state there with torch's writer of the same layout. With
``job["refused_on_rank"] = R`` rank R alone adds a tensor "refused" of
dtype ``job["refused_dtype"]``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import spawn_ranks  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

# Every dtype torch's FileSystemWriter saves (torch 2.x), and the subset
# torch's HuggingFaceStorageWriter saves (safetensors.torch.save refuses
# complex128 and complex32).
DCP_DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
              "uint16", "uint32", "uint64", "complex64", "complex128", "complex32", "float8_e4m3fn", "float8_e5m2",
              "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2"]
HF_DTYPES = [d for d in DCP_DTYPES if d not in ("complex128", "complex32")]


def random_tensor(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, esize), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def full_values(dtypes: list[str], world: int, seed: int, scalars: bool) -> dict[str, torch.Tensor]:
    out = {}
    for i, name in enumerate(dtypes):
        dt = getattr(torch, name)
        out[f"{name}.row"] = random_tensor(dt, (2 * world, 3), seed * 1000 + 3 * i)
        out[f"{name}.col"] = random_tensor(dt, (2, 2 * world), seed * 1000 + 3 * i + 1)
        out[f"{name}.plain"] = random_tensor(dt, (5,), seed * 1000 + 3 * i + 2)
        if scalars:
            out[f"{name}.scalar"] = random_tensor(dt, (), seed * 1000 + 3 * i + 500)
    return out


def chunk_count(fqns, world: int) -> int:
    """The chunks a save of these tensors holds: world per sharded DTensor,
    one per plain tensor (saved once)."""
    return sum(world if f.endswith((".row", ".col")) else 1 for f in fqns)


def state(full: dict[str, torch.Tensor], mesh) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = {}
    for fqn, t in full.items():
        if fqn.endswith((".row", ".col")):
            dim = 0 if fqn.endswith(".row") else 1
            local = t.narrow(dim, 2 * rank, 2).clone()  # its own memory: async saves overwrite it
            sd[fqn] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=t.shape,
                                         stride=t.stride())
        else:
            sd[fqn] = t.clone()
    return sd


def _overwrite(sd: dict) -> None:
    """What a training step does to the state once async_save has staged it."""
    for v in sd.values():
        local = v.to_local() if isinstance(v, DTensor) else v
        local.reshape(-1).view(torch.uint8).bitwise_not_() if local.dtype != torch.bool else local.logical_not_()


def save(sd: dict, job: dict, directory: str, writer: str) -> None:
    if writer == "stock":
        dcp.save(sd, checkpoint_id=directory)
    elif writer == "stock-hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(directory, save_distributed=True))
    else:
        from ckptfs.torch import StorageWriter
        w = StorageWriter(directory, layout=job.get("layout", "dcp"), buffer_bytes=job.get("buffer_bytes", 4096))
        if job.get("mode") == "async":
            fut = dcp.async_save(sd, storage_writer=w)
            _overwrite(sd)
            fut.result()
        else:
            dcp.save(sd, storage_writer=w)


def _job(job: dict, mesh) -> None:
    full = full_values(job["dtypes"], dist.get_world_size(), job.get("seed", 1), job.get("scalars", False))
    if dist.get_rank() == 0 and job.get("oracle"):
        torch.save(full, job["oracle"])
    sd = state(full, mesh)
    if job.get("refused_on_rank") == dist.get_rank():  # a tensor of a dtype the layout refuses, on one rank only
        sd["refused"] = torch.zeros(4, dtype=getattr(torch, job["refused_dtype"]))
    save(sd, job, job["dir"], job.get("writer", "ckptfs"))
    if job.get("torch_dir"):
        stock = "stock-hf" if job.get("layout") == "hf" else "stock"
        save(state(full, mesh), job, job["torch_dir"], stock)


def _worker(rank: int, world: int, init_file: str, job: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from writer_gen import _destroy_process_group
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = None
    try:
        mesh = init_device_mesh("cpu", (world,))
        _job(job, mesh)
        dist.barrier()
    finally:
        mesh = None
        _destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_worker":
        import json
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    else:
        sys.exit("usage: writer_dtypes_gen.py _worker RANK WORLD INIT_FILE JOB_FILE (see spawn_ranks)")
