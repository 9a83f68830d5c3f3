"""ckptfs.torch.StorageWriter takes every dtype torch's writers save, on 2
gloo ranks (CPU), both layouts, dcp.save and dcp.async_save
(tests/e2e/writer_dtypes_gen.py; docs/WRITER.md, "Element types").

- DCP: every dtype torch's FileSystemWriter saves (float4_e2m1fn_x2,
  complex32, complex128, every float8 ...), DTensors sharded on the first
  and on the last dim, plain and 0-d tensors: stock ``dcp.load`` reads back
  every byte.
- HF: every dtype torch's HuggingFaceStorageWriter saves: the files are
  torch's own writer's (the same header entries, sharding info and data
  bytes).
- Both: ``consolidated/`` through a mount holds every tensor safetensors
  can hold as ``safetensors.torch.save`` stores it (dtype, shape: F4 with
  its last dim doubled) with the saved bytes; ``ckptfs verify`` checks the
  CRC32C of every chunk.
- A dtype a layout cannot hold (complex32 in safetensors, a sub-byte
  torch.uint4 anywhere) is refused while planning, naming the tensor and
  the dtype, before any file is written.

Expected values: the bytes generated before the save, torch's own readers
and writers, ``safetensors.torch.save`` and the safetensors format's
definition (parsed here).
"""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save as safetensors_save

from harness import Mounted, run_ckptfs, spawn_ranks
from writer_dtypes_gen import DCP_DTYPES, HF_DTYPES, chunk_count

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_dtypes_gen.py")
WORLD = 2


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _parse(blob: bytes) -> tuple[dict, bytes]:
    """(header, data) of a safetensors file, by the format's definition."""
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _safetensors_entry(t: torch.Tensor) -> dict | None:
    """How safetensors.torch.save stores ``t`` (dtype, shape), or None when it cannot."""
    try:
        header, _ = _parse(safetensors_save({"t": t.contiguous()}))
    except Exception:  # noqa: BLE001 - safetensors' refusal (complex128, a 0-d F4 ...)
        return None
    return {"dtype": header["t"]["dtype"], "shape": header["t"]["shape"]}


def _save(tmp_path_factory, layout: str, mode: str) -> dict:
    base = tmp_path_factory.mktemp(f"dtypes_{layout}_{mode}")
    job = {"dtypes": DCP_DTYPES if layout == "dcp" else HF_DTYPES, "scalars": layout == "dcp", "seed": 3,
           "layout": layout, "mode": mode, "dir": str(base / "root" / "step_1"), "oracle": str(base / "oracle.pt")}
    if layout == "hf":
        job["torch_dir"] = str(base / "torch")
    spawn_ranks(GEN, WORLD, job, name=f"dtypes save ({layout}, {mode})")
    return {**job, "base": base, "full": torch.load(job["oracle"], weights_only=True)}


DCP_SAVES = [("dcp", "sync"), ("dcp", "async")]
HF_SAVES = [("hf", "sync"), ("hf", "async")]


@pytest.fixture(scope="module")
def saved(request, tmp_path_factory) -> dict:
    """A save of (layout, mode), parametrized indirectly by each test."""
    return _save(tmp_path_factory, *request.param)


@pytest.mark.parametrize("saved", DCP_SAVES, indirect=True, ids="-".join)
def test_stock_dcp_load_reads_every_byte(saved):
    full = saved["full"]
    assert {str(v.dtype).removeprefix("torch.") for v in full.values()} == set(DCP_DTYPES)
    assert any(v.dim() == 0 and v.dtype == torch.float4_e2m1fn_x2 for v in full.values())
    target = {k: torch.empty_like(v) for k, v in full.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(saved["dir"]))
    bad = [k for k, v in full.items() if target[k].dtype != v.dtype or _bytes(target[k]) != _bytes(v)]
    assert bad == []


def _shards(directory: str) -> dict[str, tuple[dict, bytes]]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb") as f:
                out[name] = _parse(f.read())
    return out


@pytest.mark.parametrize("saved", HF_SAVES, indirect=True, ids="-".join)
def test_hf_files_are_torchs_own(saved):
    """torch's HuggingFaceStorageWriter, the same state: the same files, the
    same entries (F4 with its last dim doubled), sharding info and bytes."""
    ours, theirs = _shards(saved["dir"]), _shards(saved["torch_dir"])
    assert sorted(ours) == sorted(theirs) and len(ours) == WORLD
    dtypes = set()
    for name, (header, data) in ours.items():
        t_header, t_data = theirs[name]
        meta, t_meta = header.pop("__metadata__"), t_header.pop("__metadata__")
        assert header == t_header, name
        assert data == t_data, name
        assert json.loads(meta.pop("DCP_SHARDING_INFO")) == json.loads(t_meta.pop("DCP_SHARDING_INFO")), name
        assert meta == t_meta, name
        dtypes |= {e["dtype"] for e in header.values()}
    assert {"F4", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "U64", "C64", "BOOL"} <= dtypes, dtypes


