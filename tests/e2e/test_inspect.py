"""End-to-end tests of ckptfs's inspection features.

- ``tensors/<escaped fqn>.npy`` read by numpy (np.load, with and without
  ``mmap_mode='r'``) through a real FUSE mount, for every dtype, against
  oracles computed by torch / ml_dtypes / safetensors from the original data;
- ``ckptfs check`` on clean and on damaged checkpoints (hole, overlap,
  changed source, unparseable header, truncated shard);
- ``ckptfs verify [--against DIR]`` against an exported Hugging Face folder,
  before and after flipping one byte;
- golden tests of ``ls --json`` / ``--filter``, ``inspect --json`` statistics,
  exit codes and ``--help``.

Self-contained: only ``ckpt_gen.py`` (the sharded-checkpoint generator) is
imported from this directory. Every ckptfs run gets its own
CKPTFS_INDEX_DIR (a tmp dir); every mount is unmounted, even on failure.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gc
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

E2E_DIR = Path(__file__).resolve().parent
if str(E2E_DIR) not in sys.path:
    sys.path.insert(0, str(E2E_DIR))
import ckpt_gen  # noqa: E402
import harness  # noqa: E402

FIXTURES = Path(harness.THIRD_PARTY)

EXIT_OK, EXIT_USAGE, EXIT_NO_SOURCE, EXIT_STALE = 0, 2, 3, 4
EXIT_PROBLEMS, EXIT_READ_ERROR, EXIT_INDEX_ERROR = 5, 6, 8

HAVE_TORCH_E8M0 = hasattr(torch, "float8_e8m0fnu")

SUBCOMMANDS = ["index", "mount", "ls", "cat", "export", "inspect", "check", "verify"]

# Dtypes ckptfs presents as float32 in tensors/*.npy.
CONVERTED = {"BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}
NUMPY_DESCR = {"BOOL": "|b1", "U8": "|u1", "I8": "|i1", "I16": "<i2", "U16": "<u2",
               "I32": "<i4", "U32": "<u4", "I64": "<i8", "U64": "<u8", "F16": "<f2",
               "F32": "<f4", "F64": "<f8", "C64": "<c8"}
ITEMSIZE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "I16": 16, "U16": 16, "I32": 32, "U32": 32,
                 "I64": 64, "U64": 64, "F16": 16, "BF16": 16, "F32": 32, "F64": 64,
                 "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "C64": 64,
                 "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


# ---------------------------------------------------------------------------
# running ckptfs
# ---------------------------------------------------------------------------


def ckptfs_bin() -> str:
    return harness.require_bin()


class Ckptfs:
    """Runs the CLI with CKPTFS_INDEX_DIR set to a private tmp dir. stdout
    and stderr go through files (a daemon must never hold our pipes)."""

    def __init__(self, index_dir: str):
        self.bin = ckptfs_bin()
        self.index_dir = index_dir

    def env(self) -> dict:
        return dict(os.environ, CKPTFS_INDEX_DIR=self.index_dir)

    def __call__(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        return harness.run_ckptfs(*args, bin_path=self.bin, index_dir=self.index_dir,
                                  timeout=timeout, text_stdout=True)


def describe(p: subprocess.CompletedProcess) -> str:
    return "\n" + harness.describe(p, stdout_chars=4000)


@contextlib.contextmanager
def mounted(ck: Ckptfs, root: str, mnt: str, log_file: str):
    """`ckptfs mount ROOT MNT --log-file F` (it daemonizes); always unmounts
    (harness.Mounted: gc.collect first, drops numpy memmaps of the mount)."""
    with harness.Mounted(root, mnt=mnt, log_file=log_file, index_dir=ck.index_dir) as m:
        yield m.path


# ---------------------------------------------------------------------------
# safetensors files by hand
# ---------------------------------------------------------------------------


def read_header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def write_safetensors_raw(path: str, tensors: list[tuple[str, str, list[int], bytes]],
                          metadata: dict | None = None) -> None:
    """A safetensors file written byte by byte: (name, dtype, shape, data)."""
    header: dict = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    off = 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, _, _, data in tensors:
            f.write(data)


def rewrite_header(path: str, header: dict) -> None:
    """Replaces the header of `path` (keeping its data buffer)."""
    n, _ = read_header(path)
    with open(path, "rb") as f:
        f.seek(8 + n)
        data = f.read()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def set_saved_offsets(path: str, fqn: str, offsets: list[int]) -> None:
    """Edits DCP_SHARDING_INFO[fqn].saved_offsets in a sharded safetensors file."""
    _, header = read_header(path)
    meta = header["__metadata__"]
    key = "DCP_SHARDING_INFO" if "DCP_SHARDING_INFO" in meta else "dcp_custom_metadata"
    info = json.loads(meta[key])
    assert fqn in info, (fqn, path, sorted(info))
    info[fqn]["saved_offsets"] = offsets
    meta[key] = json.dumps(info)
    rewrite_header(path, header)


def pack_bits(codes: np.ndarray, bits: int) -> bytes:
    """Little-endian bit stream: element i in bits [i*bits, (i+1)*bits)."""
    codes = codes.reshape(-1).astype(np.uint64)
    assert (codes.size * bits) % 8 == 0
    out = bytearray(codes.size * bits // 8)
    acc, nacc, pos = 0, 0, 0
    for c in codes.tolist():
        acc |= (c & ((1 << bits) - 1)) << nacc
        nacc += bits
        while nacc >= 8:
            out[pos] = acc & 0xFF
            pos += 1
            acc >>= 8
            nacc -= 8
    assert nacc == 0 and pos == len(out)
    return bytes(out)


def pack_bits_fast(codes: np.ndarray, bits: int) -> bytes:
    """pack_bits for F4 (2 per byte) and F6 (4 per 3 bytes), vectorised."""
    c = codes.reshape(-1).astype(np.uint32)
    if bits == 4:
        return ((c[0::2] & 0xF) | ((c[1::2] & 0xF) << 4)).astype(np.uint8).tobytes()
    assert bits == 6 and c.size % 4 == 0
    g = c.reshape(-1, 4) & 0x3F
    v = g[:, 0] | (g[:, 1] << 6) | (g[:, 2] << 12) | (g[:, 3] << 18)
    return np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()


def escape_file_name(fqn: str) -> str:
    """views.h EscapeFileName: '%' -> %25, '/' -> %2F; "", ".", ".." escaped
    entirely ("" -> a lone '%', the one name that escapes to it)."""
    if fqn == "":
        return "%"
    if fqn in (".", ".."):
        return "".join("%%%02X" % ord(c) for c in fqn)
    return "".join("%%%02X" % ord(c) if c in "%/\0" else c for c in fqn)


# ---------------------------------------------------------------------------
# oracles
# ---------------------------------------------------------------------------


class Expected:
    """What tensors/<file>.npy must hold: dtype descr, shape, values."""

    def __init__(self, st_dtype: str, array: np.ndarray):
        self.st_dtype = st_dtype
        self.array = array  # float32 for converted dtypes, else the original

    @property
    def descr(self) -> str:
        return "<f4" if self.st_dtype in CONVERTED else NUMPY_DESCR[self.st_dtype]


def torch_oracle(t: torch.Tensor, st_dtype: str) -> Expected:
    if st_dtype in CONVERTED:
        return Expected(st_dtype, t.float().numpy())
    if t.dtype == torch.bfloat16:
        raise AssertionError("bf16 must be converted")
    return Expected(st_dtype, t.numpy().copy())


def assert_npy_equal(got: np.ndarray, exp: Expected, what: str) -> None:
    assert got.dtype.str == exp.descr or (got.dtype.str == "|b1" and exp.descr == "|b1"), (
        f"{what}: dtype {got.dtype.str}, expected {exp.descr}")
    assert got.shape == exp.array.shape, f"{what}: shape {got.shape}, expected {exp.array.shape}"
    assert not np.isfortran(got) or got.ndim < 2, f"{what}: Fortran order"
    a = np.asarray(got)
    e = exp.array.astype(a.dtype, copy=False)
    if exp.st_dtype in CONVERTED:
        # Every value of these types is exact in float32: equal values, the
        # same NaNs, the same signed zeros.
        assert np.array_equal(a, e, equal_nan=True), (
            f"{what}: values differ at {np.argwhere(~((a == e) | (np.isnan(a) & np.isnan(e))))[:5].tolist()}")
        fin = ~np.isnan(e)
        assert np.array_equal(np.signbit(a[fin]), np.signbit(e[fin])), f"{what}: sign of zero differs"
    else:
        assert a.tobytes() == e.tobytes(), f"{what}: bytes differ"


# ---------------------------------------------------------------------------
# fixtures: checkpoints
# ---------------------------------------------------------------------------

SHARDED_SPECS: dict = {}
SHARDED_SPECS.update(ckpt_gen.BASE_SPECS)
SHARDED_SPECS.update(ckpt_gen.INT_SPECS)
SHARDED_SPECS.update(ckpt_gen.EXTRA_SPECS)
SHARDED_SPECS.update({
    "extra.wide": ((129, 67), torch.float32, "shard1"),   # many row pieces
    "extra.tall": ((257, 33), torch.bfloat16, "shard0"),  # converted, spans pages
})


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("inspect")


@pytest.fixture(scope="module")
def ck(work) -> Ckptfs:
    d = work / "index"
    d.mkdir()
    return Ckptfs(str(d))


@pytest.fixture(scope="module")
def sharded(work) -> dict:
    """A 2-rank checkpoint written by torch's HuggingFaceStorageWriter
    (ckpt_gen), kept pristine outside every mounted root; tests copy it."""
    info = ckpt_gen.write_hf_sharded(str(work / "gen" / "sharded"), 2, specs=SHARDED_SPECS)
    assert len([f for f in info["files"] if f.endswith(".safetensors")]) == 2, info["files"]
    return info


def copy_ckpt(info: dict, dest: Path) -> Path:
    shutil.copytree(info["out_dir"], dest)
    return dest


def _dtype_tensors() -> dict[str, tuple[torch.Tensor, str]]:
    """{fqn: (tensor, safetensors dtype)}: every dtype torch can save."""
    g = torch.Generator().manual_seed(7)
    out: dict[str, tuple[torch.Tensor, str]] = {}

    def ints(shape, lo, hi, dtype):
        return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)

    out["t.bool"] = (torch.randint(0, 2, (3, 7), generator=g).bool(), "BOOL")
    out["t.u8"] = (ints((4, 9), 0, 256, torch.uint8), "U8")
    out["t.i8"] = (ints((4, 9), -128, 128, torch.int8), "I8")
    out["t.i16"] = (ints((5, 6), -2**15, 2**15, torch.int16), "I16")
    out["t.u16"] = (torch.tensor(np.random.default_rng(1).integers(0, 2**16, (5, 6), dtype=np.uint16)), "U16")
    out["t.i32"] = (ints((3, 4, 5), -2**31, 2**31, torch.int32), "I32")
    out["t.u32"] = (torch.tensor(np.random.default_rng(2).integers(0, 2**32, (7,), dtype=np.uint32)), "U32")
    out["t.i64"] = (ints((6, 5), -2**62, 2**62, torch.int64), "I64")
    out["t.u64"] = (torch.tensor(np.random.default_rng(3).integers(0, 2**64, (4, 3), dtype=np.uint64)), "U64")
    # Every 16-bit pattern of F16 and BF16 (NaNs, infinities, subnormals, -0).
    out["t.f16"] = (torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
                    .view(torch.float16).reshape(256, 256), "F16")
    out["t.bf16"] = (torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
                     .view(torch.bfloat16).reshape(256, 256), "BF16")
    out["t.f32"] = (torch.randn(6, 11, generator=g), "F32")
    out["t.f64"] = (torch.randn(3, 5, generator=g, dtype=torch.float64), "F64")
    # Every 8-bit pattern, shuffled, for the float8 types.
    perm = torch.randperm(256, generator=g)
    all8 = torch.arange(256, dtype=torch.int32).to(torch.uint8)[perm]
    out["t.f8_e4m3"] = (all8.clone().view(torch.float8_e4m3fn).reshape(16, 16), "F8_E4M3")
    out["t.f8_e5m2"] = (all8.clone().view(torch.float8_e5m2).reshape(8, 32), "F8_E5M2")
    if HAVE_TORCH_E8M0:  # else dtype_root writes it by hand, ml_dtypes as the oracle
        out["t.f8_e8m0"] = (all8.clone().view(torch.float8_e8m0fnu).reshape(32, 8), "F8_E8M0")
    out["t.c64"] = (torch.randn(4, 5, generator=g, dtype=torch.complex64), "C64")
    # A converted tensor larger than one read (1 MiB) as float32.
    big = torch.randint(-2**15, 2**15, (700, 601), generator=g, dtype=torch.int32).to(torch.int16)
    out["t.bf16_big"] = (big.view(torch.bfloat16), "BF16")
    # 0-d and empty tensors.
    out["zero_d.f32"] = (torch.tensor(-2.5), "F32")
    out["zero_d.bf16"] = (torch.tensor(3.25, dtype=torch.bfloat16), "BF16")
    out["zero_d.i64"] = (torch.tensor(-(2**40) - 3, dtype=torch.int64), "I64")
    out["zero_d.f8_e4m3"] = (torch.tensor(-0.75).to(torch.float8_e4m3fn), "F8_E4M3")
    out["empty.f32"] = (torch.empty(0, 3), "F32")
    out["empty.bf16"] = (torch.empty(4, 0, dtype=torch.bfloat16), "BF16")
    out["empty.i32"] = (torch.empty(0, dtype=torch.int32), "I32")
    out["empty.f8_e5m2"] = (torch.empty(2, 0, 3, dtype=torch.float8_e5m2), "F8_E5M2")
    # Names that need escaping.
    out["model/layers/0/w"] = (torch.randn(2, 3, generator=g), "F32")
    out["50%"] = (torch.randn(4, generator=g, dtype=torch.float64), "F64")
    out["%2F"] = (ints((3,), 0, 100, torch.int16), "I16")
    out["a/%/b"] = (torch.randn(2, 2, generator=g).to(torch.bfloat16), "BF16")
    out[""] = (ints((2,), 0, 9, torch.int8), "I8")
    out["."] = (torch.randn(2, generator=g), "F32")
    out[".."] = (torch.randn(1, 2, generator=g), "F32")
    return out


PACKED_SHAPES = {
    # F4: even element counts; (2, 5) puts a row boundary inside a byte.
    "p.f4": ("F4", (6, 10)),
    "p.f4_odd_rows": ("F4", (2, 5)),
    "p.f4_big": ("F4", (1000, 1002)),
    "p.f4_empty": ("F4", (0, 8)),
    # F6: multiples of 4 elements; (2, 6) puts row boundaries inside groups.
    "p.f6_e2m3": ("F6_E2M3", (8, 12)),
    "p.f6_e2m3_odd_rows": ("F6_E2M3", (2, 6)),
    "p.f6_e2m3_big": ("F6_E2M3", (513, 1024)),
    "p.f6_e3m2": ("F6_E3M2", (5, 8)),
    "p.f6_e3m2_odd_rows": ("F6_E3M2", (6, 2)),
    "p.f6_e3m2_1d": ("F6_E3M2", (64,)),
}
ML_DTYPE = {"F4": ml_dtypes.float4_e2m1fn, "F6_E2M3": ml_dtypes.float6_e2m3fn,
            "F6_E3M2": ml_dtypes.float6_e3m2fn}


@pytest.fixture(scope="module")
def dtype_root(work, sharded) -> dict:
    """ROOT with several checkpoints: dt/ (every torch dtype, odd names), packed/
    (F4/F6 written by hand), sharded/ (ckpt_gen), burn/ and stcpp/ (third-party
    files). Returns {"root", "expected": {ckpt: {fqn: Expected}}, "meta": ...}."""
    root = work / "dtypes-root"
    root.mkdir()
    expected: dict[str, dict[str, Expected]] = {}
    meta: dict[str, dict[str, tuple[str, list[int]]]] = {}

    # dt/: the real safetensors library (torch).
    (root / "dt").mkdir()
    tensors = _dtype_tensors()
    safetensors.torch.save_file({k: v for k, (v, _) in tensors.items()},
                                str(root / "dt" / "model.safetensors"))
    _, hdr = read_header(str(root / "dt" / "model.safetensors"))
    for fqn, (t, st_dtype) in tensors.items():
        assert hdr[fqn]["dtype"] == st_dtype, (fqn, hdr[fqn])
    expected["dt"] = {fqn: torch_oracle(t, d) for fqn, (t, d) in tensors.items()}
    if HAVE_TORCH_E8M0:
        # F8_E8M0 oracle cross-checked with ml_dtypes (torch is the primary one).
        e8 = tensors["t.f8_e8m0"][0]
        np.testing.assert_array_equal(
            e8.view(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32),
            expected["dt"]["t.f8_e8m0"].array)
    meta["dt"] = {fqn: (d, list(t.shape)) for fqn, (t, d) in tensors.items()}

    # packed/: F4 / F6 written by hand from random codes.
    (root / "packed").mkdir()
    rng = np.random.default_rng(11)
    raw, expected["packed"], meta["packed"] = [], {}, {}
    for fqn, (st_dtype, shape) in PACKED_SHAPES.items():
        bits = ITEMSIZE_BITS[st_dtype]
        n = math.prod(shape)
        codes = rng.integers(0, 1 << bits, n, dtype=np.uint8)
        codes[: min(n, 1 << bits)] = np.arange(min(n, 1 << bits), dtype=np.uint8)  # every code
        data = pack_bits_fast(codes, bits)
        if n <= 4096:
            assert data == pack_bits(codes, bits)
        raw.append((fqn, st_dtype, list(shape), data))
        oracle = codes.view(ML_DTYPE[st_dtype]).astype(np.float32).reshape(shape)
        expected["packed"][fqn] = Expected(st_dtype, oracle)
        meta["packed"][fqn] = (st_dtype, list(shape))
    if not HAVE_TORCH_E8M0:  # torch without float8_e8m0fnu: every code, by hand
        codes = rng.permutation(256).astype(np.uint8)
        raw.append(("p.f8_e8m0", "F8_E8M0", [32, 8], codes.tobytes()))
        expected["packed"]["p.f8_e8m0"] = Expected(
            "F8_E8M0", codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32).reshape(32, 8))
        meta["packed"]["p.f8_e8m0"] = ("F8_E8M0", [32, 8])
    write_safetensors_raw(str(root / "packed" / "model.safetensors"), raw, {"format": "pt"})
    with safetensors.safe_open(str(root / "packed" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(expected["packed"])  # the reference parser accepts the file

    # sharded/: ckpt_gen's torch DCP HuggingFaceStorageWriter output.
    copy_ckpt(sharded, root / "sharded")
    expected["sharded"] = {fqn: torch_oracle(t, sharded["tensors"][fqn]["dtype"])
                           for fqn, t in sharded["expected"].items()}
    meta["sharded"] = {fqn: (v["dtype"], v["shape"]) for fqn, v in sharded["tensors"].items()}

    # Third-party fixtures, each in its own folder.
    for name, src in (("burn", FIXTURES / "burn" / "multi_layer.safetensors"),
                      ("stcpp", FIXTURES / "safetensors-cpp" / "model.safetensors")):
        (root / name).mkdir()
        shutil.copyfile(src, root / name / "model.safetensors")
        arrays = safetensors.numpy.load_file(str(src))
        _, h = read_header(str(src))
        expected[name] = {fqn: Expected(h[fqn]["dtype"], a) for fqn, a in arrays.items()}
        meta[name] = {fqn: (h[fqn]["dtype"], h[fqn]["shape"]) for fqn in arrays}
    return {"root": str(root), "expected": expected, "meta": meta}


# ---------------------------------------------------------------------------
# 1. numpy reads tensors/*.npy
# ---------------------------------------------------------------------------


def test_numpy_loads_every_npy(ck, dtype_root, work):
    root = dtype_root["root"]
    checked = 0
    with mounted(ck, root, str(work / "mnt-npy"), str(work / "npy.log")) as mnt:
        for ckpt, exp in dtype_root["expected"].items():
            tdir = os.path.join(mnt, ckpt, "tensors")
            names = sorted(os.listdir(tdir))
            want = sorted(escape_file_name(fqn) + ".npy" for fqn in exp)
            assert names == want, f"{ckpt}/tensors: {names} != {want}"
            # `ckptfs ls ROOT PATH --json` agrees with the mount on names and sizes.
            p = ck("ls", root, f"{ckpt}/tensors", "--json")
            assert p.returncode == EXIT_OK, describe(p)
            listed = {r["name"]: r["size"] for r in json.loads(p.stdout)}
            assert listed == {n: os.path.getsize(os.path.join(tdir, n)) for n in names}, listed
            for fqn, e in exp.items():
                path = os.path.join(tdir, escape_file_name(fqn) + ".npy")
                what = f"{ckpt}/tensors/{escape_file_name(fqn)}.npy ({fqn!r}, {e.st_dtype})"
                with open(path, "rb") as f:
                    head = f.read(10)
                assert head[:8] == b"\x93NUMPY\x01\x00", f"{what}: not NPY 1.0: {head!r}"
                hlen = struct.unpack("<H", head[8:10])[0]
                assert (10 + hlen) % 64 == 0, f"{what}: data does not start on a 64-byte boundary"
                assert os.path.getsize(path) == 10 + hlen + e.array.size * np.dtype(e.descr).itemsize
                a = np.load(path)
                assert_npy_equal(a, e, what)
                m = np.load(path, mmap_mode="r")
                assert_npy_equal(m, e, what + " [mmap_mode='r']")
                del a, m
                checked += 1
        gc.collect()
    total = sum(len(v) for v in dtype_root["expected"].values())
    assert checked == total
    # Every dtype the brief names was covered.
    seen = {e.st_dtype for v in dtype_root["expected"].values() for e in v.values()}
    assert seen >= set(ITEMSIZE_BITS), set(ITEMSIZE_BITS) - seen


def test_npy_file_names_via_ls(ck, dtype_root):
    """`ckptfs ls ROOT dt/tensors --json` names the escaped files."""
    p = ck("ls", dtype_root["root"], "dt/tensors", "--json")
    assert p.returncode == 0, describe(p)
    rows = json.loads(p.stdout)
    names = {r["name"] for r in rows}
    for fqn, want in {"model/layers/0/w": "model%2Flayers%2F0%2Fw.npy", "50%": "50%25.npy",
                      "%2F": "%252F.npy", "a/%/b": "a%2F%25%2Fb.npy", "": "%.npy",
                      ".": "%2E.npy", "..": "%2E%2E.npy", "t.f32": "t.f32.npy"}.items():
        assert want in names, f"{fqn!r} -> {want} not in {sorted(names)}"
    assert all(r["type"] == "file" and r["virtual"] for r in rows), rows
    assert len(rows) == len(dtype_root["expected"]["dt"])


# ---------------------------------------------------------------------------
# 2. check
# ---------------------------------------------------------------------------

SHARD1 = "shard-00001-model-00001-of-00001.safetensors"
SHARD2 = "shard-00002-model-00001-of-00001.safetensors"


def check_lines(p) -> list[str]:
    return [line for line in p.stdout.splitlines() if line.strip()]


def test_check_clean(ck, sharded, dtype_root, work):
    root = copy_ckpt(sharded, work / "check-clean")
    for r in (root, dtype_root["root"]):
        p = ck("check", r)
        assert p.returncode == EXIT_OK, describe(p)
        assert p.stdout == "", describe(p)


def test_check_hole(ck, sharded, work):
    root = copy_ckpt(sharded, work / "check-hole")
    # Rank 2 holds row 2 of model.position_ids (3, 5); move it to row 3: the
    # tensor becomes (4, 5) with row 2 in no chunk.
    set_saved_offsets(str(root / SHARD2), "model.position_ids", [3, 0])
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    lines = check_lines(p)
    assert lines and all("model.position_ids" in line for line in lines), describe(p)
    assert re.search(r"no chunk|hole|missing", p.stdout), describe(p)


def test_check_hole_missing_rank_file(ck, sharded, work):
    """A whole rank file deleted: the tensors it held are reported."""
    root = copy_ckpt(sharded, work / "check-missing")
    (root / SHARD1).unlink()
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    # Shard(0) tensors lose their first rows: a hole each.
    for fqn in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"):
        assert any(fqn in line for line in check_lines(p)), f"{fqn} not reported" + describe(p)
    assert "model.norm.weight" not in p.stdout, describe(p)  # replicated: rank 2 has it whole


def test_check_overlap(ck, sharded, work):
    root = copy_ckpt(sharded, work / "check-overlap")
    # up_proj (8, 10) rows 4..7 on rank 2 -> rows 3..6: row 3 is in both chunks.
    set_saved_offsets(str(root / SHARD2), "model.layers.0.mlp.up_proj.weight", [3, 0])
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    lines = check_lines(p)
    assert lines and all("model.layers.0.mlp.up_proj.weight" in line for line in lines), describe(p)
    assert "overlap" in p.stdout, describe(p)


def test_index_shows_the_first_problems_of_a_checkpoint_and_check_lists_them_all(ck, work):
    """A checkpoint with dozens of problems (an HF index naming 27 missing
    shards): `index` prints the first 20 and says how many more and which
    command lists them; `check` prints them all."""
    root = work / "many-problems"
    root.mkdir()
    safetensors.numpy.save_file({"present": np.arange(4, dtype=np.float32)}, str(root / "model-present.safetensors"))
    weight_map = {"present": "model-present.safetensors"}
    weight_map.update({f"w{i:02d}": f"model-missing-{i:02d}.safetensors" for i in range(27)})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    p = ck("index", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    shown = [line for line in p.stderr.splitlines() if line.startswith("ckptfs: problem in ")]
    assert len(shown) == 20 and all("missing" in line for line in shown), describe(p)
    total = int(re.search(r"ckptfs: (\d+) problem\(s\)", p.stderr).group(1))
    assert total >= 27, describe(p)
    assert f"ckptfs: ... and {total - 20} more problem(s) in .; `ckptfs check {root}` lists them all" in p.stderr, \
        describe(p)
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    assert len(check_lines(p)) == total, describe(p)
    listed = [line for line in check_lines(p) if "listed in model.safetensors.index.json but missing" in line]
    assert len(listed) == 27, describe(p)


def test_check_changed_after_indexing(ck, sharded, work):
    root = copy_ckpt(sharded, work / "check-stale")
    p = ck("index", root)
    assert p.returncode == EXIT_OK, describe(p)
    assert ck("check", root).stdout == ""
    with open(root / SHARD1, "ab") as f:
        f.write(b"\0")
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    lines = check_lines(p)
    assert lines and all(SHARD1 in line for line in lines), describe(p)
    assert "index" in p.stdout, describe(p)  # says to re-index


def test_check_unparseable_header(ck, sharded, work):
    root = copy_ckpt(sharded, work / "check-corrupt")
    n, _ = read_header(str(root / SHARD2))
    with open(root / SHARD2, "r+b") as f:
        f.seek(8)
        f.write(b"#NOT JSON")  # same length file, header no longer parses
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    assert SHARD2 in p.stdout, describe(p)
    assert SHARD1 not in p.stdout, describe(p)


def test_check_truncated_shard(ck, sharded, work):
    root = copy_ckpt(sharded, work / "check-truncated")
    n, hdr = read_header(str(root / SHARD2))
    ents = {k: v for k, v in hdr.items() if k != "__metadata__"}
    last = max(ents, key=lambda k: ents[k]["data_offsets"][1])
    size = os.path.getsize(root / SHARD2)
    assert size == 8 + n + ents[last]["data_offsets"][1]
    os.truncate(root / SHARD2, size - 1)
    p = ck("check", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    assert SHARD2 in p.stdout, describe(p)
    assert any(last in line for line in check_lines(p)), f"truncated tensor {last} not named" + describe(p)
    assert SHARD1 not in p.stdout, describe(p)


# ---------------------------------------------------------------------------
# 3. verify
# ---------------------------------------------------------------------------


def test_verify_against_export(ck, sharded, work):
    root = copy_ckpt(sharded, work / "verify")
    ref = work / "verify-ref"
    p = ck("export", root, "consolidated", ref)
    assert p.returncode == EXIT_OK, describe(p)
    files = sorted(f for f in os.listdir(ref) if f.endswith(".safetensors"))
    assert files == ["model.safetensors"], files

    p = ck("verify", root)
    assert p.returncode == EXIT_OK and p.stdout == "", describe(p)
    p = ck("verify", root, "--against", ref)
    assert p.returncode == EXIT_OK and p.stdout == "", describe(p)
    p = ck("verify", root, "--against", ref, "--json")
    assert p.returncode == EXIT_OK, describe(p)
    out = json.loads(p.stdout)
    assert out["problems"] == [], out
    # consolidated/model.safetensors + one .npy per tensor
    assert out["files"] >= 1 + len(sharded["tensors"]), out

    # Flip one byte inside one tensor's data.
    fqn = "model.layers.0.mlp.up_proj.weight"
    path = str(ref / "model.safetensors")
    n, hdr = read_header(path)
    begin, end = hdr[fqn]["data_offsets"]
    k = 4 * 13 + 2  # byte 2 of element 13
    assert k < end - begin
    with open(path, "r+b") as f:
        f.seek(8 + n + begin + k)
        b = f.read(1)
        f.seek(8 + n + begin + k)
        f.write(bytes([b[0] ^ 0x5A]))
    p = ck("verify", root, "--against", ref)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    lines = check_lines(p)
    assert len(lines) == 1, describe(p)
    assert fqn in lines[0] and re.search(rf"\bbyte {k}\b", lines[0]), describe(p)
    p = ck("verify", root, "--against", ref, "--json")
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    probs = json.loads(p.stdout)["problems"]
    assert len(probs) == 1 and fqn in probs[0] and re.search(rf"\bbyte {k}\b", probs[0]), probs


def test_verify_finds_unreadable_tensor(ck, sharded, work):
    root = copy_ckpt(sharded, work / "verify-hole")
    set_saved_offsets(str(root / SHARD2), "model.position_ids", [3, 0])
    p = ck("verify", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    assert "tensors/model.position_ids.npy" in p.stdout, describe(p)
    # Other tensors' .npy files read fine, so they are not reported.
    assert "tensors/model.norm.weight.npy" not in p.stdout, describe(p)


def test_verify_clean_dtypes(ck, dtype_root):
    """Reads every byte of every view of the all-dtype tree."""
    p = ck("verify", dtype_root["root"], "--json")
    assert p.returncode == EXIT_OK, describe(p)
    out = json.loads(p.stdout)
    assert out["problems"] == [], out
    n_npy = sum(len(v) for v in dtype_root["expected"].values())
    assert out["files"] >= n_npy + len(dtype_root["expected"]), out


# ---------------------------------------------------------------------------
# 4. CLI golden tests
# ---------------------------------------------------------------------------


def expected_chunks(info: dict) -> dict[str, set]:
    """Distinct boxes per tensor, from the shard headers (replicas count once)."""
    boxes: dict[str, set] = {}
    for fn, h in info["headers"].items():
        offs = json.loads(h["__metadata__"]["DCP_SHARDING_INFO"])
        for fqn, e in h.items():
            if fqn == "__metadata__":
                continue
            boxes.setdefault(fqn, set()).add((tuple(offs[fqn]["saved_offsets"]), tuple(e["shape"])))
    return boxes


def test_ls_json_golden(ck, dtype_root, sharded):
    p = ck("ls", dtype_root["root"], "--json")
    assert p.returncode == EXIT_OK, describe(p)
    rows = json.loads(p.stdout)
    got = {(r["checkpoint"], r["name"]): r for r in rows}
    assert len(got) == len(rows), "duplicate rows"
    want = {(c, fqn) for c, m in dtype_root["meta"].items() for fqn in m}
    assert set(got) == want, (sorted(set(got) - want), sorted(want - set(got)))
    boxes = expected_chunks(sharded)
    for (c, fqn), r in got.items():
        dtype, shape = dtype_root["meta"][c][fqn]
        assert r["dtype"] == dtype, r
        assert r["shape"] == list(shape), r
        assert r["bytes"] == math.prod(shape) * ITEMSIZE_BITS[dtype] // 8, r
        assert r["problem"] == "", r
        assert set(r) >= {"checkpoint", "name", "dtype", "shape", "chunks", "bytes", "files", "problem"}
        if c == "sharded":
            assert r["chunks"] == len(boxes[fqn]), (r, boxes[fqn])
            holders = {fn for fn, h in sharded["headers"].items() if fqn in h}
            assert r["files"] and set(r["files"]) <= holders, (r, holders)
        else:
            assert r["chunks"] == 1 and r["files"] == ["model.safetensors"], r
    # Sanity of the oracle: sharded tensors really have 2 chunks.
    assert got[("sharded", "model.layers.0.mlp.up_proj.weight")]["chunks"] == 2
    assert got[("sharded", "model.norm.weight")]["chunks"] == 1


def test_ls_filter(ck, dtype_root):
    root = dtype_root["root"]
    all_rows = json.loads(ck("ls", root, "--json").stdout)
    for pattern in ("*proj*", "t.f8_*", "*%*", "model.layers.0.*.weight", "nothing-matches-this"):
        p = ck("ls", root, "--filter", pattern, "--json")
        assert p.returncode == EXIT_OK, describe(p)
        got = sorted((r["checkpoint"], r["name"]) for r in json.loads(p.stdout))
        want = sorted((r["checkpoint"], r["name"]) for r in all_rows
                      if fnmatch.fnmatchcase(r["name"], pattern))
        assert got == want, (pattern, got, want)
        if pattern == "*proj*":
            assert len(got) == 3
    # The text table with --filter lists exactly the matches too.
    p = ck("ls", root, "--filter", "t.f8_*")
    assert p.returncode == EXIT_OK, describe(p)
    header, *lines = p.stdout.splitlines()
    # A root of several checkpoints gets a leading checkpoint column.
    columns = header.split()
    assert columns[0] == ("checkpoint" if len({r["checkpoint"] for r in all_rows}) > 1 else "name"), header
    name_col = columns.index("name")
    assert sorted(line.split()[name_col] for line in lines) == ["t.f8_e4m3", "t.f8_e5m2", "t.f8_e8m0"], p.stdout


def test_ls_json_reports_problem(ck, sharded, work):
    root = copy_ckpt(sharded, work / "ls-hole")
    set_saved_offsets(str(root / SHARD2), "model.position_ids", [3, 0])
    p = ck("ls", root, "--json")
    assert p.returncode == EXIT_OK, describe(p)
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows["model.position_ids"]["problem"], rows["model.position_ids"]
    assert rows["model.position_ids"]["shape"] == [4, 5]
    assert all(r["problem"] == "" for n, r in rows.items() if n != "model.position_ids")


@pytest.fixture(scope="module")
def stats_root(work) -> dict:
    g = torch.Generator().manual_seed(3)
    f32 = torch.randn(50, 40, generator=g)
    f32[3, 4] = float("nan")
    f32[7, 1] = float("nan")
    f32[9, 9] = float("inf")
    f32[10, 0] = float("-inf")
    f32[11, 11] = float("-inf")
    bf16 = (torch.randn(33, 17, generator=g) * 100).to(torch.bfloat16)
    bf16[0, 0] = float("nan")
    bf16[1, 1] = float("inf")
    f16 = torch.randn(64, generator=g).to(torch.float16)
    f16[5] = float("-inf")
    f64 = torch.randn(7, 3, generator=g, dtype=torch.float64)
    f64[2, 2] = float("nan")
    i64 = torch.randint(-2**40, 2**40, (9, 4), generator=g)
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    allnan = torch.full((3,), float("nan"))
    tensors = {"s.f32": f32, "s.bf16": bf16, "s.f16": f16, "s.f64": f64, "s.i64": i64,
               "s.e4m3": e4m3, "s.allnan": allnan}
    root = work / "stats"
    root.mkdir()
    safetensors.torch.save_file(tensors, str(root / "model.safetensors"))
    return {"root": str(root), "tensors": tensors}


def test_inspect_stats(ck, stats_root):
    for fqn, t in stats_root["tensors"].items():
        p = ck("inspect", stats_root["root"], fqn, "--json")
        assert p.returncode == EXIT_OK, describe(p)
        out = json.loads(p.stdout)
        a = (t.double() if t.dtype != torch.int64 else t).numpy()
        st = out["stats"]
        if a.dtype.kind == "f":
            nan, inf = int(np.isnan(a).sum()), int(np.isinf(a).sum())
            fin = a[np.isfinite(a)]
        else:
            nan, inf, fin = 0, 0, a.reshape(-1)
        assert st["nan"] == nan and st["inf"] == inf, (fqn, st, nan, inf)
        if fin.size == 0:
            assert st["min"] is None and st["max"] is None and st["mean"] is None, (fqn, st)
            continue
        assert st["min"] == float(fin.min()) and st["max"] == float(fin.max()), (fqn, st, fin.min(), fin.max())
        mean = float(np.mean(fin.astype(np.float64)))
        assert math.isclose(st["mean"], mean, rel_tol=1e-9, abs_tol=1e-12), (fqn, st["mean"], mean)
        assert out["name"] == fqn and out["shape"] == list(t.shape), out
        assert out["numel"] == t.numel() and len(out["chunks"]) == 1, out
    # Planted values really are there (the oracle is not vacuous).
    assert json.loads(ck("inspect", stats_root["root"], "s.f32", "--json").stdout)["stats"]["inf"] == 3


def test_inspect_sharded(ck, sharded, work):
    """Statistics of a tensor assembled from two ranks' chunks."""
    root = copy_ckpt(sharded, work / "inspect-sharded")
    fqn = "extra.wide"
    p = ck("inspect", root, fqn, "--json")
    assert p.returncode == EXIT_OK, describe(p)
    out = json.loads(p.stdout)
    a = sharded["expected"][fqn].double().numpy()
    assert len(out["chunks"]) == 2 and out["dtype"] == "F32" and out["shape"] == [129, 67], out
    assert out["stats"]["min"] == a.min() and out["stats"]["max"] == a.max()
    assert math.isclose(out["stats"]["mean"], a.mean(), rel_tol=1e-9, abs_tol=1e-12)
    # Text form names the chunks' file and the statistics.
    p = ck("inspect", root, fqn)
    assert p.returncode == EXIT_OK and SHARD1 in p.stdout and SHARD2 in p.stdout and "mean" in p.stdout, describe(p)


