#!/usr/bin/env python3
"""One state, saved as a DCP step by each producer ckptfs must read:

- ``single``: ``dcp.save`` from one process, no process group;
- ``fsdp2``: FSDP2 ``fully_shard`` on 4 gloo ranks (every parameter a
  ``Shard(0)`` DTensor), the module's own ``state_dict()``;
- ``dim1``: every matrix split on dim 1 over 4 ranks (uneven columns);
- ``zstd``: ``Shard(0)`` over 4 ranks, items compressed by torch's
  ``_extension.ZStandard``;
- ``ckptfs_writer``: ``ckptfs.torch.StorageWriter`` on 4 ranks;
- ``s3tc``: s3torchconnector's ``S3StorageWriter`` on 4 ranks, written
  straight into an S3 bucket (its own object names: ``.metadata``,
  ``__R_T.distcp`` for rank R's I/O thread T), path-style, at the endpoint
  ``AWS_ENDPOINT_URL`` names.

    write_all(base, s3_uri, env) -> {step: {name: full tensor}}

Each step is saved under the key "model", so consolidated/ names its
tensors "<name>". The full tensors come from a seed here, before any
sharding, so expected values never come from what was saved.
"""

from __future__ import annotations

import os
import sys

from harness import end_rank, spawn_ranks

WORLD = 4
RANKED = ("fsdp2", "dim1", "zstd", "ckptfs_writer", "s3tc")
S3TC_THREADS = 2  # S3StorageWriter's thread_count: objects per rank


def full_state(all_f32: bool = False) -> dict:
    """Uneven over 4 ranks on both dims (33 rows, 18 columns); the FSDP2
    module is all float32 (one dtype per FSDP parameter group)."""
    import torch
    g = torch.Generator().manual_seed(2024)
    sd = {
        "embed.weight": torch.randn(33, 18, generator=g).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(20, 18, generator=g),
        "layers.0.out.weight": torch.randn(18, 20, generator=g).to(torch.float16),
        "norm.weight": torch.randn(18, generator=g),
    }
    return {k: v.float() for k, v in sd.items()} if all_f32 else sd


def expected(step: str) -> dict:
    return full_state(all_f32=step == "fsdp2")


def _fsdp2_state(mesh) -> dict:
    import torch
    from torch.distributed.fsdp import fully_shard

    full = full_state(all_f32=True)
    model = torch.nn.Module()
    for name, t in full.items():
        owner = model
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, torch.nn.Parameter(t.clone()))
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    assert all(type(v).__name__ == "DTensor" for v in sd.values()), {k: type(v) for k, v in sd.items()}
    return sd


def _writer(step: str, out: str):
    import torch.distributed.checkpoint as dcp
    if step == "zstd":
        import dcp_gen
        dcp_gen.ensure_zstd()
        from torch.distributed.checkpoint._extension import ZStandard
        return dcp.FileSystemWriter(out, sync_files=False, _extensions=[ZStandard()])
    if step == "ckptfs_writer":
        import ckptfs.torch
        return ckptfs.torch.StorageWriter(out)
    if step == "s3tc":
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter
        return S3StorageWriter("us-east-1", out, s3client_config=S3ClientConfig(force_path_style=True),
                               thread_count=S3TC_THREADS)
    return dcp.FileSystemWriter(out, sync_files=False)


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    for step, out in job["steps"].items():
        if step == "fsdp2":
            sd = _fsdp2_state(mesh)
        else:
            dim = 1 if step == "dim1" else 0
            sd = {k: distribute_tensor(v, mesh, [Shard(min(dim, v.dim() - 1))], src_data_rank=None)
                  for k, v in full_state().items()}
        dcp.save({"model": sd}, storage_writer=_writer(step, out))
        dist.barrier()
    dist.destroy_process_group()
    end_rank()


def write_all(base: str, s3_uri: str, env: dict | None = None) -> dict:
    """Steps under `base`/<step>/ (s3tc under `s3_uri`/s3tc/ instead, with
    the AWS_* variables of `env`)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": full_state()}, storage_writer=dcp.FileSystemWriter(os.path.join(base, "single")))
    steps = {s: os.path.join(base, s) for s in RANKED}
    steps["s3tc"] = s3_uri.rstrip("/") + "/s3tc"
    spawn_ranks(__file__, WORLD, {"steps": steps}, name="producers_gen", timeout=600, env=env)
    return {s: expected(s) for s in ("single", *RANKED)}


if __name__ == "__main__":
    if sys.argv[1] == "_worker":
        import json
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
    else:
        write_all(sys.argv[1], sys.argv[2])
