"""torch.save files written by other projects (../shared/fixtures/third_party),
read through ckptfs: every tensor torch.load finds is served, through a real
mount, as tensors/<name>.npy with torch.load's values."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch


BIN = os.environ.get("CKPTFS_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "ckptfs"))
FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "fixtures", "third_party")
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
    env = dict(os.environ, CKPTFS_INDEX_DIR=str(tmp_path / "index"))
    p = subprocess.run([BIN, "index", str(root)], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = subprocess.run([BIN, "mount", str(root), str(mnt), "--log-file", str(tmp_path / "log")],
                       capture_output=True, text=True, env=env)
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
        import gc
        gc.collect()
        for _ in range(20):
            if subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True).returncode == 0:
                break
        else:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