def test_exit_codes(ck, sharded, work):
    root = copy_ckpt(sharded, work / "exit-codes")
    missing = str(work / "does-not-exist")

    def rc(want, *args):
        p = ck(*args)
        assert p.returncode == want, f"expected exit {want}" + describe(p)
        return p

    # unknown tensor -> 3
    p = rc(EXIT_NO_SOURCE, "inspect", root, "no.such.tensor")
    assert "no.such.tensor" in p.stderr
    rc(EXIT_NO_SOURCE, "inspect", root, "no.such.tensor", "--json")
    # missing ROOT -> 3
    for args in (("ls", missing), ("ls", missing, "--json"), ("inspect", missing, "x"),
                 ("check", missing), ("verify", missing), ("cat", missing, "consolidated/model.safetensors"),
                 ("index", missing)):
        rc(EXIT_NO_SOURCE, *args)
    # missing PATH -> 3
    rc(EXIT_NO_SOURCE, "ls", root, "no/such/dir")
    rc(EXIT_NO_SOURCE, "cat", root, "tensors/no.such.tensor.npy")
    # bad flag / missing argument -> 2
    for args in (("ls", root, "--no-such-flag"), ("inspect", root, "x", "--bogus"), ("inspect", root),
                 ("check", root, "--json-please"), ("verify", root, "--against"),
                 ("verify", root, "--frobnicate"), ("cat", root), ("export", root, "consolidated"),
                 ("ls",), ("no-such-subcommand", root), ("ls", root, "--max-file-size", "huge")):
        rc(EXIT_USAGE, *args)

    # cat of a tensor works before anything changes
    p = rc(EXIT_OK, "cat", root, "tensors/model.norm.weight.npy")
    # stale -> 4 for cat and ls (the index is built by the calls above)
    with open(root / SHARD2, "ab") as f:
        f.write(b"\0")
    for args in (("cat", root, "tensors/model.norm.weight.npy"), ("ls", root), ("ls", root, "--json"),
                 ("ls", root, "tensors"), ("inspect", root, "model.norm.weight"), ("verify", root)):
        p = rc(EXIT_STALE, *args)
        assert p.stdout == "", describe(p)