@pytest.mark.parametrize("saved", DCP_SAVES + HF_SAVES, indirect=True, ids="-".join)
def test_consolidated_through_a_mount_holds_the_saved_bytes(saved, tmp_path):
    """Every tensor safetensors can hold, as safetensors.torch.save stores it,
    holding the bytes saved; the others (complex128, complex32, a 0-d F4)
    are left out, as the index leaves them out of any checkpoint."""
    full = saved["full"]
    expected = {k: _safetensors_entry(v) for k, v in full.items()}
    with Mounted(os.path.dirname(saved["dir"]), index_dir=str(tmp_path / "idx"), base_dir=str(tmp_path)) as m:
        folder = m.p("step_1", "consolidated")
        got = {}
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                with open(os.path.join(folder, name), "rb") as f:
                    header, data = _parse(f.read())
                header.pop("__metadata__", None)
                for k, e in header.items():
                    got[k] = (e["dtype"], e["shape"], data[e["data_offsets"][0]:e["data_offsets"][1]])
    assert sorted(got) == sorted(k for k, e in expected.items() if e is not None)
    bad = [k for k, (dt, shape, data) in got.items()
           if (dt, shape) != (expected[k]["dtype"], expected[k]["shape"]) or data != _bytes(full[k])]
    assert bad == []
    assert expected["float4_e2m1fn_x2.col"] == {"dtype": "F4", "shape": [2, 4 * WORLD]}


@pytest.mark.parametrize("saved", DCP_SAVES + HF_SAVES, indirect=True, ids="-".join)
def test_verify_checks_every_chunk(saved, tmp_path):
    held = [k for k, v in saved["full"].items() if _safetensors_entry(v) is not None]
    p = run_ckptfs("verify", saved["dir"], "--json", index_dir=str(tmp_path / "idx"), text_stdout=True)
    report = json.loads(p.stdout)
    assert p.returncode == 0 and report["problems"] == [], report
    assert report["checksummed_chunks"] == chunk_count(held, WORLD), report


@pytest.mark.parametrize("layout,fqn,tensor,dtype", [
    ("hf", "c", torch.zeros(8, dtype=torch.complex32), "complex32"),
    ("hf", "c", torch.zeros(8, dtype=torch.complex128), "complex128"),
    ("hf", "s", torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2), "float4_e2m1fn_x2"),
    ("dcp", "q", torch.empty(8, dtype=torch.uint4), "uint4"),
])
def test_a_dtype_a_layout_cannot_hold_is_refused_before_any_file_is_written(tmp_path, layout, fqn, tensor, dtype):
    from torch.distributed.checkpoint.api import CheckpointException
    from ckptfs.torch import StorageWriter
    step = tmp_path / "run" / "step_1"
    state = {"w": torch.arange(3000, dtype=torch.float32), fqn: tensor}
    with pytest.raises(CheckpointException) as e:
        dcp.save(state, storage_writer=StorageWriter(step, layout=layout, buffer_bytes=4096))
    refusal = e.value.failures[0][0]
    assert isinstance(refusal, TypeError), refusal
    assert f"'{fqn}'" in str(refusal) and f"torch.{dtype}" in str(refusal) and "'w'" not in str(refusal), refusal
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "run") for f in files]
    assert left == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_refusal_on_one_rank_fails_every_rank_before_any_file_is_written(tmp_path, mode):
    """Rank 1 alone holds a complex32 tensor (HF layout): every rank raises
    (async_save's staging gathers the refusal, so rank 0 does not wait on
    rank 1 forever) and the step directory holds no file."""
    step = tmp_path / "run" / "step_1"
    job = {"dtypes": ["float32"], "layout": "hf", "mode": mode, "dir": str(step), "refused_on_rank": 1,
           "refused_dtype": "complex32"}
    with pytest.raises(RuntimeError) as e:
        spawn_ranks(GEN, WORLD, job, name=f"refused on rank 1 ({mode})", timeout=180)
    assert "timed out" not in str(e.value) and "torch.complex32" in str(e.value), str(e.value)[-3000:]
    ranks = str(e.value).split("--- rank ")[1:]  # each failed rank's output
    assert [r[:1] for r in ranks] == ["0", "1"] and all("torch.complex32" in r for r in ranks), str(e.value)[-3000:]
    left = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "run") for f in files]
    assert left == []
