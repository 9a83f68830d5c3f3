"""Which files of a step ckptfs's writer takes for a save's: torch's whole
names only, on disk and in object storage, and never the files of a save
of the other layout.

- A save (either layout) into a step that holds a user's objects whose
  names merely end like a rank file (``backup-shard-00001-model-00001-of-
  00001.safetensors``, ``notes__0_0.distcp``), and open multipart uploads
  of such names: after the save every one of them is there, byte for
  byte (boto3), and the uploads still open.
- A save into a step that holds a save of the other layout is refused
  before anything is removed or written: the old save's files are as they
  were, and stock ``dcp.load`` still reads its values.

Real torch (one process, ``no_dist``), a real SeaweedFS, boto3 as the
oracle of what the bucket holds."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.api import CheckpointException

from s3_server import BUCKET

# Names that end like a rank file of either layout but are not torch's.
LOOKALIKES = ["backup-shard-00001-model-00001-of-00001.safetensors", "myshard-7-model-1-of-1.safetensors",
              "notes__0_0.distcp", "old.shard-00001-model-00001-of-00001.safetensors"]
UPLOADS = ["x-shard-00002-model-00001-of-00001.safetensors", "draft__0_0.distcp"]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16()}


def _save(target, layout: str, seed: int) -> dict:
    from ckptfs.torch import StorageWriter
    sd = _state(seed)
    dcp.save(sd, storage_writer=StorageWriter(target, layout=layout, buffer_bytes=1 << 20), no_dist=True)
    return sd


def _load_local(path, layout: str) -> dict:
    target = {k: torch.zeros_like(v) for k, v in _state(0).items()}
    reader = HuggingFaceStorageReader(str(path)) if layout == "hf" else FileSystemReader(str(path))
    dcp.load(target, storage_reader=reader, no_dist=True)
    return target


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _objects(boto, prefix: str) -> dict[str, bytes]:
    listed = boto.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: boto.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def _uploads(boto, prefix: str) -> dict[str, str]:
    listed = boto.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    return {u["Key"][len(prefix):]: u["UploadId"] for u in listed}


@pytest.mark.parametrize("layout", ["dcp", "hf"])
def test_a_save_leaves_objects_that_only_end_like_its_files(s3_env, layout):
    boto = s3_env["client"]
    prefix = f"names_{layout}/step_1/"
    mine = {name: os.urandom(100 + i) for i, name in enumerate(LOOKALIKES)}
    for name, data in mine.items():
        boto.put_object(Bucket=BUCKET, Key=prefix + name, Body=data)
    opened = {name: boto.create_multipart_upload(Bucket=BUCKET, Key=prefix + name)["UploadId"] for name in UPLOADS}
    try:
        _save(f"s3://{BUCKET}/{prefix.rstrip('/')}", layout, seed=1)
        after = _objects(boto, prefix)
        for name, data in mine.items():
            assert after.get(name) == data, f"{name} was removed or changed by the save"
        assert _uploads(boto, prefix) == opened, "the save aborted uploads that were not its own"
        own = {"dcp": "__0_0.distcp", "hf": "shard-00001-model-00001-of-00001.safetensors"}[layout]
        assert own in after and ".ckptfs/commit.sst" in after, sorted(after)  # the save itself happened
    finally:
        for name, upload_id in opened.items():
            boto.abort_multipart_upload(Bucket=BUCKET, Key=prefix + name, UploadId=upload_id)


@pytest.mark.parametrize("first,second", [("hf", "dcp"), ("dcp", "hf")])
def test_a_save_over_the_other_layout_is_refused_and_changes_nothing(tmp_path, first, second):
    step = tmp_path / "step_1"
    old = _save(step, first, seed=1)
    before = {p.name: p.read_bytes() for p in step.rglob("*") if p.is_file()}
    with pytest.raises(CheckpointException, match=rf"holds a layout='{first}' save .*Save into a new step, or remove"):
        _save(step, second, seed=2)
    assert {p.name: p.read_bytes() for p in step.rglob("*") if p.is_file()} == before
    assert _same(_load_local(step, first), old)


@pytest.mark.parametrize("first,second", [("hf", "dcp"), ("dcp", "hf")])
def test_a_save_over_the_other_layout_in_a_bucket_is_refused(s3_env, first, second):
    boto = s3_env["client"]
    prefix = f"switch_{first}/step_1/"
    _save(f"s3://{BUCKET}/{prefix.rstrip('/')}", first, seed=1)
    before = _objects(boto, prefix)
    with pytest.raises(CheckpointException, match=rf"holds a layout='{first}' save"):
        _save(f"s3://{BUCKET}/{prefix.rstrip('/')}", second, seed=2)
    assert _objects(boto, prefix) == before
    assert _uploads(boto, prefix) == {}