def test_exit_code_read_error(ck, sharded, work):
    root = copy_ckpt(sharded, work / "exit-read")
    set_saved_offsets(str(root / SHARD2), "model.position_ids", [3, 0])
    for path in ("tensors/model.position_ids.npy", "consolidated/model.safetensors"):
        p = ck("cat", root, path)
        assert p.returncode == EXIT_READ_ERROR, describe(p)
        assert "model.position_ids" in p.stderr, describe(p)
    # A file not touching the hole reads fine and equals the original.
    p = subprocess.run([ck.bin, "cat", str(root), "tensors/model.norm.weight.npy"],
                       capture_output=True, env=ck.env(), timeout=60)
    assert p.returncode == EXIT_OK, p.stderr
    ref = work / "exit-read-norm.npy"
    ref.write_bytes(p.stdout)
    np.testing.assert_array_equal(np.load(ref), sharded["expected"]["model.norm.weight"].numpy())
    # inspect on the broken tensor: no statistics, no crash
    p = ck("inspect", root, "model.position_ids", "--json")
    out = json.loads(p.stdout)
    assert out.get("problem") and "stats" not in out, out


def test_inspect_says_when_it_cannot_read_the_tensor(ck, sharded, work, mount_factory):
    """A tensor whose header is sound but whose bytes fail to read: the
    source is a ckptfs mount of a root with a hole in model.position_ids,
    whose consolidated/ holds the tensor (its header comes from the
    metadata) and answers a read of its bytes with EIO. inspect prints what
    it knows, says it could not read the statistics and why, and exits with
    the read-error code."""
    root = copy_ckpt(sharded, work / "inspect-unreadable")
    set_saved_offsets(str(root / SHARD2), "model.position_ids", [3, 0])
    with mount_factory(str(root)) as m:
        src = m.p("consolidated")
        p = ck("inspect", src, "model.position_ids", "--json")
        assert p.returncode == EXIT_READ_ERROR, describe(p)
        out = json.loads(p.stdout)
        assert "stats" not in out and "problem" not in out, out
        assert re.search(r"model\.safetensors: read at \d+: Input/output error", out["stats_error"]), out
        with safetensors.safe_open(os.path.join(src, "model.safetensors"), "np") as f:
            assert out["shape"] == list(f.get_slice("model.position_ids").get_shape()), out
        p = ck("inspect", src, "model.position_ids")
        assert p.returncode == EXIT_READ_ERROR, describe(p)
        assert "statistics: cannot read the tensor: " in p.stdout, describe(p)
        # A tensor clear of the hole, from the same file, has its statistics.
        p = ck("inspect", src, "model.norm.weight", "--json")
        assert p.returncode == EXIT_OK, describe(p)
        want = sharded["expected"]["model.norm.weight"].double()
        assert math.isclose(json.loads(p.stdout)["stats"]["mean"], want.mean().item(), rel_tol=1e-6), p.stdout


