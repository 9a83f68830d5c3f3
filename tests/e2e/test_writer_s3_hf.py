"""ckptfs.torch.StorageWriter("s3://...", layout="hf") end to end: 2 gloo
ranks (CPU) save writer_hf_gen's state (FSDP2 f32 + bf16, uneven TP
DTensors on dim 0 and 1, an empty shard, a replicated DTensor, a plain
tensor) with dcp.save and dcp.async_save into a real SeaweedFS, and torch's
own HuggingFaceStorageWriter saves the same state to disk. Oracles are
independent of ckptfs: the full values gathered before the save, torch's
files, boto3 (objects, open multipart uploads, bytes), stock dcp.load with
HuggingFaceStorageReader over the downloaded shards, safetensors'
safe_open and a CRC32C written in the test.

Through the fault proxy (tools/s3_fault_proxy.py): a fault that never clears on
the uploads of rank 2's shard, on the completion of rank 1's shard (the
coordinator has completed rank 2's by then) and on the commit record's PUT
each fail the save on both ranks and leave no shard, no record and no open
multipart upload, and an earlier step under the prefix as it was; a live
mount never serves the step while a shard is missing. A re-save by fewer
ranks leaves no shard of the earlier save.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time

import pytest
import torch
from safetensors import safe_open

import writer_util
from harness import spawn_ranks
from s3_server import ACCESS_KEY, BUCKET, SECRET_KEY

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_hf_gen.py")
SHARDS = ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
RECORD = ".ckptfs/commit.sst"


def aws_env(port: int) -> dict:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_REGION": "us-east-1"}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _keys(boto, prefix: str) -> dict[str, str]:
    listed = boto.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: o["ETag"] for o in listed}


def _open_uploads(boto, prefix: str) -> list:
    return boto.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])


def _get(boto, key: str) -> bytes:
    return boto.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _header(blob: bytes) -> tuple[int, dict, bytes]:
    """(header length, parsed header, data bytes) of a safetensors file, by the format's definition."""
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n]), blob[8 + n:]


def _save(port: int, url: str, tmp, seed: int, name: str, **kw) -> dict:
    job = {"kind": "save", "seed": seed, "dir": url, "oracle": str(tmp / f"oracle{seed}.pt"), **kw}
    spawn_ranks(GEN, 2, job, name=name, env=aws_env(port), timeout=240)
    return job


@pytest.fixture(scope="module", params=["sync", "async"])
def saved(request, s3_server, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp(f"writer_s3_hf_{request.param}")
    root = f"hf_{request.param}"
    job = _save(s3_server["port"], f"s3://{BUCKET}/{root}/step_5", base, 5, f"s3 hf save ({request.param})",
                mode=request.param, torch_dir=str(base / "torch_hf"), rows=str(base / "rows.json"))
    with open(job["rows"]) as f:
        rows = json.load(f)
    local = base / "downloaded"
    local.mkdir()
    for name in SHARDS:
        (local / name).write_bytes(_get(s3_server["client"], f"{root}/step_5/{name}"))
    return {**job, "root": root, "prefix": f"{root}/step_5/", "rows": rows, "local": str(local),
            "oracle_path": job["oracle"], "oracle": torch.load(job["oracle"], weights_only=True), "server": s3_server}


def test_objects_are_the_shards_and_the_record_and_no_upload_is_left(saved):
    boto = saved["server"]["client"]
    assert set(_keys(boto, saved["prefix"])) == {*SHARDS, RECORD}
    assert _open_uploads(boto, saved["root"] + "/") == []
    assert saved["rows"]["format"] == "sharded-safetensors"


@pytest.mark.parametrize("shard", SHARDS)
def test_each_shard_has_torchs_entries_offsets_and_bytes(saved, shard):
    with open(os.path.join(saved["local"], shard), "rb") as f, open(os.path.join(saved["torch_dir"], shard), "rb") as t:
        (n, ours, data), (tn, theirs, tdata) = _header(f.read()), _header(t.read())
    meta, tmeta = ours.pop("__metadata__"), theirs.pop("__metadata__")
    info, tinfo = json.loads(meta.pop("DCP_SHARDING_INFO")), json.loads(tmeta.pop("DCP_SHARDING_INFO"))
    assert info == tinfo and meta == tmeta
    assert list(ours.items()) == list(theirs.items())
    assert n == tn and data == tdata


def test_stock_hf_reader_loads_the_downloaded_shards_into_a_new_layout(saved, tmp_path):
    out = str(tmp_path / "loaded.pt")
    spawn_ranks(GEN, 2, {"kind": "load", "dir": saved["local"], "oracle": saved["oracle_path"], "out": out},
                name="stock HF load")
    loaded = torch.load(out, weights_only=True)
    assert loaded.keys() == saved["oracle"].keys()
    bad = [k for k, v in saved["oracle"].items() if not _equal(v, loaded[k])]
    assert not bad, bad


def test_rows_point_at_the_uploaded_bytes_with_their_crc32c(saved):
    chunks = 0
    for t in saved["rows"]["tensors"]:
        for c in t["chunks"]:
            with open(os.path.join(saved["local"], c["file"].split("/", 1)[1]), "rb") as f:
                data = f.read()
            assert writer_util.crc32c(data[c["offset"]:c["offset"] + c["length"]]) == c["crc32c"], (t["fqn"], c)
            chunks += 1
    assert chunks > 10


def test_a_mount_serves_consolidated_exactly_and_verify_checks_every_chunk(saved, s3_env, mount_factory, tmp_path):
    with mount_factory(f"s3://{BUCKET}/{saved['root']}", "--verify-checksums") as m:
        folder = m.p("step_5", "consolidated")
        files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
        served = {}
        for f in files:
            with safe_open(os.path.join(folder, f), framework="pt") as st:
                served.update({k: st.get_tensor(k) for k in st.keys()})
        assert served.keys() == saved["oracle"].keys()
        bad = [k for k, v in saved["oracle"].items() if not _equal(v, served[k])]
        assert not bad, bad
        del served  # it maps the mount's files: held, the unmount would find it busy
    writer_util.assert_verify_checks_every_chunk(f"s3://{BUCKET}/{saved['root']}", saved["rows"],
                                                 str(tmp_path / "idx"))


# --- faults ------------------------------------------------------------------


def _assert_nothing_left(boto, root: str, earlier: dict[str, str]) -> None:
    step2 = _keys(boto, f"{root}/step_2/")
    assert step2 == {}, step2  # no shard, no record: nothing a reader takes for a step
    assert _open_uploads(boto, f"{root}/") == [], _open_uploads(boto, f"{root}/")
    assert _keys(boto, f"{root}/step_1/") == earlier  # the earlier step, object for object


def test_a_resave_by_fewer_ranks_leaves_no_shard_of_the_earlier_save(s3_server, tmp_path):
    """Saved by 2 ranks, then again by 1 into the same step: the earlier
    save's shards go before the new one is written (as in a directory), so
    the step is the new save's one shard, which the stock reader loads."""
    boto = s3_server["client"]
    url = f"s3://{BUCKET}/hf_fewer/step_1"
    _save(s3_server["port"], url, tmp_path, 3, "save by 2")
    job = {"kind": "save", "seed": 4, "dir": url, "oracle": str(tmp_path / "oracle4.pt")}
    spawn_ranks(GEN, 1, job, name="save by 1", env=aws_env(s3_server["port"]), timeout=240)
    assert set(_keys(boto, "hf_fewer/step_1/")) == {SHARDS[0], RECORD}
    local = tmp_path / "one"
    local.mkdir()
    (local / SHARDS[0]).write_bytes(_get(boto, f"hf_fewer/step_1/{SHARDS[0]}"))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    oracle = torch.load(job["oracle"], weights_only=True)
    target = {k: torch.zeros_like(v) for k, v in oracle.items()}
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(local)), no_dist=True)
    bad = [k for k, v in oracle.items() if not _equal(v, target[k])]
    assert not bad, bad


