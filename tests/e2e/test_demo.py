"""The README's demo (tools/demo.py), run as a user runs it: training on 2
gloo ranks saves through ckptfs.torch.StorageWriter into a live-mounted
root and straight to a local S3 server (StorageWriter("s3://...")) under a
live `ckptfs mount s3://`; the eval loads each step from both mounts'
consolidated/ with transformers and compares logits with the trained
model's (computed by the trainer before the save, not through ckptfs), and
verify checks the last step's chunk checksums, local and in the bucket.
The demo's own checks decide its exit status; this test also reads what it
printed, so a demo that skipped a step fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from harness import is_mounted, require_bin

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_trains_saves_and_evaluates_every_step_through_the_live_mount(tmp_path):
    env = {**os.environ, "CKPTFS_BIN": require_bin()}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "demo.py"), "--workdir", str(tmp_path),
                        "--steps", "6", "--save-every", "3"],
                       env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "Demo passed." in p.stdout, out[-4000:]
    evals = re.findall(r"eval: step_(\d+)/consolidated/ .*logits equal the trained model's: (\w+)", p.stdout)
    assert evals == [("3", "True"), ("6", "True")], out[-4000:]
    evals = re.findall(r"eval: step_(\d+)/consolidated.bf16/ .*bf16 logits: (\w+)", p.stdout)
    assert evals == [("3", "True"), ("6", "True")], out[-4000:]
    # Each step from the S3 mount: shown only with its .metadata in the
    # bucket (boto3, asked when it appeared), the trained model's logits.
    evals = re.findall(r"eval: s3://ckpts/run1/step_(\d+)/consolidated/ .*its \.metadata was in the bucket when "
                       r"it appeared \(boto3\): (\w+); transformers logits equal the trained model's: (\w+)", p.stdout)
    assert evals == [("3", "True", "True"), ("6", "True", "True")], out[-4000:]
    # The steps were saved by ckptfs's writer: each has its commit record,
    # and verify checked checksums (a scanned step has none to check).
    for n in (3, 6):
        assert os.path.isfile(tmp_path / "run1" / f"step_{n}" / ".ckptfs" / "commit.sst")
    assert re.search(r"^\$ \S+ verify s3://ckpts/run1/step_6$", p.stdout, re.M), p.stdout[-4000:]
    verified = re.findall(r"ckptfs verify: .* [1-9]\d* chunk checksum\(s\) checked: no problems", p.stderr)
    assert len(verified) == 2, p.stderr  # the local step_6, then s3://ckpts/run1/step_6
    assert not is_mounted(tmp_path / "mnt") and not is_mounted(tmp_path / "mnt-s3")