def test_help(ck):
    for sub in SUBCOMMANDS:
        p = ck(sub, "--help")
        assert p.returncode == EXIT_OK, describe(p)
        assert "Example" in p.stdout, f"`ckptfs {sub} --help` has no example" + describe(p)
    p = ck("--help")
    assert p.returncode == EXIT_OK and "Example" in p.stdout, describe(p)
    # `ckptfs help` is the program's page (every subcommand listed), and
    # `ckptfs help SUB` is SUB's own --help.
    top = ck("help")
    assert top.returncode == EXIT_OK and top.stdout == ck("--help").stdout, describe(top)
    assert all(re.search(rf"^  {sub} ", top.stdout, re.M) for sub in SUBCOMMANDS), describe(top)
    for sub in SUBCOMMANDS:
        p = ck("help", sub)
        assert p.returncode == EXIT_OK and p.stdout == ck(sub, "--help").stdout, describe(p)
    p = ck("help", "frobnicate")
    assert p.returncode == EXIT_USAGE and "no command 'frobnicate'" in p.stderr, describe(p)
    # An unknown command is named, with the commands there are.
    p = ck("frobnicate", "/x")
    assert p.returncode == EXIT_USAGE, describe(p)
    assert "no command 'frobnicate'" in p.stderr and all(sub in p.stderr for sub in SUBCOMMANDS), describe(p)
    # A flag or argument CLI11 refuses names the subcommand whose --help to read.
    p = ck("ls", "/x", "--bogus")
    assert p.returncode == EXIT_USAGE and "ckptfs: error: ls: " in p.stderr and "--bogus" in p.stderr, describe(p)
    assert "`ckptfs ls --help`" in p.stderr, describe(p)


