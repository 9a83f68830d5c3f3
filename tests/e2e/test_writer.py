"""ckptfs.torch.StorageWriter end to end, real torch on 2 gloo ranks (CPU).

The saved state (tests/e2e/writer_gen.py): an FSDP2 model and its AdamW
state after one step, TP DTensors sharded unevenly on dim 0 and dim 1
(bf16, f32, int64, int32; one with an empty shard), a replicated DTensor,
a plain tensor and non-tensor items. Oracles are torch's own: the full
values gathered before the save (``full_tensor()``), stock ``dcp.load``
with FileSystemReader, Python's zipfile, and a CRC32C written in the test.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import time
import zipfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import writer_util
from harness import spawn_ranks

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module", params=["sync", "async", "async-snapshot"])
def saved(request, tmp_path_factory) -> dict:
    """A checkpoint saved with dcp.save or dcp.async_save, its oracle and rows."""
    base = tmp_path_factory.mktemp(f"writer_{request.param}")
    job = {"kind": "save", "seed": 3, "mode": request.param, "dir": str(base / "step_3"),
           "oracle": str(base / "oracle.pt"), "rows": str(base / "rows.json")}
    spawn_ranks(GEN, 2, job, name=f"writer save ({request.param})")
    with open(job["rows"]) as f:
        rows = json.load(f)
    return {**job, "root": str(base), "rows": rows, "oracle_path": job["oracle"],
            "oracle": torch.load(job["oracle"], weights_only=False)}


def _item_files(directory: str) -> dict[tuple, str]:
    """(fqn, chunk offsets) -> the .distcp file holding the item, from torch's .metadata."""
    md = dcp.FileSystemReader(directory).read_metadata()
    return {(k.fqn, tuple(k.offset) if k.offset is not None else None): v.relative_path
            for k, v in md.storage_data.items()}


def test_files_are_standard_dcp(saved):
    # One file per I/O thread (io_threads=2), named as torch's
    # FileSystemWriter(thread_count=2) names them; torch's .metadata
    # places items in every one of them and in no other.
    files = set(_item_files(saved["dir"]).values())
    assert files == {f"__{r}_{k}.distcp" for r in range(2) for k in range(2)}, files
    assert sorted(os.listdir(saved["dir"])) == sorted([".ckptfs", ".metadata", *files])
    assert os.listdir(os.path.join(saved["dir"], ".ckptfs")) == ["commit.sst"]


def test_stock_load_into_a_new_layout_equals_the_saved_state(saved, tmp_path):
    out = str(tmp_path / "loaded.pt")
    spawn_ranks(GEN, 2, {"kind": "load", "dir": saved["dir"], "oracle": saved["oracle_path"], "out": out},
                name="stock load")
    loaded = torch.load(out, weights_only=False)
    assert loaded.keys() == saved["oracle"].keys()
    bad = [k for k, v in saved["oracle"].items() if not _equal(v, loaded[k])]
    assert not bad, f"differ after dcp.load into a new layout: {bad}"


def test_stock_load_in_one_process_equals_the_saved_state(saved):
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
              for k, v in saved["oracle"].items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(saved["dir"]), no_dist=True)
    bad = [k for k, v in saved["oracle"].items() if not _equal(v, target[k])]
    assert not bad, bad


def test_state_covers_fsdp2_adamw_tp_and_non_tensors(saved):
    o = saved["oracle"]
    assert o["model.0.weight"].shape == (7, 6)                     # FSDP2: 7 rows over 2 ranks
    assert o["optim.state.0.weight.exp_avg"].shape == (7, 6)       # AdamW state
    assert o["tp.row_bf16"].dtype == torch.bfloat16 and o["tp.col_i32"].dtype == torch.int32
    assert o["tp.col_f32"].shape == (4, 9)                         # Shard(1), 9 cols: uneven
    assert o["step"] == 103 and o["meta.name"] == "run-3"


