"""`ckptfs mount s3://BUCKET/PREFIX` and the commands that read through the
mount tree (ls, cat, export, inspect, verify) against a real S3 server
(SeaweedFS, SigV4 checked; tools/s3_server.py). Checkpoints written by real torch
(torch's HF writer on 2 gloo ranks, dcp.save of DTensors on 2 gloo ranks)
are uploaded with boto3; what the mount serves is judged by safetensors,
numpy, transformers and numpy slicing of the saved tensors.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import harness
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
        # A plain file passed through, opened before it changes.
        plain = "notes/deep/data.bin"
        plain_fd = os.open(m.p("main", plain), os.O_RDONLY | os.O_DIRECT)
        client.put_object(Bucket=BUCKET, Key=f"changing/main/{shard}", Body=bytes(data))
        client.put_object(Bucket=BUCKET, Key=f"changing/main/{plain}", Body=b"another version\n" * 800)
        fd = os.open(cons, os.O_RDONLY | os.O_DIRECT)
        try:
            with pytest.raises(OSError) as e:
                os.pread(fd, len(before) + 4096, 0)
            assert e.value.errno == errno.EIO
            with pytest.raises(OSError) as e:
                os.pread(plain_fd, 4096, 0)
            assert e.value.errno == errno.EIO
        finally:
            os.close(fd)
            os.close(plain_fd)
        assert "ETag" in m.log() or "changed" in m.log(), m.log()[-2000:]
        plain_lines = [line for line in m.log().splitlines() if plain in line]
        assert plain_lines and "failed (Input/output error)" in plain_lines[-1], m.log()[-2000:]


def test_indexed_objects_are_read_by_their_etag_without_a_head_and_a_replacement_still_fails(
        s3_server, s3_env, dcp_step, mount_factory, ckptfs, tmp_path):
    """Indexing takes each object's identity from the listing, and reads and
    a mount pin their GETs to the indexed ETag: no HEAD per object, no LIST
    twice, .metadata read once (each request a round trip on a distant
    server). A replacement after indexing is still caught: the first GET of
    the replaced object, If-Match the indexed ETag, is refused, and the read
    fails with EIO instead of serving either version. The reads run in a
    child process: the proxy's threads need this one's interpreter."""
    from s3_fault_proxy import FaultProxy

    client = s3_server["client"]
    keys = upload_tree(client, dcp_step["out_dir"], "pinned/step-100/")
    # A sidecar the views read when they are built.
    client.put_object(Bucket=BUCKET, Key="pinned/step-100/config.json", Body=b'{"model_type": "llama"}')
    shards = sorted(k for k in keys if k.endswith(".distcp"))
    assert len(shards) == 2, keys
    url = f"s3://{BUCKET}/pinned"
    proxy = FaultProxy(s3_server["port"], seed=4, p_slowdown=0, p_reset=0, p_truncate=0)
    via = ("--endpoint-url", f"http://127.0.0.1:{proxy.port}")
    loaded = tmp_path / "loaded.pt"
    load = ("import sys, torch\n"
            "from safetensors.torch import load_file\n"
            "torch.save(load_file(sys.argv[1]), sys.argv[2])\n")
    read_all = ("import json, os, sys\n"
                "errs = []\n"
                "for n in sorted(os.listdir(sys.argv[1])):\n"
                "    try:\n"
                "        open(os.path.join(sys.argv[1], n), 'rb').read()\n"
                "    except OSError as e:\n"
                "        errs.append(e.errno)\n"
                "print(json.dumps(errs))\n")
    try:
        r = ckptfs("index", *via, url)
        assert r.returncode == 0, r.stderr.decode()
        sent = list(proxy.requests)
        heads = [q for q in sent if q.startswith("HEAD ")]
        assert len(heads) <= 1, sent  # the probe's check that objects may be read, no more
        listings = [q for q in sent if "delimiter=" in q]
        assert len(listings) == len(set(listings)) == 2, sent  # the root, then the step
        assert [q for q in sent if q.startswith("GET ") and q.endswith("/.metadata")] == \
            [f"GET /{BUCKET}/pinned/step-100/.metadata"], sent

        with mount_factory(url, *via, "--rescan-ms", "0", "--reindex") as m:
            child = subprocess.run([sys.executable, "-c", load, m.p("step-100", "consolidated", "model.safetensors"),
                                    str(loaded)], capture_output=True, text=True, timeout=120)
            assert child.returncode == 0, child.stderr + m.log()[-2000:]
            heads = [q for q in proxy.requests if q.startswith("HEAD ") and q.endswith(".distcp")]
            assert not heads, heads
        got, want = torch.load(loaded), dcp_step["expected"]
        assert set(got) == set(want), sorted(got)
        for k, t in want.items():
            assert torch.equal(got[k], t), k

        before = len(proxy.requests)
        with mount_factory(url, *via, "--rescan-ms", "0") as m:
            cons = m.p("step-100", "consolidated")
            assert "model.safetensors" in os.listdir(cons)
            # Over the stored index: checked by listings, its views built
            # from config.json read at its indexed ETag; only the probe HEADs.
            heads = [q for q in proxy.requests[before:] if q.startswith("HEAD ")]
            assert len(heads) <= 1, proxy.requests[before:]
            # Replaced after the mount indexed it, before any read opened
            # it: same size, one byte changed, so only the ETag tells.
            body = bytearray(client.get_object(Bucket=BUCKET, Key=shards[0])["Body"].read())
            body[len(body) // 2] ^= 0xFF
            client.put_object(Bucket=BUCKET, Key=shards[0], Body=bytes(body))
            child = subprocess.run([sys.executable, "-c", read_all, cons], capture_output=True, text=True,
                                   timeout=120)
            assert child.returncode == 0, child.stderr
            assert json.loads(child.stdout) == [errno.EIO], child.stdout + m.log()[-2000:]
            assert "changed since indexing" in m.log(), m.log()[-2000:]
    finally:
        proxy.close()


def _wait_until(m, done, seconds: float = 120) -> None:
    """Waits for `done()` while mount `m` works, failing with its log."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, m.log()[-2000:]
        time.sleep(0.2)


