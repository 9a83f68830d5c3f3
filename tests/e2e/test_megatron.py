"""End-to-end test of ckptfs on a real Megatron-Core ``torch_dist`` checkpoint.

The checkpoint is written by ``megatron.core.dist_checkpointing.save`` on 3
gloo CPU ranks (``megatron_gen.py``; megatron-core 0.15.x, the last release
that still saves distributed-optimizer *flattened* tensors, plus psutil). It
holds regular ShardedTensors (row-sharded BF16, a layer-stacked F32 with
``prepend_axis_num=1``, a replicated BF16), four flattened optimizer tensors
(2-d, layer-stacked 3-d, plain 3-d, 1-d) whose ranges cut blocks mid-row
(up to 5 boxes per range, 1-element pieces), and one ShardedObject per rank.
Megatron saves the flattened ones reformulated as ``[X/x, Y/y, ..., x*y*...]``
and records the original shape in ``mcore_data[key]["nd_reformulated_orig_global_shape"]``.

Two roots are served:

- ``real``: exactly what Megatron wrote. Its ``.metadata`` root object is
  ``megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata`` (a
  subclass of torch's Metadata carrying ``mcore_data``) and it holds
  ``all_local_plans`` (``MCoreSavePlan`` / torch ``WriteItem`` ...);
- ``plain``: the same files with ``.metadata`` re-pickled as a plain torch
  ``Metadata`` + ``mcore_data`` attribute (the layout docs/FORMATS.md
  describes), so the reformulation logic is tested even where the real
  metadata is refused.

Oracles, all required to agree bit for bit:
1. the values saved (``<name>-expected.pt``, generated before saving);
2. what Megatron's own ``dist_checkpointing.load`` returns for every whole
   tensor (flattened ones resharded to a single range; ``<name>-megatron.pt``);
3. a numpy reconstruction computed here from the flat pieces on disk
   (``.distcp`` items located through ``storage_data``, placed with
   ``block.reshape(-1)[start:start+len]``, every element exactly once).

Contract under test (docs/FORMATS.md "Megatron-Core torch_dist",
docs/SEMANTICS.md): ``ckptfs index ROOT`` exits 0 without problems;
``ckptfs ls ROOT --json`` lists every tensor with its ORIGINAL global shape
and dtype; ``ckptfs cat ROOT tensors/<escaped key>.npy`` gives the original
values (BF16 presented as F32); ``bytes/<escaped key>.pt`` gives each
ShardedObject's BYTE_IO item (Megatron saves ``[obj]``).

Megatron must be importable by ``python3`` (or set MEGATRON_PYTHONPATH to a
``pip install --target`` dir); nothing is installed here and nothing is
skipped. ~15 s on 2 cores (generation ~11 s).

Run: CKPTFS_BIN=build/ckptfs python3 -m pytest tests/e2e/test_megatron.py -q
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

E2E_DIR = Path(__file__).resolve().parent
if str(E2E_DIR) not in sys.path:
    sys.path.insert(0, str(E2E_DIR))
import megatron_gen  # noqa: E402
from harness import describe, run_ckptfs  # noqa: E402

EXIT_OK = 0
ROOTS = ["real", "plain"]
ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32"}
NPY_DTYPE = {torch.bfloat16: np.dtype("<f4"), torch.float32: np.dtype("<f4")}  # BF16 -> F32


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def escape_name(name: str) -> str:
    """File name of a tensor / byte item (docs/SEMANTICS.md)."""
    if name == "":
        return "%"
    if name in (".", ".."):
        return "%2E" * len(name)
    return name.replace("%", "%25").replace("/", "%2F")


def ckptfs(index_dir: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`ckptfs ARGS` with CKPTFS_INDEX_DIR=index_dir (harness.run_ckptfs)."""
    return run_ckptfs(*args, index_dir=index_dir, timeout=timeout)


