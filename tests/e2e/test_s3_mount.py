"""`ckptfs mount s3://BUCKET/PREFIX` and the commands that read through the
mount tree (ls, cat, export, inspect, verify) against a real S3 server
(SeaweedFS, SigV4 checked; s3_server.py). Checkpoints written by real torch
(torch's HF writer on 2 gloo ranks, dcp.save of DTensors on 2 gloo ranks)
are uploaded with boto3; what the mount serves is judged by safetensors,
numpy, transformers and numpy slicing of the saved tensors.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import s3_gen
from s3_server import BUCKET, upload_tree


def _consolidated(mount_dir: str) -> dict:
    """Every tensor of a consolidated/ folder, read by safetensors."""
    out = {}
    for name in sorted(os.listdir(mount_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(mount_dir, name), framework="pt") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


@pytest.fixture(scope="module")
def dcp_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("dcp") / "step-100"
    return {"out_dir": str(out), "expected": s3_gen.write_dcp(str(out))}


@pytest.fixture(scope="module")
def bucket_root(s3_server, main_ckpt, llama_ckpt, dcp_step):
    """s3://ckpts/runs/ holding the HF-writer main and llama checkpoints and
    the DCP step, uploaded once for the module."""
    client = s3_server["client"]
    upload_tree(client, main_ckpt["out_dir"], "runs/main/")
    upload_tree(client, llama_ckpt["out_dir"], "runs/llama/")
    upload_tree(client, dcp_step["out_dir"], "runs/dcp/step-100/")
    return f"s3://{BUCKET}/runs"


@pytest.fixture
def s3_mount(bucket_root, s3_env, mount_factory):
    with mount_factory(bucket_root) as m:
        yield m


def test_the_tree_of_the_bucket_is_shown_with_the_views(s3_mount, main_ckpt):
    assert sorted(os.listdir(s3_mount.path)) == ["dcp", "llama", "main"]
    local = Path(main_ckpt["out_dir"])
    shown = sorted(os.listdir(s3_mount.p("main")))
    # Object storage keeps no empty directories: every name holding a file is shown.
    for name in os.listdir(local):
        if any(p.is_file() for p in [local / name, *(local / name).rglob("*")]):
            assert name in shown, (name, shown)
    for view in ("consolidated", "tensors", "mesh"):
        assert view in shown, shown
    # Source files read through as they are, sizes from the listing.
    for p in local.rglob("*"):
        if p.is_file():
            rel = p.relative_to(local)
            there = Path(s3_mount.p("main", str(rel)))
            assert there.stat().st_size == p.stat().st_size, rel
            assert there.read_bytes() == p.read_bytes(), rel
            assert there.stat().st_mode & 0o777 == 0o444, rel
    assert os.stat(s3_mount.p("main")).st_uid == os.getuid()


def test_consolidated_of_torchs_hf_writer_in_s3(s3_mount, main_ckpt):
    got = _consolidated(s3_mount.p("main", "consolidated"))
    assert set(got) == set(main_ckpt["expected"])
    for k, want in main_ckpt["expected"].items():
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k


def test_from_pretrained_from_s3_gives_the_saved_models_logits(s3_mount, llama_ckpt):
    from transformers import AutoModelForCausalLM

    ref = torch.load(llama_ckpt["logits_path"])
    model = AutoModelForCausalLM.from_pretrained(s3_mount.p("llama", "consolidated")).eval()
    with torch.no_grad():
        got = model(input_ids=ref["input_ids"]).logits.float()
    assert torch.equal(got, ref["logits"])


def test_dcp_from_gloo_ranks_in_s3(s3_mount, dcp_step):
    step = s3_mount.p("dcp", "step-100")
    got = _consolidated(os.path.join(step, "consolidated"))
    want = dcp_step["expected"]
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k, t in want.items():
        assert torch.equal(got[k], t), k
    # tensors/<name>.npy loads with numpy (bf16 has no numpy dtype: skip it).
    w = np.load(os.path.join(step, "tensors", "model.layers.0.weight.npy"))
    np.testing.assert_array_equal(w, want["layers.0.weight"].numpy())


def test_mesh_tp2_of_a_llama_in_s3_is_cut_as_numpy_slices(s3_mount, llama_ckpt):
    # q_proj is column-parallel: rank r holds rows [r*n/2, (r+1)*n/2).
    full = llama_ckpt["expected"]["model.layers.0.self_attn.q_proj.weight"]
    half = full.shape[0] // 2
    for r in range(2):
        d = s3_mount.p("llama", "mesh", "tp2", f"rank-{r:05d}")
        got = _consolidated(d)["model.layers.0.self_attn.q_proj.weight"]
        assert torch.equal(got, full[r * half:(r + 1) * half]), r


def test_ls_cat_export_inspect_verify_of_an_s3_root(bucket_root, s3_env, ckptfs, dcp_step, tmp_path):
    r = ckptfs("ls", bucket_root)
    assert r.returncode == 0, r.stderr.decode()
    assert b"dcp/step-100" in r.stdout and b"llama" in r.stdout, r.stdout.decode()
    r = ckptfs("cat", bucket_root, "dcp/step-100/tensors/model.layers.1.weight.npy")
    assert r.returncode == 0, r.stderr.decode()
    np.save(tmp_path / "w.npy", np.load(__import__("io").BytesIO(r.stdout)))
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"),
                                  dcp_step["expected"]["layers.1.weight"].numpy())
    out = tmp_path / "exported"
    r = ckptfs("export", bucket_root, "dcp/step-100/consolidated", str(out))
    assert r.returncode == 0, r.stderr.decode()
    got = _consolidated(str(out))
    for k, t in dcp_step["expected"].items():
        assert torch.equal(got[k], t), k
    r = ckptfs("inspect", "--json", bucket_root, "model.layers.0.weight")
    assert r.returncode == 0, r.stderr.decode()
    info = json.loads(r.stdout)
    assert info["shape"] == [9, 6], info
    assert len(info["chunks"]) == 2, info
    r = ckptfs("verify", bucket_root)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


def test_an_object_overwritten_while_mounted_reads_eio(s3_server, s3_env, main_ckpt, mount_factory):
    client = s3_server["client"]
    upload_tree(client, main_ckpt["out_dir"], "changing/main/")
    with mount_factory(f"s3://{BUCKET}/changing", "--rescan-ms", "0") as m:
        cons = m.p("main", "consolidated", "model.safetensors")
        before = Path(cons).read_bytes()
        shard = next(k for k in sorted(os.listdir(main_ckpt["out_dir"])) if k.endswith(".safetensors"))
        data = bytearray((Path(main_ckpt["out_dir"]) / shard).read_bytes())
        data[-1] ^= 0xFF  # same size: only the ETag tells
        client.put_object(Bucket=BUCKET, Key=f"changing/main/{shard}", Body=bytes(data))
        fd = os.open(cons, os.O_RDONLY | os.O_DIRECT)
        try:
            with pytest.raises(OSError) as e:
                os.pread(fd, len(before) + 4096, 0)
            assert e.value.errno == errno.EIO
        finally:
            os.close(fd)
        assert "ETag" in m.log() or "changed" in m.log(), m.log()[-2000:]


def test_a_step_uploaded_to_a_mounted_prefix_appears_and_a_deleted_one_vanishes(
        s3_server, s3_env, dcp_step, mount_factory):
    client = s3_server["client"]
    client.put_object(Bucket=BUCKET, Key="live/README", Body=b"a training root\n")
    with mount_factory(f"s3://{BUCKET}/live", "--rescan-ms", "300") as m:
        local = Path(dcp_step["out_dir"])
        # Every shard first, the commit point (.metadata) last, as dcp.save does.
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != ".metadata")
        for p in files:
            client.upload_file(str(p), BUCKET, f"live/step-1/{p.relative_to(local)}")
        time.sleep(1.5)
        assert not os.path.exists(m.p("step-1", "consolidated")), "served before its commit point"
        client.upload_file(str(local / ".metadata"), BUCKET, "live/step-1/.metadata")
        deadline = time.monotonic() + 20
        while not os.path.exists(m.p("step-1", "consolidated")) and time.monotonic() < deadline:
            time.sleep(0.2)
        got = _consolidated(m.p("step-1", "consolidated"))
        for k, t in dcp_step["expected"].items():
            assert torch.equal(got[k], t), k
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="live/step-1/")["Contents"]]
        client.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys]})
        # SeaweedFS may go on listing the emptied prefix for a while (S3
        # itself lists no empty prefix): the step is gone when nothing of it
        # is shown, its views included.
        def gone() -> bool:
            shown = not os.path.exists(m.p("step-1")) or os.listdir(m.p("step-1")) == []
            return shown and "step-1/: gone; no longer served" in m.log()

        deadline = time.monotonic() + 20
        while not gone() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(), m.log()[-2000:]


def test_mount_with_a_wrong_secret_fails_at_once_and_names_credentials(s3_env, bucket_root, ckptfs, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    t0 = time.monotonic()
    r = ckptfs("mount", bucket_root, str(mnt), timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 3, r.stderr.decode()
    assert b"credentials" in r.stderr.lower() or b"secret" in r.stderr.lower(), r.stderr.decode()
    assert b"not-the-secret" not in r.stderr
    assert not os.path.ismount(mnt)


def test_a_sequential_reader_is_served_from_parts_fetched_ahead(s3_server, s3_env, mount_factory, tmp_path):
    # One 24 MiB tensor in an HF folder; read front to back through a proxy
    # that counts ranged GETs. The kernel asks in requests of at most 1 MiB,
    # so reads without read-ahead would take >= 24 GETs; read ahead in 4 MiB
    # parts they take about 6.
    from safetensors.numpy import save_file
    from s3_fault_proxy import FaultProxy

    rng = np.random.default_rng(5)
    weight = rng.standard_normal((3 << 20,), dtype=np.float64).astype(np.float64).reshape(3072, 1024)
    folder = tmp_path / "big"
    folder.mkdir()
    save_file({"w": weight}, str(folder / "model.safetensors"))
    upload_tree(s3_server["client"], str(folder), "seq/big/")
    proxy = FaultProxy(s3_server["port"], seed=1, p_slowdown=0, p_reset=0, p_truncate=0)
    try:
        with mount_factory(f"s3://{BUCKET}/seq", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                           "--part-size", "4MiB") as m:
            path = m.p("big", "consolidated", "model.safetensors")
            before = proxy.ranged_gets
            with open(path, "rb", buffering=0) as f:
                data = b"".join(iter(lambda: f.read(128 << 10), b""))
            gets = proxy.ranged_gets - before
    finally:
        proxy.close()
    from safetensors.numpy import load
    np.testing.assert_array_equal(load(data)["w"], weight)
    assert gets <= 12, f"{gets} ranged GETs for a 24 MiB sequential read in 4 MiB parts"


def test_random_range_reads_through_a_faulty_network_are_exact_or_eio(s3_server, s3_env, main_ckpt, mount_factory):
    """Random ranges of consolidated/ read with O_DIRECT (each one reaches
    the daemon) through a proxy that answers 503 SlowDown, resets
    connections mid-body and cuts bodies short. The reference bytes are the
    file read without faults, checked tensor by tensor against the saved
    tensors first; every read must give them or fail with EIO."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load as st_load
    from s3_fault_proxy import FaultProxy

    upload_tree(s3_server["client"], main_ckpt["out_dir"], "faults/main/")
    with mount_factory(f"s3://{BUCKET}/faults") as clean:
        ref = Path(clean.p("main", "consolidated", "model.safetensors")).read_bytes()
    loaded = st_load(ref)
    for k, want in main_ckpt["expected"].items():
        assert torch.equal(loaded[k], want), k
    proxy = FaultProxy(s3_server["port"], seed=23, p_slowdown=0.05, p_reset=0.05, p_truncate=0.05)
    reads, wrong, eio = 3000, [], []
    try:
        with mount_factory(f"s3://{BUCKET}/faults", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                           "--readahead-mib", "0") as m:
            path = m.p("main", "consolidated", "model.safetensors")

            def worker(seed: int) -> None:
                rng = random.Random(seed)
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    for _ in range(reads // 4):
                        off = rng.randrange(0, len(ref))
                        n = rng.choice([1, 7, 512, 4096, 65536])
                        try:
                            got = os.pread(fd, n, off)
                        except OSError as e:
                            (eio if e.errno == errno.EIO else wrong).append((off, n, e))
                            continue
                        if got != ref[off:off + n]:
                            wrong.append((off, n))
                finally:
                    os.close(fd)

            with ThreadPoolExecutor(4) as ex:
                list(ex.map(worker, range(4)))
            log = m.log()
    finally:
        proxy.close()
    assert wrong == [], wrong[:5]
    for kind in ("slowdown", "reset", "truncate"):
        assert proxy.counts[kind] > 0, proxy.counts
    # Faults are retried: a read fails only after its retries ran out, and
    # then the log names the key, the range and the cause.
    assert len(eio) <= reads // 100, (len(eio), log[-2000:])
    if eio:
        assert "bytes=" in log or "range" in log, log[-2000:]


@pytest.fixture
def s3fs_mount(s3_server, tmp_path):
    """The bucket's prefix s3fs/ mounted by s3fs (Debian's), with its stat
    cache off, so every lookup asks the server and gets a new inode."""
    import s3_server as s3
    import shutil

    assert shutil.which("s3fs"), "s3fs not found: apt-get install s3fs (tools/setup.sh)"
    passwd = tmp_path / "passwd-s3fs"
    passwd.write_text(f"{s3.ACCESS_KEY}:{s3.SECRET_KEY}\n")
    passwd.chmod(0o600)
    mnt = tmp_path / "s3fs"
    mnt.mkdir()
    r = subprocess.run(["s3fs", f"{BUCKET}:/s3fs", str(mnt), "-o", f"url={s3_server['endpoint']}",
                        "-o", "use_path_request_style", "-o", f"passwd_file={passwd}", "-o", "endpoint=us-east-1",
                        "-o", "max_stat_cache_size=0", "-o", "ro"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert os.path.ismount(mnt)
    yield mnt
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False)
    subprocess.run(["fusermount", "-u", "-z", str(mnt)], check=False, capture_output=True)


def _drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")  # pages, dentries and inodes: s3fs numbers the files anew


def test_ckptfs_over_s3fs_serves_exact_bytes_after_s3fs_renumbers_then_sees_an_overwrite(
        s3_server, s3_env, main_ckpt, ckptfs, mount_factory, s3fs_mount):
    client = s3_server["client"]
    upload_tree(client, main_ckpt["out_dir"], "s3fs/main/")
    shard = next(k for k in sorted(os.listdir(main_ckpt["out_dir"])) if k.endswith(".safetensors"))
    # Indexed while s3fs numbers the files one way, served after the kernel
    # dropped its inodes and s3fs numbered them anew.
    inode = os.stat(s3fs_mount / "main" / shard).st_ino
    r = ckptfs("index", str(s3fs_mount))
    assert r.returncode == 0, r.stderr.decode()
    _drop_caches()
    assert os.stat(s3fs_mount / "main" / shard).st_ino != inode, "s3fs kept its inode numbers"
    with mount_factory(str(s3fs_mount)) as m:
        cons = m.p("main", "consolidated")
        for round_ in range(3):
            got = _consolidated(cons)
            for k, want in main_ckpt["expected"].items():
                assert torch.equal(got[k], want), (round_, k)
            _drop_caches()
        assert "changed" not in m.log() and "EIO" not in m.log(), m.log()[-2000:]
    # An overwrite (same size, a later Last-Modified) is seen as soon as
    # s3fs shows it: s3fs keeps serving the version a client has open from
    # its own cache, so it shows it once ckptfs closed its files.
    time.sleep(1.1)
    data = bytearray((Path(main_ckpt["out_dir"]) / shard).read_bytes())
    data[-1] ^= 0xFF
    before = os.stat(s3fs_mount / "main" / shard).st_mtime_ns
    client.put_object(Bucket=BUCKET, Key=f"s3fs/main/{shard}", Body=bytes(data))
    deadline = time.monotonic() + 30
    while True:  # s3fs lets go of the closed files' entries in its own time
        _drop_caches()
        if os.stat(s3fs_mount / "main" / shard).st_mtime_ns != before or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert os.stat(s3fs_mount / "main" / shard).st_mtime_ns != before, "s3fs never showed the overwrite"
    r = ckptfs("check", str(s3fs_mount))
    assert r.returncode == 5 and shard.encode() in r.stdout + r.stderr, r.stdout.decode() + r.stderr.decode()
    r = ckptfs("cat", str(s3fs_mount), "main/consolidated/model.safetensors")
    assert r.returncode == 4, r.stderr.decode()
