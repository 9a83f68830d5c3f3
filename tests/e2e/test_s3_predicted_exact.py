"""Exact or an error on the fast path of a fresh `mount s3://` (issue 54).

A fresh mount places a DCP step's items by prediction and reads their
framing with their bytes (docs/SEMANTICS.md, "Framing read with the
bytes"). An item whose framing says otherwise (a view saved with its own
strides or storage offset) must never have a byte served from where it was
predicted: not through a reply, not through a page pushed into the page
cache ahead of the reader, whatever the item's size against `--part-size`.

The step is written by stock torch `dcp.save`: a large ordinary bf16
tensor, then a 4096x4096 bf16 transposed view (same pickle length as a
contiguous tensor, only the strides differ: 75 % of its bytes were served
wrong), a 4096x4096 fp32 slice with a storage offset, a permuted 3-d view,
an item over 64 MiB, and small tensors. Uploaded to SeaweedFS, each case
gets a fresh mount (a fresh index: every item predicted) and is read one
way, and every tensor is compared with torch's own `dcp.load` of the same
step: `load_file` (mmap), `read()` of the whole file, `safe_open` in
reverse order; at part sizes 5 MiB and 64 MiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load, load_file

import harness
from s3_server import BUCKET, upload_tree


def _state() -> dict:
    g = torch.Generator().manual_seed(54)
    sd = {"a.big": torch.randn(4096, 2048, generator=g).to(torch.bfloat16)}
    sd["b.transposed"] = torch.randn(4096, 4096, generator=g).to(torch.bfloat16).t()
    sd["c.offset_slice"] = torch.randn(4097, 4096, generator=g)[1:]
    sd["d.permuted"] = torch.randn(64, 96, 128, generator=g).permute(2, 0, 1)
    sd["e.over_64mib"] = torch.randn(4096, 4160, generator=g)
    sd["f.small"] = torch.randn(300, generator=g)
    sd["g.scalar"] = torch.tensor(2.5)
    return sd


@pytest.fixture(scope="module")
def step(s3_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("exact") / "step_1"
    sd = _state()
    assert not sd["b.transposed"].is_contiguous() and sd["c.offset_slice"].storage_offset() == 4096
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    del sd
    # The oracle: torch's own loader over the files on disk.
    expected = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in _shapes().items()}
    dcp.load(expected, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    upload_tree(s3_server["client"], str(out.parent), "exact/")
    return {"root": f"s3://{BUCKET}/exact", "expected": expected}


def _shapes() -> dict:
    return {"a.big": torch.empty(4096, 2048, dtype=torch.bfloat16),
            "b.transposed": torch.empty(4096, 4096, dtype=torch.bfloat16),
            "c.offset_slice": torch.empty(4096, 4096), "d.permuted": torch.empty(128, 64, 96),
            "e.over_64mib": torch.empty(4096, 4160), "f.small": torch.empty(300), "g.scalar": torch.empty(())}


def _read_load_file(path: str) -> dict:
    return dict(load_file(path))


def _read_whole(path: str) -> dict:
    with open(path, "rb") as f:
        return load(f.read())


def _read_safe_open_reversed(path: str) -> dict:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in reversed(sorted(f.keys()))}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


READERS = {"load_file": _read_load_file, "read": _read_whole, "safe_open_reversed": _read_safe_open_reversed}


@pytest.mark.parametrize("part_size", ["5MiB", "64MiB"])
@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_mispredicted_item_reads_exactly_through_a_fresh_mount(step, s3_env, tmp_path, reader, part_size):
    expected = step["expected"]
    with harness.Mounted(step["root"], "--index", str(tmp_path / "fresh-index"), "--part-size", part_size,
                         base_dir=str(tmp_path)) as m:
        got = READERS[reader](m.p("step_1", "consolidated", "model.safetensors"))
        assert set(got) == set(expected), sorted(set(got) ^ set(expected))
        wrong = {k: int((_bytes(got[k]) != _bytes(expected[k])).sum())
                 for k in expected if got[k].dtype == expected[k].dtype and got[k].shape == expected[k].shape}
        assert len(wrong) == len(expected), "a tensor came back with another dtype or shape"
        del got  # load_file's tensors map the file: the mount would stay busy
        assert all(n == 0 for n in wrong.values()), f"wrong bytes per tensor: {wrong}"
