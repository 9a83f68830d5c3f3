"""ckptfs.torch.StorageWriter(layout="hf") end to end, real torch on 2 gloo
ranks (CPU).

The saved state (tests/e2e/writer_hf_gen.py): an FSDP2 model (f32 and bf16
layers, 7 rows over 2 ranks), TP DTensors sharded unevenly on dim 0 and
dim 1 (bf16, f32, int64; one with an empty shard), a replicated DTensor
and a plain tensor. Oracles are independent of ckptfs: the full values
gathered before the save (``full_tensor()``), the files torch's own
HuggingFaceStorageWriter writes for the same state, stock ``dcp.load`` with
HuggingFaceStorageReader, ``safetensors.safe_open`` and a CRC32C written in
the test.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

import writer_util
from ckptfs import _writer
from harness import Mounted, run_ckptfs, spawn_ranks

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_hf_gen.py")
SHARDS = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float8_e8m0fnu, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
          torch.float4_e2m1fn_x2, torch.complex64]


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _header(path: str) -> tuple[int, dict, bytes]:
    """(header length, parsed header, data bytes) of a safetensors file, by the format's definition."""
    with open(path, "rb") as f:
        blob = f.read()
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n]), blob[8 + n:]


@pytest.fixture(scope="module", params=["sync", "async"])
def saved(request, tmp_path_factory) -> dict:
    """The state saved by ckptfs (dcp.save or dcp.async_save) and by torch's
    HF writer, its oracle and the commit rows."""
    base = tmp_path_factory.mktemp(f"writer_hf_{request.param}")
    job = {"kind": "save", "seed": 5, "mode": request.param, "dir": str(base / "step_5"),
           "torch_dir": str(base.parent / f"torch_hf_{request.param}"), "oracle": str(base.parent / f"oracle_{request.param}.pt"),
           "rows": str(base.parent / f"rows_{request.param}.json")}
    spawn_ranks(GEN, 2, job, name=f"hf writer save ({request.param})")
    with open(job["rows"]) as f:
        rows = json.load(f)
    return {**job, "root": str(base), "rows": rows, "oracle_path": job["oracle"],
            "oracle": torch.load(job["oracle"], weights_only=True)}


def test_files_are_torchs_sharded_safetensors(saved):
    assert sorted(os.listdir(saved["dir"])) == [".ckptfs", *SHARDS]
    assert os.listdir(os.path.join(saved["dir"], ".ckptfs")) == ["commit.sst"]
    assert sorted(os.listdir(saved["torch_dir"])) == SHARDS  # torch's writer names them alike
    assert saved["rows"]["format"] == "sharded-safetensors"


def test_state_covers_fsdp2_uneven_bf16_and_f32(saved):
    o = saved["oracle"]
    assert o["model.0.weight"].shape == (7, 6) and o["model.0.weight"].dtype == torch.float32  # FSDP2: 4 + 3 rows
    assert o["model.2.weight"].dtype == torch.bfloat16
    assert o["tp.row_bf16"].shape == (7, 5) and o["tp.col_f32"].shape == (4, 9)
    _, h, _ = _header(os.path.join(saved["dir"], SHARDS[1]))
    assert h["tp.row_bf16"]["shape"] == [3, 5] and h["tp.one_row"]["shape"] == [0, 4]


@pytest.mark.parametrize("shard", SHARDS)
def test_headers_and_data_match_torchs_writer(saved, shard):
    n, ours, data = _header(os.path.join(saved["dir"], shard))
    tn, theirs, tdata = _header(os.path.join(saved["torch_dir"], shard))
    # __metadata__'s keys come from a hash map in safetensors (any order),
    # and torch orders DCP_SHARDING_INFO's by size where CUDA is available:
    # the values must agree; the entries, offsets and data bytes exactly.
    meta, tmeta = ours.pop("__metadata__"), theirs.pop("__metadata__")
    info, tinfo = json.loads(meta.pop("DCP_SHARDING_INFO")), json.loads(tmeta.pop("DCP_SHARDING_INFO"))
    assert info == tinfo and meta == tmeta
    assert list(ours.items()) == list(theirs.items())  # entries, in file order, with their offsets
    assert n == tn
    assert data == tdata


