"""Checkpoints holding dtypes beyond the common ones (docs/FORMATS.md,
"Element types").

- A DCP checkpoint (torch's own dcp.save) with float8_e4m3fnuz,
  float8_e5m2fnuz and float4_e2m1fn_x2 tensors between ordinary ones: every
  tensor is served, in tensors/*.npy (as float32) and in
  consolidated/model.safetensors (as F8_E4M3FNUZ, F8_E5M2FNUZ and F4).
- A dtype the index cannot hold (complex128): that tensor is left out and
  named by `ckptfs index` and `check`; every other tensor is served.
- A safetensors folder with an F8_E5M2FNUZ entry: served, and safetensors
  loads consolidated/ to the same bits.

Expected values: torch's own conversions (``Tensor.float()``), the raw
bytes torch saved, and a per-element E2M1 decoder written here.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from harness import Mounted, run_ckptfs

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e2m1(nibble: int) -> float:
    v = E2M1[nibble & 7]
    return -v if nibble & 8 else v


def _f4x2_as_float(t: torch.Tensor) -> np.ndarray:
    """float4_e2m1fn_x2 bytes as float32 values, the low nibble first."""
    raw = t.view(torch.uint8).numpy()
    out = np.empty(raw.shape[:-1] + (raw.shape[-1] * 2,), dtype=np.float32)
    for idx in np.ndindex(raw.shape):
        b = int(raw[idx])
        out[idx[:-1] + (2 * idx[-1],)] = _e2m1(b & 0xF)
        out[idx[:-1] + (2 * idx[-1] + 1,)] = _e2m1(b >> 4)
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _safetensors_entries(path: str) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


@pytest.fixture(scope="module")
def rare(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("rare_dtypes")
    g = torch.Generator().manual_seed(3)
    fnuz = torch.randn(6, generator=g) * 4
    sd = {
        "a.weight": torch.randn(3, 4, generator=g),
        "b.fnuz": fnuz.to(torch.float8_e4m3fnuz),
        "c.e5fnuz": (torch.randn(2, 3, generator=g) * 100).to(torch.float8_e5m2fnuz),
        "d.f4": torch.randint(0, 256, (3, 2), dtype=torch.uint8, generator=g).view(torch.float4_e2m1fn_x2),
        "z.last": torch.arange(6.0),
    }
    dcp.save(sd, checkpoint_id=str(base / "run" / "step_1"), no_dist=True)
    return {"base": base, "root": str(base / "run"), "sd": sd}


def test_fnuz_and_f4x2_tensors_are_served_with_the_rest(rare, tmp_path):
    sd = rare["sd"]
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", rare["root"], index_dir=idx)
    assert p.returncode == 0, p.stderr
    with Mounted(rare["root"], index_dir=idx, base_dir=str(tmp_path)) as m:
        t = lambda name: np.load(m.p("step_1", "tensors", name + ".npy"))  # noqa: E731
        assert np.array_equal(t("a.weight"), sd["a.weight"].numpy())
        assert np.array_equal(t("z.last"), sd["z.last"].numpy())
        for name in ("b.fnuz", "c.e5fnuz"):
            assert np.array_equal(t(name), sd[name].float().numpy(), equal_nan=True), name
        assert np.array_equal(t("d.f4"), _f4x2_as_float(sd["d.f4"]))
        header, data = _safetensors_entries(m.p("step_1", "consolidated", "model.safetensors"))
    want = {"a.weight": ("F32", [3, 4]), "b.fnuz": ("F8_E4M3FNUZ", [6]), "c.e5fnuz": ("F8_E5M2FNUZ", [2, 3]),
            "d.f4": ("F4", [3, 4]), "z.last": ("F32", [6])}
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__"} == want
    for name in want:
        begin, end = header[name]["data_offsets"]
        assert data[begin:end] == _raw(sd[name]), name


def test_a_dtype_ckptfs_cannot_hold_is_named_and_the_rest_served(tmp_path):
    sd = {"a.weight": torch.randn(3, 4), "m.complex": torch.randn(2, 2, dtype=torch.complex128),
          "z.last": torch.arange(5, dtype=torch.int64)}
    root = tmp_path / "run"
    dcp.save(sd, checkpoint_id=str(root / "step_1"), no_dist=True)
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", str(root), index_dir=idx)
    assert "m.complex" in p.stderr and "complex128" in p.stderr, p.stderr
    p = run_ckptfs("check", str(root), index_dir=idx, text_stdout=True)
    assert p.returncode == 5 and "m.complex" in p.stdout + p.stderr, p.stdout + p.stderr
    with Mounted(str(root), index_dir=idx, base_dir=str(tmp_path)) as m:
        assert np.array_equal(np.load(m.p("step_1", "tensors", "a.weight.npy")), sd["a.weight"].numpy())
        assert np.array_equal(np.load(m.p("step_1", "tensors", "z.last.npy")), sd["z.last"].numpy())
        assert not os.path.exists(m.p("step_1", "tensors", "m.complex.npy"))


def test_a_safetensors_folder_with_an_f8_e5m2fnuz_entry(tmp_path):
    from safetensors.torch import load_file, save_file
    sd = {"w": torch.randn(4, 3), "s": (torch.randn(8) * 10).to(torch.float8_e5m2fnuz)}
    (tmp_path / "model").mkdir()
    save_file(sd, str(tmp_path / "model" / "model.safetensors"))
    with Mounted(str(tmp_path / "model"), index_dir=str(tmp_path / "idx"), base_dir=str(tmp_path)) as m:
        got = load_file(m.p("consolidated", "model.safetensors"))
        assert np.array_equal(np.load(m.p("tensors", "s.npy")), sd["s"].float().numpy(), equal_nan=True)
    assert got["s"].dtype == torch.float8_e5m2fnuz and _raw(got["s"]) == _raw(sd["s"])
    assert torch.equal(got["w"], sd["w"])