def test_rows_point_at_the_saved_bytes_with_their_crc32c(saved):
    rows, oracle = saved["rows"], saved["oracle"]
    fqns = {t["fqn"] for t in rows["tensors"]}
    assert fqns == {k for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    for t in rows["tensors"]:
        full = oracle[t["fqn"]]
        assert t["shape"] == list(full.shape), t["fqn"]
        covered = 0
        for c in t["chunks"]:
            box = tuple(slice(o, o + s) for o, s in zip(c["offsets"], c["sizes"]))
            want = full[box].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            got = writer_util.chunk_bytes(saved["root"], c)
            assert got == want, f"{t['fqn']} chunk {c['offsets']}: bytes differ"
            assert c["crc32c"] == writer_util.crc32c(got), f"{t['fqn']} chunk {c['offsets']}: crc32c"
            covered += int(np.prod(c["sizes"])) if c["sizes"] else 1
        assert covered == full.numel(), t["fqn"]  # no replica counted twice
    assert set(rows["bytes"]) == {k for k, v in oracle.items() if not isinstance(v, torch.Tensor)}
    for key, (file, off, length) in rows["bytes"].items():
        with open(os.path.join(saved["root"], file), "rb") as f:
            f.seek(off)
            assert torch.load(io.BytesIO(f.read(length)), weights_only=False) == oracle[key], key


def test_tensor_items_are_zips_with_correct_crcs(saved):
    with open(os.path.join(saved["dir"], ".metadata"), "rb") as f:
        md = pickle.load(f)
    n = 0
    for idx, info in md.storage_data.items():
        with open(os.path.join(saved["dir"], info.relative_path), "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        if not isinstance(md.state_dict_metadata[idx.fqn], TensorStorageMetadata):
            continue  # a BYTE_IO item: torch.save's own bytes, stored as given
        z = zipfile.ZipFile(io.BytesIO(blob))
        assert z.testzip() is None, idx  # every entry's zip CRC-32 is right
        assert "archive/data.pkl" in z.namelist() and "archive/data/0" in z.namelist()
        n += 1
    assert n >= 20


def test_bit_rot_changes_exactly_the_flipped_chunk(saved, tmp_path):
    root = str(tmp_path / "copy")
    shutil.copytree(saved["root"], root)
    rows = saved["rows"]
    fqn, chunk = "tp.col_f32", None
    chunk = next(c for t in rows["tensors"] if t["fqn"] == fqn for c in t["chunks"] if c["length"] > 0)
    victim = chunk["offset"] + chunk["length"] // 2
    with open(os.path.join(root, chunk["file"]), "r+b") as f:
        f.seek(victim)
        b = f.read(1)
        f.seek(victim)
        f.write(bytes([b[0] ^ 0x10]))
    assert writer_util.chunk_at(rows, chunk["file"], victim) == (fqn, chunk)
    bad = [(t["fqn"], c["offsets"]) for t in rows["tensors"] for c in t["chunks"]
           if writer_util.crc32c(writer_util.chunk_bytes(root, c)) != c["crc32c"]]
    assert bad == [(fqn, chunk["offsets"])]


def test_framing_bytes_belong_to_no_chunk(saved):
    rows = saved["rows"]
    c = rows["tensors"][0]["chunks"][0]
    assert writer_util.chunk_at(rows, c["file"], c["offset"] - 1) is None  # data/0's local header


def test_mount_serves_the_saved_tensors(saved):
    import ckptfs
    with ckptfs.mount(saved["dir"]) as m:
        got = np.load(os.path.join(m.path, "tensors", "tp.col_f32.npy"))
        assert np.array_equal(got, saved["oracle"]["tp.col_f32"].numpy())
        got = np.load(os.path.join(m.path, "tensors", "tp.row_bf16.npy"))  # bf16 shows as f32
        assert np.array_equal(got, saved["oracle"]["tp.row_bf16"].float().numpy())
    assert not os.path.ismount(m.path)


def test_ckptfs_index_ingests_the_commit_record(saved, tmp_path):
    from harness import run_ckptfs
    assert os.path.isfile(os.path.join(saved["dir"], ".ckptfs", "commit.sst"))
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", saved["root"], index_dir=idx)
    assert p.returncode == 0, p.stderr
    # The store says when it falls back to scanning the files instead.
    assert "commit.sst not used" not in p.stderr, p.stderr
    p = run_ckptfs("ls", saved["root"], "--json", index_dir=idx, text_stdout=True)
    assert p.returncode == 0, p.stderr
    # (the root also holds the oracle, a torch.save file: checkpoint "")
    listed = {t["name"] for t in json.loads(p.stdout) if t["checkpoint"] == "step_3"}
    assert listed == {t["fqn"] for t in saved["rows"]["tensors"]}


def test_verify_rereads_every_chunk_against_its_crc32c(saved, tmp_path):
    from harness import run_ckptfs
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    with open(os.path.join(saved["dir"], ".metadata"), "rb") as f:
        md = pickle.load(f)
    # torch's own metadata: one storage item per saved tensor chunk
    items = [i for i in md.storage_data if isinstance(md.state_dict_metadata[i.fqn], TensorStorageMetadata)]
    # Every byte the writer wrote into its rank files: tensor data by its
    # chunks' checksums, the rest (zip framing, non-tensor items) by each
    # file's own.
    distcp = [os.path.join(saved["dir"], f) for f in os.listdir(saved["dir"]) if f.endswith(".distcp")]
    nbytes = sum(os.path.getsize(f) for f in distcp)
    p = run_ckptfs("verify", saved["dir"], "--json", index_dir=str(tmp_path / "idx"), text_stdout=True)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["problems"] == []
    assert report["checksummed_chunks"] == len(items), (report, len(items))
    assert report["checksummed_bytes"] == nbytes
    assert report["checksummed_files"] == len(distcp)


def test_a_copy_that_keeps_mtimes_keeps_its_checksums(saved, tmp_path):
    """cp -a / rsync -a keep mtimes, so the commit record stays current and
    the copy is verified against the writer's checksums."""
    copy = tmp_path / "root" / "step_3"
    shutil.copytree(saved["dir"], copy)  # copy2: mtimes kept
    writer_util.assert_verify_checks_every_chunk(str(copy), saved["rows"], str(tmp_path / "idx"))


def test_verify_says_when_a_writers_checksums_do_not_apply(saved, tmp_path):
    """A record older than the step's .metadata describes another save (here:
    a copy that did not keep mtimes, the record copied first): verify must
    say it checked no writer checksum, not pass in silence."""
    from harness import run_ckptfs
    copy = tmp_path / "root" / "step_3"
    os.makedirs(copy / ".ckptfs")
    shutil.copyfile(os.path.join(saved["dir"], ".ckptfs", "commit.sst"), copy / ".ckptfs" / "commit.sst")
    time.sleep(0.05)
    for f in os.listdir(saved["dir"]):
        if os.path.isfile(os.path.join(saved["dir"], f)):
            shutil.copyfile(os.path.join(saved["dir"], f), copy / f)  # new mtimes, after the record's
    p = run_ckptfs("verify", str(copy), "--json", index_dir=str(tmp_path / "idx"), text_stdout=True)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads(p.stdout)
    assert report["problems"] == [] and report["checksummed_chunks"] == 0, report
    assert len(report["warnings"]) == 1 and "older than the save" in report["warnings"][0], report
    assert "none of its checksums checked" in p.stderr, p.stderr
    p = run_ckptfs("verify", saved["dir"], "--json", index_dir=str(tmp_path / "idx2"), text_stdout=True)
    assert json.loads(p.stdout)["warnings"] == [], p.stdout


@pytest.fixture(scope="module")
def rotten(tmp_path_factory) -> dict:
    """A save whose chunk of tp.row_i64 on rank 1 (rows 3..4) has one byte
    flipped on disk before the commit (writer_gen's ``flip``)."""
    base = tmp_path_factory.mktemp("writer_rotten")
    job = {"kind": "save", "seed": 5, "dir": str(base / "step_5"), "oracle": str(base / "oracle.pt"),
           "rows": str(base / "rows.json"), "flip": ["tp.row_i64", [3, 0]]}
    spawn_ranks(GEN, 2, job, name="writer save (flipped byte)")
    return {**job, "root": str(base), "oracle": torch.load(job["oracle"], weights_only=False)}


def test_verify_names_the_flipped_chunk(rotten, tmp_path):
    from harness import run_ckptfs
    p = run_ckptfs("verify", rotten["dir"], "--json", index_dir=str(tmp_path / "idx"), text_stdout=True)
    assert p.returncode != 0, p.stdout
    problems = json.loads(p.stdout)["problems"]
    assert len(problems) == 1, problems
    name = _item_files(rotten["dir"])[("tp.row_i64", (3, 0))]
    assert "tp.row_i64" in problems[0] and name in problems[0] and "CRC32C" in problems[0], problems


def test_verify_checksums_mount_fails_only_the_flipped_chunk(rotten, tmp_path):
    from harness import Mounted
    oracle = rotten["oracle"]
    with Mounted(rotten["dir"], index_dir=str(tmp_path / "plain"), base_dir=str(tmp_path)) as m:
        served = np.load(m.p("tensors", "tp.row_i64.npy"))
    # Without the flag the flipped bytes are served: one element differs,
    # in the rows rank 1 saved.
    diff = np.argwhere(served != oracle["tp.row_i64"].numpy())
    assert len(diff) == 1 and diff[0][0] >= 3, diff
    with Mounted(rotten["dir"], "--verify-checksums", index_dir=str(tmp_path / "verified"),
                 base_dir=str(tmp_path)) as m:
        with pytest.raises(OSError) as err:
            np.load(m.p("tensors", "tp.row_i64.npy"))
        assert err.value.errno == errno.EIO
        assert "tp.row_i64" in m.log() and "CRC32C" in m.log(), m.log()
        # Every other tensor, rank 1's chunks in the same file included, is served.
        files = _item_files(rotten["dir"])
        others = ("tp.row_bf16", "tp.col_f32", "tp.col_i32", "tp.one_row")
        flipped_file = files[("tp.row_i64", (3, 0))]
        assert any(f == flipped_file for (n, _), f in files.items() if n in others), files
        for name in others:
            got = np.load(m.p("tensors", f"{name}.npy"))
            assert np.array_equal(got, oracle[name].float().numpy() if name.endswith("bf16")
                                  else oracle[name].numpy()), name


@pytest.mark.parametrize("io_threads", [1, 3])
def test_one_file_per_io_thread_in_one_process(tmp_path, io_threads):
    """dcp.save(no_dist=True): io_threads files, the items split as
    torch's FileSystemWriter(thread_count) splits them, and stock dcp.load
    reads every tensor back."""
    from ckptfs.torch import StorageWriter
    g = torch.Generator().manual_seed(7)
    sd = {f"w{i}": torch.randn(64 * (i + 1), 33, generator=g) for i in range(5)}
    sd["step"] = 12
    dcp.save(sd, storage_writer=StorageWriter(tmp_path / "s", io_threads=io_threads, buffer_bytes=4096),
             no_dist=True)
    files = sorted(set(_item_files(str(tmp_path / "s")).values()))
    assert files == [f"__0_{k}.distcp" for k in range(io_threads)], files
    # The split is torch's: every item lands in the file torch's own writer puts it in.
    ref = str(tmp_path / "ref")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(ref, thread_count=io_threads), no_dist=True)
    ours, theirs = _item_files(str(tmp_path / "s")), _item_files(ref)
    assert ours == theirs, (ours, theirs)
    target = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / "s")), no_dist=True)
    assert all(_equal(sd[k], target[k]) for k in sd), target


def test_bad_ring_or_thread_counts_are_refused(tmp_path):
    from ckptfs.torch import StorageWriter
    with pytest.raises(ValueError, match="io_threads"):
        StorageWriter(tmp_path, io_threads=0)
    with pytest.raises(ValueError, match="buffers"):
        StorageWriter(tmp_path, buffers=0)
