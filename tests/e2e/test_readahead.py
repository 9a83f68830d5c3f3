"""Read-ahead of source ranges (`ckptfs mount --readahead-mib`) never serves
wrong bytes, and does read ahead.

A sharded safetensors checkpoint of ~22 MB (np_ckpt: 4 rank files; row- and
column-split tensors, a replicated one, and 16 tensors of 512 KiB for 16
readers at once) is mounted with a small read-ahead window, so that windows
open, slide and break many times within one file.

Expected bytes are built without ckptfs: the consolidated file's header is
parsed from the file and must name exactly the generated tensors with their
dtypes and shapes; the data bytes at its offsets are the generated numpy
arrays (np_ckpt.Synth.tensors). A .npy view is its numpy header (checked with
numpy.lib.format) followed by the generated array's bytes.

Source changes are made as tests/e2e/test_faults.py makes them (every data
byte rewritten in place with the mtime set back, or a changed copy renamed
over the file) while read-ahead of the changed file has been issued: every
read after the change is EIO or the original bytes, never the new ones.
Those reads use O_DIRECT, so each one reaches the daemon (no page cache of
the virtual file hides the change) and the reads that need the changed file
must fail.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import threading
import time

import numpy as np
import pytest
from safetensors import safe_open

import harness
import np_ckpt

MiB = 1 << 20
VFILE = "consolidated/model.safetensors"
EMBED = "model.embed_tokens.weight"
STREAMS = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(16)]

SPECS: np_ckpt.Spec = {
    EMBED: ((4096, 512), np.float32, 0),                               # 8 MiB, rows
    "model.layers.0.mlp.down_proj.weight": ((1024, 2048), np.float16, 1),  # 4 MiB, columns
    "model.layers.0.self_attn.o_proj.weight": ((512, 1031), np.float32, 1),  # odd row pieces
    "model.norm.weight": ((4096,), np.float32, None),                  # replicated
}
# 16 x 512 KiB, alternately split on rows and on columns.
SPECS.update({fqn: ((256, 1024), np.float16, i % 2) for i, fqn in enumerate(STREAMS)})


# ---------------------------------------------------------------------------
# expected bytes, from the generated arrays
# ---------------------------------------------------------------------------


def expected_consolidated(path: str, synth: np_ckpt.Synth) -> bytes:
    """The bytes the consolidated file must hold: its own header (checked to
    list exactly the generated tensors) and the generated arrays at its
    data_offsets."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header_bytes = f.read(n)
    header = json.loads(header_bytes)
    header.pop("__metadata__", None)
    assert sorted(header) == sorted(synth.tensors)
    names = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    out = bytearray(8 + n + max(e["data_offsets"][1] for e in header.values()))
    out[:8 + n] = n.to_bytes(8, "little") + header_bytes
    covered = 0
    for fqn, e in header.items():
        want = synth.tensors[fqn]
        assert e["dtype"] == names[want.dtype] and e["shape"] == list(want.shape), fqn
        b, end = e["data_offsets"]
        assert end - b == want.nbytes, fqn
        out[8 + n + b:8 + n + end] = want.tobytes()
        covered += want.nbytes
    assert covered == len(out) - 8 - n, "the data buffer has bytes no tensor owns"
    return bytes(out)


def expected_npy(path: str, want: np.ndarray) -> bytes:
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
        start = f.tell()
        f.seek(0)
        head = f.read(start)
    assert (shape, fortran, dtype) == (want.shape, False, want.dtype), path
    return head + want.tobytes()


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> np_ckpt.Synth:
    return np_ckpt.write(str(tmp_path_factory.mktemp("ra") / "ckpt"), world_size=4, specs=SPECS, seed=5)


def fresh_copy(synth: np_ckpt.Synth, tmp_path) -> np_ckpt.Synth:
    """A copy of the checkpoint a test may change (same tensors)."""
    dst = tmp_path / "ckpt"
    os.makedirs(dst)
    for r in range(synth.world_size):
        with open(synth.shard(r), "rb") as f, open(dst / np_ckpt.shard_name(r), "wb") as g:
            g.write(f.read())
    return np_ckpt.Synth(str(dst), synth.world_size, synth.specs, synth.tensors, synth.chunks)


def mount(synth: np_ckpt.Synth, tmp_path, readahead_mib: int) -> harness.Mounted:
    return harness.Mounted(synth.path, "--readahead-mib", str(readahead_mib), base_dir=str(tmp_path),
                           index_dir=str(tmp_path / "index"))


