#!/usr/bin/env python3
"""A DCP checkpoint saved by 2 gloo ranks, for the s3:// tests: FSDP-style
DTensors (Shard(0) and Shard(1) on a 1-d CPU mesh) and a replicated
tensor, written with ``dcp.save`` to a local directory the test uploads.

    write_dcp(out_dir) -> {name: full tensor}

saved under the state-dict key "model", so the DCP keys are
"model.<name>" (tensors/ shows them so) and consolidated/ names them
"<name>", as Hugging Face does.

The full tensors are made from a seed here, before sharding, so the test's
expected values never come from what was saved.
"""

from __future__ import annotations

import os
import sys

from harness import end_rank, spawn_ranks


def full_state() -> dict:
    import torch
    g = torch.Generator().manual_seed(1234)
    return {
        "layers.0.weight": torch.randn(9, 6, generator=g),                       # Shard(0), 9 rows over 2
        "layers.0.bias": torch.randn(9, generator=g).to(torch.bfloat16),         # Shard(0)
        "layers.1.weight": torch.randn(4, 7, generator=g).to(torch.float16),     # Shard(1)
        "step": torch.tensor(17, dtype=torch.int64),                             # replicated
    }


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    placement = {"layers.1.weight": Shard(1), "step": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [placement.get(k, Shard(0))]) for k, v in full_state().items()}
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(job["out_dir"]))
    dist.barrier()
    dist.destroy_process_group()
    end_rank()


def write_dcp(out_dir: str) -> dict:
    spawn_ranks(__file__, 2, {"out_dir": out_dir}, name="s3_gen")
    return full_state()


if __name__ == "__main__":
    if sys.argv[1] == "_worker":
        import json
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
    else:
        write_dcp(sys.argv[1])
