#!/usr/bin/env python3
"""Write a real Megatron-Core ``torch_dist`` checkpoint on CPU, for ckptfs tests.

The checkpoint is written by ``megatron.core.dist_checkpointing.save`` itself
(TorchDistSaveShardedStrategy, i.e. ``torch_dist``) across WORLD_SIZE gloo
ranks run as subprocesses (``python3 megatron_gen.py _worker ...``), like
ckpt_gen.py does. It holds

- regular ShardedTensors (model weights): row-sharded BF16, a layer-stacked
  F32 tensor (``prepend_axis_num=1``) sharded along its last axis, and a
  replicated BF16 vector (only the main replica is saved);
- distributed-optimizer-style *flattened* ShardedTensors
  (``ShardedTensor.from_rank_offsets_flat`` with ``flattened_range``), which
  Megatron saves reformulated as ``[X/x, Y/y, ..., x*y*...]`` with chunks
  ``(i, j, ..., range.start)`` of size ``(1, 1, ..., len)`` and records the
  original shape in ``Metadata.mcore_data[key]["nd_reformulated_orig_global_shape"]``:
  2-d, 3-d with a prepended layer axis, plain 3-d, and 1-d. The ranges cut
  blocks mid-row, so one range covers up to ``2*ndim - 1`` boxes of the
  original tensor (and 1-element pieces at both ends of a block);
- a ShardedObject per rank (a BYTE_IO item ``rng_state/shard_R_W``) and the
  common state (``common.pt``).

Megatron-Core accepts at most one flattened range of a block per rank
(otherwise torch's ShardedTensor rejects the "overlapping" shards), so a
block with three ranges needs three ranks: WORLD_SIZE is 3.

Megatron version: ``from_rank_offsets_flat``/``flattened_range`` exist up to
megatron-core 0.15.3; 0.16 removed them ("ShardedTensor.flattened_range is
not supported."). Running it on a CPU-only torch needs three shims, applied
only in the rank processes (see ``_cpu_shims``):

1. ``torch.cuda.synchronize`` -> no-op: ``FileSystemWriterAsync.preload_tensors``
   calls it unconditionally ("Torch not compiled with CUDA enabled").
2. ``torch.cuda.current_device`` -> ``"cpu"``: ``save_state_dict_async_finalize``
   builds the all-reduce flag tensor on it (gloo reduces CPU tensors).
3. ``numpy.product = numpy.prod`` when missing (numpy >= 2):
   ``validation._validate_sharding_for_key_flattened`` calls ``np.product``
   (megatron-core 0.15 pins ``numpy<2``).

Megatron also needs ``psutil`` (the writer process calls ``_process_memory``).

Layout (as in ckpt_gen.py): ``out_dir`` gets only what Megatron wrote; the
oracles go next to it:

    <parent>/<name>-expected.pt    {key: full original tensor} (the values saved)
    <parent>/<name>-megatron.pt    {key: full tensor as megatron's own
                                    dist_checkpointing.load returns it}
    <parent>/<name>-plain/         the same files, `.metadata` re-pickled as a
                                   plain torch Metadata + `mcore_data`
                                   attribute, no `all_local_plans` (see
                                   `_write_plain_copy`)

``generate(out_dir)`` returns a JSON-serialisable dict (see its docstring).
CLI: ``python3 megatron_gen.py OUT`` prints it.
Env MEGATRON_PYTHONPATH, if set, is prepended to the ranks' PYTHONPATH (a
``pip install --target`` directory holding megatron-core and psutil).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from typing import Any

from harness import spawn_ranks

import torch

WORLD_SIZE = 3
COMMON = {"iteration": 7, "checkpoint_version": 3.0}

# Regular (non-flat) model tensors: key -> (per-layer/global shape, dtype,
# kind). kind: ("shard", axis) splits that axis over the ranks;
# ("layers", L, axis) stacks L layers on a prepended axis (prepend_axis_num=1)
# and splits the per-layer `axis` over the ranks; "replicated" is the same
# full tensor on every rank (replica_id = rank, only rank 0's is saved).
MODEL = {
    "embedding.word_embeddings.weight": ((12, 8), torch.bfloat16, ("shard", 0)),
    "decoder.layers.self_attention.linear_proj.weight": ((8, 12), torch.float32, ("layers", 2, 1)),
    "decoder.final_layernorm.weight": ((8,), torch.bfloat16, "replicated"),
}

# Flattened (distributed-optimizer) tensors: key -> (global shape, dtype,
# block shape, prepend_axis_num, {block index: [(start, stop, rank), ...]}).
# The global shape includes the prepended axis; the block shape does not.
# Block indices are in units of blocks (for a prepended axis: the layer).
# Each block's ranges tile [0, numel(block)); one range per rank per block.
FLAT = {
    # 2-d: blocks (6, 8) = 48, cuts mid-row (13 = row 1 col 5, 30 = row 3 col 6).
    "optimizer.state.exp_avg.embedding.word_embeddings.weight": (
        (12, 8), torch.float32, (6, 8), 0, {
            (0, 0): [(0, 13, 2), (13, 30, 0), (30, 48, 1)],
            (1, 0): [(0, 48, 1)],
        }),
    # layer-stacked: global (2, 8, 12), blocks (8, 6) = 48 per (layer, col block),
    # saved as [2, 1, 2, 48].
    "optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_proj.weight": (
        (2, 8, 12), torch.float32, (8, 6), 1, {
            (0, 0, 0): [(0, 20, 0), (20, 48, 1)],
            (0, 0, 1): [(0, 5, 1), (5, 41, 2), (41, 48, 0)],
            (1, 0, 0): [(0, 48, 2)],
            (1, 0, 1): [(0, 1, 0), (1, 47, 1), (47, 48, 2)],
        }),
    # plain 3-d: global (6, 4, 5), blocks (3, 4, 5) = 60, saved as [2, 1, 1, 60].
    # [7, 52) = (0,1,2)..(2,2,1): 5 boxes; [1, 59): 5 boxes; 1-element ends.
    "optimizer.state.fp32_param.decoder.mlp.linear_fc1.weight": (
        (6, 4, 5), torch.float32, (3, 4, 5), 0, {
            (0, 0, 0): [(0, 7, 1), (7, 52, 2), (52, 60, 0)],
            (1, 0, 0): [(0, 1, 2), (1, 59, 0), (59, 60, 1)],
        }),
    # 1-d: global (8,), one block of 8, saved as [1, 8].
    "optimizer.state.exp_avg.decoder.final_layernorm.weight": (
        (8,), torch.bfloat16, (8,), 0, {
            (0,): [(0, 3, 1), (3, 8, 0)],
        }),
}

SHARDED_OBJECT_KEY = "rng_state"


def model_global_shape(key: str) -> tuple[int, ...]:
    shape, _dtype, kind = MODEL[key]
    if isinstance(kind, tuple) and kind[0] == "layers":
        return (kind[1],) + tuple(shape)
    return tuple(shape)


def global_shapes() -> dict[str, tuple[int, ...]]:
    out = {k: model_global_shape(k) for k in MODEL}
    out.update({k: tuple(v[0]) for k, v in FLAT.items()})
    return out


def dtypes() -> dict[str, torch.dtype]:
    out = {k: v[1] for k, v in MODEL.items()}
    out.update({k: v[1] for k, v in FLAT.items()})
    return out


def make_expected(seed: int = 1234) -> dict[str, torch.Tensor]:
    """Distinct random values per element (so a misplaced element shows)."""
    g = torch.Generator().manual_seed(seed)
    shapes, dts = global_shapes(), dtypes()
    return {k: torch.randn(shapes[k], generator=g, dtype=torch.float32).to(dts[k])
            for k in sorted(shapes)}


def block_slices(key: str, bidx: tuple[int, ...]) -> tuple[slice, ...]:
    """The slice of the original global tensor that block `bidx` covers."""
    gshape, _dt, blk, prepend, _plan = FLAT[key]
    full_blk = (1,) * prepend + tuple(blk)
    return tuple(slice(b * s, (b + 1) * s) for b, s in zip(bidx, full_blk))


def fragmentations(key: str) -> tuple[int, ...]:
    gshape, _dt, blk, prepend, _plan = FLAT[key]
    full_blk = (1,) * prepend + tuple(blk)
    return tuple(g // b for g, b in zip(gshape, full_blk))


def reformulated_shape(key: str) -> tuple[int, ...]:
    blk = FLAT[key][2]
    n = 1
    for s in blk:
        n *= s
    return fragmentations(key) + (n,)


def flat_boxes(block_shape: tuple[int, ...], start: int, stop: int) -> int:
    """How many regular boxes the C-order range [start, stop) of a block needs
    at least (independent of ckptfs; used to show the layout exercises the
    multi-box cases)."""
    n = 0
    pos = start
    strides = []
    acc = 1
    for s in reversed(block_shape):
        strides.insert(0, acc)
        acc *= s
    while pos < stop:
        # largest aligned box starting at pos that fits in [pos, stop)
        for d in range(len(block_shape)):
            step = strides[d]
            if pos % step == 0 and pos + step <= stop:
                cnt = min((stop - pos) // step,
                          block_shape[d] - (pos // step) % block_shape[d])
                pos += cnt * step
                break
        n += 1
    return n


# ---------------------------------------------------------------------------
# worker (one rank)
# ---------------------------------------------------------------------------


def _cpu_shims() -> list[str]:
    applied = []
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
        applied += ["torch.cuda.synchronize", "torch.cuda.current_device"]
    import numpy as np
    if not hasattr(np, "product"):
        np.product = np.prod
        applied.append("numpy.product")
    return applied


def _sharded_state_dict(rank: int, ws: int, full: dict[str, torch.Tensor] | None) -> dict:
    """This rank's sharded state dict (full=None: empty tensors, for loading)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def data(key, sl, shape, dtype):
        if full is None:
            return torch.zeros(shape, dtype=dtype)
        return full[key][sl].clone()

    model = {}
    for key, (shape, dtype, kind) in MODEL.items():
        if kind == "replicated":
            model[key] = ShardedTensor.from_rank_offsets(
                key, data(key, (), shape, dtype), replica_id=rank)
        elif kind[0] == "shard":
            ax = kind[1]
            n = shape[ax] // ws
            sl = tuple(slice(rank * n, (rank + 1) * n) if d == ax else slice(None)
                       for d in range(len(shape)))
            local = tuple(n if d == ax else s for d, s in enumerate(shape))
            model[key] = ShardedTensor.from_rank_offsets(
                key, data(key, sl, local, dtype), (ax, rank, ws))
        else:                                           # ("layers", L, axis)
            _, layers, ax = kind
            n = shape[ax] // ws
            local = tuple(n if d == ax else s for d, s in enumerate(shape))
            per_layer = []
            for layer in range(layers):
                sl = (layer,) + tuple(slice(rank * n, (rank + 1) * n) if d == ax else slice(None)
                                      for d in range(len(shape)))
                per_layer.append(ShardedTensor.from_rank_offsets(
                    key, data(key, sl, local, dtype), (0, layer, layers), (ax + 1, rank, ws),
                    prepend_axis_num=1))
            model[key] = per_layer

    optim = {}
    for key, (gshape, dtype, blk, prepend, plan) in FLAT.items():
        frags = fragmentations(key)
        shards = []
        for bidx, ranges in plan.items():
            for (a, b, owner) in ranges:
                if owner != rank:
                    continue
                if full is None:
                    flat = torch.zeros(b - a, dtype=dtype)
                else:
                    flat = full[key][block_slices(key, bidx)].reshape(-1)[a:b].clone()
                rank_offsets = [(ax, bidx[ax], frags[ax]) for ax in range(len(gshape))
                                if frags[ax] > 1]
                shards.append(ShardedTensor.from_rank_offsets_flat(
                    key, flat, tuple(blk), *rank_offsets, prepend_axis_num=prepend,
                    flattened_range=slice(a, b)))
        if shards:                      # a rank without a piece has no entry
            optim[key] = shards

    obj = ShardedObject(SHARDED_OBJECT_KEY, {"rank": rank, "seed": 1000 + rank},
                        (ws,), (rank,), replica_id=0)
    return {"model": model, "optimizer": {"state": optim}, SHARDED_OBJECT_KEY: obj}


