"""ckptfs mount, end to end: the tree, the bytes, and read-only semantics.

The reference for every consolidated file is built here, from the original
tensors, with a small safetensors serializer of our own (never from ckptfs
output): header = compact JSON with __metadata__ {"format": "pt"} first,
then the tensors ordered by dtype size (descending) then name, each
{"dtype", "shape", "data_offsets"}; padded with spaces so the data starts
on a 4096-byte (page) boundary (still a multiple of 8, as the format asks).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import random
import stat
import struct
import threading

import pytest
import torch
from safetensors import safe_open

from conftest import (MAIN_EXTRA_FILES, MAIN_SIDECARS, MAPPING_NUM_FILES, SPLIT_BYTES,
                      is_mounted)

# ---------------------------------------------------------------------------
# independent reference: safetensors serializer
# ---------------------------------------------------------------------------

ST_DTYPE = {
    torch.float64: ("F64", 8), torch.int64: ("I64", 8), torch.uint64: ("U64", 8),
    torch.float32: ("F32", 4), torch.int32: ("I32", 4), torch.uint32: ("U32", 4),
    torch.float16: ("F16", 2), torch.bfloat16: ("BF16", 2), torch.int16: ("I16", 2),
    torch.uint16: ("U16", 2), torch.int8: ("I8", 1), torch.uint8: ("U8", 1),
    torch.bool: ("BOOL", 1),
}
VFILE_MODE = stat.S_IFREG | 0o444
VDIR_MODE = stat.S_IFDIR | 0o555
# virtual views besides consolidated/ (docs/ARCHITECTURE.md), checked only for modes here
OTHER_VIEWS = ("mesh", "tensors")


def raw_bytes(t: torch.Tensor) -> bytes:
    """Row-major little-endian bytes of `t`."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * ST_DTYPE[t.dtype][1]


def st_serialize(tensors: dict[str, torch.Tensor]) -> bytes:
    order = sorted(tensors, key=lambda n: (-ST_DTYPE[tensors[n].dtype][1], n))
    header: dict = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name in order:
        t = tensors[name]
        b = raw_bytes(t)
        assert len(b) == nbytes(t)
        header[name] = {"dtype": ST_DTYPE[t.dtype][0], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    hj += b" " * (-(8 + len(hj)) % 4096)
    return struct.pack("<Q", len(hj)) + hj + b"".join(blobs)


def st_parse(data: bytes) -> tuple[dict, int]:
    """(header incl. __metadata__, offset of the data section)."""
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), 8 + n


