"""torch.save files written by other projects (tests/fixtures/third_party),
read through ckptfs: every tensor torch.load finds is served, through a real
mount, as tensors/<name>.npy with torch.load's values."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

from harness import THIRD_PARTY, run_ckptfs, unmount


BIN = os.environ.get("CKPTFS_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "ckptfs"))
FIXTURES = THIRD_PARTY
FILES = ["burn/float32.pt", "burn/bfloat16.pt", "burn/checkpoint.pt", "burn/linear.pt",
         "candle/test.pt", "candle/test_with_key.pt"]


def flatten(obj, prefix=()):
    """{dotted key path: tensor} the way ckptfs names torch.save tensors."""
    if isinstance(obj, torch.Tensor):
        yield ".".join(prefix), obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, prefix + (str(k),))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flatten(v, prefix + (str(i),))


@pytest.mark.parametrize("rel", FILES)
def test_fixture_tensors_equal_torch_load(rel, tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    src = os.path.join(FIXTURES, rel)
    shutil.copy(src, root / os.path.basename(rel))
    want = dict(flatten(torch.load(src, weights_only=False)))
    if not want:
        raise AssertionError(f"{rel}: torch.load found no tensors")
    stem = os.path.splitext(os.path.basename(rel))[0]
    want = {(k if k else stem): v for k, v in want.items()}
    index_dir = str(tmp_path / "index")
    p = run_ckptfs("index", root, bin_path=BIN, index_dir=index_dir)
    assert p.returncode == 0, p.stderr
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = run_ckptfs("mount", root, mnt, "--log-file", tmp_path / "log", bin_path=BIN,
                   index_dir=index_dir)
    assert p.returncode == 0, p.stderr
    try:
        served = sorted(f[:-4] for f in os.listdir(mnt / "tensors"))
        assert served == sorted(k.replace("%", "%25").replace("/", "%2F") for k in want), (served, sorted(want))
        for name, t in want.items():
            a = np.load(mnt / "tensors" / (name.replace("%", "%25").replace("/", "%2F") + ".npy"))
            exp = (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()
            assert a.dtype == exp.dtype and a.shape == exp.shape, (name, a.dtype, a.shape, exp.dtype, exp.shape)
            assert np.array_equal(a, exp, equal_nan=True), name
            del a
    finally:
        unmount(mnt)  # gc.collect, fusermount3 -u retried, then -u -z
