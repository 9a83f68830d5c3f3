"""ckptfs.torch.StorageWriter("s3://BUCKET/PREFIX/step_N") end to end: 2
gloo ranks (CPU) save writer_gen's state (FSDP2 + AdamW, uneven TP
DTensors, non-tensor items) with dcp.save and dcp.async_save into a real
SeaweedFS. Oracles are independent of ckptfs: the full values gathered
before the save, stock ``dcp.load`` through s3torchconnector's
``S3StorageReader``, boto3 (what objects exist, open multipart uploads,
the bytes), Python's zipfile and a CRC32C written in the test."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch

import writer_util
from harness import run_ckptfs, spawn_ranks
from s3_server import ACCESS_KEY, BUCKET, SECRET_KEY

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")


def aws_env(endpoint: str) -> dict:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": "us-east-1"}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _keys(boto, prefix: str) -> set[str]:
    listed = boto.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):] for o in listed}


def _open_uploads(boto, prefix: str) -> list:
    return boto.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])


def _get(boto, key: str) -> bytes:
    return boto.get_object(Bucket=BUCKET, Key=key)["Body"].read()


@pytest.fixture(scope="module", params=["sync", "async"])
def saved(request, s3_server, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp(f"writer_s3_{request.param}")
    root = f"ws_{request.param}"
    job = {"kind": "save", "seed": 3, "mode": request.param, "dir": f"s3://{BUCKET}/{root}/step_3",
           "oracle": str(base / "oracle.pt"), "rows": str(base / "rows.json")}
    spawn_ranks(GEN, 2, job, name=f"writer s3 save ({request.param})", env=aws_env(s3_server["endpoint"]),
                timeout=240)
    with open(job["rows"]) as f:
        rows = json.load(f)
    return {**job, "root": root, "prefix": f"{root}/step_3/", "rows": rows, "oracle_path": job["oracle"],
            "oracle": torch.load(job["oracle"], weights_only=False), "server": s3_server}


def test_objects_are_rank_files_metadata_and_record_and_no_upload_is_left(saved):
    boto = saved["server"]["client"]
    assert _keys(boto, saved["prefix"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata", ".ckptfs/commit.sst"}
    assert _open_uploads(boto, saved["root"] + "/") == []
    md = pickle.loads(_get(boto, saved["prefix"] + ".metadata"))
    assert {v.relative_path for v in md.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}


def test_stock_s3_storage_reader_loads_into_a_new_layout(saved, tmp_path):
    out = str(tmp_path / "loaded.pt")
    spawn_ranks(GEN, 2, {"kind": "load", "dir": saved["dir"], "oracle": saved["oracle_path"], "out": out},
                name="s3torchconnector load", env=aws_env(saved["server"]["endpoint"]), timeout=240)
    loaded = torch.load(out, weights_only=False)
    assert loaded.keys() == saved["oracle"].keys()
    bad = [k for k, v in saved["oracle"].items() if not _equal(v, loaded[k])]
    assert not bad, f"differ after dcp.load into a new layout: {bad}"


def test_rows_point_at_the_uploaded_bytes_with_their_crc32c(saved):
    boto = saved["server"]["client"]
    objects = {}
    chunks = 0
    for t in saved["rows"]["tensors"]:
        for c in t["chunks"]:
            key = f"{saved['root']}/{c['file']}"
            data = objects.setdefault(key, _get(boto, key))
            assert writer_util.crc32c(data[c["offset"]:c["offset"] + c["length"]]) == c["crc32c"], (t["fqn"], c)
            chunks += 1
    assert chunks > 10 and len(objects) == 2, (chunks, objects.keys())


def test_tensor_items_are_zips_with_correct_crcs(saved):
    boto = saved["server"]["client"]
    md = pickle.loads(_get(boto, saved["prefix"] + ".metadata"))
    files = {name: _get(boto, saved["prefix"] + name) for name in ("__0_0.distcp", "__1_0.distcp")}
    zips = 0
    for index, info in md.storage_data.items():
        item = files[info.relative_path][info.offset:info.offset + info.length]
        if item[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(item)) as z:
                assert z.testzip() is None, index
            zips += 1
    assert zips > 10


def test_verify_checks_every_chunk_against_the_writers_crc32c(saved, s3_env, tmp_path):
    writer_util.assert_verify_checks_every_chunk(f"s3://{BUCKET}/{saved['root']}", saved["rows"],
                                                 str(tmp_path / "idx"))


def test_verify_names_a_chunk_altered_after_the_save(saved, s3_env, tmp_path):
    """A copy of the step (rank files and .metadata, then the record, as
    the writer orders them), then one byte of a chunk of tp.row_i64 flipped
    in its object with boto3."""
    boto = saved["server"]["client"]
    rot = f"rot_{saved['mode']}/step_3/"
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", ".ckptfs/commit.sst"):
        boto.copy_object(Bucket=BUCKET, Key=rot + name, CopySource={"Bucket": BUCKET, "Key": saved["prefix"] + name})
    fqn, chunk = next((t["fqn"], c) for t in saved["rows"]["tensors"] for c in t["chunks"]
                      if t["fqn"] == "tp.row_i64" and c["length"] > 0)
    name = chunk["file"].split("/", 1)[1]
    data = bytearray(_get(boto, rot + name))
    data[chunk["offset"] + chunk["length"] // 2] ^= 0x10
    boto.put_object(Bucket=BUCKET, Key=rot + name, Body=bytes(data))
    p = run_ckptfs("verify", f"s3://{BUCKET}/rot_{saved['mode']}", "--json", index_dir=str(tmp_path / "idx"),
                   text_stdout=True)
    assert p.returncode != 0, p.stdout
    problems = json.loads(p.stdout)["problems"]
    assert len(problems) == 1 and fqn in problems[0] and name in problems[0] and "CRC32C" in problems[0], problems


def test_a_live_mount_serves_the_step_once_committed(saved, s3_env, mount_factory):
    import numpy as np
    with mount_factory(f"s3://{BUCKET}/{saved['root']}", "--verify-checksums") as m:
        served = np.load(m.p("step_3", "tensors", "tp.col_f32.npy"))
    assert np.array_equal(served, saved["oracle"]["tp.col_f32"].numpy())


def test_one_process_save_across_many_parts_loads_exact(s3_env, monkeypatch):
    """dcp.save(no_dist=True) of items larger than a part, items smaller
    than their framing and empty ones, so that framing lands at part
    boundaries and in parts of many items: parts of 5 MiB, a ring of 2
    (so the uploads must free parts for the producer to go on). Loaded back
    with stock dcp.load through s3torchconnector, and each archive's zip
    CRCs checked by zipfile."""
    import torch.distributed.checkpoint as dcp
    from ckptfs.torch import StorageWriter
    from writer_gen import s3_storage_reader
    g = torch.Generator().manual_seed(1)
    sd = {"big": torch.randn(3_000_000, generator=g), "mid": torch.randn(700, 1000, generator=g).bfloat16(),
          "empty": torch.zeros(0, 5), "lr": 0.5, "name": "x" * 100}
    for i in range(300):
        sd[f"small.{i}"] = torch.randint(-9, 9, (i % 7 + 1,), generator=g)
    writer = StorageWriter(f"s3://{BUCKET}/one/step_1", part_size=5 << 20, buffer_bytes=5 << 20, buffers=2,
                           max_threads=3)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    boto = s3_env["client"]
    assert _keys(boto, "one/step_1/") == {"__0_0.distcp", ".metadata", ".ckptfs/commit.sst"}
    assert _open_uploads(boto, "one/") == []
    size = boto.head_object(Bucket=BUCKET, Key="one/step_1/__0_0.distcp")["ContentLength"]
    assert size > 2 * (5 << 20), size  # 3 parts
    target = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in sd.items()}
    dcp.load(target, storage_reader=s3_storage_reader(f"s3://{BUCKET}/one/step_1"), no_dist=True)
    bad = [k for k, v in sd.items() if not _equal(v, target[k])]
    assert not bad, bad
    md = pickle.loads(_get(boto, "one/step_1/.metadata"))
    data = _get(boto, "one/step_1/__0_0.distcp")
    for index, info in md.storage_data.items():
        item = data[info.offset:info.offset + info.length]
        if item[:4] == b"PK\x03\x04":
            with zipfile.ZipFile(io.BytesIO(item)) as z:
                assert z.testzip() is None, index


MEMORY_CHILD = r"""
import json, sys, torch, torch.distributed.checkpoint as dcp
from ckptfs.torch import StorageWriter