def st_tensor_bytes(data: bytes) -> dict[str, bytes]:
    header, start = st_parse(data)
    return {k: data[start + v["data_offsets"][0]:start + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


def greedy_groups(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The size split: tensors in name order, a new file when the next
    non-empty tensor would take a non-empty file past max_bytes."""
    groups: list[list[str]] = []
    cur = 0
    for name in sorted(tensors):
        nb = nbytes(tensors[name])
        if not groups or (cur > 0 and cur + nb > max_bytes):
            groups.append([])
            cur = 0
        groups[-1].append(name)
        cur += nb
    return groups


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def reference_consolidated(tensors: dict[str, torch.Tensor],
                           groups: list[list[str]]) -> tuple[dict[str, bytes], dict | None]:
    """({file name: bytes}, expected index.json or None)."""
    if len(groups) == 1:
        return {"model.safetensors": st_serialize(tensors)}, None
    files, weight_map, total = {}, {}, 0
    for i, g in enumerate(groups):
        name = shard_name(i, len(groups))
        files[name] = st_serialize({k: tensors[k] for k in g})
        for k in g:
            weight_map[k] = name
            total += nbytes(tensors[k])
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    return files, index


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()

# ---------------------------------------------------------------------------
# expected trees
# ---------------------------------------------------------------------------


def source_tree(root: str) -> dict:
    """{relpath: (mode minus write bits, size, sha256)} of the real tree
    (dirs: (mode, None, None))."""
    out = {".": (os.lstat(root).st_mode & ~0o222, None, None)}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            out[os.path.relpath(p, root)] = (os.lstat(p).st_mode & ~0o222, None, None)
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode & ~0o222, st.st_size, sha(read_file(p)))
    return out


def mount_tree(mnt: str) -> dict:
    out = {".": (os.lstat(mnt).st_mode, None, None)}
    for dirpath, dirnames, filenames in os.walk(mnt):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            out[os.path.relpath(p, mnt)] = (os.lstat(p).st_mode, None, None)
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            st = os.lstat(p)
            data = read_file(p)
            assert len(data) == st.st_size, f"{p}: read {len(data)} bytes, stat says {st.st_size}"
            out[os.path.relpath(p, mnt)] = (st.st_mode, st.st_size, sha(data))
    return out


class Expected:
    """What one mount should show."""

    def __init__(self, root: str, tensors: dict, groups: list[list[str]],
                 sidecars: dict[str, str]):
        self.root = root
        self.tensors = tensors
        self.groups = groups
        self.files, self.index = reference_consolidated(tensors, groups)
        self.sidecars = {name: read_file(os.path.join(root, rel))
                         for name, rel in sidecars.items()}
        # A view is readable by a class only when every source file grants
        # read and every directory below the checkpoint grants search
        # (SEMANTICS "Permissions"); all files of this fixture are sources.
        bits = 0o444
        for dirpath, dirnames, filenames in os.walk(root):
            for d in dirnames:
                bits &= (os.lstat(os.path.join(dirpath, d)).st_mode & 0o111) << 2
            for f in filenames:
                bits &= os.lstat(os.path.join(dirpath, f)).st_mode & 0o444
        self.vfile, self.vdir = stat.S_IFREG | bits, stat.S_IFDIR | bits | (bits >> 2)
        VFILE_MODE, VDIR_MODE = self.vfile, self.vdir
        tree = source_tree(root)
        tree["consolidated"] = (VDIR_MODE, None, None)
        for name, data in {**self.files, **self.sidecars}.items():
            tree["consolidated/" + name] = (VFILE_MODE, len(data), sha(data))
            for d in range(name.count("/")):  # a sidecar folder's directories
                tree["consolidated/" + name.rsplit("/", d + 1)[0]] = (VDIR_MODE, None, None)
        if self.index is not None:
            tree["consolidated/model.safetensors.index.json"] = (VFILE_MODE, "json", "json")
        self.tree = tree


def _main_expected(info) -> Expected:
    return Expected(info["out_dir"], info["expected"], [sorted(info["expected"])],
                    MAIN_SIDECARS)


def _split_expected(info) -> Expected:
    return Expected(info["out_dir"], info["expected"],
                    greedy_groups(info["expected"], SPLIT_BYTES), MAIN_SIDECARS)


def _mapping_expected(info) -> Expected:
    mapping = info["fqn_to_index_mapping"]
    n = max(mapping.values())
    groups = [sorted(k for k, v in mapping.items() if v == i + 1) for i in range(n)]
    return Expected(info["out_dir"], info["expected"], groups,
                    {"config.json": ".hf_metadata/config.json"})


@pytest.fixture(scope="module")
def main_expected(main_ckpt):
    return _main_expected(main_ckpt)


@pytest.fixture(scope="module")
def split_expected(main_ckpt):
    return _split_expected(main_ckpt)


@pytest.fixture(scope="module")
def mapping_expected(mapping_ckpt):
    return _mapping_expected(mapping_ckpt)


VIEWS = {
    "main": ("main_mount", "main_expected"),
    "split": ("main_split_mount", "split_expected"),
    "mapping": ("mapping_mount", "mapping_expected"),
}


@pytest.fixture(params=list(VIEWS))
def view(request):
    m, e = VIEWS[request.param]
    return request.getfixturevalue(m), request.getfixturevalue(e)


# ---------------------------------------------------------------------------
# sanity of the reference itself (so a wrong reference cannot hide a bug)
# ---------------------------------------------------------------------------


def test_reference_serializer_round_trips(main_ckpt):
    from safetensors.torch import load as st_load
    data = st_serialize(main_ckpt["expected"])
    loaded = st_load(data)
    assert set(loaded) == set(main_ckpt["expected"])
    for k, t in main_ckpt["expected"].items():
        assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape, k
        assert raw_bytes(loaded[k]) == raw_bytes(t), k
    n = struct.unpack("<Q", data[:8])[0]
    assert n % 8 == 0


def test_generated_checkpoint_is_really_sharded(main_ckpt, mapping_ckpt):
    # two ranks wrote; Shard(0) with 7 rows is split 4 + 3 on disk
    for info in (main_ckpt, mapping_ckpt):
        shards = [f for f in info["files"] if f.endswith(".safetensors")]
        assert {f.split("-model-")[0] for f in shards} == {"shard-00001", "shard-00002"}
    rows = sorted(h["model.embed_tokens.weight"]["shape"][0]
                  for h in main_ckpt["headers"].values() if "model.embed_tokens.weight" in h)
    assert rows == [3, 4]
    cols = sorted(h["model.layers.0.mlp.down_proj.weight"]["shape"][1]
                  for h in main_ckpt["headers"].values()
                  if "model.layers.0.mlp.down_proj.weight" in h)
    assert cols == [4, 5]
    # the mapping checkpoint really has several files per rank
    assert len([f for f in mapping_ckpt["files"] if f.startswith("shard-00001")]) > 1


# ---------------------------------------------------------------------------
# the tree
# ---------------------------------------------------------------------------


def test_tree_matches_expected(view):
    mount, exp = view
    got = mount_tree(mount.path)
    # The views' read bits follow the sources' (SEMANTICS "Permissions",
    # tested class by class in test_access.py): here the owner may read, no
    # class may write, and every view entry has the bits consolidated/ has.
    bits = got["consolidated"][0] & 0o444
    assert got["consolidated"][0] == stat.S_IFDIR | bits | (bits >> 2) and bits & 0o400, oct(got["consolidated"][0])
    vfile, vdir = stat.S_IFREG | bits, stat.S_IFDIR | bits | (bits >> 2)
    swap = {exp.vfile: vfile, exp.vdir: vdir}
    want = {k: (swap.get(m, m) if k.split("/")[0] == "consolidated" else m, size, h)
            for k, (m, size, h) in exp.tree.items()}
    exp.vfile, exp.vdir = vfile, vdir
    index_rel = "consolidated/model.safetensors.index.json"
    if exp.index is not None:
        assert index_rel in got, sorted(got)
        mode, size, _ = got[index_rel]
        assert mode == exp.vfile
        index_data = read_file(mount.p(index_rel))
        assert size == len(index_data)
        assert json.loads(index_data) == exp.index
        got[index_rel] = want[index_rel]
    # other views (mesh/, tensors/) are not this test's subject: only check
    # that they are virtual and read-only, then leave them out
    for rel in [k for k in got if k.split("/")[0] in OTHER_VIEWS and k not in want]:
        mode = got.pop(rel)[0]
        assert mode in (exp.vfile, exp.vdir), (rel, oct(mode))
    assert sorted(got) == sorted(want)
    diffs = {k: (oct(got[k][0]), got[k][1], oct(want[k][0]), want[k][1])
             for k in want if got[k] != want[k]}
    assert not diffs, f"entries differ (got mode,size vs want mode,size): {diffs}\nlog: {mount.log()}"


def test_source_files_keep_their_modes(main_mount, main_ckpt):
    # spot checks of the mirrored modes (independent of the tree walk)
    for rel, (mode, data) in MAIN_EXTRA_FILES.items():
        st = os.stat(main_mount.p(rel))
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == mode & ~0o222, rel
        assert st.st_size == len(data)
        assert read_file(main_mount.p(rel)) == data
    st = os.stat(main_mount.p("scripts/run.sh"))
    assert st.st_mode & stat.S_IXUSR
    assert stat.S_IMODE(os.stat(main_mount.p("empty_dir")).st_mode) == 0o550
    assert os.listdir(main_mount.p("empty_dir")) == []


def test_consolidated_header_rules(view):
    mount, exp = view
    for name in exp.files:
        data = read_file(mount.p("consolidated", name))
        n = struct.unpack("<Q", data[:8])[0]
        assert n % 8 == 0, name
        raw = data[8:8 + n]
        assert raw == raw.rstrip(b" ") + b" " * (len(raw) - len(raw.rstrip(b" ")))
        header = json.loads(raw)
        assert next(iter(header)) == "__metadata__"
        assert header["__metadata__"] == {"format": "pt"}
        names = [k for k in header if k != "__metadata__"]
        sizes = {k: ST_DTYPE[exp.tensors[k].dtype][1] for k in names}
        assert names == sorted(names, key=lambda k: (-sizes[k], k)), name
        # data offsets are contiguous from 0 and end at the end of the file
        off = 0
        for k in names:
            b, e = header[k]["data_offsets"]
            assert b == off, (name, k)
            off = e
        assert 8 + n + off == len(data)


def test_split_view_index(main_split_mount, split_expected, main_ckpt):
    cons = main_split_mount.p("consolidated")
    names = sorted(os.listdir(cons))
    st_files = [f for f in names if f.endswith(".safetensors")]
    n = len(st_files)
    assert n >= 5, names
    assert st_files == [shard_name(i, n) for i in range(n)]
    assert "model.safetensors" not in names
    index = json.loads(read_file(os.path.join(cons, "model.safetensors.index.json")))
    wm = index["weight_map"]
    tensors = main_ckpt["expected"]
    assert set(wm) == set(tensors)
    assert index["metadata"]["total_size"] == sum(nbytes(t) for t in tensors.values())
    for f in st_files:
        with safe_open(os.path.join(cons, f), "pt") as sf:
            keys = set(sf.keys())
        assert keys == {k for k, v in wm.items() if v == f}, f
        nonempty = [k for k in keys if nbytes(tensors[k]) > 0]
        assert sum(nbytes(tensors[k]) for k in keys) <= SPLIT_BYTES or len(nonempty) == 1, f
    # the documented split: greedy in name order
    assert [sorted(k for k, v in wm.items() if v == f) for f in st_files] == \
        [sorted(g) for g in split_expected.groups]


def test_mapping_split_follows_hf_metadata(mapping_mount, mapping_ckpt):
    mapping = mapping_ckpt["fqn_to_index_mapping"]
    assert os.path.exists(os.path.join(mapping_ckpt["out_dir"], ".hf_metadata",
                                       "fqn_to_file_index_mapping.json"))
    cons = mapping_mount.p("consolidated")
    names = sorted(os.listdir(cons))
    want_files = [shard_name(i, MAPPING_NUM_FILES) for i in range(MAPPING_NUM_FILES)]
    assert names == sorted(want_files + ["config.json", "model.safetensors.index.json"])
    index = json.loads(read_file(os.path.join(cons, "model.safetensors.index.json")))
    assert index["weight_map"] == {k: shard_name(v - 1, MAPPING_NUM_FILES)
                                   for k, v in mapping.items()}
    assert index["metadata"]["total_size"] == sum(
        nbytes(t) for t in mapping_ckpt["expected"].values())
    for i, f in enumerate(want_files):
        with safe_open(os.path.join(cons, f), "pt") as sf:
            assert set(sf.keys()) == {k for k, v in mapping.items() if v == i + 1}
    assert read_file(os.path.join(cons, "config.json")) == read_file(
        os.path.join(mapping_ckpt["out_dir"], ".hf_metadata", "config.json"))

# ---------------------------------------------------------------------------
# reads
# ---------------------------------------------------------------------------


def _all_files(mount, exp) -> dict[str, bytes]:
    """relpath in the mount -> reference bytes (consolidated + shards)."""
    out = {"consolidated/" + k: v for k, v in {**exp.files, **exp.sidecars}.items()}
    for f in os.listdir(exp.root):
        if f.endswith(".safetensors"):
            out[f] = read_file(os.path.join(exp.root, f))
    return out


def test_whole_file_reads(view):
    mount, exp = view
    for rel, ref in _all_files(mount, exp).items():
        p = mount.p(rel)
        assert read_file(p) == ref, rel
        # odd-sized sequential reads, uncached
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            parts, off = [], 0
            while True:
                b = os.pread(fd, 4093, off)
                if not b:
                    break
                parts.append(b)
                off += len(b)
            assert b"".join(parts) == ref, rel
        finally:
            os.close(fd)
        # O_DIRECT: every read reaches the filesystem
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.pread(fd, len(ref) + 4096, 0) == ref, rel
        finally:
            os.close(fd)


def _ranges(rng: random.Random, ref: bytes, n: int) -> list[tuple[int, int]]:
    size = len(ref)
    # tensor boundaries make the interesting offsets
    points = [0, 8, size]
    if ref[:8] and size > 8:
        header, start = st_parse(ref)
        points.append(start)
        for k, v in header.items():
            if k != "__metadata__":
                points += [start + v["data_offsets"][0], start + v["data_offsets"][1]]
    out = []
    for i in range(n):
        r = rng.random()
        if r < 0.4:
            off = max(0, rng.choice(points) + rng.randint(-9, 9))
        else:
            off = rng.randint(0, size + 16)
        kind = rng.random()
        if kind < 0.4:
            length = rng.randint(1, 64)
        elif kind < 0.8:
            length = rng.randint(65, 9000)
        else:
            length = rng.randint(1, size + 100)
        out.append((off, length))
    return out


def test_random_ranges(view):
    mount, exp = view
    rng = random.Random(20240601)
    files = _all_files(mount, exp)
    st_rel = [k for k in files if k.endswith(".safetensors")]
    checked = 0
    for rel in st_rel:
        ref = files[rel]
        n = 240 if rel.startswith("consolidated/") and len(ref) > 20000 else 40
        dfd = os.open(mount.p(rel), os.O_RDONLY | os.O_DIRECT)
        bfd = os.open(mount.p(rel), os.O_RDONLY)
        try:
            for i, (off, length) in enumerate(_ranges(rng, ref, n)):
                if i % 2:
                    got = os.pread(dfd, length, off)
                else:
                    os.posix_fadvise(bfd, 0, 0, os.POSIX_FADV_DONTNEED)
                    got = os.pread(bfd, length, off)
                assert got == ref[off:off + length], (rel, off, length)
                checked += 1
        finally:
            os.close(dfd)
            os.close(bfd)
    assert checked >= 200


def test_concurrent_random_reads(main_mount, main_expected):
    ref = main_expected.files["model.safetensors"]
    path = main_mount.p("consolidated", "model.safetensors")
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for off, length in _ranges(rng, ref, 60):
                got = os.pread(fd, length, off)
                if got != ref[off:off + length]:
                    errors.append((seed, off, length))
        except OSError as e:
            errors.append((seed, repr(e)))
        finally:
            os.close(fd)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:10]


def test_mmap(view):
    mount, exp = view
    rng = random.Random(7)
    for name, ref in exp.files.items():
        with open(mount.p("consolidated", name), "rb") as f:
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                assert len(mm) == len(ref)
                for off, length in _ranges(rng, ref, 30):
                    assert mm[off:off + length] == ref[off:off + length], (name, off, length)
                assert mm[:] == ref, name


def test_safe_open(view):
    mount, exp = view
    seen = set()
    for name in exp.files:
        with safe_open(mount.p("consolidated", name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                t = f.get_tensor(k)
                want = exp.tensors[k]
                assert t.dtype == want.dtype and t.shape == want.shape, k
                assert torch.equal(t, want), k
                assert raw_bytes(t) == raw_bytes(want), k
                seen.add(k)
    assert seen == set(exp.tensors)

# ---------------------------------------------------------------------------
# read-only: every write-type call is EROFS
# ---------------------------------------------------------------------------

SHARD = "shard-00001-model-00001-of-00001.safetensors"
FILE_TARGETS = {
    "src-file": "README.md",
    "src-exec": "scripts/run.sh",
    "src-shard": SHARD,
    "virt-safetensors": "consolidated/model.safetensors",
    "virt-sidecar": "consolidated/config.json",
}
DIR_TARGETS = {
    "src-root": "",
    "src-dir": "scripts",
    "src-empty-dir": "empty_dir",
    "virt-dir": "consolidated",
}


def _open_close(p, flags, mode=0o644):
    fd = os.open(p, flags, mode)
    os.close(fd)


def _py_open(p, mode):
    with open(p, mode) as f:
        f.write(b"x")


# op name -> (callable(mnt, path) , names it must not create (relative to path's dir or inside))
FILE_OPS = {
    "open-wronly": lambda m, p: _open_close(p, os.O_WRONLY),
    "open-rdwr": lambda m, p: _open_close(p, os.O_RDWR),
    "open-creat": lambda m, p: _open_close(p, os.O_WRONLY | os.O_CREAT),
    "open-trunc": lambda m, p: _open_close(p, os.O_WRONLY | os.O_TRUNC),
    "open-rdonly-trunc": lambda m, p: _open_close(p, os.O_RDONLY | os.O_TRUNC),
    "open-append": lambda m, p: _open_close(p, os.O_WRONLY | os.O_APPEND),
    "write-w": lambda m, p: _py_open(p, "wb"),
    "write-a": lambda m, p: _py_open(p, "ab"),
    "write-r+": lambda m, p: _py_open(p, "r+b"),
    "truncate": lambda m, p: os.truncate(p, 0),
    "truncate-grow": lambda m, p: os.truncate(p, 1 << 20),
    "unlink": lambda m, p: os.unlink(p),
    "rename": lambda m, p: os.rename(p, p + ".renamed"),
    "rename-to-root": lambda m, p: os.rename(p, os.path.join(m, "moved-here")),
    "rename-onto": lambda m, p: os.rename(os.path.join(m, "README.md"), p),
    "link": lambda m, p: os.link(p, p + ".hardlink"),
    "chmod": lambda m, p: os.chmod(p, 0o644),
    "chown": lambda m, p: os.chown(p, os.getuid(), os.getgid()),
    "utime-now": lambda m, p: os.utime(p),
    "utime-set": lambda m, p: os.utime(p, (1, 2)),
    "setxattr": lambda m, p: os.setxattr(p, "user.ckptfs", b"1"),
    "removexattr": lambda m, p: os.removexattr(p, "user.ckptfs"),
}
DIR_OPS = {
    "rmdir": lambda m, p: os.rmdir(p),
    "rename": lambda m, p: os.rename(p, p + ".renamed"),
    "chmod": lambda m, p: os.chmod(p, 0o755),
    "chown": lambda m, p: os.chown(p, os.getuid(), os.getgid()),
    "utime-now": lambda m, p: os.utime(p),
    "utime-set": lambda m, p: os.utime(p, (1, 2)),
    "setxattr": lambda m, p: os.setxattr(p, "user.ckptfs", b"1"),
    "removexattr": lambda m, p: os.removexattr(p, "user.ckptfs"),
    "mkdir-in": lambda m, p: os.mkdir(os.path.join(p, "new-dir")),
    "creat-in": lambda m, p: _open_close(os.path.join(p, "new-file"),
                                         os.O_WRONLY | os.O_CREAT | os.O_EXCL),
    "open-x-in": lambda m, p: _py_open(os.path.join(p, "new-file"), "xb"),
    "open-w-in": lambda m, p: _py_open(os.path.join(p, "new-file"), "wb"),
    "mknod-in": lambda m, p: os.mknod(os.path.join(p, "new-node"), stat.S_IFREG | 0o644),
    "mkfifo-in": lambda m, p: os.mkfifo(os.path.join(p, "new-fifo")),
    "symlink-in": lambda m, p: os.symlink("README.md", os.path.join(p, "new-link")),
    "link-in": lambda m, p: os.link(os.path.join(m, "README.md"), os.path.join(p, "new-hard")),
    "rename-in": lambda m, p: os.rename(os.path.join(m, "README.md"), os.path.join(p, "new-moved")),
    "rename-virtual-in": lambda m, p: os.rename(
        os.path.join(m, "consolidated", "config.json"), os.path.join(p, "new-moved")),
}
# The mount point itself is a directory of the parent filesystem for rmdir
# and rename (EBUSY there), so those two are not asked of the root.
CASES = ([(t, o) for t in FILE_TARGETS for o in FILE_OPS] +
         [(t, o) for t in DIR_TARGETS for o in DIR_OPS
          if not (t == "src-root" and o in ("rmdir", "rename"))])
NEW_NAMES = ["new-dir", "new-file", "new-node", "new-fifo", "new-link", "new-hard",
             "new-moved", "moved-here"]


def _snapshot(mnt: str) -> dict:
    return {rel: v[:2] for rel, v in _stat_tree(mnt).items()}


def _stat_tree(mnt: str) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(mnt):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, mnt)] = (st.st_mode, st.st_size if not stat.S_ISDIR(st.st_mode) else 0, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def main_snapshot(main_mount):
    return _snapshot(main_mount.path)


@pytest.mark.parametrize("target,op", CASES, ids=[f"{t}-{o}" for t, o in CASES])
def test_write_ops_are_erofs(main_mount, main_snapshot, target, op):
    rel = FILE_TARGETS.get(target, DIR_TARGETS.get(target))
    p = main_mount.p(rel) if rel else main_mount.path
    assert os.path.lexists(p), p
    fn = (FILE_OPS if target in FILE_TARGETS else DIR_OPS)[op]
    before = os.lstat(p)
    with pytest.raises(OSError) as ei:
        fn(main_mount.path, p)
    assert ei.value.errno == errno.EROFS, (
        f"{op} on {rel or '/'}: got {errno.errorcode.get(ei.value.errno)} ({ei.value}), want EROFS")
    after = os.lstat(p)
    assert (after.st_mode, after.st_size, after.st_mtime_ns) == (
        before.st_mode, before.st_size, before.st_mtime_ns)
    assert is_mounted(main_mount.path)
    assert _snapshot(main_mount.path) == main_snapshot


def test_erofs_leaves_no_trace_in_source(main_ckpt, main_mount):
    # after all the attempts above (same module, same mount), the source is untouched
    for name in NEW_NAMES:
        for d in ("", "scripts", "empty_dir"):
            assert not os.path.lexists(os.path.join(main_ckpt["out_dir"], d, name))
    assert os.listdir(os.path.join(main_ckpt["out_dir"], "empty_dir")) == []
    assert read_file(os.path.join(main_ckpt["out_dir"], "README.md")) == \
        MAIN_EXTRA_FILES["README.md"][1]

# ---------------------------------------------------------------------------
# the mount helper itself
# ---------------------------------------------------------------------------


def test_mount_context_unmounts_on_failure(main_ckpt, mount_factory):
    seen = {}
    with pytest.raises(RuntimeError, match="boom"):
        with mount_factory(main_ckpt["out_dir"]) as m:
            seen["path"] = m.path
            seen["log"] = m.log_path
            assert is_mounted(m.path)
            assert os.path.exists(m.p("consolidated", "model.safetensors"))
            # keep a file open: unmount must still happen (retry, then lazy)
            f = open(m.p("consolidated", "model.safetensors"), "rb")
            try:
                raise RuntimeError("boom")
            finally:
                f.close()
    assert not is_mounted(seen["path"])
    assert os.path.exists(seen["log"])


def test_xattr_and_statfs(main_mount):
    for rel in ("README.md", "consolidated/model.safetensors", "consolidated", ""):
        p = main_mount.p(rel) if rel else main_mount.path
        assert os.listxattr(p) == [], rel
        with pytest.raises(OSError) as ei:
            os.getxattr(p, "user.ckptfs")
        assert ei.value.errno == errno.ENODATA, rel
    assert os.statvfs(main_mount.path).f_flag & os.ST_RDONLY

# ---------------------------------------------------------------------------
# errors are errors, never wrong bytes
# ---------------------------------------------------------------------------


def test_truncated_shard_eio_only_where_affected(ckptfs, copy_ckpt, main_ckpt, mount_factory):
    root = copy_ckpt(main_ckpt["out_dir"])
    shard = os.path.join(root, "shard-00002-model-00001-of-00001.safetensors")
    # the last tensor in this shard is extra.flag (BOOL, 5 bytes): cut 3 of them
    with open(shard, "rb") as f:
        header, start = st_parse(f.read())
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    assert last == "extra.flag"
    os.truncate(shard, os.path.getsize(shard) - 3)
    r = ckptfs("index", root)
    assert r.returncode == 5, r.stderr.decode()
    assert "ckptfs: problem in" in r.stderr.decode()

    ref = _main_expected(main_ckpt).files["model.safetensors"]
    rh, rstart = st_parse(ref)
    b, e = rh["extra.flag"]["data_offsets"]
    assert e + rstart == len(ref)  # extra.flag is the last tensor of the file too
    with mount_factory(root) as m:
        p = m.p("consolidated", "model.safetensors")
        assert os.stat(p).st_size == len(ref)
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            # everything before the affected tensor reads exactly
            assert os.pread(fd, rstart + b, 0) == ref[:rstart + b]
            for off, length in [(rstart + b, 1), (rstart + e - 1, 1), (rstart + b - 10, 20), (0, len(ref))]:
                with pytest.raises(OSError) as ei:
                    os.pread(fd, length, off)
                assert ei.value.errno == errno.EIO, (off, length)
        finally:
            os.close(fd)
        # buffered: the header page alone still reads (a safetensors client can open it)
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            assert f.read(n) == ref[8:8 + n]
        log = m.log()
        assert "consolidated/model.safetensors" in log, log
        assert "truncated" in log, log
        # the source shard itself is mirrored as it is now
        assert read_file(m.p(os.path.basename(shard))) == read_file(shard)


def test_source_changed_while_mounted_is_eio(copy_ckpt, main_ckpt, mount_factory):
    root = copy_ckpt(main_ckpt["out_dir"])
    ref = _main_expected(main_ckpt).files["model.safetensors"]
    with mount_factory(root) as m:
        p = m.p("consolidated", "model.safetensors")
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.pread(fd, len(ref), 0) == ref
            # rewrite one shard in place: same size, other bytes, new mtime
            shard = os.path.join(root, "shard-00001-model-00001-of-00001.safetensors")
            data = bytearray(read_file(shard))
            data[-1] ^= 0xFF
            st = os.stat(shard)
            with open(shard, "r+b") as f:
                f.write(bytes(data))
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
            with pytest.raises(OSError) as ei:
                os.pread(fd, len(ref), 0)
            assert ei.value.errno == errno.EIO
        finally:
            os.close(fd)
        assert "consolidated/model.safetensors" in m.log()


def test_a_tensor_name_too_long_for_a_file_name_is_left_out_of_tensors_and_served_by_consolidated(
        mount_factory, tmp_path):
    """A tensor whose name makes a file name of more than 255 bytes (the
    most a name may have): tensors/ lists every other tensor (not EIO for the
    whole directory) and the log says which tensor has no file and why;
    consolidated/ serves both tensors exactly."""
    import numpy as np
    from safetensors.numpy import load, save_file

    long_name = "model." + "very_long_module_name." * 14 + "weight"
    assert len(long_name) + len(".npy") > 255
    want = {long_name: np.arange(6, dtype=np.float32).reshape(2, 3), "short.weight": np.ones(4, dtype=np.float32)}
    root = tmp_path / "longname"
    root.mkdir()
    save_file(want, str(root / "model.safetensors"))
    with mount_factory(str(root)) as m:
        assert os.listdir(m.p("tensors")) == ["short.weight.npy"]
        np.testing.assert_array_equal(np.load(m.p("tensors", "short.weight.npy")), want["short.weight"])
        with open(m.p("consolidated", "model.safetensors"), "rb") as f:
            got = load(f.read())
        assert set(got) == set(want)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v)
        log = m.log()
    assert f"tensors: no file for '{long_name[:64]}...': its file name would be {len(long_name) + 4} bytes" \
        in log, log[-2000:]


def test_a_non_tensor_item_whose_key_is_too_long_for_a_file_name_is_left_out_of_bytes(mount_factory, tmp_path):
    """A DCP step (dcp.save from one process) with two non-tensor items, one
    under a key that makes a file name of more than 255 bytes: bytes/ lists
    the other, which torch.load reads back as saved, and the log names the
    one left out; the tensor is served as saved."""
    import torch.distributed.checkpoint as dcp

    long_key = "trainer." + "very_long_state_name." * 13 + "step"
    assert len(long_key) + len(".pt") > 255
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    step = tmp_path / "step"
    dcp.save({"w": weight, "epoch": 7, long_key: 11}, checkpoint_id=str(step))
    with mount_factory(str(tmp_path)) as m:
        assert os.listdir(m.p("step", "bytes")) == ["epoch.pt"], m.log()[-2000:]
        assert torch.load(m.p("step", "bytes", "epoch.pt"), weights_only=False) == 7
        import numpy as np
        np.testing.assert_array_equal(np.load(m.p("step", "tensors", "w.npy")), weight.numpy())
        log = m.log()
    assert f"step/bytes: no file for '{long_key[:64]}...': its file name would be {len(long_key) + 3} bytes" \
        in log, log[-2000:]