def _watch(path: str, boto, prefix: str, stop: threading.Event, seen: list, alone: list) -> None:
    """Until ``stop``: whether ``path`` (a view of the mount) ever exists,
    and whether boto3 ever lists rank 2's shard under ``prefix`` without
    rank 1's (the window in which a mount must not serve the step)."""
    while not stop.is_set():
        if os.path.exists(path):
            seen.append(time.monotonic())
        if set(_keys(boto, prefix)) == {SHARDS[1]}:
            alone.append(time.monotonic())
        stop.wait(0.05)


@pytest.mark.parametrize("where", ["upload", "completion", "record"])
def test_a_fault_that_never_clears_leaves_no_step_and_no_upload(s3_env, mount_factory, tmp_path, where):
    """``upload``: every part of rank 2's shard answered SlowDown (a rank
    fails in write_data); ``completion``: the coordinator's completion of
    rank 1's shard (rank 2's is complete by then: it must be deleted
    again); ``record``: the commit record's PUT (both shards complete).
    A live mount of the prefix watches: until rank 1's shard is completed
    the step is never served (rank 2's shard alone is no step), so with
    the first two faults step_2/consolidated/ never shows."""
    from s3_fault_proxy import FaultProxy
    s3_server = s3_env
    boto = s3_server["client"]
    root = f"hf_never_{where}"
    _save(s3_server["port"], f"s3://{BUCKET}/{root}/step_1", tmp_path, 1, "earlier step")
    earlier = _keys(boto, f"{root}/step_1/")
    assert set(earlier) == {*SHARDS, RECORD}
    target = {"upload": f"{SHARDS[1]}?partNumber=",
              "completion": f"POST /{BUCKET}/{root}/step_2/{SHARDS[0]}?uploadId=",
              "record": f"PUT /{BUCKET}/{root}/step_2/{RECORD} "}[where]
    proxy = FaultProxy(s3_server["port"], seed=21, p_slowdown=0, p_reset=0, p_truncate=0,
                       script={target: ["slowdown"] * 1000})
    t0 = time.monotonic()
    stop, shown, alone = threading.Event(), [], []
    try:
        with mount_factory(f"s3://{BUCKET}/{root}", "--rescan-ms", "100") as m:
            assert os.path.isdir(m.p("step_1", "consolidated"))
            watcher = threading.Thread(target=_watch, args=(m.p("step_2", "consolidated"), boto, f"{root}/step_2/",
                                                            stop, shown, alone))
            watcher.start()
            try:
                with pytest.raises(RuntimeError) as failed:
                    _save(proxy.port, f"s3://{BUCKET}/{root}/step_2", tmp_path, 2, "save that never gets through")
            finally:
                stop.set()
                watcher.join()
        faulted = proxy.counts["slowdown"]
    finally:
        proxy.close()
    assert time.monotonic() - t0 < 200
    if where == "completion":  # rank 2's shard stood alone for the retries' length
        assert alone, "the watch never saw rank 2's shard completed alone"
    if where != "record":  # never a step
        assert shown == [], "step_2 was served with a shard missing"
    assert faulted >= 2, faulted  # the fault was met (and retried)
    message = str(failed.value)
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message, message
    for part in message.split("--- rank ")[1:]:
        assert "SlowDown" in part, part
    _assert_nothing_left(boto, root, earlier)
