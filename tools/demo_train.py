#!/usr/bin/env python3
"""The training half of the ckptfs demo: a tiny Llama trained data-parallel
on 2 gloo ranks (CPU), saving a checkpoint every few steps with
torch.distributed.checkpoint through ckptfs's writer
(``ckptfs.torch.StorageWriter``) into ROOT/step_N/: standard DCP files,
a CRC32C per chunk, and the commit record a live mount picks up.

Weights are saved as DTensors sharded the way tensor-parallel training
shards them (q/k/v/gate/up/embed/lm_head on dim 0, o/down on dim 1, norms
replicated), plus the AdamW state: each rank writes its own shard files.
config.json goes into step_N/ before the save, so the step's consolidated/
view is a complete Hugging Face folder the moment the save commits.

With ``job["s3_root"]`` (``s3://BUCKET/PREFIX``) each step is then saved
again, straight to object storage, with ``StorageWriter("s3://...")``
into S3_ROOT/step_N/ (AWS_* credentials and AWS_ENDPOINT_URL from the
environment, as ``ckptfs mount s3://`` reads them).

For each step, rank 0 also writes REFS/step_N.pt (the model's logits on a
fixed input, computed before the save), REFS/step_N.saved and
REFS/step_N.s3saved (the times the saves returned): the eval half compares
what it loads from the mounts with these.

Run by tools/demo.py through tools/ranks.spawn_ranks:
    python3 tools/demo_train.py _worker RANK WORLD INIT_FILE JOB_FILE
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch


CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
EVAL_IDS = [[1, 17, 42, 99, 200, 3, 7, 128, 255, 0, 64, 33]]


def placement(fqn: str):
    from torch.distributed.tensor import Replicate, Shard
    if fqn.endswith(("o_proj.weight", "down_proj.weight")):
        return Shard(1)
    if fqn.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                     "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
        return Shard(0)
    return Replicate()


def train_step(model, opt, rank: int, step: int) -> float:
    import torch.distributed as dist
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 16), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():  # data parallel: average the gradients
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt.step()
    return loss.item()


def state_dict(model, opt, mesh) -> dict:
    """Weights as sharded DTensors (every rank holds the same replica, so no
    communication is needed), plus the optimizer state as plain tensors."""
    from torch.distributed.tensor import distribute_tensor
    weights = {k: distribute_tensor(v.detach(), mesh, [placement(k)], src_data_rank=None)
               for k, v in model.state_dict().items()}
    return {"model": weights, "optim": opt.state_dict()}


def save_step(model, opt, mesh, job: dict, step: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    rank = dist.get_rank()
    out = os.path.join(job["root"], f"step_{step}")
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        model.config.save_pretrained(out)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(EVAL_IDS)).logits
        torch.save({"input_ids": torch.tensor(EVAL_IDS), "logits": logits},
                   os.path.join(job["refs"], f"step_{step}.pt"))
    dist.barrier()
    from ckptfs.torch import StorageWriter
    sd = state_dict(model, opt, mesh)
    dcp.save(sd, storage_writer=StorageWriter(out))
    if rank == 0:
        with open(os.path.join(job["refs"], f"step_{step}.saved"), "w") as f:
            f.write(repr(time.time()))
    if job.get("s3_root"):
        save_step_to_s3(model, sd, job, step)


def save_step_to_s3(model, sd: dict, job: dict, step: int) -> None:
    """The same step saved straight to object storage: S3_ROOT/step_N/,
    each rank's file a multipart upload from the writer's ring, committed
    once every rank's upload completed. config.json goes up first (with
    boto3, as save_pretrained writes it on disk) so that consolidated/ is a
    complete Hugging Face folder the moment the step commits."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckptfs.torch import StorageWriter
    url = f"{job['s3_root']}/step_{step}"
    if dist.get_rank() == 0:
        import s3_server  # tools/s3_server.py: a boto3 client for the local server
        bucket, _, key = url[len("s3://"):].partition("/")
        s3_server.client_for(os.environ["AWS_ENDPOINT_URL"]).put_object(
            Bucket=bucket, Key=f"{key}/config.json", Body=model.config.to_json_string().encode())
    dist.barrier()
    dcp.save(sd, storage_writer=StorageWriter(url))
    if dist.get_rank() == 0:
        with open(os.path.join(job["refs"], f"step_{step}.s3saved"), "w") as f:
            f.write(repr(time.time()))


def _worker(rank: int, world_size: int, init_file: str, job: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)  # the same initial replica on every rank
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, job["steps"] + 1):
            loss = train_step(model, opt, rank, step)
            if rank == 0:
                print(f"train: step {step} loss {loss:.4f}", flush=True)
            if step % job["save_every"] == 0:
                save_step(model, opt, mesh, job, step)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from ranks import end_rank  # tools/ranks.py, beside this script
        end_rank()
    else:
        sys.exit(__doc__)
