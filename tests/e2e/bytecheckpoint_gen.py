#!/usr/bin/env python3
"""Write real ByteCheckpoint (PyPI `bytecheckpoint` 0.0.2) checkpoints on CPU
with gloo ranks, plus the training-side full state (the oracle), for ckptfs
end-to-end tests.

bytecheckpoint is not installed system-wide: it lives in an isolated
`pip install --target` folder (default /tmp/bcp-site, or $BYTECHECKPOINT_SITE)
holding bytecheckpoint 0.0.2, grpcio 1.69.0 and protobuf 3.20.3 (`install`
below creates it; everything else it imports is already in the system python).
Only the ranks put that folder on sys.path; the reference reader below does
not need it.

Notes on running it here (torch 2.13 CPU):
  * bcp's "torch 2.1..2.5 only" assert compares version *strings*
    ("2.1.0" <= "2.13.0+cpu" < "2.6.0" holds), so it passes.
  * FSDP1 refuses CPU unless device_id=torch.device("cpu") is given.
  * every save starts a gRPC server in a `spawn` child process; the child
    re-imports this file as __mp_main__, so the rank code is guarded by
    __name__ == "__main__". The server address comes from a UDP connect to
    8.8.8.8; without a route that raises, so we fall back to 127.0.0.1.

Variants (one fresh set of rank processes each: bcp caches plans by state-dict
keys and monkey-patches FSDP globally):
    fsdp_decomposed  FSDP1 use_orig_params, nested wrap, save_decomposed_
                     model_optimizer=True (LOCAL_STATE_DICT): flat params +
                     user_defined_dict fsdp_* tables
    fsdp             FSDP1 SHARDED_STATE_DICT: per-fqn row chunks
    fsdp2            fully_shard on a CPU DeviceMesh: per-fqn row chunks
    ddp              DDP: whole tensors, "module." prefix, optimizer state by
                     param index

Layout:
    <base>/<name>/model|optimizer/{.metadata,__R_N.distcp}, extra_state/
                                  extra_state_rank_R.pt (only what bcp wrote)
    <base>/<name>-oracle.pt   {"model": {name: tensor},
                               "optimizer": {name: tensor | object}}
                              names as a reader should present them:
                              model: the module fqn ("module."+fqn for ddp),
                              flat params decomposed; optimizer:
                              "state.<fqn>.<k>" ("state.<idx>.<k>" for ddp)
                              and "param_groups" (a BYTE_IO item)
    <base>/<name>-info.json   {"name", "variant", "out_dir", "oracle_path",
                               "world_size", "dtype", "files",
                               "flat_params": {key: user_defined_dict slice},
                               "extra_items": [optimizer items not in oracle]}

CLI:
    python3 bytecheckpoint_gen.py install [--site DIR]
    python3 bytecheckpoint_gen.py gen OUT_BASE [--variants a,b] [--dtype f32|bf16]
    python3 bytecheckpoint_gen.py dump DIR [--pickletools]   (DIR = model/ or optimizer/)
    python3 bytecheckpoint_gen.py read CKPT_DIR              (reference reader)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import pickletools
import shutil
import subprocess
import sys
from typing import Any

from harness import spawn_ranks

DEFAULT_SITE = os.environ.get("BYTECHECKPOINT_SITE", "/tmp/bcp-site")
SITE_PKGS = ["bytecheckpoint==0.0.2", "grpcio==1.69.0", "protobuf==3.20.3"]
VARIANTS = ["fsdp_decomposed", "fsdp", "fsdp2", "ddp"]
FLAT = "_flat_param"


# ---------------------------------------------------------------------------
# isolated install
# ---------------------------------------------------------------------------


def site_ok(site: str) -> bool:
    return os.path.isfile(os.path.join(site, "bytecheckpoint", "__init__.py")) and \
        os.path.isdir(os.path.join(site, "grpc"))


def ensure_site(site: str = DEFAULT_SITE) -> str:
    """pip install --no-deps --target SITE (system site-packages untouched)."""
    if not site_ok(site):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--target", site, *SITE_PKGS], check=True)
    return site


# ---------------------------------------------------------------------------
# reference reader (needs only torch + pickle, not bytecheckpoint)
# ---------------------------------------------------------------------------


class _Obj:
    """Stand-in for bytecheckpoint's dataclasses (Metadata, _StorageInfo):
    pickled as `cls.__new__` + BUILD with a plain __dict__ state."""

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


class Metadata(_Obj):
    pass


class _StorageInfo(_Obj):
    pass


class _MetaUnpickler(pickle.Unpickler):
    found: set

    def find_class(self, module, name):
        self.found.add(f"{module}.{name}")
        if module == "bytecheckpoint.checkpointer.meta_type":
            return {"Metadata": Metadata, "_StorageInfo": _StorageInfo}[name]
        return super().find_class(module, name)


def load_metadata(path: str) -> tuple[Any, set]:
    """Unpickle a bcp .metadata without bytecheckpoint (torch's DCP metadata
    classes are still needed). Returns (metadata, set of globals used)."""
    import torch  # noqa: F401  (torch.distributed.checkpoint.metadata, torch.Size)
    with open(path, "rb") as f:
        u = _MetaUnpickler(f)
        u.found = set()
        return u.load(), u.found


class _TensorMetaUnpickler(pickle.Unpickler):
    """Decodes one all_tensor_metadata pickle (torch.save's per-tensor pickle,
    protocol 2): _rebuild_tensor_v2(persid(('storage', <X>Storage, key,
    'cpu', numel)), storage_offset, size, stride, requires_grad,
    OrderedDict()) -> a dict, no tensor built."""

    def find_class(self, module, name):
        import torch
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, off, size, stride, rg, hooks, *rest: dict(
                dtype=storage, storage_offset=off, size=tuple(size),
                stride=tuple(stride), requires_grad=rg)
        if module == "torch" and name.endswith("Storage"):
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return getattr(torch, name).dtype
        return super().find_class(module, name)

    def persistent_load(self, pid):
        kind, storage_dtype, _key, _location, _numel = pid
        assert kind == "storage"
        return storage_dtype


def decode_tensor_meta(blob: bytes) -> dict:
    return _TensorMetaUnpickler(io.BytesIO(blob)).load()


def read_item(ckdir: str, md, index):
    """Bytes of one item -> tensor (raw storage bytes + its pickle) or, for a
    BYTE_IO item (no tensor metadata), torch.load of a torch.save zip."""
    import torch
    si = md.storage_data[index]
    with open(os.path.join(ckdir, si.relative_path), "rb") as f:
        f.seek(si.offset)
        raw = f.read(si.length)
    tm = md.all_tensor_metadata.get(index)
    if tm is None:
        return torch.load(io.BytesIO(raw), weights_only=False)
    m = decode_tensor_meta(tm)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    flat = buf.view(m["dtype"])
    return torch.as_strided(flat, m["size"], m["stride"], m["storage_offset"]).clone()


def assemble(ckdir: str, md) -> dict[str, Any]:
    """Every state_dict_metadata key -> full tensor (chunks pasted at their
    offsets; holes stay zero) or the BYTE_IO object."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    out: dict[str, Any] = {}
    by_fqn: dict[str, list] = {}
    for idx in md.storage_data:
        by_fqn.setdefault(idx.fqn, []).append(idx)
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, BytesStorageMetadata):
            (idx,) = by_fqn[fqn]
            out[fqn] = read_item(ckdir, md, idx)
            continue
        full = torch.zeros(tuple(smd.size), dtype=smd.properties.dtype)
        for idx in by_fqn.get(fqn, []):
            t = read_item(ckdir, md, idx)
            assert t.dtype == smd.properties.dtype, (fqn, t.dtype)
            view = full
            for d, (o, n) in enumerate(zip(idx.offset, t.shape)):
                view = view.narrow(d, o, n)
            view.copy_(t)
        out[fqn] = full
    return out


