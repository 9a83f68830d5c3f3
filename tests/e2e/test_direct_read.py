"""Direct source reads (`ckptfs mount --direct-pool-mib`) and scatter replies
serve exactly the indexed bytes, through each path.

A sharded safetensors checkpoint (np_ckpt: 4 rank files; row splits,
column splits whose 1 MiB requests have fewer and more pieces than a writev
takes, odd row pieces, a replicated tensor) is mounted with read-ahead off,
so a source range not in the page cache is read by the daemon with O_DIRECT
and not by the kernel's read-ahead into the page cache.

- On a disk filesystem with half of each shard dropped from the page cache
  (posix_fadvise DONTNEED), whole files and random ranges read through the
  mount equal the expected bytes, and the daemon's closing log line counts
  direct reads and cached bytes (both paths ran).
- On tmpfs (no O_DIRECT) the same reads are right and the daemon counts the
  files as read buffered, with no direct read.
- Shards rewritten in place while 8 threads read random ranges with their
  page cache dropped: 10^5 reads (CKPTFS_DIRECT_FAULT_READS), no wrong byte,
  every failure EIO (fault_harness.judge).

Expected bytes never come from ckptfs: a consolidated file is its own header
(checked to list exactly the generated tensors) followed by the generated
numpy arrays at its data_offsets, and checked whole with the safetensors
package; a .npy file is its numpy header followed by the array's bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

import fault_harness as fh
import harness
import np_ckpt

MiB = 1 << 20
VFILE = "consolidated/model.safetensors"
READS = int(os.environ.get("CKPTFS_DIRECT_FAULT_READS", "100000"))
THREADS = 8
ROUNDS = 10

SPECS: np_ckpt.Spec = {
    "model.embed_tokens.weight": ((2048, 256), np.float32, 0),             # 2 MiB, rows
    "model.layers.0.mlp.down_proj.weight": ((1024, 1024), np.float16, 1),  # 512 B pieces: > IOV_MAX per MiB
    "model.layers.0.mlp.up_proj.weight": ((256, 2048), np.float32, 1),     # 2 KiB pieces: 512 per MiB
    "model.layers.0.self_attn.o_proj.weight": ((512, 1031), np.float32, 1),  # odd row pieces
    "model.norm.weight": ((4096,), np.float32, None),                      # replicated
}

STATS = re.compile(r"direct reads: (\d+) \(([^)]*)\), cached ([^,]*), buffered ([^,]*), "
                   r"files without O_DIRECT (\d+), pool full (\d+)")


# ---------------------------------------------------------------------------
# where: a filesystem with O_DIRECT, and tmpfs
# ---------------------------------------------------------------------------


def fs_type(path: str) -> str:
    """The type of the filesystem holding ``path`` (longest mount point)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    with open("/proc/self/mounts") as f:
        for line in f:
            _, point, typ = line.split()[:3]
            point = point.replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, typ
    return kind


DISK_TYPES = {"ext4", "xfs", "btrfs"}


@pytest.fixture
def disk_dir(tmp_path):
    """A fresh directory on a disk filesystem with O_DIRECT: the test's temp
    dir, or one under /var/tmp where /tmp is tmpfs."""
    if fs_type(str(tmp_path)) in DISK_TYPES:
        yield str(tmp_path)
        return
    d = tempfile.mkdtemp(prefix="ckptfs-direct-", dir="/var/tmp")
    assert fs_type(d) in DISK_TYPES, f"neither {tmp_path} nor /var/tmp is on ext4/xfs/btrfs ({fs_type(d)})"
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmpfs_dir():
    assert fs_type("/dev/shm") == "tmpfs", "/dev/shm is not tmpfs here"
    d = tempfile.mkdtemp(prefix="ckptfs-direct-", dir="/dev/shm")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------
# expected bytes, from the generated arrays
# ---------------------------------------------------------------------------


def expected_consolidated(path: str, synth: np_ckpt.Synth) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header_bytes = f.read(n)
    header = json.loads(header_bytes)
    header.pop("__metadata__", None)
    assert sorted(header) == sorted(synth.tensors)
    out = bytearray(8 + n + max(e["data_offsets"][1] for e in header.values()))
    out[:8 + n] = n.to_bytes(8, "little") + header_bytes
    for fqn, e in header.items():
        want = synth.tensors[fqn]
        b, end = e["data_offsets"]
        assert e["shape"] == list(want.shape) and end - b == want.nbytes, fqn
        out[8 + n + b:8 + n + end] = want.tobytes()
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


