"""Bad input: ckptfs must answer with a clear error, never with wrong or zero bytes.

One real 3-rank sharded checkpoint (torch HuggingFaceStorageWriter, gloo
ranks, via ckpt_gen.py) is written once per module; each test damages a copy
of it and checks the result three ways:

- `ckptfs index` exits 5 and names the damaged file (or tensor);
- `ckptfs cat` of consolidated/model.safetensors exits non-zero and names the
  cause, and whatever it wrote to stdout is a prefix of the right bytes;
- a real FUSE mount (`ckptfs mount --log-file F`): the consolidated file is
  read one page at a time; every page that holds bytes of an unreadable
  chunk must fail with EIO, every other page must succeed, and every page
  that succeeds must equal the original tensor bytes from <name>-expected.pt;
  mirrored source files read as their on-disk bytes; the log names the cause;
  the tensors/<fqn>.npy view obeys the same page rules.

Page granularity: the kernel serves reads of the mount through the page
cache; after a failed readahead it reads single pages, so a failure stays
confined to the pages that really hold unreadable bytes. Which bytes are
unreadable is computed from the shard headers (element boxes of the chunks
that are past EOF, in a changed file, or in a tensor with a hole/overlap).
Headers of served files are read with O_DIRECT (exactly their bytes) so the
checks can run even when page 0 also holds an unreadable tensor.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _util  # noqa: E402
from harness import THIRD_PARTY  # noqa: E402
from _util import (EXIT_OK, EXIT_PROBLEMS, EXIT_READ_ERROR, EXIT_STALE,  # noqa: E402
                   PAGE, Mount, describe, run_ckptfs)

WORLD = 3
VFILE = "consolidated/model.safetensors"
ABUSE = os.path.join(THIRD_PARTY, "safetensors-cpp", "safetensors_abuse_attempt_1.safetensors")
FIXTURE_MODEL = os.path.join(THIRD_PARTY, "safetensors-cpp", "model.safetensors")

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2,
            "I8": 1, "U8": 1, "BOOL": 1}


def shard(rank: int) -> str:
    """File name of 1-based `rank` (the writer's naming)."""
    return f"shard-{rank:05d}-model-00001-of-00001.safetensors"


def _specs():
    import torch
    # Big enough that every tensor spans many pages, so one unreadable tensor
    # (or chunk) never shares all its pages with a readable one. Shard(0) and
    # Shard(1) (the column-gather path), uneven splits over 3 ranks,
    # replicated (torch stores it in one rank's file only), BF16/F32/I64.
    return {
        "a.embed": ((256, 512), torch.bfloat16, "shard0"),
        "b.up": ((256, 256), torch.float32, "shard0"),
        "c.down": ((256, 512), torch.bfloat16, "shard1"),
        "d.o_proj": ((128, 384), torch.float32, "shard1"),
        "e.norm": ((4096,), torch.float32, "replicate"),
        "f.pos": ((64, 300), torch.int64, "shard0"),
        # More replicated tensors: torch spreads them over the ranks' files
        # (here ranks 3, 3, 3), so some tensors live outside rank 2's file.
        "g.gamma": ((2048,), torch.float32, "replicate"),
        "h.beta": ((3000,), torch.bfloat16, "replicate"),
        "i.scale": ((1024,), torch.float32, "replicate"),
    }


def _tensor_bytes(t) -> bytes:
    return t.contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()


class Base:
    """The pristine checkpoint and everything known about it."""

    def __init__(self, root: str):
        import torch
        sys.path.insert(0, HERE)
        import ckpt_gen
        self.dir = os.path.join(root, "ck")
        info = ckpt_gen.write_hf_sharded(self.dir, world_size=WORLD, specs=_specs())
        self.expected_path = info["expected_path"]
        full = torch.load(self.expected_path)
        self.expected = {k: _tensor_bytes(v) for k, v in full.items()}
        self.shapes = {k: list(v.shape) for k, v in full.items()}
        # Values as tensors/<fqn>.npy presents them (BF16 -> float32, exactly).
        self.values = {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in full.items()}
        self.files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
        assert self.files == [shard(r) for r in range(1, WORLD + 1)], self.files
        # Chunks: file -> [(fqn, saved_offsets, shape, dtype, abs_begin, abs_end)].
        self.chunks: dict[str, list[tuple]] = {}
        for f in self.files:
            path = os.path.join(self.dir, f)
            n, h = _util.read_header(path)
            offs = _util.sharding_info(h)
            self.chunks[f] = [
                (fqn, offs[fqn], e["shape"], e["dtype"], 8 + n + e["data_offsets"][0],
                 8 + n + e["data_offsets"][1])
                for fqn, e in sorted(_util.entries(h).items(), key=lambda kv: kv[1]["data_offsets"][0])]

    def element_mask(self, fqn: str, pred) -> np.ndarray:
        """Bool array of fqn's global shape: True where the element lies in a
        chunk for which pred(file, chunk) is true."""
        m = np.zeros(self.shapes[fqn], dtype=bool)
        for f, chunks in self.chunks.items():
            for c in chunks:
                if c[0] == fqn and pred(f, c):
                    m[tuple(slice(o, o + s) for o, s in zip(c[1], c[2]))] = True
        return m

    def bad_masks(self, pred) -> dict[str, np.ndarray]:
        out = {}
        for fqn in self.shapes:
            m = self.element_mask(fqn, pred)
            if m.any():
                out[fqn] = m
        return out


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    assert os.access(_util.ckptfs_bin(), os.X_OK), f"no ckptfs binary at {_util.ckptfs_bin()} (set CKPTFS_BIN)"
    return Base(str(tmp_path_factory.mktemp("bad_input_base")))


class Case:
    """A fresh copy of the base checkpoint with its own index, mountpoint and log."""

    def __init__(self, base: Base, tmp: str):
        self.base = base
        self.root = os.path.join(tmp, "ck")
        shutil.copytree(base.dir, self.root)
        self.index = os.path.join(tmp, "index")
        self.mnt = os.path.join(tmp, "mnt")
        self.log_file = os.path.join(tmp, "mount.log")
        self.tmp = tmp

    def file(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def ckptfs(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return run_ckptfs(*args, index_dir=os.path.join(self.tmp, "index-default"), **kw)

    def index_(self) -> subprocess.CompletedProcess:
        return self.ckptfs("index", self.root, "--index", self.index)

    def cat(self, vpath: str = VFILE) -> subprocess.CompletedProcess:
        return self.ckptfs("cat", self.root, vpath, "--index", self.index)

    def mount(self, *extra: str) -> Mount:
        return Mount(self.root, self.mnt, self.index, self.log_file, list(extra))


@pytest.fixture
def case(base, tmp_path) -> Case:
    return Case(base, str(tmp_path))


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def expect_index_problem(c: Case, *needles: str) -> str:
    p = c.index_()
    assert p.returncode == EXIT_PROBLEMS, "index should exit 5 (problems)\n" + describe(p)
    lines = [l for l in p.stderr.splitlines() if "problem in" in l]
    assert lines, "no `ckptfs: problem in DIR: ...` line\n" + describe(p)
    for n in needles:
        assert any(n in l for l in lines), f"no problem line names {n!r}\n" + describe(p)
    return p.stderr


def expect_cat_fails(c: Case, code: int, *needles: str, prefix_of: bytes | None = None) -> None:
    p = c.cat()
    assert p.returncode == code, f"cat should exit {code}\n" + describe(p)
    for n in needles:
        assert n in p.stderr, f"cat's message does not name {n!r}\n" + describe(p)
    # Never wrong bytes: what cat wrote before failing must be right.
    if prefix_of is None:
        assert p.stdout == b"", f"cat wrote {len(p.stdout)} bytes of a file it cannot serve"
    else:
        assert prefix_of.startswith(p.stdout), "cat wrote bytes that differ from the original"


def expect_source_files_readable(c: Case, m: Mount, names) -> None:
    """Mirrored source files read, through the mount and through cat, as their
    bytes on disk (damaged or not)."""
    for name in names:
        with open(c.file(name), "rb") as f:
            disk = f.read()
        with open(m.path(name), "rb") as f:
            assert f.read() == disk, f"mounted {name} differs from the file on disk"
        p = c.cat(name)
        assert p.returncode == EXIT_OK and p.stdout == disk, f"cat {name}\n" + describe(p)


def expect_log(m: Mount, *needles: str) -> None:
    lines = [l for l in m.log().splitlines() if "failed" in l or "error" in l.lower()]
    for n in needles:
        assert any(n in l for l in lines), (
            f"no failure line in the --log-file names {n!r}; log:\n{m.log()[-4000:]}")


def expected_file(expected: dict[str, bytes], shapes: dict[str, list[int]],
                  header_bytes: bytes) -> bytes:
    """The right consolidated file for `header_bytes` (prefix + JSON as
    served): the header followed by the original tensors at its offsets.
    Tensors whose served shape differs from the original get zeros (their
    bytes must all be unreadable anyway; check_consolidated checks that)."""
    n, h = _util.header_from_bytes(header_bytes)
    ents = _util.entries(h)
    end = 8 + n + max((e["data_offsets"][1] for e in ents.values()), default=0)
    out = bytearray(end)
    out[:8 + n] = header_bytes[:8 + n]
    for fqn, e in ents.items():
        b0, b1 = e["data_offsets"]
        if fqn in expected and e["shape"] == shapes[fqn]:
            out[8 + n + b0:8 + n + b1] = expected[fqn]
    return bytes(out)


def check_pages(path: str, want: bytes, bad_bytes: np.ndarray, owner=lambda off: "") -> tuple[dict, np.ndarray]:
    """Reads `path` page by page: pages holding any byte flagged in
    bad_bytes must fail with EIO, all other pages must succeed, and every
    page that succeeds must equal `want`. Returns ({"eio", "ok"}, page_ok)."""
    size = len(want)
    problems = []
    counts = {"eio": 0, "ok": 0}
    page_ok = np.zeros(size // PAGE + 1, dtype=bool)
    for p in _util.read_pages(path):
        hi = min(p.offset - p.offset % PAGE + PAGE, size)
        must_fail = bool(bad_bytes[p.offset:hi].any())
        where = f"page at {p.offset} ({owner(p.offset)}..{owner(hi - 1)})"
        if p.data is not None:
            counts["ok"] += 1
            page_ok[p.offset // PAGE] = True
            if p.data != want[p.offset:hi]:
                problems.append(f"{where}: WRONG BYTES served")
            elif must_fail:
                problems.append(f"{where}: holds unreadable bytes but the read succeeded")
        else:
            counts["eio"] += 1
            if p.err != errno.EIO:
                problems.append(f"{where}: failed with {_util.eio_name(p.err)}, not EIO")
            elif not must_fail:
                problems.append(f"{where}: readable bytes only, but the read failed with EIO")
    assert not problems, f"{len(problems)} bad pages in {path}:\n" + "\n".join(problems[:25])
    return counts, page_ok


def read_npy_header_direct(path: str) -> bytes:
    """Magic + header of a served .npy file, read with O_DIRECT (exactly
    these bytes, whatever the data behind them)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        head = os.pread(fd, 12, 0)
        assert head[:6] == b"\x93NUMPY", head
        n = struct.unpack("<H", head[8:10])[0] + 10 if head[6] == 1 else struct.unpack("<I", head[8:12])[0] + 12
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def check_npy_view(c: "Case", mnt_dir: str, bad: dict, absent_ok: set[str] = frozenset(),
                   strict: bool = True) -> dict:
    """The tensors/<fqn>.npy view of the checkpoint: each file is the npy
    header plus the tensor's values (BF16 presented as float32). strict: the
    same page rules as check_pages; not strict (an incomplete checkpoint,
    whose contract covers only consolidated/): only "whatever reads is right"."""
    import io
    import numpy.lib.format as npf
    base = c.base
    folder = os.path.join(mnt_dir, "tensors")
    names = sorted(os.listdir(folder))
    served = {f[:-len(".npy")] for f in names if f.endswith(".npy")}
    if strict:
        assert set(base.values) - set(absent_ok) <= served <= set(base.values), sorted(served)
    stats = {"eio_files": [], "ok_files": []}
    for fqn in sorted(served):
        path = os.path.join(folder, fqn + ".npy")
        head = read_npy_header_direct(path)
        bio = io.BytesIO(head)
        version = npf.read_magic(bio)
        read = npf.read_array_header_1_0 if version == (1, 0) else npf.read_array_header_2_0
        shape, fortran, dtype = read(bio)
        exp = base.values[fqn]
        mask = bad.get(fqn, True if fqn in absent_ok else None)
        assert not fortran
        if list(shape) == list(exp.shape):
            want = head + exp.astype(dtype).tobytes()
        else:  # a wrong shape is only acceptable for a tensor none of whose bytes read
            assert mask is True or not strict, (fqn, shape, exp.shape)
            want = head + bytes(int(np.prod(shape)) * dtype.itemsize)
            mask = True
        assert os.path.getsize(path) == len(want), (fqn, os.path.getsize(path), len(want))
        bad_bytes = np.zeros(len(want), dtype=bool)
        if mask is True:
            bad_bytes[len(head):] = True
        elif mask is not None:
            bad_bytes[len(head):] = np.repeat(mask.reshape(-1), dtype.itemsize)
        if strict:
            counts, _ = check_pages(path, want, bad_bytes)
        else:
            res = _util.read_pages(path)
            wrong = [p.offset for p in res if p.data is not None
                     and p.data != want[p.offset:p.offset + len(p.data)]]
            assert not wrong, f"{path}: WRONG BYTES at pages {wrong[:10]}"
            counts = {"eio": sum(p.data is None for p in res)}
        (stats["eio_files"] if counts["eio"] else stats["ok_files"]).append(fqn)
    return stats


def check_consolidated(path: str, expected: dict[str, bytes], shapes: dict[str, list[int]],
                       bad: dict, absent_ok: set[str] = frozenset()) -> dict:
    """Reads `path` page by page. bad = {fqn: element mask (True = unreadable)
    or True for the whole tensor}. Pages with any unreadable byte must fail
    with EIO; all other pages must succeed; every page that succeeds must
    equal the original bytes. Tensors in absent_ok may be missing from the
    file (if served, they must be unreadable). Returns {"eio": pages,
    "ok": pages, "clean": tensors whose every page read, "partly": tensors
    with at least one page read, "want": the right file bytes}."""
    size = os.path.getsize(path)
    header = read_header_direct(path)
    n = len(header) - 8
    _, h = _util.header_from_bytes(header)
    ents = _util.entries(h)
    assert h.get("__metadata__", {}).get("format") == "pt", h.get("__metadata__")
    assert set(expected) - set(absent_ok) <= set(ents) <= set(expected), (
        f"served tensors {sorted(ents)}, saved {sorted(expected)}")
    bad = dict(bad, **{fqn: True for fqn in absent_ok if fqn in ents})
    want = expected_file(expected, shapes, header)
    assert size == len(want), f"{path}: size {size}, header says {len(want)}"

    bad_bytes = np.zeros(size, dtype=bool)
    for fqn, e in ents.items():
        b0, b1 = (8 + n + x for x in e["data_offsets"])
        mask = bad.get(fqn)
        if mask is True:
            bad_bytes[b0:b1] = True
            continue
        assert e["shape"] == shapes[fqn] and e["dtype"] in ITEMSIZE, (
            f"{fqn}: served as {e['dtype']}{e['shape']}, saved as {shapes[fqn]}")
        if mask is not None:
            bad_bytes[b0:b1] = np.repeat(mask.reshape(-1), ITEMSIZE[e["dtype"]])

    def owner(off: int) -> str:
        for fqn, e in ents.items():
            if 8 + n + e["data_offsets"][0] <= off < 8 + n + e["data_offsets"][1]:
                return fqn
        return "header"

    counts, page_ok = check_pages(path, want, bad_bytes, owner)
    if bad:
        assert counts["eio"] > 0
    counts["clean"] = sorted(
        fqn for fqn, e in ents.items()
        if page_ok[(8 + n + e["data_offsets"][0]) // PAGE:(8 + n + e["data_offsets"][1] - 1) // PAGE + 1].all())
    counts["partly"] = sorted(
        fqn for fqn, e in ents.items()
        if page_ok[(8 + n + e["data_offsets"][0]) // PAGE:(8 + n + e["data_offsets"][1] - 1) // PAGE + 1].any())
    counts["want"] = want
    return counts


def read_header_direct(path: str) -> bytes:
    """Prefix + JSON of a served safetensors file, read with O_DIRECT: the
    request asks for exactly these bytes, so it succeeds even when the page
    they share with the first tensor cannot be served."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = struct.unpack("<Q", os.pread(fd, 8, 0))[0]
        header = os.pread(fd, 8 + n, 0)
    finally:
        os.close(fd)
    assert len(header) == 8 + n
    return header


def check_case(c: "Case", path: str, bad: dict, absent_ok: set[str] = frozenset()) -> dict:
    return check_consolidated(path, c.base.expected, c.base.shapes, bad, absent_ok)


def check_all_eio(path: str) -> None:
    """A weight file of an incomplete checkpoint is listed with its size but
    refused at open with EIO (docs/SEMANTICS.md): a mapped read of it would
    kill the reader with SIGBUS, a failed open is an exception."""
    size = os.path.getsize(path)
    assert size > 0
    with pytest.raises(OSError) as ei:
        open(path, "rb").close()
    assert ei.value.errno == errno.EIO, _util.eio_name(ei.value.errno)


def check_load_file_raises(path: str) -> None:
    """safetensors.torch.load_file (which mmaps) raises a Python error for
    the refused file: no bus error."""
    script = ("import sys\nfrom safetensors.torch import load_file\n"
              "try:\n    load_file(sys.argv[1])\nexcept Exception as e:\n    print('RAISED', type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "RAISED" in r.stdout, (r.returncode, r.stdout, r.stderr)


def pristine_file(c: Case) -> bytes:
    """The consolidated file of the undamaged base checkpoint (via cat)."""
    p = run_ckptfs("cat", c.base.dir, VFILE, "--index", os.path.join(c.tmp, "base-index"))
    assert p.returncode == EXIT_OK, describe(p)
    return p.stdout


# ---------------------------------------------------------------------------
# the baseline: if this fails, the checks below mean nothing
# ---------------------------------------------------------------------------


def test_pristine_checkpoint_reads_exactly(case):
    p = case.index_()
    assert p.returncode == EXIT_OK, describe(p)
    got = case.cat()
    assert got.returncode == EXIT_OK, describe(got)
    n = struct.unpack("<Q", got.stdout[:8])[0]
    assert got.stdout == expected_file(case.base.expected, case.base.shapes, got.stdout[:8 + n])
    with case.mount() as m:
        counts = check_case(case, m.path(VFILE), {})
        assert counts["eio"] == 0 and counts["ok"] > 200


# ---------------------------------------------------------------------------
# a truncated shard: chunks past EOF are unavailable, the rest reads
# ---------------------------------------------------------------------------


def test_truncated_shard(case):
    base, name = case.base, shard(2)
    chunks = {ch[0]: ch for ch in base.chunks[name]}
    # Cut inside e.norm (replicated: stored in rank 2's file only), so that
    # e.norm, a.embed (rows of rank 2) and c.down (columns of rank 2) lose
    # their bytes, while f.pos, b.up, d.o_proj and g/h/i (rank 3) keep theirs.
    cut = chunks["e.norm"][4] + 100
    os.truncate(case.file(name), cut)
    bad = base.bad_masks(lambda f, ch: f == name and ch[5] > cut)
    assert set(bad) == {"e.norm", "a.embed", "c.down"}, sorted(bad)
    assert not bad["a.embed"].all() and bad["e.norm"].all()

    expect_index_problem(case, name, "truncated")
    pristine = pristine_file(case)
    expect_cat_fails(case, EXIT_READ_ERROR, name, "truncated", prefix_of=pristine)
    p = case.cat()
    assert any(f"'{t}'" in p.stderr for t in bad), "cat's message names no affected tensor\n" + describe(p)

    with case.mount() as m:
        counts = check_case(case, m.path(VFILE), bad)
        assert counts["ok"] > 100, counts  # f.pos, b.up, d.o_proj and rank 1's rows of a.embed
        expect_source_files_readable(case, m, base.files)
        expect_log(m, name, "truncated")
        npy = check_npy_view(case, m.mnt, bad)
        assert set(npy["eio_files"]) == set(bad), npy
        # A real mmap client (safetensors) gets the unaffected tensors right.
        clean = counts["clean"]
        assert {"f.pos", "b.up", "i.scale"} <= set(clean), clean
        script = textwrap.dedent("""
            import sys, torch
            from safetensors import safe_open
            exp = torch.load(sys.argv[2])
            with safe_open(sys.argv[1], "pt") as f:
                for k in sys.argv[3:]:
                    assert torch.equal(f.get_tensor(k), exp[k]), k
            print("OK")
        """)
        r = subprocess.run([sys.executable, "-c", script, m.path(VFILE), base.expected_path, *clean],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------
# files whose header cannot be parsed: the checkpoint is incomplete
# ---------------------------------------------------------------------------


def check_incomplete(case: Case, damaged: str, *needles: str) -> None:
    expect_index_problem(case, damaged, *needles)
    expect_cat_fails(case, EXIT_READ_ERROR, damaged, *needles)
    with case.mount() as m:
        check_all_eio(m.path(VFILE))
        expect_source_files_readable(case, m, sorted(os.listdir(case.root)))
        expect_log(m, damaged, "incomplete")
        if os.path.isdir(m.path("tensors")):
            check_npy_view(case, m.mnt, {}, strict=False)


@pytest.mark.parametrize("how", ["just-past-eof", "over-cap", "u64-max"])
def test_header_length_beyond_file(case, how):
    name = shard(2)
    size = os.path.getsize(case.file(name))
    n = {"just-past-eof": size - 7, "over-cap": 100_000_001, "u64-max": 2**64 - 1}[how]
    _util.set_header_length(case.file(name), n)
    check_incomplete(case, name, "header length")


def test_corrupt_json_header(case):
    name = shard(1)
    # Same length, so only the JSON is wrong: ',' -> ';' inside data_offsets.
    _util.edit_header_same_length(case.file(name), b'"data_offsets":[0,', b'"data_offsets":[0;')
    check_incomplete(case, name, "JSON")


def test_duplicate_key_header(case):
    name = shard(1)
    _, raw = _util.read_header_raw(case.file(name))
    text = raw.rstrip(b" ")
    h = json.loads(text)
    # The same entry twice: only a duplicate check can notice.
    dup = b',"f.pos":' + json.dumps(h["f.pos"], separators=(",", ":")).encode()
    assert text.endswith(b"}")
    _util.replace_header_text(case.file(name), text[:-1] + dup + b"}")
    n, raw2 = _util.read_header_raw(case.file(name))
    assert raw2.count(b'"f.pos":') == 2
    check_incomplete(case, name, "duplicate")


@pytest.mark.parametrize("how", ["invalid-utf8-byte", "lone-surrogate-escape"])
def test_non_utf8_header(case, how):
    name = shard(1)
    new = {"invalid-utf8-byte": b'"c.d\xffwn"', "lone-surrogate-escape": b'"\\ud800"'}[how]
    _util.edit_header_same_length(case.file(name), b'"c.down"', new)
    check_incomplete(case, name)


# ---------------------------------------------------------------------------
# overlapping chunks: the tensor reads as EIO, the others read
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rows-shape-shrinks", "columns-overlap-and-hole"])
def test_overlapping_chunks(case, how):
    # Edit one saved_offsets value in a shard header (same length, in place).
    fqn, rank, dim, delta = {"rows-shape-shrinks": ("b.up", 3, 0, -2),
                             "columns-overlap-and-hole": ("c.down", 2, 1, -1)}[how]
    name = shard(rank)
    off = next(ch[1] for ch in case.base.chunks[name] if ch[0] == fqn)
    new_off = list(off)
    new_off[dim] += delta
    esc = lambda o: json.dumps(f'"{fqn}": {{"saved_offsets": {json.dumps(o)}}}')[1:-1].encode()
    _util.edit_header_same_length(case.file(name), esc(off), esc(new_off))

    err = expect_index_problem(case, fqn, "overlap")
    # Only this tensor is reported: the other tensors are fine.
    problems = [l for l in err.splitlines() if "problem in" in l]
    assert len(problems) == 1 and f"'{fqn}'" in problems[0], err
    with case.mount() as m:
        counts = check_case(case, m.path(VFILE), {fqn: True})
        assert counts["ok"] > 100, counts
        assert set(counts["clean"]) >= {"e.norm", "g.gamma", "i.scale"}, counts["clean"]
        expect_source_files_readable(case, m, case.base.files)
        expect_log(m, fqn, "overlap")
        npy = check_npy_view(case, m.mnt, {fqn: True})
        assert npy["eio_files"] == [fqn], npy
    expect_cat_fails(case, EXIT_READ_ERROR, f"'{fqn}'", "overlap", prefix_of=counts["want"])


def test_overlapping_chunks_synthetic_safetensors(case, tmp_path):
    """A sharded checkpoint written with the `safetensors` library whose two
    ranks both claim rows 2..3 of 'w' (and 'v' is fine)."""
    from safetensors.numpy import save_file
    root = os.path.join(str(tmp_path), "synthetic")
    os.makedirs(root)
    w = np.arange(6 * 4, dtype=np.float32).reshape(6, 4) * 1000 + 0.5
    v = (np.arange(64 * 1024, dtype=np.float32) + 7).reshape(64, 1024)  # 256 KiB
    parts = {1: {"w": (w[0:4], [0, 0]), "v": (v[0:32], [0, 0])},
             2: {"w": (w[2:6], [2, 0]), "v": (v[32:64], [32, 0])}}
    for rank, ts in parts.items():
        info = {k: {"saved_offsets": o} for k, (_, o) in ts.items()}
        save_file({k: np.ascontiguousarray(a) for k, (a, _) in ts.items()},
                  os.path.join(root, shard(rank)),
                  metadata={"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0",
                            "format": "pt"})
    idx = os.path.join(str(tmp_path), "synthetic-index")
    p = run_ckptfs("index", root, "--index", idx)
    assert p.returncode == EXIT_PROBLEMS and "'w'" in p.stderr and "overlap" in p.stderr, describe(p)
    p = run_ckptfs("cat", root, VFILE, "--index", idx)
    assert p.returncode == EXIT_READ_ERROR and "'w'" in p.stderr and p.stdout == b"", describe(p)
    with Mount(root, os.path.join(str(tmp_path), "smnt"), idx, os.path.join(str(tmp_path), "s.log")) as m:
        counts = check_consolidated(m.path(VFILE), {"w": w.tobytes(), "v": v.tobytes()},
                                    {"w": [6, 4], "v": [64, 1024]}, {"w": True})
        assert counts["ok"] > 50, counts
        assert "'w'" in m.log() and "overlap" in m.log(), m.log()


# ---------------------------------------------------------------------------
# a missing shard: 3 ranks, rank 2's file deleted -> holes, incomplete
# ---------------------------------------------------------------------------


def test_missing_shard(case):
    """Rank 2's file is gone. Its rows/columns leave holes, and e.norm (which
    torch stored in rank 2's file only) cannot be known of any more, so the
    tensor list is untrustworthy: the checkpoint is incomplete and every
    consolidated weight file fails (a loader must not get a model that is
    silently missing a tensor). tensors/*.npy still serve each surviving
    tensor exactly, and the holes as EIO."""
    name = shard(2)
    os.remove(case.file(name))
    in_file = {ch[0] for ch in case.base.chunks[name]}
    elsewhere = {ch[0] for f, chs in case.base.chunks.items() if f != name for ch in chs}
    holes = in_file & elsewhere          # sharded tensors: rank 2's rows/columns are gone
    only_there = in_file - elsewhere     # e.norm: torch stored it in rank 2's file only
    assert holes == {"a.embed", "b.up", "c.down", "d.o_proj", "f.pos"} and only_there == {"e.norm"}

    err = expect_index_problem(case, "ranks found: 1,3", "in no chunk")
    for t in holes:
        assert any(f"'{t}'" in l and "in no chunk" in l for l in err.splitlines()), (t, err)
    expect_cat_fails(case, EXIT_READ_ERROR, "ranks found: 1,3")
    with case.mount() as m:
        check_all_eio(m.path(VFILE))
        check_load_file_raises(m.path(VFILE))
        expect_source_files_readable(case, m, [shard(1), shard(3)])
        expect_log(m, "incomplete", "ranks found: 1,3")
        assert not os.path.exists(m.path(name))
        npy = check_npy_view(case, m.mnt, {t: True for t in holes}, absent_ok=only_there)
        assert set(npy["eio_files"]) == holes | (only_there & set(npy["eio_files"])), npy
        assert {"g.gamma", "h.beta", "i.scale"} <= set(npy["ok_files"]), npy


def test_header_reads_when_first_tensor_is_unreadable(case):
    """docs/SEMANTICS.md: "A read that does not touch the affected tensor
    succeeds (for example the header of the file ...)". With f.pos (the first
    tensor of the file) made unservable by an overlap, a plain read of the
    header (what safetensors and transformers do first) must still succeed,
    and so must reading another tensor with safetensors, or no tensor of the
    file could be loaded at all."""
    fqn = "f.pos"
    name = next(f for f, chs in case.base.chunks.items() if any(ch[0] == fqn and ch[1][0] > 0 for ch in chs))
    off = next(ch[1] for ch in case.base.chunks[name] if ch[0] == fqn)
    new_off = [off[0] - 1] + list(off[1:])
    esc = lambda o: json.dumps(f'"{fqn}": {{"saved_offsets": {json.dumps(o)}}}')[1:-1].encode()
    _util.edit_header_same_length(case.file(name), esc(off), esc(new_off))
    assert case.index_().returncode == EXIT_PROBLEMS
    with case.mount() as m:
        path = m.path(VFILE)
        direct = read_header_direct(path)  # the bytes the header must have
        _, h = _util.header_from_bytes(direct)
        first = min(_util.entries(h).items(), key=lambda kv: kv[1]["data_offsets"][0])[0]
        assert first == fqn
        fd = os.open(path, os.O_RDONLY)
        try:
            try:
                got = os.pread(fd, len(direct), 0)
            except OSError as e:
                raise AssertionError(
                    f"reading the header (bytes 0..{len(direct)}) of {VFILE} failed with "
                    f"{errno.errorcode[e.errno]}: it shares a page with the unreadable tensor "
                    f"'{first}' (data starts at byte {len(direct)}, not at a page boundary)") from None
        finally:
            os.close(fd)
        assert got == direct
        assert len(direct) % 4096 == 0, len(direct)
        # A client nobody here wrote reads an intact tensor of the same file.
        code = ("import sys, numpy as np\n"
                "from safetensors import safe_open\n"
                "with safe_open(sys.argv[1], 'np') as f:\n"
                "    sys.stdout.buffer.write(np.ascontiguousarray(f.get_tensor('g.gamma')).tobytes())\n")
        p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, timeout=120)
        assert p.returncode == 0, p.stderr.decode()[-2000:]
        assert p.stdout == case.base.values["g.gamma"].tobytes()


# ---------------------------------------------------------------------------
# a source changed after indexing: mount and cat refuse (exit 4)
# ---------------------------------------------------------------------------


def _flip_data(path: str, start: int, end: int) -> None:
    """Overwrites [start, end) with different bytes (every byte changes)."""
    with open(path, "r+b") as f:
        f.seek(start)
        old = f.read(end - start)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in old))
        f.flush()
        os.fsync(f.fileno())


def _change(path: str, how: str) -> None:
    before = os.stat(path)
    time.sleep(0.02)  # let the clock tick past the indexed mtime
    if how == "rewrite-bytes":
        ds = _util.data_start(path)
        _flip_data(path, ds, os.path.getsize(path))
    elif how == "touch":
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    elif how == "append":
        with open(path, "ab") as f:
            f.write(b"\0" * 16)
    elif how == "truncate":
        os.truncate(path, before.st_size - 4096)
    elif how == "replace-by-rename":
        ds = _util.data_start(path)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        data[ds:] = bytes(b ^ 0xFF for b in data[ds:])
        tmp = path + ".new"
        with open(tmp, "wb") as f:
            f.write(data)
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size and mtime
        os.replace(tmp, path)
    else:
        raise ValueError(how)
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) != (
        before.st_size, before.st_mtime_ns, before.st_ino), "the change is invisible to stat"


@pytest.mark.parametrize("how", ["rewrite-bytes", "touch", "append"])
def test_source_changed_after_indexing(case, how):
    p = case.index_()
    assert p.returncode == EXIT_OK, describe(p)
    name = shard(3)
    _change(case.file(name), how)

    os.makedirs(case.mnt, exist_ok=True)
    try:
        r = case.ckptfs("mount", case.root, case.mnt, "--index", case.index,
                        "--log-file", case.log_file)
        assert r.returncode == EXIT_STALE, "mount of a stale index should exit 4\n" + describe(r)
        assert name in r.stderr and "ckptfs index" in r.stderr, describe(r)
        assert not _util.is_mounted(case.mnt)
    finally:
        _util.unmount(case.mnt)
    expect_cat_fails(case, EXIT_STALE, name, "ckptfs index")

    # Re-indexing is the cure the message names.
    p = case.index_()
    if how == "append":
        assert p.returncode == EXIT_PROBLEMS and "trailing bytes" in p.stderr, describe(p)
    else:
        assert p.returncode == EXIT_OK, describe(p)
        got = case.cat()
        assert got.returncode == EXIT_OK, describe(got)
        if how == "touch":
            assert got.stdout == pristine_file(case)


# ---------------------------------------------------------------------------
# a source modified after mounting: EIO for every page that needs it
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rewrite-bytes", "truncate", "replace-by-rename"])
def test_source_modified_after_mount(case, how):
    p = case.index_()
    assert p.returncode == EXIT_OK, describe(p)
    name = shard(2)
    with case.mount() as m:
        # Nothing of the consolidated file has been read (or cached) yet.
        with open(m.path(shard(1)), "rb") as f:
            assert f.read(8)
        _change(case.file(name), how)
        # Every tensor has a chunk in rank 2's file: the first read of one
        # finds the change. From then on the whole checkpoint reads as EIO
        # (docs/SEMANTICS.md), pages of ranks 1 and 3 too: a change may be a
        # new save whose other files were replaced as well.
        bad = case.base.bad_masks(lambda f, ch: f == name)
        assert set(bad) == {"a.embed", "b.up", "c.down", "d.o_proj", "e.norm", "f.pos"}, sorted(bad)
        with pytest.raises(OSError) as ei:
            with open(os.path.join(m.mnt, "tensors", "a.embed.npy"), "rb") as f:
                f.read()
        assert ei.value.errno == errno.EIO
        size = os.path.getsize(m.path(VFILE))
        fd = os.open(m.path(VFILE), os.O_RDONLY)
        try:
            for off in range(0, size, 4096):
                with pytest.raises(OSError) as ei:
                    os.pread(fd, 4096, off)
                assert ei.value.errno == errno.EIO, off
        finally:
            os.close(fd)
        for fqn in bad:
            with pytest.raises(OSError) as ei:
                with open(os.path.join(m.mnt, "tensors", fqn + ".npy"), "rb") as f:
                    f.read()
            assert ei.value.errno == errno.EIO, fqn
        expect_log(m, name, "ckptfs index")
    expect_cat_fails(case, EXIT_STALE, name, "ckptfs index")


# ---------------------------------------------------------------------------
# the safetensors-cpp abuse fixture
# ---------------------------------------------------------------------------


def test_abuse_fixture_alone(tmp_path):
    root = os.path.join(str(tmp_path), "abuse")
    os.makedirs(root)
    shutil.copy(ABUSE, root)
    name = os.path.basename(ABUSE)
    idx = os.path.join(str(tmp_path), "index")
    p = run_ckptfs("index", root, "--index", idx)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    assert name in p.stderr and "header length" in p.stderr, describe(p)
    # No tensor could be read, so no consolidated file can be served: cat
    # fails cleanly (no crash, nothing written).
    p = run_ckptfs("cat", root, VFILE, "--index", idx)
    assert p.returncode not in (0, 1) and p.returncode > 0 and p.stdout == b"", describe(p)
    with Mount(root, os.path.join(str(tmp_path), "mnt"), idx, os.path.join(str(tmp_path), "log")) as m:
        with open(m.path(name), "rb") as f, open(ABUSE, "rb") as g:
            assert f.read() == g.read()
        for f in os.listdir(m.path("consolidated")):
            if f.endswith(".safetensors"):
                check_all_eio(m.path(os.path.join("consolidated", f)))


def test_abuse_fixture_next_to_valid_file(case, tmp_path):
    root = os.path.join(str(tmp_path), "abuse2")
    os.makedirs(root)
    shutil.copy(ABUSE, root)
    shutil.copy(FIXTURE_MODEL, root)
    name = os.path.basename(ABUSE)
    case.root = root
    expect_index_problem(case, name, "header length")
    expect_cat_fails(case, EXIT_READ_ERROR, name, "incomplete")
    with case.mount() as m:
        check_all_eio(m.path(VFILE))
        expect_source_files_readable(case, m, [name, "model.safetensors"])
        expect_log(m, name, "incomplete")
