#!/usr/bin/env python3
"""Ranks that save with ckptfs.torch.StorageWriter and load with stock DCP,
for tests/e2e/test_writer*.py. Real torch, CPU, gloo.

Jobs (``spawn_ranks(__file__, world, job)``; ``job["kind"]``):

- ``save``: builds ``state(seed)`` (FSDP2 model + AdamW state after one
  step, TP DTensors sharded unevenly on dim 0 and dim 1, bf16/f32/int64/
  int32, a replicated DTensor, a plain tensor, non-tensor items), writes
  rank 0's oracle (every value in full, flattened: ``{fqn: value}``; with
  ``job["big"]`` also a float32 tensor of that many bytes, sharded) to
  ``job["oracle"]``, then saves into ``job["dir"]`` with ``dcp.save`` or
  ``dcp.async_save`` (``job["mode"]``). For async_save every tensor is
  overwritten in place as soon as async_save returns (staging is done),
  before waiting for the save: the checkpoint must still hold the oracle.
  Rank 0 writes the commit rows to ``job["rows"]`` (JSON). With
  ``job["flip"] = [fqn, offsets]`` the coordinator flips one byte in the
  middle of that chunk's stored bytes after every rank wrote its file and
  before it commits (``_FlippingWriter``): bytes on disk that are not the
  bytes checksummed, under the file identity the commit records -- what
  corruption on the way to disk looks like to a reader.
- ``load``: stock ``dcp.load`` (FileSystemReader; for an ``s3://`` dir
  s3torchconnector's ``S3StorageReader``, path style, at $AWS_ENDPOINT_URL)
  into a new layout: every
  tensor a DTensor on the other dim than it was saved on (Shard(1) for
  Shard(0) and the reverse, Shard(0) for 1-d), non-tensors as placeholders;
  rank 0 writes the full values to ``job["out"]``.
- ``stock``: like ``save``, but with torch's own ``FileSystemWriter``
  (``dcp.save(sd, checkpoint_id=dir)``): the same state, as a stock save
  writes it (one ``__<rank>_0.distcp`` per rank).
- ``flat``: loads the plain state dict ``job["state"]`` (torch.save) and
  saves it into ``job["dir"]`` with ckptfs's StorageWriter
  (``job["writer"] == "ckptfs"``, ``job["layout"]`` "dcp" or "hf") or
  torch's own FileSystemWriter (``"stock"``).
- ``refused``: ``save``'s tensors plus a complex32 tensor, saved with
  layout="hf": safetensors has no dtype for it, so the writer refuses the
  save while planning; every rank raises and exits 1 through the
  interpreter.
- ``steps``: saves ``job["steps"]`` one after another into
  ``job["root"]/step_<n>`` (for the crash tests: the parent SIGKILLs a rank
  at a random moment; rank 0 appends ``ready N`` before and ``done N``
  after each save to ``job["marker"]``, with time.monotonic(); with
  ``job["oracles"]`` it first writes ``<oracles>/<n>.pt`` like ``save``).
  With ``job["layout"] == "hf"`` the steps are saved with layout="hf" and
  hold the state's tensors only (``tensors_only``).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import spawn_ranks  # noqa: E402,F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402

TENSOR_SPECS = {  # name -> (shape, dtype, placement dim or None = Replicate)
    "tp.row_bf16": ((7, 5), torch.bfloat16, 0),
    "tp.col_f32": ((4, 9), torch.float32, 1),
    "tp.row_i64": ((5, 3), torch.int64, 0),
    "tp.col_i32": ((3, 5), torch.int32, 1),
    "tp.one_row": ((1, 4), torch.float32, 0),   # fewer rows than ranks: an empty shard
    "tp.rep_f32": ((2, 3), torch.float32, None),
}


def _values(name: str, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)))
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 10).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def state(seed: int, mesh) -> dict:
    """The saved state on this rank (deterministic in seed)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    tp = {}
    for name, (shape, dtype, dim) in TENSOR_SPECS.items():
        full = _values(name, shape, dtype, seed)
        tp[name.split(".", 1)[1]] = distribute_tensor(full, mesh, [Replicate() if dim is None else Shard(dim)])
    return {"model": msd, "optim": osd, "tp": tp,
            "plain": torch.arange(10, dtype=torch.int32) * seed,
            "step": 100 + seed, "meta": {"name": f"run-{seed}", "lrs": [0.1, 0.01]}}


