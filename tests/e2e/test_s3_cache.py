"""`--cache DIR --max-cache-size SIZE` on s3:// roots, against a real S3
server (SeaweedFS, tools/s3_server.py) behind a proxy that counts ranged GETs
(tools/s3_fault_proxy.py, no faults): bytes fetched once are read from the local
directory by later mounts and commands; a corrupt or truncated cache block
is fetched again, never served; the directory stays under its bound. What
is served is judged by safetensors against the arrays that were saved.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load, save_file

from s3_fault_proxy import FaultProxy
from s3_server import BUCKET, upload_tree

MIB = 1 << 20


@pytest.fixture(scope="module")
def sharded(s3_server, tmp_path_factory):
    """An HF folder of two shards (6 and 4 MiB: several 1 MiB cache blocks
    each) uploaded to s3://BUCKET/cached/model/; the saved arrays."""
    folder = tmp_path_factory.mktemp("cached") / "model"
    folder.mkdir()
    rng = np.random.default_rng(9)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((1024, 768)).astype(np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((768, 1024)).astype(np.float32),
        "model.layers.1.mlp.up_proj.weight": rng.standard_normal((512, 1024)).astype(np.float64),
        "model.norm.weight": rng.standard_normal((768,)).astype(np.float16),
    }
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    upload_tree(s3_server["client"], str(folder), "cached/model/")
    return tensors


@pytest.fixture
def proxy(s3_server):
    p = FaultProxy(s3_server["port"], seed=1, p_slowdown=0, p_reset=0, p_truncate=0)
    yield p
    p.close()


def _read_folder(folder: str) -> dict[str, bytes]:
    """Every .safetensors file of a folder, read front to back."""
    return {n: Path(folder, n).read_bytes() for n in sorted(os.listdir(folder)) if n.endswith(".safetensors")}


def _check(files: dict[str, bytes], tensors: dict) -> None:
    got = {}
    for data in files.values():
        got.update(load(data))
    assert sorted(got) == sorted(tensors)
    for k, want in tensors.items():
        assert got[k].dtype == want.dtype, k
        np.testing.assert_array_equal(got[k], want, err_msg=k)


def _final_log(m) -> str:
    """The log of an unmounted mount once its daemon has written its last
    lines (the cache's counts, then "unmounted"), which it does after
    fusermount3 returns."""
    deadline = time.monotonic() + 20
    while "unmounted " not in m.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    return m.log()


def _bytes_in(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())


def _blocks(cache: Path) -> dict[tuple[str, int], Path]:
    """The cache's block files by (identity, offset), read from their headers
    (docs/CLI.md, "--cache": magic, version, identity length, offset, ...)."""
    out = {}
    for p in (cache / "blocks").glob("*.blk"):
        head = p.read_bytes()[:40 + 4096]
        assert head[:8] == b"ckptfsCB", p
        (id_len,) = struct.unpack_from("<I", head, 12)
        (offset,) = struct.unpack_from("<Q", head, 16)
        out[(head[40:40 + id_len].decode(), offset)] = p
    return out


def _block_of(blocks: dict, key_suffix: str, offset: int) -> Path:
    found = [p for (ident, off), p in blocks.items() if off == offset and key_suffix in ident]
    assert len(found) == 1, (key_suffix, offset, sorted(blocks))
    return found[0]