class _Stub:
    """Stand-in for a megatron class in a pickle: keeps the BUILD state."""

    def __init__(self, *args, **kwargs):
        self._args = args

    def __setstate__(self, state):
        if isinstance(state, tuple):            # (dict, slots)
            for part in state:
                if isinstance(part, dict):
                    self.__dict__.update(part)
        elif isinstance(state, dict):
            self.__dict__.update(state)


class _NoMegatronUnpickler(pickle.Unpickler):
    """Reads Megatron's `.metadata` without importing megatron: its classes
    become _Stub subclasses named like the original; torch classes are real."""

    def find_class(self, module, name):
        if module.split(".")[0] == "megatron":
            return type(name, (_Stub,), {"_megatron_module": module})
        return super().find_class(module, name)


def read_metadata(ckpt_dir: str):
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as f:
        return _NoMegatronUnpickler(f).load()


def reconstruct_from_pieces(ckpt_dir: str, md) -> dict[str, torch.Tensor]:
    """Every tensor rebuilt from the .distcp items with numpy alone (the
    flattened ones from their (i, j, ..., start) pieces); asserts each
    element is written exactly once."""
    mcore = getattr(md, "mcore_data", None) or {}
    out = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if not hasattr(tmd, "chunks"):
            continue                                            # BYTE_IO
        saved = tuple(tmd.size)
        orig = tuple(mcore.get(fqn, {}).get("nd_reformulated_orig_global_shape", saved))
        flat = "nd_reformulated_orig_global_shape" in mcore.get(fqn, {})
        dtype = tmd.properties.dtype
        full = np.zeros(orig, dtype=np.float32)
        seen = np.zeros(orig, dtype=np.int64)
        if flat:
            assert len(saved) == len(orig) + 1, (fqn, saved, orig)
            blk = tuple(o // n for o, n in zip(orig, saved[:-1]))
            assert all(b * n == o for b, n, o in zip(blk, saved[:-1], orig)), (fqn, saved, orig)
            assert int(np.prod(blk)) == saved[-1], (fqn, blk, saved)
        for idx, info in md.storage_data.items():
            if idx.fqn != fqn:
                continue
            with open(os.path.join(ckpt_dir, info.relative_path), "rb") as f:
                f.seek(info.offset)
                item = f.read(info.length)
            piece = torch.load(io.BytesIO(item), weights_only=True)
            arr = piece.float().numpy()
            off = tuple(idx.offset)
            if flat:
                assert piece.shape[:-1] == (1,) * (len(saved) - 1), (fqn, off, piece.shape)
                start, n = off[-1], piece.shape[-1]
                sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(off[:-1], blk))
                # the block (i, j, ...) in C order; the piece is [start, start + n)
                vals = full[sl].copy().reshape(-1)
                vals[start:start + n] = arr.reshape(-1)
                full[sl] = vals.reshape(blk)
                cnt = seen[sl].copy().reshape(-1)
                cnt[start:start + n] += 1
                seen[sl] = cnt.reshape(blk)
            else:
                sl = tuple(slice(o, o + s) for o, s in zip(off, piece.shape))
                full[sl] = arr
                seen[sl] += 1
        assert (seen == 1).all(), (
            f"{fqn}: the pieces on disk cover some elements {sorted(set(seen.ravel().tolist()))} "
            f"times, not exactly once")
        out[fqn] = torch.from_numpy(full).to(dtype)
    return out


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    g, w = got.float().reshape(-1), want.float().reshape(-1)
    bad = torch.nonzero(g.view(torch.int32) != w.view(torch.int32)).reshape(-1)
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {w.numel()} elements differ; first at flat "
                             f"index {i} (C-order of shape {tuple(want.shape)}): got {float(g[i])!r}, "
                             f"want {float(w[i])!r}")