class Direct:
    """O_DIRECT reads of a file of the mount: each one reaches the daemon."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.size = os.fstat(self.fd).st_size

    def read(self, off: int, n: int) -> tuple[bytes | None, int | None]:
        n = min(n, self.size - off)
        buf = mmap.mmap(-1, max(n, mmap.PAGESIZE))  # page-aligned
        try:
            got = os.preadv(self.fd, [memoryview(buf)[:n]], off)
            return bytes(buf[:got]), None
        except OSError as e:
            return None, e.errno
        finally:
            buf.close()

    def close(self) -> None:
        os.close(self.fd)


def shard_range(path: str, fqn: str) -> tuple[int, int]:
    """[lo, hi) of `fqn`'s bytes in a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        b, e = json.loads(f.read(n))[fqn]["data_offsets"]
    return 8 + n + b, 8 + n + e


def _check(got: bytes | None, err: int | None, want: bytes, what: str) -> None:
    assert err is None, f"{what}: {errno.errorcode.get(err, err)}"
    assert got == want, f"{what}: wrong bytes"


# ---------------------------------------------------------------------------
# read-ahead happens, and only when asked for
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("readahead_mib", [16, 0])
def test_sequential_reader_gets_its_sources_read_ahead(synth, tmp_path, readahead_mib):
    """Two sequential requests at the start of tensors/<embed>.npy (rows
    split over 4 ranks, 2 MiB each) make the daemon hint the next 16 MiB:
    the pages of ranks 2 and 3, which no request has touched, come into the
    page cache. With --readahead-mib 0 they stay out."""
    rel = "tensors/" + np_ckpt.npy_name(EMBED)
    far = [(synth.shard(r), *shard_range(synth.shard(r), EMBED)) for r in (2, 3)]
    with mount(synth, tmp_path, readahead_mib) as m:
        want = expected_npy(m.p(rel), synth.tensors[EMBED])
        for r in range(synth.world_size):
            harness.evict(synth.shard(r))
        assert sum(harness.resident_bytes(*f) for f in far) == 0, "eviction failed: the check below would mean nothing"
        d = Direct(m.p(rel))  # open until the end: closing it cancels its read-ahead
        try:
            for off in (0, 256 << 10):
                _check(*d.read(off, 256 << 10), want[off:off + (256 << 10)], f"{rel}@{off}")
            total = sum(hi - lo for _, lo, hi in far)
            deadline = time.monotonic() + 10
            while True:
                resident = sum(harness.resident_bytes(*f) for f in far)
                if readahead_mib == 0 or resident >= total or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if readahead_mib:
                assert resident >= total, f"only {resident} of {total} bytes read ahead"
            else:
                time.sleep(0.5)
                resident = sum(harness.resident_bytes(*f) for f in far)
                assert resident == 0, f"{resident} bytes read ahead with read-ahead off"
        finally:
            d.close()