def _consolidated_in_child(mount_dir: str, expected: dict, tmp_path: Path) -> None:
    """consolidated/ of a mount read by safetensors in a child process (a
    proxy of this process serves the mount: its threads need this
    interpreter, which a page fault on the mapped file would hold), and
    compared tensor by tensor with `expected`."""
    out = tmp_path / "loaded.pt"
    code = ("import sys, torch\n"
            "from safetensors.torch import load_file\n"
            "torch.save(load_file(sys.argv[1]), sys.argv[2])\n")
    child = subprocess.run([sys.executable, "-c", code, os.path.join(mount_dir, "model.safetensors"), str(out)],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    got = torch.load(out)
    assert set(got) == set(expected), sorted(got)
    for k, t in expected.items():
        assert torch.equal(got[k], t), k


def test_a_shard_the_server_fails_while_indexing_is_not_stored_as_a_problem_and_is_served_once_it_reads(
        s3_server, s3_env, dcp_step, mount_factory, ckptfs, tmp_path):
    """Every GET of one shard answered 503 SlowDown while `ckptfs index` runs:
    the index exits 3, naming the step, the shard and the cause, and stores
    nothing of the step (a transient failure is no property of the
    checkpoint). A mount started while the shard still fails comes up
    without the step, and serves its exact tensors on a later rescan once
    the shard reads, though none of its files changed; so does a step
    uploaded while its shard fails."""
    from s3_fault_proxy import FaultProxy

    client = s3_server["client"]
    keys = upload_tree(client, dcp_step["out_dir"], "flaky/step-1/")
    shard = sorted(k for k in keys if k.endswith(".distcp"))[0]
    url = f"s3://{BUCKET}/flaky"
    proxy = FaultProxy(s3_server["port"], seed=5, p_slowdown=0, p_reset=0, p_truncate=0)
    via = ("--endpoint-url", f"http://127.0.0.1:{proxy.port}")
    try:
        proxy.set_script({shard: ["slowdown"] * 1000})
        r = ckptfs("index", *via, "--request-timeout-s", "5", url)
        err = r.stderr.decode()
        assert r.returncode == 3, err  # neither indexed nor indexed with problems (5)
        assert "step-1: not indexed (a source could not be read" in err and shard in err and "HTTP 503" in err, err
        with mount_factory(url, *via, "--request-timeout-s", "5", "--rescan-ms", "300") as m:
            assert not os.path.exists(m.p("step-1", "consolidated")), m.log()[-2000:]
            proxy.set_script({})
            _wait_until(m, lambda: os.path.exists(m.p("step-1", "consolidated")))
            _consolidated_in_child(m.p("step-1", "consolidated"), dcp_step["expected"], tmp_path)
            second = shard.replace("step-1", "step-2")
            proxy.set_script({second: ["slowdown"] * 1000})
            local = Path(dcp_step["out_dir"])
            files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != ".metadata")
            for p in files + [local / ".metadata"]:  # the commit point last
                client.upload_file(str(p), BUCKET, f"flaky/step-2/{p.relative_to(local)}")
            _wait_until(m, lambda: "step-2/: not served yet (looked at again on each rescan)" in m.log())
            assert second in m.log() and not os.path.exists(m.p("step-2", "consolidated")), m.log()[-2000:]
            proxy.set_script({})
            _wait_until(m, lambda: os.path.exists(m.p("step-2", "consolidated")))
            _consolidated_in_child(m.p("step-2", "consolidated"), dcp_step["expected"], tmp_path)
    finally:
        proxy.close()


