#!/usr/bin/env python3
"""A LoRA fine-tune sharded with FSDP2 on 2 gloo ranks (CPU), for
test_merged.py: the adapter and its base as a training job leaves them.

``make(root, reference)``:

1. Pre-training's save. A tiny Llama (lora_gen.llama) is sharded with
   ``fully_shard`` (each decoder layer, then the root: FSDP2's Shard(0)
   DTensors, uneven where the vocabulary is odd), takes one AdamW step, and
   is saved with ``dcp.save({"model": ..., "optim": ...})`` into
   ``root/base_step`` (``get_state_dict``: DTensor shards, one
   ``__<rank>_0.distcp`` per rank), with its ``config.json`` beside it.
   Rank 0 also writes the same weights unsharded (gathered by
   ``get_model_state_dict(full_state_dict=True)``) with transformers'
   ``save_pretrained`` into ``reference``, outside the root: the oracle's
   base, read without ckptfs.
2. The fine-tune. A Llama of other random weights loads the step's
   ``model`` with stock ``dcp.load``, is wrapped by peft's
   ``get_peft_model`` (LoRA on every linear layer, B initialised to zero),
   sharded with ``fully_shard`` as above, and trains a few AdamW steps on
   each rank's own batches, so lora_B is no longer zero.
3. The adapter's save, as accelerate and most FSDP2 recipes write it: the
   full state dict gathered with ``get_model_state_dict(model,
   StateDictOptions(full_state_dict=True, cpu_offload=True))`` (rank 0 gets
   every tensor whole, the others nothing), then on rank 0
   ``PeftModel.save_pretrained(dir, state_dict=...)``, which keeps the
   adapter's tensors (``adapter_model.safetensors``, names without the
   adapter's name) and writes ``adapter_config.json``; its
   ``base_model_name_or_path`` then names ``../base_step``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import spawn_ranks  # noqa: E402

import peft  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import lora_gen  # noqa: E402

ADAPTER = "adapter"
BASE = "base_step"
LORA = dict(r=4, lora_alpha=8, target_modules=lora_gen.ATTN + lora_gen.MLP)
STEPS = 3


def make(root: str, reference: str) -> None:
    """root/base_step (a DCP step) and root/adapter (its LoRA adapter), and
    the unsharded base in ``reference`` (a transformers folder)."""
    spawn_ranks(__file__, 2, {"root": root, "reference": reference}, name="fsdp_lora_gen")


def _shard(model, mesh, layers) -> None:
    from torch.distributed.fsdp import fully_shard
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _train(model, params, steps: int, seed: int) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = torch.Generator().manual_seed(seed + dist.get_rank())  # data parallel: a batch of its own per rank
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return opt


def _pretrain_save(job: dict, mesh) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    model = lora_gen.llama(seed=0).train()
    _shard(model, mesh, model.model.layers)
    opt = _train(model, model.parameters(), 1, seed=10)
    msd, osd = get_state_dict(model, opt)
    base = os.path.join(job["root"], BASE)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=base)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.config.save_pretrained(base)
        plain = lora_gen.llama(seed=0)
        plain.load_state_dict(full)
        plain.save_pretrained(job["reference"])


def _finetune_save(job: dict, mesh) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    model = lora_gen.llama(seed=7)  # other weights than the step's: the load must replace every one
    dcp.load({"model": model.state_dict()}, checkpoint_id=os.path.join(job["root"], BASE))
    model = peft.get_peft_model(model.train(), peft.LoraConfig(**LORA))
    _shard(model, mesh, model.base_model.model.model.layers)
    _train(model, [p for p in model.parameters() if p.requires_grad], STEPS, seed=20)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        adapter = os.path.join(job["root"], ADAPTER)
        model.save_pretrained(adapter, state_dict=full)
        lora_gen.point_at_base(adapter, "../" + BASE)


def _worker(rank: int, world: int, init_file: str, job: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from writer_gen import _destroy_process_group
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = None
    try:
        mesh = init_device_mesh("cpu", (world,))
        _pretrain_save(job, mesh)
        _finetune_save(job, mesh)
        dist.barrier()  # no rank tears gloo down while a peer may still be in a collective
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # the failed job's frames hold DTensors, and so the mesh
        raise
    finally:
        mesh = None  # it holds the process group
        _destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    else:
        sys.exit("usage: fsdp_lora_gen.py _worker RANK WORLD INIT_FILE JOB_FILE (see make)")