def test_a_second_mount_reads_from_the_cache_and_a_bad_block_is_fetched_again(
        s3_env, sharded, proxy, mount_factory, tmp_path):
    cache = tmp_path / "cache"
    root = f"s3://{BUCKET}/cached"
    args = ("--endpoint-url", f"http://127.0.0.1:{proxy.port}", "--cache", str(cache), "--max-cache-size", "64MiB")

    def one_pass() -> tuple[dict[str, bytes], int, str]:
        with mount_factory(root, *args) as m:
            before = proxy.ranged_gets
            files = _read_folder(m.p("model", "consolidated"))
            gets = proxy.ranged_gets - before
        return files, gets, _final_log(m)

    first, gets, _ = one_pass()
    _check(first, sharded)
    assert gets > 0
    assert _bytes_in(cache) <= 64 * MIB

    second, gets, log = one_pass()
    assert second == first
    assert gets == 0, f"{gets} ranged GETs with every block cached"
    assert re.search(r"disk cache: [1-9]\d* hits, 0 misses, 0 discarded", log), log[-2000:]

    # A flipped byte in one block, another block cut short: both are
    # discarded and fetched again, and the bytes served stay exact.
    blocks = _blocks(cache)
    corrupt = _block_of(blocks, "model-00001-of-00002.safetensors", 0)
    truncated = _block_of(blocks, "model-00002-of-00002.safetensors", MIB)
    good = {p: p.read_bytes() for p in (corrupt, truncated)}
    bad = bytearray(good[corrupt])
    bad[-1] ^= 0x40
    corrupt.write_bytes(bytes(bad))
    truncated.write_bytes(good[truncated][:-1000])
    third, gets, log = one_pass()
    assert third == first
    assert 2 <= gets <= 4, gets  # one GET per bad block (two readers may both find one)
    assert re.search(r"disk cache: \d+ hits, [1-9]\d* misses, 2 discarded", log), log[-2000:]
    for p, want in good.items():
        assert p.read_bytes() == want, p  # stored again, whole
    assert _bytes_in(cache) <= 64 * MIB


def test_the_cache_directory_stays_under_its_bound(s3_env, sharded, proxy, mount_factory, tmp_path):
    # 6 MiB for a 10 MiB checkpoint: blocks are evicted as it is read.
    cache = tmp_path / "small"
    with mount_factory(f"s3://{BUCKET}/cached", "--endpoint-url", f"http://127.0.0.1:{proxy.port}",
                       "--cache", str(cache), "--max-cache-size", "6M") as m:
        folder = m.p("model", "consolidated")
        files = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                files[name] = Path(folder, name).read_bytes()
                assert _bytes_in(cache) <= 6 * MIB, name
    _check(files, sharded)
    log = _final_log(m)
    assert re.search(r"[1-9]\d* evicted", log), log[-2000:]
    assert _bytes_in(cache) <= 6 * MIB


def test_export_twice_with_a_cache_fetches_once(s3_env, sharded, proxy, ckptfs, tmp_path):
    cache = tmp_path / "cache"
    args = ("--endpoint-url", f"http://127.0.0.1:{proxy.port}", "--cache", str(cache))
    gets = []
    for out in ("one", "two"):
        before = proxy.ranged_gets
        r = ckptfs("export", f"s3://{BUCKET}/cached", "model/consolidated", str(tmp_path / out), *args)
        assert r.returncode == 0, r.stderr.decode()
        gets.append(proxy.ranged_gets - before)
        _check(_read_folder(str(tmp_path / out)), sharded)
    assert gets[0] > 0 and gets[1] == 0, gets
    assert (cache / "CACHEDIR.TAG").read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")


def test_cache_flags_that_cannot_work_are_refused(s3_env, sharded, ckptfs, tmp_path):
    root = f"s3://{BUCKET}/cached"
    path = "model/model.safetensors.index.json"
    r = ckptfs("cat", root, path, "--max-cache-size", "1G")
    assert r.returncode == 2 and b"--max-cache-size needs --cache" in r.stderr, r.stderr.decode()
    r = ckptfs("cat", root, path, "--cache", str(tmp_path / "c"), "--max-cache-size", "lots")
    assert r.returncode == 2 and b"--max-cache-size" in r.stderr, r.stderr.decode()
    r = ckptfs("cat", str(tmp_path), "config.json", "--cache", str(tmp_path / "c"))
    assert r.returncode == 2 and b"s3://" in r.stderr, r.stderr.decode()
    # A directory with files ckptfs did not write is refused, and left as it is.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    r = ckptfs("cat", root, path, "--cache", str(theirs))
    assert r.returncode == 2 and b"notes.txt" in r.stderr, r.stderr.decode()
    assert sorted(os.listdir(theirs)) == ["notes.txt"] and (theirs / "notes.txt").read_text() == "mine"