def flat_full(sd: dict) -> dict:
    """{DCP fqn: value}, DTensors gathered to full tensors (collective)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    flat, _ = flatten_state_dict(sd)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in flat.items()}


def _flipping_writer(flip: list):
    from ckptfs.torch import StorageWriter

    class _FlippingWriter(StorageWriter):
        def finish(self, metadata, results) -> None:
            fqn, offsets = flip
            row = next(r.row for rl in results for r in rl
                       if r.row[0] == "tensor" and r.row[1] == fqn and list(r.row[2]) == offsets)
            _, _, _, _, name, data_offset, data_length, _ = row
            with open(os.path.join(self.path, name), "r+b") as f:
                f.seek(data_offset + data_length // 2)
                b = f.read(1)
                f.seek(data_offset + data_length // 2)
                f.write(bytes([b[0] ^ 0x10]))
                os.fsync(f.fileno())
            super().finish(metadata, results)

    return _FlippingWriter


def _save(sd: dict, job: dict, directory: str) -> None:
    from ckptfs.torch import StorageWriter
    cls = _flipping_writer(job["flip"]) if job.get("flip") else StorageWriter
    s3 = {k: job[k] for k in ("part_size", "max_threads") if k in job}  # s3:// only
    writer = cls(directory, layout=job.get("layout", "dcp"), buffer_bytes=job.get("buffer_bytes", 4096), buffers=2,
                 **s3)
    if job.get("mode") == "async":
        fut = dcp.async_save(sd, storage_writer=writer)
        # Staging returned: the training loop may change every tensor now.
        for v in flat_local_tensors(sd):
            v.add_(7) if v.dtype != torch.bool else v.logical_not_()
        fut.result()
    elif job.get("mode") == "async-snapshot":
        writer = _save_snapshot(sd, job, directory)
    else:
        dcp.save(sd, storage_writer=writer)
    if dist.get_rank() == 0 and job.get("rows"):
        with open(job["rows"], "w") as f:
            json.dump(writer.last_rows, f)


def _save_snapshot(sd: dict, job: dict, directory: str):
    """async_save with ``snapshot=True``, twice: a first save into a scratch
    directory allocates the snapshot, the save of the test reuses it. Its
    background save is held at write_data until the training loop has
    checked that nothing reached storage (the stall wrote nothing: no rank
    file exists) and has changed every tensor in place."""
    import shutil
    import tempfile
    import threading
    from ckptfs import _snapshot
    from ckptfs.torch import StorageWriter

    class _HeldWriter(StorageWriter):
        gate = threading.Event()

        def write_data(self, plan, planner):
            if not self.gate.wait(120):
                raise TimeoutError("the training loop never released the save")
            return super().write_data(plan, planner)

    scratch = tempfile.mkdtemp(prefix="snapshot_warmup_") if dist.get_rank() == 0 else None
    box = [scratch]
    dist.broadcast_object_list(box)
    dcp.async_save(sd, storage_writer=StorageWriter(os.path.join(box[0], "step"), snapshot=True)).result()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0])
    writer = _HeldWriter(directory, buffer_bytes=job.get("buffer_bytes", 4096), buffers=2, snapshot=True)
    fut = dcp.async_save(sd, storage_writer=writer)
    written = [n for n in os.listdir(directory) if n.endswith(".distcp")] if os.path.isdir(directory) else []
    assert not written, f"the training thread wrote rank files before async_save returned: {written}"
    for v in flat_local_tensors(sd):
        v.add_(7) if v.dtype != torch.bool else v.logical_not_()
    _HeldWriter.gate.set()
    fut.result()
    assert _snapshot.snapshot().allocations == 1, "the second save did not reuse the snapshot"
    return writer


def flat_local_tensors(sd: dict) -> list[torch.Tensor]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    flat, _ = flatten_state_dict(sd)
    return [v.to_local() if isinstance(v, DTensor) else v for v in flat.values() if isinstance(v, torch.Tensor)]


def _job_save(job: dict, mesh) -> None:
    sd = state(job["seed"], mesh)
    if job.get("big"):  # job["big"] bytes of float32 more, half on each rank
        sd["big"] = distribute_tensor(torch.arange(job["big"] // 4, dtype=torch.float32), mesh, [Shard(0)])
    oracle = flat_full(sd)
    if dist.get_rank() == 0:
        torch.save(oracle, job["oracle"])
    _save(sd, job, job["dir"])


def _job_stock(job: dict, mesh) -> None:
    sd = state(job["seed"], mesh)
    oracle = flat_full(sd)
    if dist.get_rank() == 0:
        torch.save(oracle, job["oracle"])
    dcp.save(sd, checkpoint_id=job["dir"])


def _job_flat(job: dict, mesh) -> None:
    sd = torch.load(job["state"], weights_only=True)
    if job["writer"] == "stock":
        dcp.save(sd, checkpoint_id=job["dir"])
    else:
        _save(sd, job, job["dir"])


def _job_load(job: dict, mesh) -> None:
    oracle = torch.load(job["oracle"], weights_only=False)
    target = {}
    for k, v in oracle.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            # The other dim than any saved layout used: a new sharding.
            dim = 1 if v.dim() > 1 and not k.startswith("tp.col") else 0
            target[k] = distribute_tensor(torch.zeros_like(v), mesh, [Shard(dim)])
        elif isinstance(v, torch.Tensor):
            target[k] = torch.zeros_like(v)
        else:
            target[k] = None
    if job["dir"].startswith("s3://"):
        dcp.load(target, storage_reader=s3_storage_reader(job["dir"]))
    else:
        dcp.load(target, checkpoint_id=job["dir"])
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in target.items()}
    if dist.get_rank() == 0:
        torch.save(full, job["out"])


def s3_storage_reader(url: str):
    """s3torchconnector's stock DCP reader of ``url`` at the test server:
    path-style addressing, and the endpoint (its reader takes none, so its
    file system is made over a client that has one)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3StorageReader
    from s3torchconnector.dcp.s3_file_system import S3FileSystem
    config = S3ClientConfig(force_path_style=True)
    reader = S3StorageReader("us-east-1", url, s3client_config=config)
    client = S3Client("us-east-1", endpoint=os.environ["AWS_ENDPOINT_URL"], s3client_config=config)
    reader.fs = S3FileSystem("us-east-1", s3_client=client, reader_constructor=reader._reader_constructor)
    return reader