def _oracle_request(rank: int) -> dict:
    """Every tensor whole (unsharded, replica_id = rank): regular ones as
    plain tensors, flattened ones as ONE flattened range over the whole
    tensor (a single block), which megatron reshards from the saved layout."""
    from megatron.core.dist_checkpointing import ShardedTensor
    req = {}
    for key in MODEL:
        shape = model_global_shape(key)
        req[key] = ShardedTensor.from_rank_offsets(
            key, torch.zeros(shape, dtype=MODEL[key][1]), replica_id=rank)
    for key, (gshape, dtype, _blk, _prepend, _plan) in FLAT.items():
        n = 1
        for s in gshape:
            n *= s
        req[key] = ShardedTensor.from_rank_offsets_flat(
            key, torch.zeros(n, dtype=dtype), tuple(gshape), replica_id=rank,
            flattened_range=slice(0, n))
    return req


def _write_plain_copy(src: str, dst: str) -> None:
    """`dst`: the same files as `src`, but `.metadata` re-pickled as a plain
    torch `Metadata` with an `mcore_data` attribute and without
    `all_local_plans` (no megatron classes): the layout docs/FORMATS.md
    describes. Needs megatron importable (to read the real `.metadata`)."""
    import pickle
    import pickletools
    from torch.distributed.checkpoint.metadata import Metadata
    os.makedirs(dst)
    for fn in os.listdir(src):
        if fn != ".metadata":
            shutil.copy2(os.path.join(src, fn), os.path.join(dst, fn))
    with open(os.path.join(src, ".metadata"), "rb") as f:
        raw = f.read()
    proto = next(pickletools.genops(raw))[1]          # PROTO n, as torch wrote it
    real = pickle.loads(raw)
    plain = Metadata(state_dict_metadata=real.state_dict_metadata,
                     planner_data=real.planner_data, storage_data=real.storage_data)
    for attr in ("storage_meta", "version"):
        if hasattr(real, attr):
            setattr(plain, attr, getattr(real, attr))
    plain.mcore_data = real.mcore_data
    with open(os.path.join(dst, ".metadata"), "wb") as f:
        pickle.dump(plain, f, protocol=proto)