def rss(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) << 10 for l in f if l.startswith(field + ":"))

url, ring = sys.argv[1], int(sys.argv[2])
kw = dict(part_size=ring // 2, buffer_bytes=ring // 2, buffers=2, max_threads=2)
state = {f"w{i}": torch.randn(8 << 20) for i in range(8)}  # 256 MiB
# A small save first: the pooled ring (and the libraries) are in memory.
dcp.save({"x": torch.randn(1 << 20)}, storage_writer=StorageWriter(url + "/warm", **kw), no_dist=True)
base = rss("VmRSS")
dcp.save(state, storage_writer=StorageWriter(url + "/step_1", **kw), no_dist=True)
print(json.dumps({"growth": rss("VmHWM") - base, "state": sum(t.nbytes for t in state.values())}))
"""


def test_a_large_save_keeps_host_memory_within_the_ring(s3_env, tmp_path):
    """256 MiB through a ring of 2 parts of 16 MiB: the writer's peak RSS
    grows by the ring (the small warm-up save touched only part of it) and
    little more: 16 MiB of slack for libcurl's upload buffers (1 MiB per
    connection) and Python's objects, far from one file's 256 MiB (no
    local copy, no whole-file buffer)."""
    import subprocess
    import sys
    ring = 32 << 20
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, f"s3://{BUCKET}/mem", str(ring)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["state"] == 256 << 20
    assert res["growth"] < ring + (16 << 20), res  # a whole-file buffer would be 256 MiB more
    boto = s3_env["client"]
    assert boto.head_object(Bucket=BUCKET, Key="mem/step_1/__0_0.distcp")["ContentLength"] > 256 << 20


def test_a_live_mount_shows_a_step_saved_while_mounted(s3_env, mount_factory, tmp_path):
    """The mount is there first; the 2-rank save lands under it; the step
    is served once committed, read with --verify-checksums (so through the
    writer's record), values equal to the oracle."""
    import time

    import numpy as np
    boto = s3_env["client"]
    boto.put_object(Bucket=BUCKET, Key="wlive/README", Body=b"a training root\n")
    with mount_factory(f"s3://{BUCKET}/wlive", "--rescan-ms", "300", "--verify-checksums") as m:
        assert not os.path.exists(m.p("step_4"))
        job = {"kind": "save", "seed": 4, "dir": f"s3://{BUCKET}/wlive/step_4", "oracle": str(tmp_path / "o.pt")}
        spawn_ranks(GEN, 2, job, name="writer s3 save (live)", env=aws_env(s3_env["endpoint"]), timeout=240)
        deadline = time.monotonic() + 30
        path = m.p("step_4", "tensors", "tp.row_i64.npy")
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        oracle = torch.load(job["oracle"], weights_only=False)
        assert np.array_equal(np.load(path), oracle["tp.row_i64"].numpy()), m.log()[-2000:]
        assert np.array_equal(np.load(m.p("step_4", "tensors", "tp.col_f32.npy")), oracle["tp.col_f32"].numpy())
