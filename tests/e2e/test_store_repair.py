"""A damaged store is rebuilt by `ckptfs index` (and `mount --reindex`),
and then serves the right bytes; a directory without ckptfs's marker is
never rebuilt, nor anything in it deleted.

Damage is 64 bytes flipped in an SST's data blocks (the index and footer
are at its end): in the middle of the largest, or in the block that holds a
checkpoint's first rows. No open notices it; only the reads that hit it do.
Expected tensors are computed here (test_store.full_tensor), never read
back through ckptfs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness import Mounted, describe, require_bin
from test_store import EXIT_INDEX_ERROR, ckptfs, full_tensor, make_checkpoint, npy, tree_hash

STEPS, TENSORS = 3, 20_000  # 60,000 tensor rows


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    require_bin()
    root = tmp_path_factory.mktemp("repair") / "root"
    for s in range(STEPS):
        make_checkpoint(root / f"step_{s:03d}", s, TENSORS)
    return root


def build(root: Path, index: Path) -> None:
    p = ckptfs("index", root, "--index", index)
    assert p.returncode == 0, describe(p)


def block_of_first_row(sst: Path, step: str, scratch: Path) -> int | None:
    """The offset in ``sst`` of the data block that holds ``step``'s first
    row (its first source file row), or None if ``sst`` holds none of its
    rows. Found with RocksDB's own sst_dump (rocksdb-tools, installed by
    tools/setup.sh), which lists every data block with its handle and its
    keys: the blocks are LZ4-compressed, so whether a key appears in their
    bytes verbatim is up to the compressor."""
    copy = scratch / sst.name  # sst_dump writes its dump beside the file
    shutil.copyfile(sst, copy)
    p = subprocess.run(["sst_dump", f"--file={copy}", "--command=raw"], capture_output=True, text=True)
    assert p.returncode == 0, describe(p)
    first = (f"d/{step}".encode() + b"\x00f").hex().upper()
    handle = None
    with open(scratch / f"{copy.stem}_dump.txt", "rb") as dump:
        for line in dump:
            if line.startswith(b"Data Block # "):
                handle = line.split(b" @ ")[1].strip().decode()
            elif handle and line.lstrip().startswith(b"HEX") and line.split()[1].decode().startswith(first):
                return varint(bytes.fromhex(handle))
    return None


def varint(data: bytes) -> int:
    """The first unsigned LEB128 varint of ``data`` (a block handle's offset)."""
    value = 0
    for i, b in enumerate(data):
        value |= (b & 0x7F) << (7 * i)
        if b < 0x80:
            return value
    raise ValueError(f"truncated varint {data.hex()}")


def damage(index: Path, where: str) -> bytes:
    """Flips 64 bytes of a store SST and returns them as they now are.
    ``where``: "files", at the start of the data block that holds step_001's
    first rows (its source file rows, which every command reads first and
    which `index` seeks to before replacing the checkpoint's rows); "middle",
    in the middle of the largest SST (tensor rows). Any flipped byte of a
    block fails that block's checksum when it is read."""
    if where == "files":
        scratch = index.parent / "sst_dump"
        scratch.mkdir(exist_ok=True)
        found = [(sst, block_of_first_row(sst, "step_001", scratch)) for sst in index.glob("*.sst")]
        found = [(sst, at) for sst, at in found if at is not None]
        assert len(found) == 1, found
        sst, at = found[0]
    else:
        sst = max(index.glob("*.sst"), key=lambda p: p.stat().st_size)
        at = sst.stat().st_size // 2
    data = sst.read_bytes()
    assert len(data) > 64 * 1024, "the store should span many data blocks"
    flipped = bytes(b ^ 0xFF for b in data[at:at + 64])
    with open(sst, "r+b") as f:
        f.seek(at)
        f.write(flipped)
    return flipped


def assert_gone(index: Path, flipped: bytes) -> None:
    """No file of the store holds the damaged bytes any more (a store that
    merely shadows them still fails the compaction that reads them)."""
    holding = [p.name for p in index.iterdir() if p.is_file() and flipped in p.read_bytes()]
    assert holding == [], holding


def assert_damaged(root: Path, index: Path) -> None:
    """The damage is seen: a checkpoint cannot be loaded."""
    p = ckptfs("ls", root, "--index", index)
    assert "Corruption" in p.stderr, describe(p)


SAMPLES = [(s, k) for s in range(STEPS) for k in (0, 1, TENSORS // 2, TENSORS - 1)]


def assert_serves(root: Path, index: Path) -> None:
    """ls, check and cat work, and the tensors hold what was written."""
    p = ckptfs("ls", root, "--index", index, "--json")
    assert p.returncode == 0 and p.stderr == "", describe(p)
    assert len(json.loads(p.stdout)) == STEPS * TENSORS
    p = ckptfs("check", root, "--index", index)
    assert p.returncode == 0, describe(p)
    for s, k in SAMPLES:
        got = npy(root, index, f"step_{s:03d}/tensors/layer.{k}.w.npy")
        assert np.array_equal(got, full_tensor(s, k)), (s, k)


@pytest.mark.parametrize("where", ["files", "middle"])
def test_index_rebuilds_a_damaged_store(root, tmp_path, where):
    index = tmp_path / "idx"
    build(root, index)
    flipped = damage(index, where)
    assert_damaged(root, index)
    p = ckptfs("index", root, "--index", index)
    assert p.returncode == 0, describe(p)
    assert "damaged" in p.stderr and "rebuilt" in p.stderr, describe(p)
    assert_gone(index, flipped)
    assert_serves(root, index)
    assert (index / "CKPTFS_STORE").is_file()
    # Repaired for good: the next run finds nothing to rebuild.
    p = ckptfs("index", root, "--index", index)
    assert p.returncode == 0 and "rebuilt" not in p.stderr, describe(p)


def test_mount_reindex_rebuilds_a_damaged_store_and_serves_it(root, tmp_path):
    index = tmp_path / "idx"
    build(root, index)
    flipped = damage(index, "files")
    assert_damaged(root, index)
    with Mounted(root, "--index", str(index), "--reindex", base_dir=str(tmp_path)) as m:
        for s, k in SAMPLES:
            got = np.load(m.p(f"step_{s:03d}", "tensors", f"layer.{k}.w.npy"))
            assert np.array_equal(got, full_tensor(s, k)), (s, k)
    assert_gone(index, flipped)
    # The mount left a sound store behind for the commands after it.
    assert_serves(root, index)


def test_a_damaged_store_without_the_marker_is_left_untouched(root, tmp_path):
    """The same damage in a directory that lost ckptfs's marker: no longer
    recognisably ckptfs's, so `index` refuses it and deletes nothing."""
    index = tmp_path / "idx"
    build(root, index)
    damage(index, "files")
    os.unlink(index / "CKPTFS_STORE")
    (tmp_path / "mnt").mkdir()
    before = tree_hash(tmp_path)
    # (-f: a background mount would create its log beside the index)
    for args in (("index", root), ("mount", root, tmp_path / "mnt", "-f", "--reindex")):
        p = ckptfs(*args, "--index", index)
        assert p.returncode == EXIT_INDEX_ERROR, describe(p)
        assert "not a ckptfs index" in p.stderr, describe(p)
        assert tree_hash(tmp_path) == before