def test_missing_root_is_said_to_not_exist_and_a_mount_leaves_no_log(ck, work):
    missing = work / "no-such-root"
    p = ck("ls", missing)
    assert p.returncode == EXIT_NO_SOURCE and f"{missing}: not a directory: it does not exist" in p.stderr, describe(p)
    mnt = work / "mnt-missing-root"
    mnt.mkdir()
    logs = work / "logs-missing-root"
    p = ck("mount", missing, mnt, "--index", logs / "idx")
    assert p.returncode == EXIT_NO_SOURCE and "it does not exist" in p.stderr, describe(p)
    assert "logging to" not in p.stderr and not logs.exists(), describe(p)


def test_s3_flags_on_a_local_root_are_refused(ck, sharded, work):
    """As --cache is: a flag that would do nothing is named, not ignored."""
    root = copy_ckpt(sharded, work / "local-s3-flags")
    for args in (("--part-size", "1K"), ("--max-threads", "0"), ("--endpoint-url", "http://127.0.0.1:1"),
                 ("--request-timeout-s", "5"), ("--no-sign-request",)):
        p = ck("ls", root, *args)
        assert p.returncode == EXIT_USAGE, describe(p)
        assert f"{args[0]}: for s3:// roots; {root} is read from the local filesystem" in p.stderr, describe(p)
    assert ck("ls", root).returncode == EXIT_OK