def test_an_object_deleted_while_mounted_reads_eio_and_an_outage_changes_nothing(
        s3_server, s3_env, dcp_step, mount_factory, tmp_path):
    """While mounted: the server failing every request (503) for a few
    rescans is no change of the sources: nothing is marked changed, and
    once it answers, the step reads exact again. A shard deleted is one:
    the next read of it fails with EIO (not ENOENT: the file is there, its
    source is gone) and the log says the object is gone since indexing."""
    from s3_fault_proxy import FaultProxy

    client = s3_server["client"]
    keys = upload_tree(client, dcp_step["out_dir"], "outage/step-1/")
    shard = sorted(k for k in keys if k.endswith(".distcp"))[0]
    proxy = FaultProxy(s3_server["port"], seed=6, p_slowdown=0, p_reset=0, p_truncate=0)
    try:
        with mount_factory(f"s3://{BUCKET}/outage", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                           "--rescan-ms", "200", "--request-timeout-s", "2") as m:
            cons = m.p("step-1", "consolidated")
            _consolidated_in_child(cons, dcp_step["expected"], tmp_path)
            proxy.set_faults(p_slowdown=1.0)
            seen = len(proxy.requests)
            deadline = time.monotonic() + 60
            while len(proxy.requests) < seen + 20:  # several rescans' listings and HEADs, all refused
                assert time.monotonic() < deadline, proxy.counts
                time.sleep(0.2)
            proxy.set_faults()
            time.sleep(1)
            _consolidated_in_child(cons, dcp_step["expected"], tmp_path)
            log = m.log()
            assert proxy.counts["slowdown"] >= 20, proxy.counts
            assert "changed since indexing" not in log and "gone" not in log, log[-2000:]
    finally:
        proxy.close()
    # No rescan: the read itself meets the deletion.
    with mount_factory(f"s3://{BUCKET}/outage", "--rescan-ms", "0") as m:
        client.delete_object(Bucket=BUCKET, Key=shard)
        with pytest.raises(OSError) as e:
            with open(m.p("step-1", "consolidated", "model.safetensors"), "rb") as f:
                f.read()
        assert e.value.errno == errno.EIO, e.value
        assert f"GET {shard}" in m.log() and "gone since indexing (HTTP 404" in m.log(), m.log()[-2000:]


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
        del got  # it maps the mount's file: held, the unmount would find it busy
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


def test_mount_fails_at_once_with_exit_3_and_says_what_to_fix(s3_env, bucket_root, ckptfs, tmp_path, monkeypatch):
    """docs/CLI.md: an s3:// root that cannot be reached (unknown bucket,
    empty prefix, no permission: none at all, or to list but not to read,
    endpoint down) is exit 3, before anything is mounted, with a message
    naming what to fix."""
    import s3_server as s3
    from s3_server import _free_ports

    (down,) = _free_ports(1)
    cases = {
        "unknown bucket": (["s3://no-such-bucket/runs"], {}, [b"bucket 'no-such-bucket' does not exist",
                                                                b"check the bucket name"]),
        "empty prefix": ([f"s3://{BUCKET}/nothing-here"], {}, [b"no object under this prefix",
                                                                 b"check the prefix"]),
        "no permission": ([bucket_root], {"AWS_ACCESS_KEY_ID": s3.OUTSIDER_KEY,
                                          "AWS_SECRET_ACCESS_KEY": s3.OUTSIDER_SECRET},
                          [b"access denied", b"check the credentials", b"may read the bucket"]),
        "list but no read": ([bucket_root], {"AWS_ACCESS_KEY_ID": s3.LISTER_KEY,
                                             "AWS_SECRET_ACCESS_KEY": s3.LISTER_SECRET},
                             [b"access denied", b"check the credentials", b"may read the bucket"]),
        "endpoint down": ([bucket_root, "--endpoint-url", f"http://127.0.0.1:{down}"], {},
                          [b"is the endpoint right", f"127.0.0.1:{down}".encode()]),
    }
    for case, (args, env, says) in cases.items():
        with monkeypatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            mnt = tmp_path / case.replace(" ", "-")
            mnt.mkdir()
            t0 = time.monotonic()
            r = ckptfs("mount", args[0], str(mnt), *args[1:], timeout=60)
            took = time.monotonic() - t0
        assert r.returncode == 3, (case, r.returncode, r.stderr.decode())
        assert took < 20, (case, took)
        for words in says:
            assert words in r.stderr, (case, words, r.stderr.decode())
        for secret in (s3.SECRET_KEY, s3.OUTSIDER_SECRET, s3.LISTER_SECRET):
            assert secret.encode() not in r.stderr, case
        assert not os.path.ismount(mnt), case


