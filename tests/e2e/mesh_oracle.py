#!/usr/bin/env python3
"""Real torch as the oracle for ckptfs mesh views (used by test_mesh.py).

Loads an already-saved sharded Hugging Face checkpoint (a directory of
safetensors shards written by torch's HuggingFaceStorageWriter) with
``torch.distributed.checkpoint.load`` + ``HuggingFaceStorageReader`` into
DTensors on a 1-d CPU DeviceMesh of a NEW world size, with the placements the
caller chose (Shard(0) / Shard(1) / Replicate()), and saves what each rank
got: its ``to_local()`` tensor and the DTensor's own idea of where that local
tensor sits in the global tensor
(``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``).

    run_load(jobs, world_size, out_dir)

jobs: [{"name": str, "src_dir": str, "expected_path": str,
        "placements": {fqn: "shard0" | "shard1" | "replicate"}}]
expected_path is only read for each tensor's global shape and dtype: the
DTensors are filled with a sentinel before loading, so every value the
oracle returns came through DCP from src_dir.

Writes ``out_dir/<name>/rank<R>.pt`` = {fqn: {"local": Tensor,
"offsets": [int], "shape": [int]}} for each job and rank.

Ranks run as fresh ``python3 mesh_oracle.py _worker RANK WORLD INIT JOB``
processes (gloo, file:// rendezvous), like ckpt_gen.py does.
"""

from __future__ import annotations

import json
import os
import sys

from harness import spawn_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _sentinel(dtype):
    import torch
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return -12345.0
    return -77


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch
    torch.set_num_threads(1)
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dist.init_process_group("gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for load in job["loads"]:
            full = torch.load(load["expected_path"])
            sd = {}
            placements = {}
            for fqn, how in load["placements"].items():
                t = full[fqn]
                pl = {"shard0": Shard(0), "shard1": Shard(1),
                      "replicate": Replicate()}[how]
                placements[fqn] = [pl]
                filler = torch.full(t.shape, _sentinel(t.dtype), dtype=t.dtype)
                sd[fqn] = distribute_tensor(filler, mesh, [pl], src_data_rank=None)
            del full
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(load["src_dir"]))
            out = {}
            for fqn, d in sd.items():
                shape, offsets = compute_local_shape_and_global_offset(
                    d.shape, mesh, placements[fqn])
                local = d.to_local().detach().clone()
                assert list(local.shape) == list(shape), (fqn, local.shape, shape)
                out[fqn] = {"local": local, "offsets": [int(o) for o in offsets],
                            "shape": [int(s) for s in shape]}
            dest = os.path.join(job["out_dir"], load["name"])
            os.makedirs(dest, exist_ok=True)
            torch.save(out, os.path.join(dest, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_load(jobs: list[dict], world_size: int, out_dir: str,
             timeout: float = 300.0) -> None:
    """Runs the loads on `world_size` ranks (harness.spawn_ranks)."""
    spawn_ranks(__file__, world_size, {"loads": jobs, "out_dir": out_dir},
                name="mesh_oracle", timeout=timeout,
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    print(__doc__)
    sys.exit(2)