def _worker(rank: int, ws: int, init_file: str, job: dict) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ws)
    try:
        shims = _cpu_shims()
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy)
        import megatron.core
        parallel_state.initialize_model_parallel(1, 1)

        full = torch.load(job["expected_path"])
        sd = _sharded_state_dict(rank, ws, full)
        sd.update(COMMON)
        strategy = get_default_save_sharded_strategy("torch_dist")
        dist_checkpointing.save(sd, job["out_dir"], sharded_strategy=strategy)
        dist.barrier()

        # 1. Load back with the saved layout: every rank gets its own pieces.
        back = dist_checkpointing.load(_sharded_state_dict(rank, ws, None), job["out_dir"])
        want = _sharded_state_dict(rank, ws, full)
        assert set(back["optimizer"]["state"]) == set(want["optimizer"]["state"])
        for key in want["optimizer"]["state"]:
            got_l, want_l = back["optimizer"]["state"][key], want["optimizer"]["state"][key]
            assert len(got_l) == len(want_l), (key, len(got_l), len(want_l))
            for g, w in zip(got_l, want_l):
                assert torch.equal(g, w.data), f"rank {rank}: {key} reloads differently"
        for key in MODEL:
            got = back["model"][key]
            w = want["model"][key]
            pairs = zip(got, w) if isinstance(w, list) else [(got, w)]
            for g, ww in pairs:
                assert torch.equal(g, ww.data), f"rank {rank}: {key} reloads differently"
        obj = back[SHARDED_OBJECT_KEY]
        assert obj == {"rank": rank, "seed": 1000 + rank}, obj

        # 2. Megatron's own view of every whole tensor (resharded load).
        whole = dist_checkpointing.load(_oracle_request(rank), job["out_dir"])
        if rank == 0:
            assert all(whole[k] == v for k, v in COMMON.items()), whole
            res = {k: (whole[k].reshape(FLAT[k][0]) if k in FLAT else whole[k]).clone()
                   for k in global_shapes()}
            torch.save(res, job["megatron_path"])
            _write_plain_copy(job["out_dir"], job["plain_dir"])
            with open(job["info_path"], "w") as f:
                json.dump({"shims": shims, "megatron_core": getattr(
                    megatron.core, "__version__", "?")}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------


def sidecar_paths(out_dir: str) -> dict[str, str]:
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.dirname(out_dir), os.path.basename(out_dir)
    return {"expected_path": os.path.join(parent, f"{name}-expected.pt"),
            "megatron_path": os.path.join(parent, f"{name}-megatron.pt"),
            "info_path": os.path.join(parent, f"{name}-info.json"),
            "plain_dir": os.path.join(parent, f"{name}-plain")}


def generate(out_dir: str, world_size: int = WORLD_SIZE, timeout: float = 240.0) -> dict[str, Any]:
    """Write the checkpoint; returns
    {"out_dir", "world_size", "files", "expected_path", "megatron_path",
     "shapes": {key: original global shape}, "dtypes": {key: str},
     "flat": {key: reformulated saved shape}, "object_keys": [BYTE_IO keys],
     "megatron_core": version, "shims": [...], "seconds": float}.
    Raises RuntimeError with the ranks' output when a rank fails."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty")
    if os.path.exists(sidecar_paths(out_dir)["plain_dir"]):
        raise FileExistsError(sidecar_paths(out_dir)["plain_dir"])
    os.makedirs(out_dir, exist_ok=True)
    paths = sidecar_paths(out_dir)
    torch.save(make_expected(), paths["expected_path"])
    job = dict(paths, out_dir=out_dir)
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    if os.environ.get("MEGATRON_PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ["MEGATRON_PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
    t0 = time.monotonic()
    # new_session: the rank and the helper processes megatron spawns (a
    # multiprocessing Manager) form one process group, killed as a whole if
    # the rank hangs.
    spawn_ranks(__file__, world_size, job, name="megatron_gen", env=env, timeout=timeout,
                tail=6000, new_session=True)
    with open(paths["info_path"]) as f:
        info = json.load(f)
    files = sorted(os.path.relpath(os.path.join(r, fn), out_dir)
                   for r, _d, fns in os.walk(out_dir) for fn in fns)
    return {
        "out_dir": out_dir, "world_size": world_size, "files": files,
        "expected_path": paths["expected_path"], "megatron_path": paths["megatron_path"],
        "plain_dir": paths["plain_dir"],
        "shapes": {k: list(v) for k, v in global_shapes().items()},
        "dtypes": {k: str(v).replace("torch.", "") for k, v in dtypes().items()},
        "flat": {k: list(reformulated_shape(k)) for k in FLAT},
        "object_keys": [f"{SHARDED_OBJECT_KEY}/shard_{r}_{world_size}" for r in range(world_size)],
        "megatron_core": info["megatron_core"], "shims": info["shims"],
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        rank, ws, init_file, job_file = int(argv[1]), int(argv[2]), argv[3], argv[4]
        with open(job_file) as f:
            job = json.load(f)
        _worker(rank, ws, init_file, job)
        from harness import end_rank
        end_rank()
    if len(argv) != 1:
        print(__doc__)
        return 2
    print(json.dumps(generate(argv[0]), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