# ---------------------------------------------------------------------------
# access patterns that switch mid-file
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["direct", "page-cache"])
def test_sequential_then_random_mid_file(synth, tmp_path, how):
    """Sequential to the middle, random ranges, sequential again from
    elsewhere, random again: every byte equals the generated tensors."""
    rng = random.Random(17)
    with mount(synth, tmp_path, 1) as m:
        for rel in (VFILE, "tensors/" + np_ckpt.npy_name("model.layers.0.mlp.down_proj.weight")):
            path = m.p(rel)
            want = (expected_consolidated(path, synth) if rel == VFILE else
                    expected_npy(path, synth.tensors["model.layers.0.mlp.down_proj.weight"]))
            size = len(want)
            assert os.path.getsize(path) == size
            if how == "direct":
                d = Direct(path)
                read = d.read
                step, align = 128 << 10, mmap.PAGESIZE
            else:
                fd = os.open(path, os.O_RDONLY)
                read = lambda off, n: (os.pread(fd, n, off), None)  # noqa: E731
                step, align = 100_003, 1
            try:
                def sequential(lo: int, hi: int) -> None:
                    for off in range(lo, hi, step):
                        n = min(step, size - off)
                        _check(*read(off, n), want[off:off + n], f"{rel} sequential @{off}")

                def randomly(count: int) -> None:
                    for _ in range(count):
                        off = rng.randrange(0, size) // align * align
                        n = min(rng.choice([1, 4096, 70_000, 1 << 20]), size - off)
                        n = max(align, n // align * align) if align > 1 else n
                        n = min(n, size - off)
                        _check(*read(off, n), want[off:off + n], f"{rel} random @{off}+{n}")

                mid = size // 2 // align * align
                sequential(0, mid)
                randomly(60)
                sequential(size // 5 // align * align, size * 3 // 5)
                randomly(60)
            finally:
                d.close() if how == "direct" else os.close(fd)


def test_safe_open_get_tensor_in_random_order(synth, tmp_path):
    """The safetensors package maps the file and faults its pages in: tensors
    fetched in a shuffled order after a sequential read of the first half."""
    with mount(synth, tmp_path, 1) as m:
        path = m.p(VFILE)
        with open(path, "rb") as f:
            f.read(os.path.getsize(path) // 2)
        names = sorted(synth.tensors)
        random.Random(3).shuffle(names)
        with safe_open(path, framework="numpy") as st:
            assert sorted(st.keys()) == sorted(names)
            for fqn in names:
                got = st.get_tensor(fqn)
                want = synth.tensors[fqn]
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), fqn


# ---------------------------------------------------------------------------
# a source changed while its bytes are being read ahead
# ---------------------------------------------------------------------------


def _rewrite_same_mtime(path: str) -> None:
    st0 = os.stat(path)
    with open(path, "rb") as f:
        orig = f.read()
    start = np_ckpt.data_start(path)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(np_ckpt.rewritten(orig, start)[start:])
    os.utime(path, ns=(st0.st_atime_ns, st0.st_mtime_ns))


def _replace_by_rename(path: str) -> None:
    st0 = os.stat(path)
    with open(path, "rb") as f:
        orig = f.read()
    tmp = path + ".new"
    with open(tmp, "wb") as f:
        f.write(np_ckpt.rewritten(orig, np_ckpt.data_start(path)))
    os.utime(tmp, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    os.replace(tmp, path)


@pytest.mark.parametrize("change", [_rewrite_same_mtime, _replace_by_rename], ids=["rewrite-same-mtime",
                                                                                  "replace-by-rename"])
def test_source_changed_while_read_ahead(synth, tmp_path, change):
    """Rank 2's file changes right after read-ahead of it was triggered
    (its old bytes are being brought into the page cache, or are there):
    every later read is EIO or the original bytes, and every read that
    needs rank 2's bytes (each row of the column-split tensor does) is EIO."""
    copy = fresh_copy(synth, tmp_path)
    step = 512 << 10
    with mount(copy, tmp_path, 16) as m:
        path = m.p(VFILE)
        want = expected_consolidated(path, copy)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            down = json.loads(f.read(n))["model.layers.0.mlp.down_proj.weight"]["data_offsets"]
        down_lo, down_hi = 8 + n + down[0], 8 + n + down[1]
        for r in range(copy.world_size):
            harness.evict(copy.shard(r))
        d = Direct(path)
        try:
            for off in (0, step):  # sequential: read-ahead of 16 MiB is queued now
                _check(*d.read(off, step), want[off:off + step], f"before the change @{off}")
            change(copy.shard(2))
            counts = {"ok": 0, "eio": 0}
            for off in range(2 * step, len(want), step):
                got, err = d.read(off, step)
                hi = min(off + step, len(want))
                if err is not None:
                    assert err == errno.EIO, f"@{off}: {errno.errorcode.get(err, err)}"
                    counts["eio"] += 1
                    continue
                assert got == want[off:hi], f"@{off}: bytes that are not the original ones"
                assert not (off < down_hi and hi > down_lo), f"@{off}: rank 2's changed bytes were served"
                counts["ok"] += 1
            assert counts["eio"] > 0, counts
        finally:
            d.close()
        assert "ckptfs index" in m.log(), m.log()


# ---------------------------------------------------------------------------
# many streams at once
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["direct", "page-cache"])
def test_sixteen_readers_stream_different_files(synth, tmp_path, how):
    """16 threads each stream their own tensors/*.npy (rows or columns split
    over the ranks) at the same time, from cold sources."""
    errors: list[str] = []
    with mount(synth, tmp_path, 1) as m:
        paths = [m.p("tensors/" + np_ckpt.npy_name(fqn)) for fqn in STREAMS]
        wants = [expected_npy(p, synth.tensors[fqn]) for p, fqn in zip(paths, STREAMS)]
        for r in range(synth.world_size):
            harness.evict(synth.shard(r))
        start = threading.Barrier(len(paths))

        def stream(path: str, want: bytes) -> None:
            try:
                start.wait()
                if how == "direct":
                    d = Direct(path)
                    try:
                        got = b"".join(d.read(off, 64 << 10)[0] or b"?" for off in range(0, len(want), 64 << 10))
                    finally:
                        d.close()
                else:
                    with open(path, "rb", buffering=0) as f:
                        got = b"".join(iter(lambda: f.read(64 << 10), b""))
                if got != want:
                    errors.append(f"{path}: wrong bytes")
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(f"{path}: {e!r}")

        threads = [threading.Thread(target=stream, args=(p, w)) for p, w in zip(paths, wants)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a reader hung"
        assert not errors, errors
