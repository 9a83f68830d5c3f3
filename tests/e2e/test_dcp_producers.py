"""Every DCP producer, read exactly through `consolidated/` on disk and
through `ckptfs mount s3://...`: one state saved by dcp.save from one
process, by FSDP2 on 4 gloo ranks, split on dim 1, zstd-compressed, by
ckptfs's own StorageWriter, and by s3torchconnector's S3StorageWriter
straight into the bucket (producers_gen.py). The s3torchconnector step is
downloaded with boto3 for the disk side; the others are uploaded with boto3
for the S3 side. Expected values are the tensors the state was made from,
and torch's own `dcp.load` of each step must give them too.

~60 s on 2 cores (a SeaweedFS server, 4 gloo ranks saving five steps).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import producers_gen
import s3_server as s3
from s3_server import BUCKET, upload_tree

STEPS = ("single", *producers_gen.RANKED)
PREFIX = "producers"


@pytest.fixture(scope="module")
def producers(s3_server, tmp_path_factory):
    """{"base": local root holding every step, "expected": {step: tensors},
    "s3tc_keys": the keys S3StorageWriter wrote}; the bucket's producers/
    holds every step too."""
    base = tmp_path_factory.mktemp("producers") / "run"
    base.mkdir()
    env = {"AWS_ACCESS_KEY_ID": s3.ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": s3.SECRET_KEY,
           "AWS_ENDPOINT_URL": s3_server["endpoint"], "AWS_REGION": "us-east-1"}
    expected = producers_gen.write_all(str(base), f"s3://{BUCKET}/{PREFIX}", env=env)
    client = s3_server["client"]
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=f"{PREFIX}/s3tc/")["Contents"]]
    for key in keys:
        local = base / key.removeprefix(f"{PREFIX}/")
        local.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(BUCKET, key, str(local))
    for step in STEPS:
        if step != "s3tc":
            upload_tree(client, str(base / step), f"{PREFIX}/{step}/")
    return {"base": base, "expected": expected, "s3tc_keys": sorted(keys)}


def test_s3torchconnector_writes_metadata_and_an_object_per_rank_and_thread(producers):
    names = [k.rpartition("/")[2] for k in producers["s3tc_keys"]]
    assert ".metadata" in names, names
    shards = sorted(n for n in names if n.endswith(".distcp"))
    assert shards == sorted(f"__{r}_{t}.distcp" for r in range(producers_gen.WORLD)
                            for t in range(producers_gen.S3TC_THREADS)), names


@pytest.mark.parametrize("step", STEPS)
def test_torchs_dcp_load_gives_the_saved_tensors(producers, step):
    import torch.distributed.checkpoint as dcp

    want = producers["expected"][step]
    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(producers["base"] / step)))
    for k, v in want.items():
        assert torch.equal(out["model"][k], v), (step, k)


def _mismatches(mount_root: str, expected: dict) -> dict:
    """{step: what differs} for every step whose consolidated/ is not
    exactly its tensors (read by safetensors)."""
    bad = {}
    for step in STEPS:
        folder = os.path.join(mount_root, step, "consolidated")
        try:
            files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
            got = {}
            for name in files:
                with safe_open(os.path.join(folder, name), framework="pt") as f:
                    got.update({k: f.get_tensor(k) for k in f.keys()})
        except OSError as e:
            bad[step] = repr(e)
            continue
        want = expected[step]
        if set(got) != set(want):
            bad[step] = f"names {sorted(got)} != {sorted(want)}"
            continue
        diff = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
        if diff:
            bad[step] = f"values differ: {diff}"
    return bad


def test_every_step_reads_exactly_through_consolidated_on_disk(producers, mount_factory):
    with mount_factory(str(producers["base"])) as m:
        bad = _mismatches(m.path, producers["expected"])
        log = m.log()
    assert not bad, (bad, log[-3000:])


def test_every_step_reads_exactly_through_consolidated_over_s3(producers, s3_env, mount_factory):
    with mount_factory(f"s3://{BUCKET}/{PREFIX}") as m:
        bad = _mismatches(m.path, producers["expected"])
        log = m.log()
    assert not bad, (bad, log[-3000:])


def test_s3torchconnector_reader_agrees_over_the_bucket(producers, s3_env, monkeypatch):
    """The s3tc step as s3torchconnector's own reader loads it from the
    bucket: the saved tensors, so the disk copy above is that step."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector import S3ClientConfig
    from s3torchconnector.dcp import S3StorageReader

    monkeypatch.setenv("AWS_REGION", "us-east-1")
    want = producers["expected"]["s3tc"]
    out = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(out, storage_reader=S3StorageReader("us-east-1", f"s3://{BUCKET}/{PREFIX}/s3tc",
                                                 s3client_config=S3ClientConfig(force_path_style=True)))
    for k, v in want.items():
        assert torch.equal(out["model"][k], v), k