def decompose_flat(key: str, flat, udd: dict) -> dict[str, Any]:
    """Split one flat param (1-d, size = sum(fsdp_numels_with_padding)) into
    its original params: walk numels_with_padding; entries whose
    is_padding_mask is True are alignment padding; the k-th non-padding entry
    is fsdp_flat_param_to_fqns[key][k] with shape fsdp_shapes[key][k]. The
    fqns are f"{module}.{param}" relative to the flat param's FSDP module
    (prefix = key minus '_flat_param'); a param held directly by that module
    has module "" and so reads ".name": the leading dot is dropped."""
    prefix = key[: -len(FLAT)]
    fqns = udd["fsdp_flat_param_to_fqns"][key]
    shapes = udd["fsdp_shapes"][key]
    numels = udd["fsdp_numels_with_padding"][key]
    mask = udd["fsdp_is_padding_mask"][key]
    out, pos, k = {}, 0, 0
    for n, pad in zip(numels, mask):
        if not pad:
            fqn = fqns[k][1:] if fqns[k].startswith(".") else fqns[k]
            out[prefix + fqn] = flat[pos:pos + n].reshape(tuple(shapes[k])).clone()
            k += 1
        pos += n
    assert k == len(fqns) and pos == flat.numel(), (key, k, len(fqns), pos, flat.numel())
    return out