def _libcurl_mapped(pid: int) -> list[str]:
    """The libcurl files process `pid` has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f if "/libcurl" in line})


def test_libcurl_is_loaded_by_the_first_s3_request_only(s3_mount, main_ckpt, mount_factory):
    """A mount of local files never loads libcurl, nor the libraries it
    needs (source/curl_api.h); an s3:// mount has it once it has listed the
    bucket."""
    with mount_factory(main_ckpt["out_dir"]) as local:
        path = local.p("consolidated", "model.safetensors")
        with open(path, "rb") as f:
            assert len(f.read()) == os.path.getsize(path) > 0
        assert _libcurl_mapped(harness.mount_daemon_pid(local.path)) == []
    os.listdir(s3_mount.path)
    assert _libcurl_mapped(harness.mount_daemon_pid(s3_mount.path)), "the s3:// mount has no libcurl mapped"


def test_without_libcurl_local_roots_work_and_s3_roots_say_what_to_install(s3_mount, bucket_root, s3_env,
                                                                            ckptfs_bin, main_ckpt, tmp_path):
    """With libcurl unloadable (its file replaced by /dev/null in a private
    mount namespace), commands on a local root work as before, and an
    s3:// root fails at once with the reason and what to install."""
    os.listdir(s3_mount.path)
    (lib,) = _libcurl_mapped(harness.mount_daemon_pid(s3_mount.path))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = ('mount --bind /dev/null "$LIB" && "$BIN" ls "$LOCAL" && echo LOCAL-OK && '
              'exec "$BIN" mount "$S3" "$MNT"')
    env = dict(os.environ, LIB=lib, BIN=ckptfs_bin, LOCAL=main_ckpt["out_dir"], S3=bucket_root, MNT=str(mnt))
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                       capture_output=True, timeout=60)
    out, err = r.stdout.decode(), r.stderr.decode()
    listed = {line.split()[0] for line in out.splitlines()[1:] if line.strip() and line != "LOCAL-OK"}
    assert "LOCAL-OK" in out and listed == set(main_ckpt["expected"]), (out, err)
    assert r.returncode == 3, (r.returncode, out, err)
    assert f"cannot load {os.path.basename(lib).split('.so')[0]}.so" in err, err
    assert "install" in err and "libcurl" in err, err
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
        # The mount logs what it fetched when it ends: every ranged GET the
        # proxy passed, this read's among them.
        deadline = time.monotonic() + 10
        while "unmounted" not in m.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        fetched = re.search(r"s3: (\d+) ranged GETs, ([\d.]+) GB received", m.log())
        total = proxy.ranged_gets
    finally:
        proxy.close()
    from safetensors.numpy import load
    np.testing.assert_array_equal(load(data)["w"], weight)
    assert gets <= 12, f"{gets} ranged GETs for a 24 MiB sequential read in 4 MiB parts"
    assert fetched, m.log()[-2000:]
    assert gets <= int(fetched.group(1)) <= total, (fetched.group(0), gets, total)
    assert float(fetched.group(2)) * 1e9 >= weight.nbytes - 0.005e9, fetched.group(0)