def test_safe_open_reads_every_file(saved):
    oracle, seen = saved["oracle"], {}
    for shard in SHARDS:
        with safe_open(os.path.join(saved["dir"], shard), framework="pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            for key in f.keys():
                t = f.get_tensor(key)
                box = tuple(slice(o, o + s) for o, s in zip(info[key]["saved_offsets"], t.shape))
                assert _equal(t, oracle[key][box].contiguous()), (shard, key)
                seen[key] = seen.get(key, 0) + t.numel()
    assert seen == {k: v.numel() for k, v in oracle.items()}  # every element once


def test_stock_hf_load_into_a_new_layout_equals_the_saved_state(saved, tmp_path):
    out = str(tmp_path / "loaded.pt")
    spawn_ranks(GEN, 2, {"kind": "load", "dir": saved["dir"], "oracle": saved["oracle_path"], "out": out},
                name="stock HF load")
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == saved["oracle"].keys()
    bad = [k for k, v in saved["oracle"].items() if not _equal(v, loaded[k])]
    assert not bad, f"differ after dcp.load into a new layout: {bad}"


def test_stock_hf_load_in_one_process_equals_the_saved_state(saved):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    target = {k: torch.zeros_like(v) for k, v in saved["oracle"].items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(saved["dir"]), no_dist=True)
    bad = [k for k, v in saved["oracle"].items() if not _equal(v, target[k])]
    assert not bad, bad


def test_rows_point_at_the_saved_bytes_with_their_crc32c(saved):
    rows, oracle = saved["rows"], saved["oracle"]
    assert {t["fqn"] for t in rows["tensors"]} == set(oracle)
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
        assert covered == full.numel(), t["fqn"]
    assert rows["bytes"] == {}


def test_ckptfs_index_ingests_the_commit_record(saved, tmp_path):
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", saved["root"], index_dir=idx)
    assert p.returncode == 0, p.stderr
    assert "commit.sst not used" not in p.stderr, p.stderr
    p = run_ckptfs("ls", saved["root"], "--json", index_dir=idx, text_stdout=True)
    assert p.returncode == 0, p.stderr
    listed = {t["name"] for t in json.loads(p.stdout) if t["checkpoint"] == "step_5"}
    assert listed == set(saved["oracle"])


def _verify(path: str, index_dir: str) -> tuple[int, dict]:
    p = run_ckptfs("verify", path, "--json", index_dir=index_dir, text_stdout=True)
    return p.returncode, json.loads(p.stdout)


def test_verify_passes_then_names_a_flipped_chunk(saved, tmp_path):
    rows = saved["rows"]
    nchunks = sum(len(t["chunks"]) for t in rows["tensors"])
    rc, report = _verify(saved["dir"], str(tmp_path / "idx"))
    assert rc == 0 and report["problems"] == [], report
    assert report["checksummed_chunks"] == nchunks
    root = str(tmp_path / "copy")
    shutil.copytree(saved["root"], root)
    fqn = "tp.row_bf16"
    chunk = next(c for t in rows["tensors"] if t["fqn"] == fqn for c in t["chunks"] if c["offsets"][0] > 0)
    victim = chunk["offset"] + chunk["length"] // 2
    with open(os.path.join(root, chunk["file"]), "r+b") as f:
        f.seek(victim)
        b = f.read(1)
        f.seek(victim)
        f.write(bytes([b[0] ^ 0x10]))
    # Bit rot leaves a file's identity (size, mtime, ctime, inode) alone; a
    # write does not. So the record is made again for the files as they are
    # now, carrying the CRC32Cs the writer computed before the flip.
    dtype = {k: str(v.dtype).removeprefix("torch.") for k, v in saved["oracle"].items()}
    tensors = [(t["fqn"], [], dtype[t["fqn"]], t["shape"]) for t in rows["tensors"]]
    chunks = [(t["fqn"], c["offsets"], c["sizes"], c["file"].split("/", 1)[1], c["offset"], c["length"], c["crc32c"])
              for t in rows["tensors"] for c in t["chunks"]]
    _writer.commit(root, "step_5", tensors, chunks, [], format="sharded-safetensors")
    rc, report = _verify(os.path.join(root, "step_5"), str(tmp_path / "idx2"))
    assert rc != 0 and len(report["problems"]) == 1, report
    problem = report["problems"][0]
    assert fqn in problem and str(chunk["offset"]) in problem and "CRC32C" in problem, problem


def test_until_rank_1_is_published_the_directory_reads_as_incomplete(saved, tmp_path, monkeypatch):
    """The coordinator renames each rank's NAME.tmp into place, rank 1's
    last: every state before that is one `ckptfs check` refuses (ranks
    missing), never a smaller checkpoint that looks complete."""
    import types

    import ckptfs.torch as ct
    root = tmp_path / "copy"
    shutil.copytree(saved["root"], root)
    step = root / "step_5"
    shutil.rmtree(step / ".ckptfs")
    for name in SHARDS:
        os.rename(step / name, step / (name + ".tmp"))
    states = []

    def replace(src, dst):
        os.rename(src, dst)
        p = run_ckptfs("check", root, index_dir=str(tmp_path / f"idx{len(states)}"))
        states.append((os.path.basename(dst), p.returncode, p.stdout + p.stderr.encode()))

    monkeypatch.setattr(ct.os, "replace", replace)
    results = [[types.SimpleNamespace(storage_data=types.SimpleNamespace(relative_path=n))] for n in SHARDS]
    ct.StorageWriter(step, layout="hf")._publish_shards(results)
    assert [s[0] for s in states] == SHARDS[::-1]
    assert states[0][1] != 0 and b"ranks found: 2" in states[0][2], states[0]
    assert states[1][1] == 0, states[1]


def test_a_resave_unpublishes_rank_1_first(saved, tmp_path, monkeypatch):
    """A save into a step whose earlier save has no commit record removes
    that save's shards rank 1's first (the reverse of publishing): a crash
    between two removals leaves a step `ckptfs check` refuses, never rank
    1's shard beside a partial set (a crash test once found one)."""
    import ckptfs.torch as ct
    root = tmp_path / "copy"
    shutil.copytree(saved["root"], root)
    step = root / "step_5"
    shutil.rmtree(step / ".ckptfs")
    states = []
    real_remove = ct._remove

    def remove(path):
        removed = real_remove(path)
        if path.name in SHARDS:
            p = run_ckptfs("check", root, index_dir=str(tmp_path / f"idx{len(states)}"))
            states.append((path.name, p.returncode, p.stdout + p.stderr.encode()))
        return removed

    monkeypatch.setattr(ct, "_remove", remove)
    ct.StorageWriter(step, layout="hf")._uncommit()
    assert [s[0] for s in states] == SHARDS, states
    for name, rc, out in states[:-1]:  # the last leaves no shard: nothing to read
        assert rc != 0 and b"ranks found" in out, (name, out)


def test_a_resave_by_fewer_ranks_leaves_no_shard_of_the_old_save(tmp_path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    step = str(tmp_path / "step_1")
    spawn_ranks(GEN, 2, {"kind": "save", "seed": 3, "dir": step, "oracle": str(tmp_path / "o3.pt")}, name="save by 2")
    assert sorted(os.listdir(step)) == [".ckptfs", *SHARDS]
    spawn_ranks(GEN, 1, {"kind": "save", "seed": 4, "dir": step, "oracle": str(tmp_path / "o4.pt")}, name="save by 1")
    assert sorted(os.listdir(step)) == [".ckptfs", SHARDS[0]]
    oracle = torch.load(str(tmp_path / "o4.pt"), weights_only=True)
    target = {k: torch.zeros_like(v) for k, v in oracle.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(step), no_dist=True)
    bad = [k for k, v in oracle.items() if not _equal(v, target[k])]
    assert not bad, bad


def test_non_tensor_items_are_refused_before_anything_is_written(tmp_path):
    job = {"kind": "non_tensor", "seed": 1, "dir": str(tmp_path / "step_1"), "out": str(tmp_path / "error.txt")}
    spawn_ranks(GEN, 2, job, name="hf writer non-tensor")
    with open(job["out"]) as f:
        error = f.read()
    assert "'step' is not a tensor" in error and "layout='dcp'" in error, error
    assert not os.path.exists(job["dir"]) or os.listdir(job["dir"]) == []


def _wait_listable(path: str, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return sorted(os.listdir(path))
        except OSError:
            assert time.monotonic() < deadline, f"{path} not listable after {timeout:g} s"
            time.sleep(0.1)


def test_live_mount_serves_consolidated_tensors_after_the_save(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    job = {"kind": "save", "seed": 9, "dir": str(root / "step_9"), "oracle": str(tmp_path / "oracle.pt")}
    with Mounted(root, base_dir=str(tmp_path), index_dir=str(tmp_path / "idx")) as m:
        spawn_ranks(GEN, 2, job, name="hf writer save under a live mount")
        oracle = torch.load(job["oracle"], weights_only=True)
        files = _wait_listable(m.p("step_9", "consolidated"))
        got = {}
        for name in files:
            if name.endswith(".safetensors"):
                with safe_open(m.p("step_9", "consolidated", name), framework="pt") as f:
                    got.update({k: f.get_tensor(k) for k in f.keys()})
        assert got.keys() == oracle.keys(), (files, m.log())
        bad = [k for k, v in oracle.items() if not _equal(v, got[k])]
        assert not bad, bad
        served = [line for line in m.log().splitlines() if "step_9/: " in line and "indexed" in line]
        assert served and f"indexed ({len(oracle)} tensors) and served" in served[0], m.log()
        del got  # it maps the mount's files: held, the unmount would find it busy


def _random(dtype: torch.dtype, shape: tuple, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def test_a_file_of_every_dtype_is_byte_for_byte_safetensors_own(tmp_path):
    """Every dtype, two tensors of each (names out of order), a 0-d and an
    empty one, through a ring smaller than most tensors: the file is what
    safetensors.torch.save writes (one metadata key, so no order to differ)."""
    tensors = {}
    for i, dt in enumerate(DTYPES):
        tensors[f"z{i}.{dt}"] = _random(dt, (3, 5) if i % 2 else (17,), i)
        tensors[f"a{i}.{dt}"] = _random(dt, (2, 3, 4), 100 + i)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    stager = _writer.Stager(buffer_bytes=64, buffers=2, io_threads=2, zip_crc32=False)
    f = _writer.SafetensorsFile(stager, str(tmp_path / "x.safetensors"))
    ids = {k: f.add_tensor(k, str(t.dtype).removeprefix("torch."), list(t.shape), t.nbytes) for k, t in tensors.items()}
    f.seal({"DCP_VERSION": "1.0"})
    for k, t in tensors.items():
        if t.nbytes:
            f.write(ids[k], t.data_ptr(), t.nbytes, -1, 0, False)
    results = f.finish()
    data = (tmp_path / "x.safetensors").read_bytes()
    assert data == safetensors_save(tensors, metadata={"DCP_VERSION": "1.0"})
    for (k, t), (off, length, crc) in zip(tensors.items(), results):
        assert data[off:off + length] == t.reshape(-1).view(torch.uint8).numpy().tobytes(), k
        assert crc == writer_util.crc32c(data[off:off + length]), k


def test_the_file_writer_refuses_what_safetensors_cannot_hold(tmp_path):
    stager = _writer.Stager(buffer_bytes=4096, use_cuda=False)
    f = _writer.SafetensorsFile(stager, str(tmp_path / "x.safetensors"))
    f.add_tensor("w", "float32", [2, 3], 24)
    with pytest.raises(ValueError, match="'w' twice"):
        f.add_tensor("w", "float32", [2, 3], 24)
    with pytest.raises(ValueError, match="do not hold 6 elements"):
        f.add_tensor("v", "float32", [2, 3], 23)
    with pytest.raises(TypeError, match="no dtype for torch.complex128"):
        f.add_tensor("u", "complex128", [2], 32)


def _consolidated(mnt_dir: str) -> dict:
    """Every tensor of a consolidated/ folder, read with read(2), not a
    mapping: a step being saved again reads as EIO, which under a mapping
    would be SIGBUS."""
    from safetensors.torch import load
    got = {}
    for name in os.listdir(mnt_dir):
        if name.endswith(".safetensors"):
            with open(os.path.join(mnt_dir, name), "rb") as f:
                got.update(load(f.read()))
    return got


def test_a_resave_under_a_live_mount_is_served_anew(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    first = {"kind": "save", "seed": 11, "dir": str(root / "step_1"), "oracle": str(tmp_path / "first.pt")}
    second = {**first, "seed": 12, "oracle": str(tmp_path / "second.pt")}
    with Mounted(root, base_dir=str(tmp_path), index_dir=str(tmp_path / "idx")) as m:
        spawn_ranks(GEN, 2, first, name="hf writer first save under a live mount")
        _wait_listable(m.p("step_1", "consolidated"))
        old = torch.load(first["oracle"], weights_only=True)
        got = _consolidated(m.p("step_1", "consolidated"))
        assert not [k for k, v in old.items() if not _equal(v, got[k])]
        spawn_ranks(GEN, 2, second, name="hf writer re-save under a live mount")
        new = torch.load(second["oracle"], weights_only=True)
        assert any(not _equal(old[k], new[k]) for k in new)  # the seeds give other values
        deadline = time.monotonic() + 15
        while True:  # EIO or the old step until the re-save is indexed; never a mix
            try:
                got = _consolidated(m.p("step_1", "consolidated"))
            except OSError:
                got = None
            if got is not None and all(_equal(v, got[k]) for k, v in new.items()):
                break
            if got is not None:
                assert all(_equal(v, got[k]) for k, v in old.items()), "a mix of two saves was served"
            assert time.monotonic() < deadline, m.log()
            time.sleep(0.2)
        # The live root takes one of two paths, by when its refresh looks:
        # it finds the served files changed and, once the re-save is
        # complete, replaces the step ("changed; indexed again"); or it
        # finds the commit record gone mid-save (the step's commit point is
        # no longer the one it served), drops the step and indexes the
        # directory anew on the same pass (fs/live_root.cc, Refresh). Either
        # way the step is indexed a second time.
        log = m.log()
        replaced = "step_1/: changed; indexed again" in log
        dropped = "step_1/: gone; no longer served (its commit point changed" in log
        assert replaced or (dropped and log.count("step_1/: indexed (") >= 2), log