def test_ls_of_a_root_without_checkpoints_says_so(ck, work):
    root = work / "no-checkpoints"
    root.mkdir()
    (root / "notes.txt").write_text("not a checkpoint\n")
    p = ck("ls", root, "--json")
    assert p.returncode == EXIT_OK and json.loads(p.stdout) == [], describe(p)
    assert f"no checkpoint under {root} (looked for " in p.stderr and ".distcp" in p.stderr, describe(p)


def test_inspect_names_the_checkpoint_when_several_hold_the_tensor(ck, sharded, work):
    """A root of two checkpoints with the same tensor names: a bare name is
    refused with both checkpoints listed, CHECKPOINT/NAME picks one."""
    root = work / "two-ckpts"
    copy_ckpt(sharded, root / "ema")
    copy_ckpt(sharded, root / "model")
    fqn = "extra.wide"
    # The ema copy's values differ, so a pick of the wrong one shows.
    ema = sharded["expected"][fqn].double().numpy() * 0 + 7.0
    for shard in (SHARD1, SHARD2):
        path = root / "ema" / shard
        with safetensors.safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta = f.metadata()
        if fqn in tensors:
            tensors[fqn] = torch.full_like(tensors[fqn], 7.0)
            safetensors.torch.save_file(tensors, str(path), metadata=meta)
    p = ck("inspect", root, fqn)
    assert p.returncode == EXIT_USAGE, describe(p)
    assert "2 checkpoints (ema, model)" in p.stderr and f"ema/{fqn}" in p.stderr, describe(p)
    want = {"ema": ema, "model": sharded["expected"][fqn].double().numpy()}
    for name, a in want.items():
        p = ck("inspect", root, f"{name}/{fqn}", "--json")
        assert p.returncode == EXIT_OK, describe(p)
        out = json.loads(p.stdout)
        assert out["checkpoint"] == name and out["name"] == fqn, out
        assert out["stats"]["min"] == a.min() and out["stats"]["max"] == a.max(), (name, out["stats"])
    # A misspelt name is suggested once, not once per checkpoint.
    p = ck("inspect", root, "extra.wid")
    assert p.returncode == EXIT_NO_SOURCE and p.stderr.count(f"'{fqn}'") == 1, describe(p)
