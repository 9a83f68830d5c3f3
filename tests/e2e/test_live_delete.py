"""A served step whose commit point is deleted stops being served
(docs/SEMANTICS.md, "Live mounts"), on a POSIX root and on an s3:// root.

Each step is a DCP checkpoint written by torch's own `dcp.save`, with an
`extra/deep/` subfolder holding a plain file. Deleting every file of a step
(its subfolders left behind, as a cleanup script leaves them; on S3 every
object deleted with boto3, SeaweedFS listing the emptied prefixes on) makes
its views vanish within the rescan delay: new opens of its former view files
and source files answer ENOENT. Deleting `.metadata` alone does the same.
The other steps keep serving exactly the tensors torch saved.

Expected values are the state dicts handed to dcp.save, compared with what
safetensors reads from the mount.

Run: CKPTFS_BIN=build/ckptfs python3 -m pytest tests/e2e/test_live_delete.py -q
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load

from harness import Mounted
from s3_server import BUCKET, upload_tree

RESCAN_MS = 300
GONE_WITHIN_S = 20.0  # the rescan delay plus a loaded machine's slack
VIEWS = ("consolidated", "mesh", "tensors")


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed.weight": torch.randn(16, 8, generator=g),
            "model.layer.weight": torch.randn(8, 8, generator=g),
            "model.layer.bias": torch.randn(8, generator=g)}


def _save_step(out_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    sd = _state(seed)
    dcp.save({"model": {k.removeprefix("model."): v for k, v in sd.items()}},
             storage_writer=dcp.FileSystemWriter(str(out_dir), thread_count=1, sync_files=False))
    (out_dir / "extra" / "deep").mkdir(parents=True)
    (out_dir / "extra" / "deep" / "notes.txt").write_text("kept beside the weights\n")
    return {k.removeprefix("model."): v for k, v in sd.items()}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """step_1..step_3 under one root, and the tensors each holds."""
    root = tmp_path_factory.mktemp("delete") / "run"
    return root, {n: _save_step(root / f"step_{n}", seed=n) for n in (1, 2, 3)}


def _served(path: str) -> dict[str, torch.Tensor]:
    with open(path, "rb") as f:
        return st_load(f.read())


def _assert_exact(m: Mounted, n: int, want: dict[str, torch.Tensor]) -> None:
    got = _served(m.p(f"step_{n}", "consolidated", "model.safetensors"))
    assert sorted(got) == sorted(want), (n, sorted(got))
    for k, t in want.items():
        assert torch.equal(got[k], t), f"step_{n}: {k} differs from what torch saved"


def _views_left(m: Mounted, n: int) -> list[str]:
    try:
        names = os.listdir(m.p(f"step_{n}"))
    except FileNotFoundError:
        return []
    return [v for v in VIEWS if v in names]


def _wait_views_gone(m: Mounted, n: int) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while _views_left(m, n) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _views_left(m, n) == [], (
        f"step_{n}: {_views_left(m, n)} still listed {GONE_WITHIN_S:g} s after its commit point went\n"
        + m.log()[-3000:])


def _wait_logged(m: Mounted, line: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while line not in m.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert line in m.log(), m.log()[-3000:]


def _assert_enoent(path: str) -> None:
    with pytest.raises(OSError) as e:
        os.close(os.open(path, os.O_RDONLY))
    assert e.value.errno == errno.ENOENT, (path, errno.errorcode.get(e.value.errno))


def _warm(m: Mounted, n: int) -> list[str]:
    """Looks up and reads step_n's views (the kernel caches their entries);
    returns the view paths to open again once the step is gone."""
    paths = [m.p(f"step_{n}", "consolidated", "model.safetensors"),
             m.p(f"step_{n}", "tensors", "model.embed.weight.npy")]
    for p in paths[:2]:
        assert len(Path(p).read_bytes()) > 0
    assert os.path.isdir(m.p(f"step_{n}", "mesh"))
    return paths


def test_posix_step_emptied_but_for_folders_and_one_without_metadata_stop_being_served(steps, tmp_path):
    root, want = steps
    with Mounted(str(root), "--rescan-ms", str(RESCAN_MS), base_dir=str(tmp_path)) as m:
        for n in want:
            _assert_exact(m, n, want[n])
        views = _warm(m, 1)
        fd = os.open(views[0], os.O_RDONLY)  # open across the delete: exact bytes or EIO
        try:
            # Every file deleted, bottom-up; the directories stay.
            for dirpath, _, files in os.walk(root / "step_1"):
                for f in files:
                    os.unlink(os.path.join(dirpath, f))
            _wait_views_gone(m, 1)
            for p in views[:2] + [m.p("step_1", ".metadata"), m.p("step_1", "__0_0.distcp"),
                                  m.p("step_1", "extra", "deep", "notes.txt")]:
                _assert_enoent(p)
            # What remains shows as plain directories.
            assert sorted(os.listdir(m.p("step_1"))) == ["extra"]
            assert os.listdir(m.p("step_1", "extra")) == ["deep"]
            assert os.listdir(m.p("step_1", "extra", "deep")) == []
            try:
                os.pread(fd, 4096, 0)
            except OSError as e:
                assert e.errno == errno.EIO, errno.errorcode.get(e.errno)
        finally:
            os.close(fd)
        _assert_exact(m, 2, want[2])
        _assert_exact(m, 3, want[3])

        # .metadata alone deleted: the shards stay, the step is no checkpoint.
        views = _warm(m, 2)
        os.unlink(root / "step_2" / ".metadata")
        _wait_views_gone(m, 2)
        for p in views[:2]:
            _assert_enoent(p)
        assert "__0_0.distcp" in os.listdir(m.p("step_2"))
        _wait_logged(m, "step_2/: gone; no longer served")
        _assert_exact(m, 3, want[3])

        # The emptied folders alone no longer hold the log on "a source changed".
        time.sleep(3 * RESCAN_MS / 1000)
        lines = m.log().count("changed since indexing")
        time.sleep(3 * RESCAN_MS / 1000)
        assert m.log().count("changed since indexing") == lines, m.log()[-3000:]


def test_s3_step_whose_objects_are_all_deleted_stops_being_served(steps, s3_env, tmp_path):
    root, want = steps
    client = s3_env["client"]
    for n in (1, 3):
        upload_tree(client, str(_copy_of(root, n, tmp_path)), f"deleted/step_{n}/")
    with Mounted(f"s3://{BUCKET}/deleted", "--rescan-ms", str(RESCAN_MS), base_dir=str(tmp_path)) as m:
        for n in (1, 3):
            _assert_exact(m, n, want[n])
        views = _warm(m, 1)
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="deleted/step_1/")["Contents"]]
        assert "deleted/step_1/extra/deep/notes.txt" in keys, keys
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys]})
        _wait_views_gone(m, 1)
        for p in views[:2] + [m.p("step_1", ".metadata"), m.p("step_1", "extra", "deep", "notes.txt")]:
            _assert_enoent(p)
        _wait_logged(m, "step_1/: gone; no longer served")
        _assert_exact(m, 3, want[3])


def test_s3_step_without_metadata_stops_being_served(steps, s3_env, tmp_path):
    root, want = steps
    client = s3_env["client"]
    for n in (1, 3):
        upload_tree(client, str(_copy_of(root, n, tmp_path)), f"nometa/step_{n}/")
    with Mounted(f"s3://{BUCKET}/nometa", "--rescan-ms", str(RESCAN_MS), base_dir=str(tmp_path)) as m:
        views = _warm(m, 1)
        client.delete_object(Bucket=BUCKET, Key="nometa/step_1/.metadata")
        _wait_views_gone(m, 1)
        for p in views[:2]:
            _assert_enoent(p)
        _assert_exact(m, 3, want[3])


def _copy_of(root: Path, n: int, tmp_path: Path) -> Path:
    """Step n as saved (the POSIX test may have deleted files of step_1 and
    step_2): written again from the same seed."""
    out = tmp_path / f"copy_{n}"
    if not out.exists():
        _save_step(out, seed=n)
    return out
