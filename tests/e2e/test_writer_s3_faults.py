"""StorageWriter("s3://...") through the fault proxy (tools/s3_fault_proxy.py)
and with ranks that die: 2 gloo ranks (CPU), real SeaweedFS.

- 503 SlowDown and dropped connections on the uploads are retried: the
  save is committed and loads exact;
- a fault that never clears (every part of rank 1's file answered
  SlowDown), a SIGKILLed rank and a SIGINT mid-upload each leave no
  visible step (.metadata absent, no commit record), no open multipart
  upload (boto3), an earlier step under the same prefix as it was, and
  every surviving rank exits with the cause, in bounded time;
- a re-save into a committed step that never gets through leaves the
  step uncommitted (no .metadata, no record, no open upload);
- a ``.metadata`` or commit-record PUT that never gets through (every rank
  file complete by then) fails the save on every rank and removes the rank
  files the save uploaded, and nothing else.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from harness import spawn_ranks
from s3_server import ACCESS_KEY, BUCKET, SECRET_KEY

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")


def aws_env(port: int) -> dict:
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_REGION": "us-east-1"}


def _keys(boto, prefix: str) -> dict[str, str]:
    listed = boto.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: o["ETag"] for o in listed}


def _open_uploads(boto, prefix: str) -> list:
    return boto.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _save(server_port: int, url: str, tmp, seed: int, name: str, **kw) -> dict:
    job = {"kind": "save", "seed": seed, "dir": url, "oracle": str(tmp / f"oracle{seed}.pt"), **kw}
    spawn_ranks(GEN, 2, job, name=name, env=aws_env(server_port), timeout=240)
    return job


def _load_equals(server_port: int, job: dict, tmp) -> None:
    out = str(tmp / f"loaded{job['seed']}.pt")
    spawn_ranks(GEN, 2, {"kind": "load", "dir": job["dir"], "oracle": job["oracle"], "out": out},
                name="s3torchconnector load", env=aws_env(server_port), timeout=240)
    oracle, loaded = torch.load(job["oracle"], weights_only=False), torch.load(out, weights_only=False)
    bad = [k for k, v in oracle.items() if not _equal(v, loaded[k])]
    assert loaded.keys() == oracle.keys() and not bad, bad


def test_slowdown_and_dropped_connections_are_retried(s3_server, tmp_path):
    from s3_fault_proxy import FaultProxy
    # Random SlowDowns on every request, and the first part of each rank's
    # file sent on a connection that is dropped, then answered SlowDown.
    proxy = FaultProxy(s3_server["port"], seed=11, p_slowdown=0.15, p_reset=0, p_truncate=0,
                       script={"__0_0.distcp?partNumber=1&": ["drop", "slowdown"],
                               "__1_0.distcp?partNumber=1&": ["drop", "slowdown"]})
    try:
        job = _save(proxy.port, f"s3://{BUCKET}/wf_retry/step_1", tmp_path, 7, "save through faults",
                    buffer_bytes=8 << 20)
        counts = dict(proxy.counts)
    finally:
        proxy.close()
    assert counts["drop"] == 2 and counts["slowdown"] >= 2, counts
    boto = s3_server["client"]
    assert set(_keys(boto, "wf_retry/step_1/")) == {"__0_0.distcp", "__1_0.distcp", ".metadata",
                                                    ".ckptfs/commit.sst"}
    assert _open_uploads(boto, "wf_retry/") == []
    _load_equals(s3_server["port"], job, tmp_path)


def _assert_nothing_committed(boto, root: str, earlier: dict[str, str]) -> None:
    step2 = _keys(boto, f"{root}/step_2/")
    assert ".metadata" not in step2 and ".ckptfs/commit.sst" not in step2, step2
    assert _open_uploads(boto, f"{root}/") == [], _open_uploads(boto, f"{root}/")
    assert _keys(boto, f"{root}/step_1/") == earlier  # the earlier step, object for object


def test_a_fault_that_never_clears_commits_nothing_and_fails_every_rank(s3_server, tmp_path):
    from s3_fault_proxy import FaultProxy
    boto = s3_server["client"]
    first = _save(s3_server["port"], f"s3://{BUCKET}/wf_never/step_1", tmp_path, 1, "earlier step")
    earlier = _keys(boto, "wf_never/step_1/")
    proxy = FaultProxy(s3_server["port"], seed=12, p_slowdown=0, p_reset=0, p_truncate=0,
                       script={"__1_0.distcp?partNumber=": ["slowdown"] * 1000})
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as failed:
            _save(proxy.port, f"s3://{BUCKET}/wf_never/step_2", tmp_path, 2, "save that never gets through")
    finally:
        proxy.close()
    assert time.monotonic() - t0 < 200
    message = str(failed.value)
    # spawn_ranks names every failed rank with its log: both failed, both say why.
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message, message
    for part in message.split("--- rank ")[1:]:
        assert "SlowDown" in part, part
    _assert_nothing_committed(boto, "wf_never", earlier)
    _load_equals(s3_server["port"], first, tmp_path)


def test_a_failed_resave_into_a_committed_step_leaves_it_uncommitted(s3_server, tmp_path):
    """A save into a step that holds a committed save uncommits it before
    anything is written: when the new save then never gets through, the
    step shows neither the old .metadata nor the old record (its rank files
    are the new save's, half written, or the old ones: either way not a
    step), no upload is left open, and stock dcp.load refuses it."""
    from s3_fault_proxy import FaultProxy
    boto = s3_server["client"]
    _save(s3_server["port"], f"s3://{BUCKET}/wf_resave/step_1", tmp_path, 1, "first save")
    assert {".metadata", ".ckptfs/commit.sst"} <= set(_keys(boto, "wf_resave/step_1/"))
    proxy = FaultProxy(s3_server["port"], seed=13, p_slowdown=0, p_reset=0, p_truncate=0,
                       script={"__1_0.distcp?partNumber=": ["slowdown"] * 1000})
    try:
        with pytest.raises(RuntimeError):
            _save(proxy.port, f"s3://{BUCKET}/wf_resave/step_1", tmp_path, 2, "re-save that never gets through")
    finally:
        proxy.close()
    left = _keys(boto, "wf_resave/step_1/")
    assert ".metadata" not in left and ".ckptfs/commit.sst" not in left, left
    assert _open_uploads(boto, "wf_resave/") == [], _open_uploads(boto, "wf_resave/")
    out = str(tmp_path / "refused.pt")
    with pytest.raises(RuntimeError):
        spawn_ranks(GEN, 2, {"kind": "load", "dir": f"s3://{BUCKET}/wf_resave/step_1",
                             "oracle": str(tmp_path / "oracle1.pt"), "out": out},
                    name="s3torchconnector load of the uncommitted step", env=aws_env(s3_server["port"]), timeout=240)


@pytest.mark.parametrize("key", [".metadata", ".ckptfs/commit.sst"])
def test_a_failed_metadata_or_record_put_removes_the_saves_rank_files(s3_server, tmp_path, key):
    """Every rank's upload completed, then the coordinator's PUT of
    ``.metadata`` (or of the commit record after it) never gets through:
    the save fails on both ranks, and neither .metadata nor the record nor
    the rank files this save uploaded are left; an object under the step
    that the save did not write stays."""
    from s3_fault_proxy import FaultProxy
    boto = s3_server["client"]
    root = "wf_meta" if key == ".metadata" else "wf_record"
    _save(s3_server["port"], f"s3://{BUCKET}/{root}/step_1", tmp_path, 1, "earlier step")
    earlier = _keys(boto, f"{root}/step_1/")
    boto.put_object(Bucket=BUCKET, Key=f"{root}/step_2/config.json", Body=b"{}")  # a sidecar, not the writer's
    proxy = FaultProxy(s3_server["port"], seed=14, p_slowdown=0, p_reset=0, p_truncate=0,
                       script={f"PUT /{BUCKET}/{root}/step_2/{key} ": ["slowdown"] * 1000})
    try:
        with pytest.raises(RuntimeError) as failed:
            _save(proxy.port, f"s3://{BUCKET}/{root}/step_2", tmp_path, 2, "save whose commit never gets through")
        faulted = proxy.counts["slowdown"]
    finally:
        proxy.close()
    assert faulted >= 2, faulted
    message = str(failed.value)
    assert "--- rank 0 ---" in message and "--- rank 1 ---" in message, message
    for part in message.split("--- rank ")[1:]:
        assert "SlowDown" in part, part
    assert set(_keys(boto, f"{root}/step_2/")) == {"config.json"}
    _assert_nothing_committed(boto, root, earlier)


def _start_ranks(job: dict, env: dict, tmp: str) -> tuple[list[subprocess.Popen], list]:
    init = os.path.join(tmp, "filestore")
    job_file = os.path.join(tmp, "job.json")
    with open(job_file, "w") as f:
        json.dump(job, f)
    full_env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", **env)
    procs, logs = [], []
    for r in range(2):
        log = open(os.path.join(tmp, f"rank{r}.log"), "w+b")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, GEN, "_worker", str(r), "2", init, job_file], env=full_env,
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    return procs, logs


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_rank_killed_or_interrupted_mid_upload_commits_nothing(s3_server, tmp_path, sig):
    """Rank 1's third part is held by the proxy, so that rank 1 is known to
    be mid-upload when it gets the signal (a rank signalled after every
    rank agreed that its upload completed would rightly commit); rank 0
    must exit with the cause (no hang at a collective), and nothing is left
    open."""
    from s3_fault_proxy import FaultProxy
    boto = s3_server["client"]
    root = f"wf_{sig.name.lower()}"
    _save(s3_server["port"], f"s3://{BUCKET}/{root}/step_1", tmp_path, 1, "earlier step")
    earlier = _keys(boto, f"{root}/step_1/")
    proxy = FaultProxy(s3_server["port"], seed=13, p_slowdown=0, p_reset=0, p_truncate=0,
                       script={f"PUT /{BUCKET}/{root}/step_2/__1_0.distcp?partNumber=3&": ["hold"]})
    tmp = tempfile.mkdtemp(dir=tmp_path)
    # A state of ~48 MiB per rank: parts of 5 MiB.
    job = {"kind": "save", "seed": 2, "dir": f"s3://{BUCKET}/{root}/step_2", "oracle": os.path.join(tmp, "o.pt"),
           "big": 96 << 20, "part_size": 5 << 20, "max_threads": 2}
    procs, logs = _start_ranks(job, aws_env(proxy.port), tmp)
    try:
        deadline = time.monotonic() + 120
        while proxy.held < 1 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a rank ended before its third part"
            time.sleep(0.05)
        assert proxy.held == 1, "rank 1 never sent its third part"
        procs[1].send_signal(sig)
        # The interrupt is raised once the rank's wait for its parts ends.
        time.sleep(0.2)
        proxy.release()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        proxy.close()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read().decode(errors="replace"))
        log.close()
    assert codes[0] != 0, outs[0][-3000:]
    assert "ckptfs StorageWriter" in outs[0], outs[0][-3000:]
    if sig == signal.SIGKILL:
        assert codes[1] == -signal.SIGKILL
    else:
        assert codes[1] != 0 and "KeyboardInterrupt" in outs[1], outs[1][-3000:]
    _assert_nothing_committed(boto, root, earlier)
