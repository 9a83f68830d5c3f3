#!/usr/bin/env python3
"""Ranks that save with ckptfs.torch.StorageWriter(layout="hf") and with
torch's own HuggingFaceStorageWriter, and load with stock DCP, for
tests/e2e/test_writer_hf.py. Real torch, CPU, gloo.

Jobs (``spawn_ranks(__file__, world, job)``; ``job["kind"]``):

- ``save``: builds ``state(seed)`` (an FSDP2 model, f32 and bf16 layers,
  7 rows over 2 ranks: uneven on dim 0; TP DTensors sharded on dim 0 and
  dim 1, unevenly, bf16/f32/int64, one with an empty shard; a replicated
  DTensor; a plain tensor), writes rank 0's oracle (every tensor in full,
  gathered with ``full_tensor()``: ``{fqn: tensor}``) to ``job["oracle"]``,
  saves into ``job["dir"]`` with ckptfs (``dcp.save`` or ``dcp.async_save``,
  ``job["mode"]``; for async_save every tensor is changed in place as soon
  as staging returns) and, with ``job["torch_dir"]``, the same state with
  torch's ``HuggingFaceStorageWriter(save_distributed=True)``. Rank 0 writes
  the commit rows to ``job["rows"]`` (JSON).
- ``load``: stock ``dcp.load`` with ``HuggingFaceStorageReader`` into a new
  layout (every 2-d tensor a DTensor sharded on dim 1, 1-d on dim 0);
  rank 0 writes the full values to ``job["out"]``.
- ``non_tensor``: the state plus a non-tensor item, saved with ckptfs;
  rank 0 writes the error's text to ``job["out"]``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import spawn_ranks  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

TENSOR_SPECS = {  # name -> (shape, dtype, placement dim or None = Replicate)
    "tp.row_bf16": ((7, 5), torch.bfloat16, 0),   # 4 + 3 rows
    "tp.row_f32": ((5, 3), torch.float32, 0),
    "tp.col_f32": ((4, 9), torch.float32, 1),     # 5 + 4 columns
    "tp.row_i64": ((5, 2), torch.int64, 0),
    "tp.one_row": ((1, 4), torch.float32, 0),     # fewer rows than ranks: an empty shard
    "tp.rep_f32": ((2, 3), torch.float32, None),
}


def _values(name: str, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def state(seed: int, mesh) -> dict:
    """The saved state on this rank (deterministic in seed): tensors only."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    model[2].to(torch.bfloat16)
    fully_shard(model[2], mesh=mesh)  # a bf16 parameter group
    fully_shard(model, mesh=mesh)
    sd = {f"model.{k}": v for k, v in get_model_state_dict(model).items()}
    for name, (shape, dtype, dim) in TENSOR_SPECS.items():
        full = _values(name, shape, dtype, seed)
        sd[name] = distribute_tensor(full, mesh, [Replicate() if dim is None else Shard(dim)])
    sd["plain"] = torch.arange(10, dtype=torch.int32) * seed
    return sd


def full_values(sd: dict) -> dict:
    """{fqn: full tensor}, DTensors gathered (collective)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in sd.items()}


def local_tensors(sd: dict) -> list[torch.Tensor]:
    return [v.to_local() if isinstance(v, DTensor) else v for v in sd.values()]


def _save_ckptfs(sd: dict, job: dict) -> None:
    from ckptfs.torch import StorageWriter
    writer = StorageWriter(job["dir"], layout="hf", buffer_bytes=job.get("buffer_bytes", 4096), buffers=2)
    if job.get("mode") == "async":
        fut = dcp.async_save(sd, storage_writer=writer)
        for v in local_tensors(sd):  # staging returned: the training loop may change every tensor now
            v.add_(7)
        fut.result()
    else:
        dcp.save(sd, storage_writer=writer)
    if dist.get_rank() == 0 and job.get("rows"):
        with open(job["rows"], "w") as f:
            json.dump(writer.last_rows, f)


def _job_save(job: dict, mesh) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    sd = state(job["seed"], mesh)
    oracle = full_values(sd)
    if dist.get_rank() == 0:
        torch.save(oracle, job["oracle"])
    if job.get("torch_dir"):  # before ours: an async save changes the tensors
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(job["torch_dir"], save_distributed=True))
    _save_ckptfs(sd, job)


def _job_load(job: dict, mesh) -> None:
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    oracle = torch.load(job["oracle"], weights_only=True)
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1 if v.dim() > 1 else 0)])
              if v.dim() > 0 else torch.zeros_like(v) for k, v in oracle.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(job["dir"]))
    full = full_values(target)
    if dist.get_rank() == 0:
        torch.save(full, job["out"])


def _job_non_tensor(job: dict, mesh) -> None:
    sd = state(job["seed"], mesh)
    sd["step"] = 100
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException
    try:
        _save_ckptfs(sd, job)
        error = ""
    except CheckpointException as e:  # the test reads the message
        error = str(e)
    if dist.get_rank() == 0:
        with open(job["out"], "w") as f:
            f.write(error)


def _worker(rank: int, world: int, init_file: str, job: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        {"save": _job_save, "load": _job_load, "non_tensor": _job_non_tensor}[job["kind"]](job, mesh)
        # No rank tears gloo down while a peer may still be in a collective
        # with it (torch's teardown has aborted a rank that did).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    else:
        sys.exit("usage: writer_hf_gen.py _worker RANK WORLD INIT_FILE JOB_FILE (see spawn_ranks)")