def read_checkpoint(ckpt: str) -> dict[str, dict[str, Any]]:
    """{"model": {...}, "optimizer": {...}} named as in the oracle."""
    res: dict[str, dict[str, Any]] = {}
    mmd, _ = load_metadata(os.path.join(ckpt, "model", ".metadata"))
    udd = mmd.user_defined_dict or {}
    model = assemble(os.path.join(ckpt, "model"), mmd)
    res["model"] = {}
    for k, v in model.items():
        if k in udd.get("fsdp_flat_param_to_fqns", {}):
            res["model"].update(decompose_flat(k, v, udd))
        else:
            res["model"][k] = v
    if os.path.isfile(os.path.join(ckpt, "optimizer", ".metadata")):
        omd, _ = load_metadata(os.path.join(ckpt, "optimizer", ".metadata"))
        res["optimizer"] = {}
        for k, v in assemble(os.path.join(ckpt, "optimizer"), omd).items():
            # state.<prefix>_flat_param.<state name>, decomposed with the
            # *model's* user_defined_dict (the optimizer's is empty)
            parts = k.split(".")
            if parts[0] == "state" and FLAT in parts:
                i = parts.index(FLAT)
                key, name = ".".join(parts[1:i + 1]), ".".join(parts[i + 1:])
                if name == "fsdp_optimizer_requires_grad_numel":
                    continue
                for fqn, t in decompose_flat(key, v, udd).items():
                    res["optimizer"][f"state.{fqn}.{name}"] = t
            else:
                res["optimizer"][k] = v
    return res


# ---------------------------------------------------------------------------
# dump
# ---------------------------------------------------------------------------


def dump(d: str, with_pickletools: bool = False, max_items: int = 8) -> None:
    path = os.path.join(d, ".metadata") if os.path.isdir(d) else d
    md, found = load_metadata(path)
    print(f"{path}: {os.path.getsize(path)} bytes")
    print("pickle globals:", *sorted(found), sep="\n  ")
    print("Metadata fields:", list(vars(md)))
    print("bytecheckpoint_version:", md.bytecheckpoint_version)
    print("planner_data:", md.planner_data)
    print("user_defined_dict:", md.user_defined_dict)
    print("state_dict_metadata:")
    for k, v in md.state_dict_metadata.items():
        print(f"  {k!r}: {v}")
    print("storage_data / all_tensor_metadata:")
    for n, (idx, si) in enumerate(md.storage_data.items()):
        tm = md.all_tensor_metadata.get(idx)
        print(f"  {idx} -> {si} tensor_meta="
              f"{None if tm is None else decode_tensor_meta(tm)}")
        if with_pickletools and tm is not None and n < 2:
            pickletools.dis(tm)
        if n + 1 >= max_items and not with_pickletools:
            print(f"  ... {len(md.storage_data) - max_items} more")
            break
    if with_pickletools:
        with open(path, "rb") as f:
            pickletools.dis(f.read())


# ---------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------