def _mark(job: dict, what: str) -> None:
    if dist.get_rank() == 0:
        with open(job["marker"], "a") as f:
            f.write(f"{what} {time.monotonic()}\n")


def tensors_only(sd: dict) -> dict:
    """The state without its non-tensor items (and the optimizer's
    param_groups), for the HF layout."""
    return {"model": sd["model"], "optim": {"state": sd["optim"]["state"]}, "tp": sd["tp"], "plain": sd["plain"]}


def _job_steps(job: dict, mesh) -> None:
    for n in job["steps"]:
        sd = state(n, mesh)
        if job.get("layout") == "hf":
            sd = tensors_only(sd)
        oracle = flat_full(sd)
        if dist.get_rank() == 0 and job.get("oracles"):
            os.makedirs(job["oracles"], exist_ok=True)
            torch.save(oracle, os.path.join(job["oracles"], f"{n}.pt"))
        dist.barrier()
        _mark(job, f"ready {n}")
        _save(sd, job, os.path.join(job["root"], f"step_{n}"))
        dist.barrier()
        _mark(job, f"done {n}")


def _job_refused(job: dict, mesh) -> None:
    """The tensors of ``save`` plus a complex32 tensor, which the writer
    refuses with layout="hf" (safetensors has no dtype for it): the save
    raises on every rank and the rank exits through the interpreter."""
    sd = tensors_only(state(job["seed"], mesh))
    sd["refused"] = torch.zeros(8, dtype=torch.complex32)
    _save(sd, {**job, "layout": "hf"}, job["dir"])


def _worker(rank: int, world: int, init_file: str, job: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = None
    try:
        mesh = init_device_mesh("cpu", (world,))
        jobs = {"save": _job_save, "stock": _job_stock, "flat": _job_flat, "load": _job_load, "steps": _job_steps,
                "refused": _job_refused}
        jobs[job["kind"]](job, mesh)
        # No rank tears gloo down while a peer may still be in a collective
        # with it (torch's teardown has aborted a rank that did).
        dist.barrier()
    except BaseException as e:
        # The failed job's frames hold its DTensors, and so the mesh; their
        # locals go now (the traceback still prints), so that the destroy
        # below frees the process group.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        mesh = None  # it holds the process group (_destroy_process_group)
        _destroy_process_group()


def _destroy_process_group() -> None:
    """destroy_process_group that frees the group, joining gloo's threads,
    while the interpreter is whole. A DeviceMesh holds its groups, so while
    one is referenced they outlive destroy_process_group, and a gloo worker
    that frees the tensors of the last collective (made in Python) during
    finalization takes the GIL then: CPython ends that thread with
    pthread_exit, whose unwind through a noexcept destructor aborts the
    process ("terminate called without an active exception"). REQUIRES:
    the caller holds no DeviceMesh or DTensor."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    # DTensor's caches (sharding propagation, redistribution plans, mesh
    # topology) keep the specs, and so the mesh, of every op a DTensor
    # went through.
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    else:
        sys.exit("usage: writer_gen.py _worker RANK WORLD INIT_FILE JOB_FILE (see spawn_ranks)")