def _resident_pages(path: str, begin: int, end: int) -> int:
    """Pages of [begin, end) of `path` in the page cache, found with
    mincore on a mapping that is never touched (nothing is read)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    first, last = begin // page, (end + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vec = ctypes.create_string_buffer(last - first)
            assert libc.mincore(addr + first * page, (last - first) * page, vec) == 0
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_a_touched_tensor_is_pushed_whole_into_the_page_cache(s3_server, s3_env, mount_factory, tmp_path):
    # transformers' load touches the ends of each tensor and reads it whole
    # only when the model first runs. Over s3:// the first touch of a
    # tensor has the rest of it stored in the kernel's page cache; a
    # tensor nobody touched stays out of it. Residency is read with
    # mincore, the bytes with numpy. With the source-order fetch of whole
    # files on (the default; test_read_order.py), a reader of several
    # tensors is served by it instead: off here, as `--fetch-hold-mib 0`.
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    tensors = {"a": rng.standard_normal((1536, 1024), dtype=np.float32),  # 6 MiB
               "b": rng.standard_normal((1536, 1024), dtype=np.float32)}
    folder = tmp_path / "pushed"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    upload_tree(s3_server["client"], str(folder), "push/m/")
    with mount_factory(f"s3://{BUCKET}/push", "--fetch-hold-mib", "0") as m:
        path = m.p("m", "consolidated", "model.safetensors")
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        begin = {k: 8 + n + header[k]["data_offsets"][0] for k in tensors}
        end = {k: 8 + n + header[k]["data_offsets"][1] for k in tensors}
        page = os.sysconf("SC_PAGE_SIZE")
        a_pages = (end["a"] + page - 1) // page - begin["a"] // page
        fd = os.open(path, os.O_RDONLY)
        try:
            # The touch, past what the kernel read ahead of the header read.
            os.pread(fd, 4096, begin["a"] + (3 << 20))
            deadline = time.monotonic() + 20
            while _resident_pages(path, begin["a"], end["a"]) < a_pages and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _resident_pages(path, begin["a"], end["a"]) == a_pages, m.log()[-2000:]
            # "b" was not touched: beyond the page or two a push rounds up
            # to, none of it is cached.
            assert _resident_pages(path, begin["b"] + (256 << 10), end["b"]) == 0
            data = os.pread(fd, end["a"] - begin["a"], begin["a"])  # from the page cache
        finally:
            os.close(fd)
    np.testing.assert_array_equal(np.frombuffer(data, dtype=np.float32).reshape(1536, 1024), tensors["a"])


def _reference_consolidated(m, rel: str, expected: dict) -> bytes:
    """consolidated/model.safetensors of checkpoint `rel`, read without
    faults and checked tensor by tensor against the saved tensors."""
    from safetensors.torch import load as st_load

    ref = Path(m.p(rel, "consolidated", "model.safetensors")).read_bytes()
    loaded = st_load(ref)
    assert set(loaded) == set(expected)
    for k, want in expected.items():
        assert torch.equal(loaded[k], want), k
    return ref


def _timed_pread(fd: int, n: int, off: int, out: dict) -> None:
    """One pread; its bytes or its exception, and how long it took, go
    into `out`."""
    t0 = time.monotonic()
    try:
        out["data"] = os.pread(fd, n, off)
    except OSError as e:
        out["error"] = e
    finally:
        out["seconds"] = time.monotonic() - t0


def test_stalled_and_trickling_gets_are_abandoned_retried_then_eio_in_bounded_time(
        s3_server, s3_env, main_ckpt, mount_factory):
    """Three copies of a checkpoint behind a proxy that, once the mount is
    up, answers ranged GETs of `once/` with one stall of each kind (headers
    then no body; no answer at all) and then normally, of `always/` with
    stalls only (half a body then nothing, too), and of `trickle/` with a
    body trickling at 2 bytes/s (never a stall). A stall is abandoned after
    its window (2 s, doubling with each stall of the same GET, up to 15 s)
    and retried; every GET of an object ends within the retry budget
    (`--request-timeout-s`, 20 s here against the default 60 s, so the
    test waits a third as long): then EIO, with a log line naming key,
    range and cause (the stall, or the timeout of the trickle)."""
    import threading

    from s3_fault_proxy import FaultProxy

    budget_s = 20
    for name in ("once", "always", "trickle"):
        upload_tree(s3_server["client"], main_ckpt["out_dir"], f"stalls/{name}/")
    proxy = FaultProxy(s3_server["port"], seed=3, p_slowdown=0, p_reset=0, p_truncate=0, stall_s=300)
    try:
        with mount_factory(f"s3://{BUCKET}/stalls", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                           "--readahead-mib", "0", "--rescan-ms", "0",
                           "--request-timeout-s", str(budget_s)) as m:
            ref = _reference_consolidated(m, "once", main_ckpt["expected"])
            # Opened (and so loaded: its sidecars are read) before the faults,
            # with O_DIRECT: each read reaches the daemon.
            fds = {name: os.open(m.p(name, "consolidated", "model.safetensors"), os.O_RDONLY | os.O_DIRECT)
                   for name in ("once", "always", "trickle")}
            for name, fd in fds.items():
                assert os.pread(fd, len(ref), 0) == ref, name
            proxy.set_script({"/stalls/once/": ["stall_headers", "stall_silent"],
                              "/stalls/always/": ["stall_headers", "stall_silent", "stall_body"] * 20,
                              "/stalls/trickle/": ["trickle"] * 20})
            off, n = len(ref) // 2, 4096
            results = {name: {} for name in ("once", "always", "trickle")}
            threads = [threading.Thread(target=_timed_pread, daemon=True,
                                        args=(fds[name], n, off, out))
                       for name, out in results.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=150)
            log = m.log()
            assert not any(t.is_alive() for t in threads), (
                {k: v for k, v in results.items()}, "a read still waits after 150 s", log[-3000:])
            for fd in fds.values():
                os.close(fd)
    finally:
        proxy.close()
    once, always, trickle = results["once"], results["always"], results["trickle"]
    # Two stalls of 2 s each (libcurl looks at an idle transfer about once
    # a second), then the bytes (a range over both shards stalls the two
    # GETs side by side: one stall's time).
    assert once.get("data") == ref[off:off + n], once
    assert 1.5 < once["seconds"] < 10, once["seconds"]
    for name, r in (("always", always), ("trickle", trickle)):
        assert "error" in r and r["error"].errno == errno.EIO, (name, r)
        # Not before the budget's end (less the last window cut short), and
        # the read's GETs of both shards side by side, not one after another.
        assert 0.7 * budget_s < r["seconds"] < budget_s + 20, (name, r["seconds"])
        lines = [line for line in log.splitlines() if f"GET stalls/{name}/" in line and "failed" in line]
        assert lines, (name, log[-3000:])
        assert "bytes [" in lines[0] and ("stall (no byte for" if name == "always" else "timeout (") in lines[0], lines[0]
    assert proxy.counts["stall_headers"] >= 2 and proxy.counts["stall_silent"] >= 2, proxy.counts
    assert proxy.counts["stall_body"] >= 1, proxy.counts
    assert proxy.counts["trickle"] >= 1, proxy.counts


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


def test_a_read_the_server_forbids_is_eacces_and_the_log_names_credentials(s3_server, s3_env, mount_factory,
                                                                             tmp_path):
    # A GET answered 403 (a bucket policy that denies one object, or
    # credentials revoked while mounted): that read fails with EACCES, not
    # EIO, and is not retried; once the server allows it again, it reads.
    from safetensors.numpy import load, save_file
    from s3_fault_proxy import FaultProxy

    weight = np.random.default_rng(11).standard_normal((256, 512)).astype(np.float32)
    folder = tmp_path / "denied"
    folder.mkdir()
    save_file({"w": weight}, str(folder / "model.safetensors"))
    upload_tree(s3_server["client"], str(folder), "deny/one/")
    proxy = FaultProxy(s3_server["port"], seed=4, p_slowdown=0, p_reset=0, p_truncate=0, ranged_only=True)
    try:
        with mount_factory(f"s3://{BUCKET}/deny", "--endpoint-url", f"http://127.0.0.1:{proxy.port}") as m:
            path = m.p("one", "consolidated", "model.safetensors")
            size = os.path.getsize(path)
            proxy.set_script({"deny/one/model.safetensors": ["forbidden"] * 3})
            with pytest.raises(OSError) as e:
                with open(path, "rb", buffering=0) as f:
                    f.seek(size - 4096)
                    f.read(4096)
            assert e.value.errno == errno.EACCES, e.value
            forbidden = proxy.counts["forbidden"]
            proxy.set_script({})
            with open(path, "rb", buffering=0) as f:
                data = f.read()
            log = m.log()
    finally:
        proxy.close()
    np.testing.assert_array_equal(load(data)["w"], weight)
    assert "access denied (HTTP 403 AccessDenied" in log and "check the credentials" in log, log[-2000:]
    # One GET per failed read (the kernel asks twice): a 403 is not retried.
    assert forbidden >= 1 and log.count("failed (Permission denied)") == forbidden, (forbidden, log[-2000:])
    assert "attempts" not in log, log[-2000:]