def _build_model(dtype):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.norm = nn.LayerNorm(6)

        def forward(self, x):
            return self.norm(torch.relu(self.fc(x))) + x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(6, 5)  # odd flat numel: shard padding on the last rank
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
            self.register_buffer("pos", torch.arange(4, dtype=torch.float32))

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x) * self.scale

    torch.manual_seed(1234)
    net = Net()
    return net.to(dtype)


def _patch_host_ip() -> None:
    """Runs in every rank and in bcp's spawn child (module level below)."""
    try:
        from bytecheckpoint.utilities.server import server_lib
    except Exception:
        return
    orig = server_lib.get_host_ip

    def get_host_ip():
        try:
            return orig()
        except OSError:
            return "127.0.0.1"
    server_lib.get_host_ip = get_host_ip


def _gather_full(x):
    """DTensor / ShardedTensor -> full tensor on every rank; else a copy."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor
    if isinstance(x, DTensor):
        return x.full_tensor().detach().clone()
    if isinstance(x, ShardedTensor):
        mine = [(list(s.metadata.shard_offsets), s.tensor.detach().clone()) for s in x.local_shards()]
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        full = torch.zeros(tuple(x.size()), dtype=mine[0][1].dtype if mine else x.dtype)
        for part in every:
            for offs, t in part:
                view = full
                for d, (o, n) in enumerate(zip(offs, t.shape)):
                    view = view.narrow(d, o, n)
                view.copy_(t)
        return full
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def _worker(rank: int, world: int, init_file: str, job: dict) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import bytecheckpoint as bcp
        variant = job["variant"]
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[job["dtype"]]
        net = _build_model(dtype)
        cpu = torch.device("cpu")
        kw: dict = {}
        if variant in ("fsdp", "fsdp_decomposed"):
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            for i in range(len(net.blocks)):
                net.blocks[i] = FSDP(net.blocks[i], device_id=cpu, use_orig_params=True)
            model, fw = FSDP(net, device_id=cpu, use_orig_params=True), "fsdp"
            if variant == "fsdp_decomposed":
                kw["save_decomposed_model_optimizer"] = True
        elif variant == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            try:
                from torch.distributed.fsdp import fully_shard
            except ImportError:
                from torch.distributed._composable.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (world,))
            for b in net.blocks:
                fully_shard(b, mesh=mesh)
            fully_shard(net, mesh=mesh)
            model, fw = net, "fsdp2"
        elif variant == "ddp":
            model, fw = torch.nn.parallel.DistributedDataParallel(net), "ddp"
        else:
            raise ValueError(variant)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            ids = torch.randint(0, 11, (3, 4), generator=g)
            model(ids).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

        # oracle, before bcp.save (which monkey-patches FSDP): torch's own
        # sharded state dicts, gathered. (FSDP1 FULL_STATE_DICT segfaults on
        # CPU in torch 2.13, so it is not used.)
        if variant == "ddp":
            msd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            osd = opt.state_dict()
            ostate = {f"state.{i}.{k}": v.clone() for i, s in osd["state"].items() for k, v in s.items()}
        else:
            if variant == "fsdp2":
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
                msd = model.state_dict()
                osd = get_optimizer_state_dict(model, opt)
            else:
                from torch.distributed.fsdp import StateDictType
                with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                    msd = model.state_dict()
                    osd = FSDP.optim_state_dict(model, opt)
            msd = {k: _gather_full(v) for k, v in msd.items()}
            ostate = {f"state.{f}.{k}": _gather_full(v)
                      for f, s in osd["state"].items() for k, v in s.items()}
        pgs = osd["param_groups"]
        if variant == "fsdp_decomposed":  # bcp saves optim.state_dict()'s (param indices)
            pgs = opt.state_dict()["param_groups"]
        if rank == 0:
            torch.save({"model": dict(msd), "optimizer": {**ostate, "param_groups": pgs}},
                       job["oracle_path"])

        bcp.save(job["out_dir"], {"model": model, "optimizer": opt,
                                  "extra_state": {"step": 2, "rng": torch.get_rng_state()}},
                 framework=fw, **kw)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, job: dict, site: str, timeout: float = 240.0) -> None:
    """Runs `world` ranks of `python3 bytecheckpoint_gen.py _worker ...`
    (harness.spawn_ranks)."""
    spawn_ranks(__file__, world, job, name=f"bytecheckpoint ({job['variant']})",
                timeout=timeout, tmp_prefix="bcp_gen_pg_",
                env={"BYTECHECKPOINT_SITE": site, "BYTECHECKPOINT_ENABLE_PINNED_MEM_D2H": "0"})


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
            tuple(a.shape) == tuple(b.shape) and torch.equal(a, b)
    return a == b


def generate(base: str, variant: str, dtype: str = "f32", world: int = 2,
             site: str = DEFAULT_SITE, verify: bool = True) -> dict:
    import torch
    ensure_site(site)
    name = f"bcp_{variant}_{dtype}"
    out_dir = os.path.join(base, name)
    oracle = os.path.join(base, f"{name}-oracle.pt")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(base, exist_ok=True)
    _spawn(world, {"variant": variant, "dtype": dtype, "out_dir": out_dir,
                   "oracle_path": oracle}, site)
    mmd, _ = load_metadata(os.path.join(out_dir, "model", ".metadata"))
    udd = mmd.user_defined_dict or {}
    got = read_checkpoint(out_dir)
    want = torch.load(oracle, weights_only=False)
    omd, _ = load_metadata(os.path.join(out_dir, "optimizer", ".metadata"))
    extra = sorted(k for k in omd.state_dict_metadata if k.endswith("fsdp_optimizer_requires_grad_numel"))
    info = {
        "name": name, "variant": variant, "out_dir": out_dir, "oracle_path": oracle,
        "world_size": world, "dtype": dtype,
        "files": sorted(os.path.relpath(os.path.join(dp, f), out_dir)
                        for dp, _, fs in os.walk(out_dir) for f in fs),
        "flat_params": {k: {t: (list(map(list, udd[t][k])) if t == "fsdp_shapes" else list(udd[t][k]))
                            for t in udd} for k in udd.get("fsdp_flat_param_to_fqns", {})},
        "extra_items": extra,
    }
    if verify:
        for part in ("model", "optimizer"):
            g, w = got[part], want[part]
            if set(g) != set(w):
                raise AssertionError(f"{name} {part}: names differ: only ckpt "
                                     f"{sorted(set(g) - set(w))}, only oracle {sorted(set(w) - set(g))}")
            bad = [k for k in w if not _same(g[k], w[k])]
            if bad:
                raise AssertionError(f"{name} {part}: values differ for {bad}")
    with open(os.path.join(base, f"{name}-info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("--site", default=DEFAULT_SITE)
    p = sub.add_parser("gen")
    p.add_argument("base")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--site", default=DEFAULT_SITE)
    p = sub.add_parser("dump")
    p.add_argument("dir")
    p.add_argument("--pickletools", action="store_true")
    p = sub.add_parser("read")
    p.add_argument("ckpt")
    a = ap.parse_args(argv)
    if a.cmd == "install":
        print(ensure_site(a.site))
    elif a.cmd == "gen":
        for v in a.variants.split(","):
            info = generate(a.base, v, a.dtype, a.world, a.site)
            print(f"{info['name']}: ok, {len(info['files'])} files, flat params "
                  f"{list(info['flat_params'])}")
    elif a.cmd == "dump":
        dump(a.dir, a.pickletools)
    elif a.cmd == "read":
        for part, d in read_checkpoint(a.ckpt).items():
            for k, v in d.items():
                print(part, k, (v.dtype, tuple(v.shape)) if hasattr(v, "shape") else v)


if len(sys.argv) > 1 and sys.argv[1] == "_worker" or __name__ == "__mp_main__":
    # ranks, and bcp's spawned gRPC server child (which re-imports this file
    # as __mp_main__): make bytecheckpoint importable, patch the host-ip probe.
    sys.path.insert(0, os.environ.get("BYTECHECKPOINT_SITE", DEFAULT_SITE))
    _patch_host_ip()

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        with open(sys.argv[5]) as f:
            _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.load(f))
        from harness import end_rank
        end_rank()
    else:
        main()
