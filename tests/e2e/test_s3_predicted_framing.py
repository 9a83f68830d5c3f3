"""A DCP step in object storage, mounted with a fresh index: each item's
framing (the torch.save zip around a tensor's bytes) is read with the bytes
instead of by a GET per item when the mount starts (indexer/dcp_item.h,
docs/SEMANTICS.md "Framing read with the bytes").

The step is written by real torch (`dcp.save` of a state dict whose items
lie more than 256 KiB apart, so that an index reading the framing up front
needs a GET per item), uploaded to SeaweedFS (tools/s3_server.py) and judged
by safetensors, numpy and torch's own tensors: exact bytes through the
source-order fetch (`load_file` of consolidated/) and through the ordinary
path (tensors/*.npy); a transposed view, whose framing says other strides
than predicted, is served where the framing says; an item whose framing is
corrupt reads EIO, never bytes; the GETs of a fresh mount's load are those
of a mount over an index built ahead, plus a few.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import harness
from s3_server import BUCKET, upload_tree


def _state() -> dict:
    """Tensors of several dtypes and ranks, the big ones 1 MiB apart; one
    transposed view (DCP saves it as it is, strides and all), named last
    but one so that the first item, which the index checks, is plain."""
    g = torch.Generator().manual_seed(7)
    sd = {f"layers.{i:02d}.weight": torch.randn(256, 512, generator=g) for i in range(36)}
    sd["layers.05.weight"] = sd["layers.05.weight"].to(torch.bfloat16)
    sd["layers.06.weight"] = sd["layers.06.weight"].to(torch.float16)
    sd["norm.bias"] = torch.randn(1024, generator=g)
    sd["scale"] = torch.tensor(3.5)  # 0-d
    sd["tokens"] = torch.arange(300_000, dtype=torch.int64)
    sd["x.cube"] = torch.randn(64, 32, 128, generator=g)
    sd["y.transposed"] = torch.randn(512, 640, generator=g).t()
    sd["z.last"] = torch.randn(256, 1024, generator=g)
    return sd


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    out = tmp_path_factory.mktemp("predicted") / "step-1"
    sd = _state()
    assert not sd["y.transposed"].is_contiguous()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    return {"dir": out, "expected": {k: v.contiguous() for k, v in sd.items()}}


@pytest.fixture(scope="module")
def roots(s3_server, step, tmp_path_factory):
    """s3://ckpts/predicted/{good,corrupt}/: the step, and a copy whose
    last item's pickle names a storage class torch does not have."""
    client = s3_server["client"]
    upload_tree(client, str(step["dir"]), "predicted/good/")
    bad = tmp_path_factory.mktemp("corrupt") / "step-1"
    shutil.copytree(step["dir"], bad)
    md = dcp.FileSystemReader(str(bad)).read_metadata()
    item = next(v for k, v in md.storage_data.items() if k.fqn == "z.last")
    path = bad / item.relative_path
    data = bytearray(path.read_bytes())
    at = data.index(b"FloatStorage", item.offset, item.offset + 512)
    data[at:at + 12] = b"FlootStorage"  # same size: only the framing can tell
    path.write_bytes(bytes(data))
    upload_tree(client, str(bad), "predicted/corrupt/")
    # A copy whose transposed item's framing says strides (1, 641) for its
    # 640x512 storage: they reach past the item's bytes, into its neighbours'.
    overrun = tmp_path_factory.mktemp("overrun") / "step-1"
    shutil.copytree(step["dir"], overrun)
    item = next(v for k, v in md.storage_data.items() if k.fqn == "y.transposed")
    path = overrun / item.relative_path
    data = bytearray(path.read_bytes())
    stride = b"K\x01M\x80\x02"  # BININT1 1, BININT2 640: the stride tuple (1, 640)
    at = data.index(stride, item.offset, item.offset + 1024)
    data[at:at + len(stride)] = b"K\x01M\x81\x02"
    path.write_bytes(bytes(data))
    upload_tree(client, str(overrun), "predicted/overrun/")
    return {"good": f"s3://{BUCKET}/predicted/good", "corrupt": f"s3://{BUCKET}/predicted/corrupt",
            "corrupt_dir": bad, "overrun": f"s3://{BUCKET}/predicted/overrun"}


def _gets(m: harness.Mounted) -> int:
    """The ranged GETs the daemon made, as it logs once unmounted."""
    deadline = time.monotonic() + 10
    while "unmounted" not in m.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    got = re.findall(r"s3: (\d+) ranged GETs", m.log())
    assert got, m.log()
    return int(got[-1])


def _load_and_count(root: str, index: Path, base: Path, expected: dict) -> int:
    """Mounts `root` over `index`, loads consolidated/ with safetensors and
    numpy, checks every tensor, and returns the GETs the mount made."""
    base.mkdir(parents=True, exist_ok=True)
    with harness.Mounted(root, "--index", str(index), base_dir=str(base)) as m:
        got = load_file(m.p("consolidated", "model.safetensors"))
        assert set(got) == set(expected), sorted(set(got) ^ set(expected))
        for k, t in expected.items():
            assert torch.equal(got[k], t), k
        del got  # its tensors map the file: the mount would stay busy
        for name in ("y.transposed", "layers.00.weight", "tokens", "scale", "x.cube"):
            np.testing.assert_array_equal(np.load(m.p("tensors", name + ".npy")), expected[name].numpy(), name)
    return _gets(m)