# ---------------------------------------------------------------------------
# fixture: one generation per session
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("megatron")
    out = str(base / "mcore")
    try:
        info = megatron_gen.generate(out)
    except Exception as e:  # noqa: BLE001 - reported as the failure
        pytest.fail("real Megatron-Core could not write the torch_dist checkpoint "
                    "(needs megatron-core 0.15.x and psutil importable by python3, or "
                    f"MEGATRON_PYTHONPATH):\n{e}", pytrace=False)
    index_dir = str(base / "index")
    os.makedirs(index_dir)
    info["roots"] = {"real": info["out_dir"], "plain": info["plain_dir"]}
    info["index_dir"] = index_dir
    info["expected"] = torch.load(info["expected_path"])
    info["megatron"] = torch.load(info["megatron_path"])
    return info


# ---------------------------------------------------------------------------
# 0. what Megatron wrote (no ckptfs involved)
# ---------------------------------------------------------------------------


def test_megatron_wrote_reformulated_flat_tensors(ckpt):
    root = ckpt["out_dir"]
    with open(os.path.join(root, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    assert os.path.isfile(os.path.join(root, "common.pt"))
    assert any(f.endswith(".distcp") for f in ckpt["files"]), ckpt["files"]
    md = read_metadata(root)
    assert hasattr(md, "mcore_data"), f"no mcore_data in .metadata ({type(md).__name__})"
    mcore = md.mcore_data
    # Megatron also lists non-flat tensors with prepended axes, with an empty dict.
    flat_keys = {k for k, v in mcore.items() if "nd_reformulated_orig_global_shape" in v}
    assert flat_keys == set(megatron_gen.FLAT), mcore
    tensors = {k: v for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert set(tensors) == set(ckpt["shapes"]), sorted(set(tensors) ^ set(ckpt["shapes"]))
    byte_keys = sorted(k for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks"))
    assert byte_keys == sorted(ckpt["object_keys"]), byte_keys
    for key, (gshape, _dt, blk, _pre, plan) in megatron_gen.FLAT.items():
        assert tuple(mcore[key]["nd_reformulated_orig_global_shape"]) == tuple(gshape), (key, mcore[key])
        assert list(tensors[key].size) == ckpt["flat"][key], (key, tensors[key].size)
        want_chunks = sorted((bidx + (a,), (1,) * len(bidx) + (b - a,))
                             for bidx, ranges in plan.items() for (a, b, _r) in ranges)
        got_chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in tensors[key].chunks)
        assert got_chunks == want_chunks, (key, got_chunks)
    for key in megatron_gen.MODEL:
        assert list(tensors[key].size) == ckpt["shapes"][key], (key, tensors[key].size)
    # The layout really needs multi-box decompositions: a 3-d range of 5
    # boxes (2*3-1), 2-d ranges of 3, 1-element pieces.
    boxes = {key: [megatron_gen.flat_boxes(blk, a, b) for rs in plan.values() for (a, b, _r) in rs]
             for key, (_g, _d, blk, _p, plan) in megatron_gen.FLAT.items()}
    assert max(boxes["optimizer.state.fp32_param.decoder.mlp.linear_fc1.weight"]) == 5, boxes
    assert max(boxes["optimizer.state.exp_avg.embedding.word_embeddings.weight"]) == 3, boxes


def test_oracles_agree(ckpt):
    """Saved values == Megatron's own load == numpy reconstruction from disk."""
    exp, meg = ckpt["expected"], ckpt["megatron"]
    assert set(exp) == set(meg) == set(ckpt["shapes"]), (sorted(exp), sorted(meg))
    rec = reconstruct_from_pieces(ckpt["out_dir"], read_metadata(ckpt["out_dir"]))
    assert set(rec) == set(exp), sorted(set(rec) ^ set(exp))
    for k in exp:
        assert list(exp[k].shape) == ckpt["shapes"][k], k
        assert_same(meg[k], exp[k], f"{k}: megatron's dist_checkpointing.load vs saved values")
        assert_same(rec[k], exp[k], f"{k}: numpy reconstruction from the pieces vs saved values")


def test_plain_copy_matches_real_metadata(ckpt):
    real = read_metadata(ckpt["out_dir"])
    with open(os.path.join(ckpt["plain_dir"], ".metadata"), "rb") as f:
        plain = pickle.load(f)                  # plain torch classes only
    from torch.distributed.checkpoint.metadata import Metadata
    assert type(plain) is Metadata, type(plain)
    assert not hasattr(plain, "all_local_plans")
    assert plain.mcore_data == real.mcore_data
    assert plain.state_dict_metadata == real.state_dict_metadata
    assert plain.storage_data == real.storage_data
    assert sorted(os.listdir(ckpt["plain_dir"])) == sorted(os.listdir(ckpt["out_dir"]))


# ---------------------------------------------------------------------------
# 1. ckptfs on both roots
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("root", ROOTS)
def test_index_has_no_problems(ckpt, root):
    p = ckptfs(ckpt["index_dir"], "index", ckpt["roots"][root])
    assert p.returncode == EXIT_OK and "problem" not in p.stderr, (
        f"{root}: ckptfs refuses the Megatron checkpoint\n{describe(p)}")


@pytest.mark.parametrize("root", ROOTS)
def test_ls_json_original_shapes(ckpt, root):
    p = ckptfs(ckpt["index_dir"], "ls", ckpt["roots"][root], "--json")
    assert p.returncode == EXIT_OK, describe(p)
    rows = json.loads(p.stdout)
    by_name = {r["name"]: r for r in rows}
    assert len(by_name) == len(rows), f"{root}: duplicate names in ls --json"
    assert set(by_name) == set(ckpt["shapes"]), (
        f"{root}: ls --json lists {sorted(by_name)}, want {sorted(ckpt['shapes'])}")
    for k, shape in ckpt["shapes"].items():
        r = by_name[k]
        assert r["shape"] == shape, f"{root}: {k}: shape {r['shape']}, want original {shape}"
        assert r["dtype"] == ST_DTYPE[ckpt["expected"][k].dtype], (root, k, r["dtype"])
        assert not r.get("problem"), (root, k, r["problem"])


@pytest.mark.parametrize("root", ROOTS)
def test_npy_values(ckpt, root):
    exp = ckpt["expected"]
    for k in sorted(exp):
        rel = "tensors/" + escape_name(k) + ".npy"
        p = ckptfs(ckpt["index_dir"], "cat", ckpt["roots"][root], rel)
        assert p.returncode == EXIT_OK, f"{root}: {rel}\n{describe(p)}"
        try:
            arr = np.load(io.BytesIO(p.stdout), allow_pickle=False)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{root}: {rel}: numpy cannot load it: {e!r}")
        assert arr.dtype == NPY_DTYPE[exp[k].dtype], (root, k, arr.dtype)
        assert list(arr.shape) == ckpt["shapes"][k], (
            f"{root}: {rel}: shape {list(arr.shape)}, want original {ckpt['shapes'][k]}")
        got = torch.from_numpy(np.ascontiguousarray(arr)).to(exp[k].dtype)
        assert_same(got, exp[k], f"{root}: {rel}")
        assert_same(got, ckpt["megatron"][k], f"{root}: {rel} vs megatron's load")


@pytest.mark.parametrize("root", ROOTS)
def test_sharded_objects_as_bytes(ckpt, root):
    for r, key in enumerate(ckpt["object_keys"]):
        rel = "bytes/" + escape_name(key) + ".pt"
        p = ckptfs(ckpt["index_dir"], "cat", ckpt["roots"][root], rel)
        assert p.returncode == EXIT_OK, f"{root}: {rel}\n{describe(p)}"
        obj = torch.load(io.BytesIO(p.stdout), weights_only=False)
        assert obj == [{"rank": r, "seed": 1000 + r}], (root, key, obj)
