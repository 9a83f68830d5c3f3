#!/usr/bin/env python3
"""A DCP step of a small Llama saved by 2 gloo ranks, for the read-order
tests (test_read_order.py): q/k/v/gate/up/embed/lm_head split on dim 0,
o_proj/down_proj on dim 1 (tensor-parallel style), norms replicated, in
float32 (~17 MiB of tensors; `larger=True`: ~88 MiB), with config.json
beside it so that consolidated/ loads with transformers.

    write_step(out_dir, larger=False) -> {name: full tensor}

The model is made from a seed in every process, so the expected tensors
(full_state) never come from what was saved.
"""

from __future__ import annotations

import json
import os
import sys

from harness import end_rank, spawn_ranks

CONFIG = dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
# Files many times the kernel's read-ahead window, for the page-cache checks.
LARGER = dict(CONFIG, vocab_size=8192, hidden_size=512, intermediate_size=1536)


def _model(larger: bool = False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(11)
    config = LlamaConfig(**(LARGER if larger else CONFIG))
    config.dtype = "float32"
    return LlamaForCausalLM._from_config(config, dtype=torch.float32), config


def full_state(larger: bool = False) -> dict:
    model, _ = _model(larger)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def placement(fqn: str) -> str:
    if fqn.endswith(("o_proj.weight", "down_proj.weight")):
        return "S1"
    if fqn.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                     "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return "S0"
    return "R"


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    kinds = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}
    sd = {k: distribute_tensor(v, mesh, [kinds[placement(k)]]) for k, v in full_state(job["larger"]).items()}
    dcp.save({"model": sd}, storage_writer=dcp.FileSystemWriter(job["out_dir"]))
    dist.barrier()
    dist.destroy_process_group()
    end_rank()


def write_step(out_dir: str, larger: bool = False) -> dict:
    spawn_ranks(__file__, 2, {"out_dir": out_dir, "larger": larger}, name="order_gen")
    _, config = _model(larger)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f)
    return full_state(larger)


if __name__ == "__main__":
    if sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
    else:
        write_step(sys.argv[1])