def test_a_fresh_mount_reads_each_items_framing_with_its_bytes_exactly(roots, step, s3_env, tmp_path):
    expected = step["expected"]
    fresh = _load_and_count(roots["good"], tmp_path / "fresh-index", tmp_path / "a", expected)
    # An index built ahead read every item's framing itself: the mount over
    # it fetches only what the load needs.
    r = harness.run_ckptfs("index", roots["good"], "--index", str(tmp_path / "built"), "-q")
    assert r.returncode == 0, harness.describe(r)
    built = _load_and_count(roots["good"], tmp_path / "built", tmp_path / "b", expected)
    # 42 items, 36 of them more than 256 KiB apart: a framing GET each, had
    # the fresh mount read them up front. It reads the framing of the first
    # item (the index's check), and of the few items the loader's first
    # requests touch before the source-order fetch starts.
    items = len(expected)
    assert fresh - built < items // 2, (fresh, built, items)
    # The fresh mount's index keeps the predictions, and a second mount over
    # it settles them again as it reads.
    again = _load_and_count(roots["good"], tmp_path / "fresh-index", tmp_path / "c", expected)
    assert again - built < items // 2, (again, built, items)


def test_an_item_whose_framing_is_corrupt_reads_eio_and_the_others_read(roots, step, s3_env, tmp_path):
    expected = step["expected"]
    with harness.Mounted(roots["corrupt"], "--index", str(tmp_path / "index"), base_dir=str(tmp_path)) as m:
        with pytest.raises(OSError) as e:
            np.load(m.p("tensors", "z.last.npy"))
        assert e.value.errno == errno.EIO, e.value
        np.testing.assert_array_equal(np.load(m.p("tensors", "layers.03.weight.npy")),
                                      expected["layers.03.weight"].numpy())
        # Read as a whole, the file fails where that tensor is; nothing of it
        # is served as bytes.
        with pytest.raises(OSError) as e:
            with open(m.p("consolidated", "model.safetensors"), "rb") as f:
                while f.read(1 << 20):
                    pass
        assert e.value.errno == errno.EIO, e.value
        assert "FlootStorage" in m.log() or "not a torch" in m.log() or "tensors, not 1" in m.log(), m.log()
    # torch's own loader refuses that item too (CheckpointException is a BaseException).
    with pytest.raises(BaseException, match="FlootStorage"):
        dcp.load({"z.last": torch.empty(256, 1024)}, storage_reader=dcp.FileSystemReader(str(roots["corrupt_dir"])),
                 no_dist=True)


def test_an_item_found_elsewhere_whose_strides_overrun_it_reads_eio(roots, step, s3_env, tmp_path):
    """Planned again where its framing says, an item passes the bounds
    checks `ckptfs index` applies (the framing's own: strides within the
    storage it declares; the chunk's: within the item's bytes): strides that
    reach past it are EIO, not its neighbours' bytes."""
    expected = step["expected"]
    with harness.Mounted(roots["overrun"], "--index", str(tmp_path / "index"), base_dir=str(tmp_path)) as m:
        with pytest.raises(OSError) as e:
            np.load(m.p("tensors", "y.transposed.npy"))
        assert e.value.errno == errno.EIO, e.value
        with pytest.raises(OSError) as e:  # read(), not mmap: an EIO under a mapping is SIGBUS
            with open(m.p("consolidated", "model.safetensors"), "rb") as f:
                while f.read(1 << 20):
                    pass
        assert e.value.errno == errno.EIO, e.value
        np.testing.assert_array_equal(np.load(m.p("tensors", "z.last.npy")), expected["z.last"].numpy())
        assert "reaches past the storage" in m.log(), m.log()
    # `ckptfs index` reads every framing up front and says the same.
    r = harness.run_ckptfs("check", roots["overrun"], "--index", str(tmp_path / "built"))
    assert r.returncode != 0 and "reaches past the storage" in r.stdout.decode(), harness.describe(r)


def test_check_and_inspect_over_a_mounts_index_never_trust_a_prediction(roots, step, s3_env, tmp_path):
    """A mount's index holds predictions; `check` and `inspect --stats`
    over it read each item's framing as a read would."""
    for name in ("corrupt", "good"):
        index = tmp_path / f"{name}-index"
        with harness.Mounted(roots[name], "--index", str(index), base_dir=str(tmp_path)):
            pass  # built the index, read nothing
        r = harness.run_ckptfs("check", roots[name], "--index", str(index))
        if name == "corrupt":
            assert r.returncode != 0, harness.describe(r)
            assert "z.last" in r.stdout.decode() and "FlootStorage" in r.stdout.decode(), harness.describe(r)
        else:
            assert r.returncode == 0 and "no problems" in r.stderr, harness.describe(r)
    # The transposed item is found elsewhere than predicted: re-planned, its
    # statistics are torch's.
    r = harness.run_ckptfs("inspect", roots["good"], "y.transposed", "--json", "--index", str(tmp_path / "good-index"),
                           text_stdout=True)
    assert r.returncode == 0, harness.describe(r)
    stats = json.loads(r.stdout)["stats"]
    t = step["expected"]["y.transposed"]
    assert stats["min"] == pytest.approx(float(t.min())) and stats["max"] == pytest.approx(float(t.max()))
    assert stats["mean"] == pytest.approx(float(t.double().mean()), rel=1e-6)