def expected_files(m: harness.Mounted, synth: np_ckpt.Synth) -> dict[str, bytes]:
    out = {VFILE: expected_consolidated(m.p(VFILE), synth)}
    for fqn, arr in synth.tensors.items():
        rel = "tensors/" + np_ckpt.npy_name(fqn)
        out[rel] = expected_npy(m.p(rel), arr)
    return out


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def drop_cache(path: str, start: int = 0) -> None:
    """Drops the page cache of [start, end) of ``path`` (flushed first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, start, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mount(synth: np_ckpt.Synth, base: str) -> harness.Mounted:
    # Read-ahead off: it would bring the cold ranges into the page cache.
    # Direct reads on (they are off by default).
    return harness.Mounted(synth.path, "--readahead-mib", "0", "--direct-pool-mib", "64", base_dir=base,
                           index_dir=os.path.join(base, "index"))


def direct_read(path: str, off: int, n: int) -> bytes:
    """O_DIRECT read through the mount: reaches the daemon whatever the
    kernel cached of the virtual file."""
    import mmap
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, max(n, mmap.PAGESIZE))
        try:
            got = os.preadv(fd, [memoryview(buf)[:n]], off)
            return bytes(buf[:got])
        finally:
            buf.close()
    finally:
        os.close(fd)


def closing_stats(m: harness.Mounted) -> re.Match:
    """The direct-read counts the daemon logs when it ends (after unmount)."""
    deadline = time.monotonic() + 20
    while True:
        found = STATS.search(m.log())
        if found:
            return found
        assert time.monotonic() < deadline, f"no direct-read line in the log:\n{m.log()[-2000:]}"
        time.sleep(0.1)


def read_everything(m: harness.Mounted, want: dict[str, bytes], seed: int) -> None:
    """Whole files (1 MiB O_DIRECT reads, and one plain read checked with
    the safetensors package) and random ranges, all against `want`."""
    import random
    rng = random.Random(seed)
    for rel, data in want.items():
        for off in range(0, len(data), MiB):
            got = direct_read(m.p(rel), off, MiB)
            assert got == data[off:off + MiB], f"{rel}@{off}: wrong bytes"
        for _ in range(40):
            off = rng.randrange(len(data))
            n = rng.randint(1, min(len(data) - off, 3 * MiB))
            assert direct_read(m.p(rel), off, n) == data[off:off + n], f"{rel}@{off}+{n}: wrong bytes"
    with open(m.p(VFILE), "rb") as f:
        whole = f.read()
    assert whole == want[VFILE]


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


def test_half_cached_source_reads_exact_bytes(disk_dir):
    synth = np_ckpt.write(os.path.join(disk_dir, "ckpt"), world_size=4, specs=SPECS, seed=3)
    with mount(synth, disk_dir) as m:
        want = expected_files(m, synth)
        np_ckpt.check_consolidated(want[VFILE], synth)
        for r in range(synth.world_size):
            drop_cache(synth.shard(r), os.path.getsize(synth.shard(r)) // 2)
        read_everything(m, want, seed=1)
    s = closing_stats(m)
    print("\n" + s[0])
    assert int(s[1]) > 0, f"no direct read: {s[0]}"
    assert s[3] != "0 B", f"nothing read from the page cache: {s[0]}"
    assert int(s[5]) == 0, f"a disk file read buffered: {s[0]}"


def test_tmpfs_source_is_read_buffered(tmpfs_dir, tmp_path):
    synth = np_ckpt.write(os.path.join(tmpfs_dir, "ckpt"), world_size=4, specs=SPECS, seed=4)
    with mount(synth, str(tmp_path)) as m:
        want = expected_files(m, synth)
        read_everything(m, want, seed=2)
    s = closing_stats(m)
    print("\n" + s[0])
    assert int(s[1]) == 0 and s[2] == "0 B", f"direct reads on tmpfs: {s[0]}"
    assert int(s[5]) > 0, f"tmpfs files not seen as lacking O_DIRECT: {s[0]}"


def rewrite_in_place(synth: np_ckpt.Synth, stop: threading.Event) -> int:
    """Rewrites every data byte of each shard in place (np_ckpt.rewritten),
    64 KiB at a time so that reads run between the writes; returns how many
    shards were changed."""
    changed = 0
    for r in range(synth.world_size):
        path = synth.shard(r)
        start = np_ckpt.data_start(path)
        with open(path, "rb") as f:
            new = np_ckpt.rewritten(f.read(), start)
        with open(path, "r+b", buffering=0) as f:
            for at in range(start, len(new), 64 << 10):
                f.seek(at)
                f.write(new[at:at + (64 << 10)])
                if stop.wait(0.002):
                    return changed + 1
        changed += 1
    return changed


def test_source_rewritten_in_place_during_direct_reads(disk_dir):
    pristine = np_ckpt.write(os.path.join(disk_dir, "pristine"), world_size=4, specs=SPECS, seed=5)
    before, during = fh.Stats(), fh.Stats()
    direct = changed = 0
    for rnd in range(ROUNDS):
        copy = os.path.join(disk_dir, f"round{rnd}")
        shutil.copytree(pristine.path, copy)
        synth = np_ckpt.Synth(copy, pristine.world_size, pristine.specs, pristine.tensors, pristine.chunks)
        base = os.path.join(disk_dir, f"m{rnd}")
        os.makedirs(base)
        with mount(synth, base) as m:
            want = expected_files(m, synth)
            paths = [m.p(rel) for rel in want]
            oracle = list(want.values())
            for r in range(synth.world_size):
                drop_cache(synth.shard(r))
            share = READS // ROUNDS
            before.add(fh.run_reads(paths, oracle, share // 4, THREADS, seed=rnd, mmap=False))
            stop = threading.Event()
            result = {}
            mutator = threading.Thread(target=lambda: result.update(n=rewrite_in_place(synth, stop)))
            mutator.start()
            during.add(fh.run_reads(paths, oracle, share - share // 4, THREADS, seed=100 + rnd, mmap=False))
            stop.set()
            mutator.join()
            changed += result.get("n", 0)
        direct += int(closing_stats(m)[1])
    print(f"\nbefore: {before.line()}\nduring: {during.line()}\ndirect reads {direct}, shards changed {changed}")
    assert before.ok == before.reads, f"reads before any change must succeed: {before.line()}\n" + "\n".join(before.examples)
    assert during.wrong == 0, f"wrong bytes served: {during.line()}\n" + "\n".join(during.examples)
    assert during.failures() == 0, f"a failed read must be EIO: {during.line()}\n" + "\n".join(during.examples)
    assert before.reads + during.reads >= READS - 2 * THREADS * ROUNDS
    assert changed >= ROUNDS and during.eio > 0, f"no read failed although sources changed: {during.line()}"
    assert direct > 0, "the daemon read nothing with O_DIRECT"
