"""End-to-end tests of ckptfs on PyTorch DCP checkpoints and torch.save files.

Checkpoints come from ``dcp_gen.py`` (real torch, gloo ranks on CPU): DCP
with every FileSystemWriter layout (single_file_per_rank x thread_count),
DTensors on 1-d and 2x2 meshes with uneven shards, nested
``{"model", "optim", ...}`` state dicts with AdamW state and non-tensor
(BYTE_IO) items, tiny Llamas (untied, tied, flat bf16), a zstd-transformed
checkpoint, and torch.save folders (pytorch_model.bin, sharded .bin + index,
a nested .pt). The oracle is torch's own reader: ``dcp_to_torch_save`` /
``torch.load``, saved next to each checkpoint as ``<name>-oracle.pt``.

Contract under test:
- ``ckptfs ls D --json``: one row per tensor, ``name`` = the .metadata key
  (torch.save: nested dict keys joined by '.'), safetensors ``dtype``,
  global ``shape``;
- ``D/tensors/<escaped name>.npy`` through a mount and through
  ``ckptfs cat``: exactly torch's values (BF16/F8 as float32);
- ``D/bytes/<escaped key>.pt``: exactly the BYTE_IO item's bytes, so
  ``torch.load(..., weights_only=False)`` gives the saved object;
- ``D/consolidated/``: only the model weights, wrapper prefix removed
  (flat HF names kept; tied lm_head stays absent); transformers reproduces
  the logits bit for bit;
- a hostile ``.metadata`` (os.system via GLOBAL/STACK_GLOBAL + REDUCE) is
  never executed: ``ckptfs index`` exits 5 naming the global; nothing crashes.

Every ckptfs run uses a private CKPTFS_INDEX_DIR; every mount is unmounted
(fusermount3 -u, retried, then -z) after numpy/transformers references are
dropped. When a reader is missing or wrong, tests fail with assertion
messages naming the checkpoint, the tensor/key and what differs (never a
skip). Whole module: ~30 s on 2 cores (generation ~20 s of it).

Run: CKPTFS_BIN=build/ckptfs python3 -m pytest tests/e2e/test_dcp.py -q
"""

from __future__ import annotations

import errno
import gc
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

E2E_DIR = Path(__file__).resolve().parent
if str(E2E_DIR) not in sys.path:
    sys.path.insert(0, str(E2E_DIR))
import dcp_gen  # noqa: E402
import harness  # noqa: E402
from harness import is_mounted, run_ckptfs, unmount  # noqa: E402

EXIT_OK, EXIT_PROBLEMS = 0, 5

DCP = dcp_gen.DCP_NAMES
TSAVE = dcp_gen.TSAVE_NAMES
ALL = DCP + TSAVE
WITH_BYTES = [n for n in DCP if n not in ("mesh2d", "llama_flat")]
WITH_MODEL = ["nested", "llama", "llama_tied", "llama_flat", "tsave_bin", "tsave_sharded"]
WITH_LOGITS = ["llama", "llama_tied", "llama_flat", "tsave_sharded"]
HOSTILE = list(dcp_gen.HOSTILE_VARIANTS) + ["torch_save"]

NP_DTYPE = {
    torch.bool: np.dtype("|b1"), torch.uint8: np.dtype("|u1"), torch.int8: np.dtype("|i1"),
    torch.int16: np.dtype("<i2"), torch.uint16: np.dtype("<u2"),
    torch.int32: np.dtype("<i4"), torch.uint32: np.dtype("<u4"),
    torch.int64: np.dtype("<i8"), torch.uint64: np.dtype("<u8"),
    torch.float16: np.dtype("<f2"), torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
}


# ---------------------------------------------------------------------------
# running ckptfs
# ---------------------------------------------------------------------------


class Runner:
    """`ckptfs ARGS` with this suite's private CKPTFS_INDEX_DIR
    (harness.run_ckptfs: stdout bytes, stderr text, through temp files)."""

    def __init__(self, index_dir: str):
        self.index_dir = index_dir

    def __call__(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        return run_ckptfs(*args, index_dir=self.index_dir, timeout=timeout)


def describe(p: subprocess.CompletedProcess) -> str:
    return harness.describe(p, stdout_chars=500)


def crashed(rc: int) -> bool:
    """Killed by a signal (negative rc), or a shell-style 128+signal code."""
    return rc < 0 or rc in (128 + signal.SIGSEGV, 128 + signal.SIGABRT, 128 + signal.SIGBUS,
                            128 + signal.SIGILL, 128 + signal.SIGFPE)


# ---------------------------------------------------------------------------
# mounting
# ---------------------------------------------------------------------------


# is_mounted / unmount (gc.collect, fusermount3 -u retried, then -u -z):
# harness.py.


class Mounts:
    """Mounts each root once (lazily, inside the test that first needs it,
    so a failing mount is that test's assertion failure) and unmounts them
    all at module teardown."""

    def __init__(self, ck: Runner, base: str):
        self.ck, self.base = ck, base
        self.mounted: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.logs: dict[str, str] = {}

    def get(self, root: str) -> str:
        if root in self.mounted:
            assert is_mounted(self.mounted[root]), (
                f"the mount of {root} at {self.mounted[root]} went away (daemon died?)\n"
                f"log: {self.log(root)}")
            return self.mounted[root]
        assert root not in self.failed, self.failed[root]
        mnt = tempfile.mkdtemp(prefix="mnt-", dir=self.base)
        log = mnt + ".log"
        self.logs[root] = log
        p = self.ck("mount", root, mnt, "--log-file", log)
        if p.returncode != 0:
            unmount(mnt)
            self.failed[root] = f"mount failed for {root}\n{describe(p)}"
            raise AssertionError(self.failed[root])
        deadline = time.monotonic() + 20
        while not is_mounted(mnt):
            if time.monotonic() > deadline:
                self.failed[root] = f"{mnt} not mounted 20 s after `ckptfs mount` exited 0"
                raise AssertionError(self.failed[root])
            time.sleep(0.05)
        self.mounted[root] = mnt
        return mnt

    def log(self, root: str) -> str:
        try:
            with open(self.logs.get(root, ""), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        for mnt in self.mounted.values():
            unmount(mnt)
            if not is_mounted(mnt):
                try:
                    os.rmdir(mnt)
                except OSError:
                    pass
        self.mounted.clear()


# ---------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every checkpoint of dcp_gen (generated and verified once), the hostile
    copies, a private index dir, the CLI runner and the mount manager."""
    base = tmp_path_factory.mktemp("dcp")
    infos = dcp_gen.generate_all(str(base / "ckpts"))
    hostile = {}
    src = infos["w_sfpr1_t1"]["out_dir"]
    for v in dcp_gen.HOSTILE_VARIANTS:
        hostile[v] = dcp_gen.write_hostile(src, str(base / "hostile" / v), v,
                                           str(base / f"PWNED-{v}"))
    hostile["torch_save"] = dcp_gen.write_hostile_torch_save(
        str(base / "hostile" / "torch_save"), str(base / "PWNED-torch_save"))
    index_dir = base / "index"
    index_dir.mkdir()
    mnt_base = base / "mnt"
    mnt_base.mkdir()
    ck = Runner(str(index_dir))
    mounts = Mounts(ck, str(mnt_base))
    oracles: dict[str, dict] = {}

    def oracle(name: str) -> dict:
        if name not in oracles:
            oracles[name] = dcp_gen.load_oracle_flat(infos[name])
        return oracles[name]

    yield {"infos": infos, "hostile": hostile, "ck": ck, "mounts": mounts,
           "oracle": oracle, "base": str(base)}
    mounts.close()


# ---------------------------------------------------------------------------
# comparison helpers
# ---------------------------------------------------------------------------


def assert_npy_equal(arr: np.ndarray, want: torch.Tensor, what: str) -> None:
    exp = dcp_gen.comparable(want)
    exp_dtype = NP_DTYPE[exp.dtype]
    assert arr.dtype == exp_dtype, (
        f"{what}: npy dtype {arr.dtype.str}, want {exp_dtype.str} "
        f"(torch {want.dtype}; BF16/F8 are presented as float32)")
    assert arr.shape == tuple(exp.shape), f"{what}: npy shape {arr.shape}, want {tuple(exp.shape)}"
    got = np.ascontiguousarray(arr).tobytes()
    exp_b = dcp_gen.raw_bytes(exp)
    if got != exp_b:
        g = np.frombuffer(got, dtype=exp_dtype)
        e = np.frombuffer(exp_b, dtype=exp_dtype)
        bits = np.dtype(f"<u{exp_dtype.itemsize}")        # compare bit patterns
        bad = np.flatnonzero(g.view(bits) != e.view(bits))
        i = int(bad[0])
        raise AssertionError(f"{what}: {len(bad)} of {e.size} elements differ from torch's; "
                             f"first at flat index {i}: got {g[i]!r}, want {e[i]!r}")


def assert_tensor_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, want {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    if dcp_gen.raw_bytes(got) != dcp_gen.raw_bytes(want):
        if want.dtype.is_floating_point:
            diff = (got.float() - want.float()).abs()
            raise AssertionError(f"{what}: values differ (max |diff| {float(diff.max())}, "
                                 f"{int((diff != 0).sum())} elements)")
        raise AssertionError(f"{what}: values differ")


def load_npy(path_or_bytes, what: str, mmap: bool) -> np.ndarray:
    try:
        if isinstance(path_or_bytes, bytes):
            return np.load(io.BytesIO(path_or_bytes), allow_pickle=False)
        return np.load(path_or_bytes, mmap_mode="r" if mmap else None, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - reported as this test's failure
        pytest.fail(f"{what}: numpy cannot load it: {e!r}")


def listdir_or_fail(path: str, what: str, parent: str) -> list[str]:
    if not os.path.isdir(path):
        try:
            have = sorted(os.listdir(parent))
        except OSError as e:
            have = f"<{e}>"
        pytest.fail(f"{what}: {path} is not a directory; {parent} holds {have}")
    return sorted(os.listdir(path))


def tensor_rows(ck: Runner, root: str) -> list[dict]:
    p = ck("ls", root, "--json")
    assert p.returncode == EXIT_OK, describe(p)
    try:
        rows = json.loads(p.stdout)
    except ValueError as e:
        pytest.fail(f"`ckptfs ls {root} --json` printed no JSON ({e}): {p.stdout[:300]!r}")
    assert isinstance(rows, list), rows
    return rows


# ---------------------------------------------------------------------------
# 0. the generators and oracles themselves (pass without any reader)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_generated_checkpoint_and_oracle(suite, name):
    info = suite["infos"][name]
    assert os.path.isfile(info["oracle_path"]), info["oracle_path"]
    assert not any(f.endswith("-oracle.pt") for f in info["files"]), info["files"]
    oracle = suite["oracle"](name)
    assert info["tensors"], f"{name}: no tensors"
    tensor_keys = {k for k, v in oracle.items() if isinstance(v, torch.Tensor)}
    assert tensor_keys == set(info["tensors"]), sorted(tensor_keys ^ set(info["tensors"]))
    for k, meta in info["tensors"].items():
        t = oracle[k]
        assert dcp_gen.ST_DTYPE[t.dtype] == meta["dtype"] and list(t.shape) == meta["shape"], k
    if info["kind"] == "dcp":
        tensors, byte_keys = dcp_gen.metadata_summary(info["out_dir"])
        assert set(oracle) == set(tensors) | set(byte_keys)
        assert byte_keys == info["bytes"]
        md = dcp_gen.read_metadata(info["out_dir"])
        for idx, s in md.storage_data.items():
            with open(os.path.join(info["out_dir"], s.relative_path), "rb") as f:
                f.seek(s.offset)
                head = f.read(4)
            if info["zstd_impl"]:
                assert s.transform_descriptors == ["stream.zstd/1"], (idx, s)
                assert head == b"\x28\xb5\x2f\xfd", f"{idx.fqn}: item is not a zstd frame"
            else:
                assert not s.transform_descriptors and head == b"PK\x03\x04", (idx, s, head)
        if name in WITH_BYTES:
            assert info["bytes"], f"{name}: expected BYTE_IO items"
    if name == "mesh2d":
        assert info["world_size"] == 4 and info["mesh"] == [2, 2]
    if name in WITH_LOGITS:
        assert os.path.isfile(os.path.join(info["out_dir"], "config.json"))
        assert os.path.isfile(info["logits_path"])


def test_hostile_payloads_are_live(suite):
    """The payloads really run under pickle (checked at generation with a
    probe marker); nothing has run them since."""
    for v, h in suite["hostile"].items():
        assert not os.path.exists(h["marker"]), f"{v}: {h['marker']} exists already"
        assert os.path.isdir(h["out_dir"])


# ---------------------------------------------------------------------------
# 1. index and ls --json
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_index_recognises_checkpoint(suite, name):
    info = suite["infos"][name]
    p = suite["ck"]("index", info["out_dir"])
    assert p.returncode == EXIT_OK, describe(p)
    assert "problem" not in p.stderr, describe(p)
    assert "no checkpoint recognised" not in p.stderr, (
        f"{name} ({info['kind']}) is not recognised as a checkpoint\n{describe(p)}")


@pytest.mark.parametrize("name", ALL)
def test_ls_json_names_dtypes_shapes(suite, name):
    info = suite["infos"][name]
    rows = tensor_rows(suite["ck"], info["out_dir"])
    by_name: dict[str, dict] = {}
    for r in rows:
        assert "name" in r, r
        assert r["name"] not in by_name, f"duplicate row {r['name']!r}"
        by_name[r["name"]] = r
    want = info["tensors"]
    missing = sorted(set(want) - set(by_name))
    unknown = sorted(set(by_name) - set(want) - set(info["bytes"]))
    assert not missing and not unknown, (
        f"{name}: `ckptfs ls --json` lists {len(by_name)} rows for {len(want)} tensors; "
        f"missing {missing[:10]}{'...' if len(missing) > 10 else ''}, "
        f"not in the checkpoint {unknown[:10]}")
    for k, meta in want.items():
        r = by_name[k]
        assert r.get("dtype") == meta["dtype"], (
            f"{name}: {k}: dtype {r.get('dtype')}, want {meta['dtype']}")
        assert r.get("shape") == meta["shape"], (
            f"{name}: {k}: shape {r.get('shape')}, want {meta['shape']}")
        assert not r.get("problem"), f"{name}: {k}: problem {r.get('problem')!r}"


# ---------------------------------------------------------------------------
# 2. tensors/*.npy: mount (numpy mmap) and ckptfs cat
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_tensors_npy_through_mount(suite, name):
    info = suite["infos"][name]
    oracle = suite["oracle"](name)
    mnt = suite["mounts"].get(info["out_dir"])
    tdir = os.path.join(mnt, "tensors")
    files = listdir_or_fail(tdir, name, mnt)
    want_files = {dcp_gen.escape_name(k) + ".npy": k for k in info["tensors"]}
    assert set(files) == set(want_files), (
        f"{name}: tensors/ missing {sorted(set(want_files) - set(files))[:10]}, "
        f"unexpected {sorted(set(files) - set(want_files))[:10]}")
    try:
        for fn, k in sorted(want_files.items()):
            arr = load_npy(os.path.join(tdir, fn), f"{name}: tensors/{fn}", mmap=True)
            assert_npy_equal(arr, oracle[k], f"{name}: tensors/{fn} (mmap)")
            del arr
    finally:
        gc.collect()
    # one whole-file read() per file too, against the same bytes as cat
    for fn, k in sorted(want_files.items())[:8]:
        with open(os.path.join(tdir, fn), "rb") as f:
            data = f.read()
        assert_npy_equal(load_npy(data, fn, mmap=False), oracle[k], f"{name}: tensors/{fn} (read)")


@pytest.mark.parametrize("name", ALL)
def test_tensors_npy_through_cat(suite, name):
    info = suite["infos"][name]
    oracle = suite["oracle"](name)
    for k in sorted(info["tensors"]):
        rel = "tensors/" + dcp_gen.escape_name(k) + ".npy"
        p = suite["ck"]("cat", info["out_dir"], rel)
        assert p.returncode == EXIT_OK, f"{name}: {k}\n{describe(p)}"
        assert_npy_equal(load_npy(p.stdout, f"{name}: cat {rel}", mmap=False), oracle[k],
                         f"{name}: cat {rel}")


# ---------------------------------------------------------------------------
# 3. bytes/*.pt (BYTE_IO items)
# ---------------------------------------------------------------------------


def _check_byte_item(info, oracle, key, data: bytes, what: str) -> None:
    want_raw = dcp_gen.item_bytes(info["out_dir"], key)
    assert len(data) == len(want_raw), f"{what}: {len(data)} bytes, the item has {len(want_raw)}"
    assert data == want_raw, f"{what}: bytes differ from the item's"
    try:
        obj = torch.load(io.BytesIO(data), weights_only=False)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{what}: torch.load fails: {e!r}")
    assert dcp_gen._values_equal(obj, oracle[key]), (
        f"{what}: torch.load gives {obj!r}, torch's DCP reader gives {oracle[key]!r}")


@pytest.mark.parametrize("name", WITH_BYTES)
def test_bytes_pt_through_mount(suite, name):
    info = suite["infos"][name]
    oracle = suite["oracle"](name)
    mnt = suite["mounts"].get(info["out_dir"])
    bdir = os.path.join(mnt, "bytes")
    files = listdir_or_fail(bdir, name, mnt)
    want_files = {dcp_gen.escape_name(k) + ".pt": k for k in info["bytes"]}
    assert set(files) == set(want_files), (
        f"{name}: bytes/ missing {sorted(set(want_files) - set(files))[:10]}, "
        f"unexpected {sorted(set(files) - set(want_files))[:10]}")
    for fn, k in sorted(want_files.items()):
        path = os.path.join(bdir, fn)
        with open(path, "rb") as f:
            data = f.read()
        _check_byte_item(info, oracle, k, data, f"{name}: bytes/{fn}")
        # and torch.load straight from the mounted path
        try:
            obj = torch.load(path, weights_only=False)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{name}: torch.load({path}) fails: {e!r}")
        assert dcp_gen._values_equal(obj, oracle[k]), f"{name}: bytes/{fn}: {obj!r}"


@pytest.mark.parametrize("name", WITH_BYTES)
def test_bytes_pt_through_cat(suite, name):
    info = suite["infos"][name]
    oracle = suite["oracle"](name)
    for k in info["bytes"]:
        rel = "bytes/" + dcp_gen.escape_name(k) + ".pt"
        p = suite["ck"]("cat", info["out_dir"], rel)
        assert p.returncode == EXIT_OK, f"{name}: {k}\n{describe(p)}"
        _check_byte_item(info, oracle, k, p.stdout, f"{name}: cat {rel}")


def test_escaped_names_present(suite):
    """'/' and '%' in keys: tensors/extra.w%2Fe%25ird.name.npy,
    bytes/extra.slash%2Fkey.pt (nested), tensors/w%2Fe%25ird.name.npy."""
    info = suite["infos"]["nested"]
    assert "extra.w/e%ird.name" in info["tensors"] and "extra.slash/key" in info["bytes"]
    assert dcp_gen.escape_name("extra.w/e%ird.name") == "extra.w%2Fe%25ird.name"
    mnt = suite["mounts"].get(info["out_dir"])
    t = os.path.join(mnt, "tensors", "extra.w%2Fe%25ird.name.npy")
    b = os.path.join(mnt, "bytes", "extra.slash%2Fkey.pt")
    assert os.path.isfile(t), f"{t} missing"
    assert os.path.isfile(b), f"{b} missing"
    arr = load_npy(t, t, mmap=False)
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]] and arr.dtype == np.dtype("<i4")
    assert torch.load(b, weights_only=False) == "value/with%"


# ---------------------------------------------------------------------------
# 4. consolidated/: model weights only, wrapper prefix removed
# ---------------------------------------------------------------------------


def _consolidated_tensors(mnt: str, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    cdir = os.path.join(mnt, "consolidated")
    files = listdir_or_fail(cdir, name, mnt)
    st = [f for f in files if f.endswith(".safetensors")]
    assert st, f"{name}: consolidated/ holds no .safetensors: {files}"
    out: dict[str, torch.Tensor] = {}
    for f in st:
        try:
            loaded = load_file(os.path.join(cdir, f))
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"{name}: safetensors cannot load consolidated/{f}: {e!r}")
        for k, v in loaded.items():
            assert k not in out, f"{name}: {k} in two consolidated files"
            out[k] = v.clone()
        del loaded
    if len(st) > 1:
        assert "model.safetensors.index.json" in files, files
    gc.collect()
    return out


@pytest.mark.parametrize("name", WITH_MODEL)
def test_consolidated_holds_model_weights_only(suite, name):
    info = suite["infos"][name]
    want = dcp_gen.model_state_from_oracle(info)
    assert set(want) == set(info["model_keys"])
    mnt = suite["mounts"].get(info["out_dir"])
    got = _consolidated_tensors(mnt, name)
    if name == "llama_tied":
        assert "lm_head.weight" not in got, "tied lm_head.weight appeared in consolidated/"
    if name == "tsave_bin":
        assert os.path.isfile(os.path.join(mnt, "consolidated", "model.safetensors"))
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"{name}: consolidated/ names differ from model.state_dict() keys: "
        f"missing {missing[:8]}, extra {extra[:8]}")
    for k in sorted(want):
        assert_tensor_equal(got[k], want[k].contiguous(), f"{name}: consolidated {k}")


@pytest.mark.parametrize("name", WITH_LOGITS)
def test_transformers_logits_from_consolidated(suite, name):
    from transformers import AutoModelForCausalLM
    info = suite["infos"][name]
    mnt = suite["mounts"].get(info["out_dir"])
    cdir = os.path.join(mnt, "consolidated")
    files = listdir_or_fail(cdir, name, mnt)
    assert "config.json" in files, f"{name}: consolidated/ has no config.json: {files}"
    ref = torch.load(info["logits_path"])
    try:
        model = AutoModelForCausalLM.from_pretrained(cdir).eval()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{name}: transformers cannot load {cdir}: {e!r}")
    try:
        with torch.no_grad():
            got = model(input_ids=ref["input_ids"]).logits.float()
        assert torch.equal(got, ref["logits"]), (
            f"{name}: logits differ, max |diff| {float((got - ref['logits']).abs().max())}")
        if name == "llama_tied":
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    finally:
        del model
        gc.collect()


# ---------------------------------------------------------------------------
# 5. hostile pickles
# ---------------------------------------------------------------------------


def _global_pattern(module: str, name: str) -> re.Pattern:
    return re.compile(re.escape(module) + r"[\s.:'\"/,]{1,3}" + re.escape(name))


@pytest.mark.parametrize("variant", HOSTILE)
def test_hostile_pickle_never_runs(suite, variant):
    h = suite["hostile"][variant]
    ck = suite["ck"]
    root, marker = h["out_dir"], h["marker"]
    module, gname = h["global"]
    problems = []

    p = ck("index", root)
    assert not crashed(p.returncode), f"index crashed\n{describe(p)}"
    assert not os.path.exists(marker), f"`ckptfs index` ran the payload: {marker} exists"
    if variant != "torch_save":
        assert p.returncode == EXIT_PROBLEMS, (
            f"{variant}: `ckptfs index` should exit 5 (problems)\n{describe(p)}")
        assert _global_pattern(module, gname).search(p.stderr), (
            f"{variant}: the message should name the global {module}.{gname}\n{describe(p)}")

    for args in (("ls", root, "--json"), ("ls", root), ("cat", root, "tensors/embed.npy"),
                 ("cat", root, "bytes/meta.step.pt"), ("index", root)):
        q = ck(*args)
        if crashed(q.returncode):
            problems.append(f"crashed: {describe(q)}")
        assert not os.path.exists(marker), f"`ckptfs {' '.join(args[:1])}` ran the payload"

    mnt = tempfile.mkdtemp(prefix="hostile-mnt-", dir=suite["base"])
    log = mnt + ".log"
    q = ck("mount", root, mnt, "--log-file", log)
    try:
        if crashed(q.returncode):
            problems.append(f"mount crashed: {describe(q)}")
        if q.returncode == 0:
            deadline = time.monotonic() + 20
            while not is_mounted(mnt) and time.monotonic() < deadline:
                time.sleep(0.05)
            for dirpath, _dirs, files in os.walk(mnt):
                for fn in files:
                    try:
                        with open(os.path.join(dirpath, fn), "rb") as f:
                            f.read()
                    except OSError as e:
                        if e.errno == errno.ENOTCONN:
                            problems.append(f"the mount daemon died reading {fn}")
            try:
                os.listdir(mnt)
            except OSError as e:
                problems.append(f"mount unusable after the walk: {e}")
    finally:
        unmount(mnt)
    assert not os.path.exists(marker), "the mount ran the payload"
    assert not problems, "\n".join(problems)


def test_a_tensor_whose_size_overflows_64_bits_is_left_out_and_the_rest_exact(suite):
    """A .metadata declaring one tensor of 2**62 x 4 elements (more than
    2**64 bytes): `index` exits 5 naming it; the mount shows no .npy of it
    (a header would promise bytes that are not there), refuses
    consolidated/ with EIO (a model without that tensor is incomplete), and
    serves every other tensor exactly as torch reads it."""
    import pickle
    import shutil

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

    name = "w_sfpr1_t1"
    info, oracle, ck = suite["infos"][name], suite["oracle"](name), suite["ck"]
    root = os.path.join(suite["base"], "overflow", name)
    shutil.copytree(info["out_dir"], root)
    meta_path = os.path.join(root, ".metadata")
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    victim = sorted(k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))[0]
    t = meta.state_dict_metadata[victim]
    t.size = torch.Size([2**62, 4])
    t.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**62, 4]))]
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)

    p = ck("index", root)
    assert p.returncode == EXIT_PROBLEMS, describe(p)
    assert f"tensor '{victim}'" in p.stderr and "overflows 64 bits" in p.stderr, describe(p)
    mnt = suite["mounts"].get(root)
    files = set(listdir_or_fail(os.path.join(mnt, "tensors"), name, mnt))
    want = {dcp_gen.escape_name(k) + ".npy": k for k in info["tensors"] if k != victim}
    assert files == set(want), (sorted(set(want) - files)[:5], sorted(files - set(want))[:5])
    for fn, k in sorted(want.items()):
        with open(os.path.join(mnt, "tensors", fn), "rb") as f:
            assert_npy_equal(load_npy(f.read(), fn, mmap=False), oracle[k], f"overflow copy: tensors/{fn}")
    with pytest.raises(OSError) as e:
        with open(os.path.join(mnt, "consolidated", "model.safetensors"), "rb") as f:
            f.read(8)
    assert e.value.errno == errno.EIO, e.value


# ---------------------------------------------------------------------------
# mesh/ views work on every input format (issue: "Works on every input format
# the index supports")
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "llama_tied", "tsave_sharded"])
@pytest.mark.parametrize("spec", ["tp2", "tp2-pp2"])
def test_mesh_views_on_dcp_and_torch_save(suite, name, spec):
    """Each rank's tensors equal the slice of the model weight (torch's own
    oracle) at the box layout.json gives, and the ranks of each stage cover
    every split tensor exactly once."""
    import numpy as np
    from safetensors.numpy import load as st_load
    info = suite["infos"][name]
    want = {k: dcp_gen.comparable(v.contiguous()).numpy() if v.dtype == torch.bfloat16 else v.contiguous().numpy()
            for k, v in dcp_gen.model_state_from_oracle(info).items()}
    mnt = suite["mounts"].get(info["out_dir"])
    ranks = sorted(os.listdir(os.path.join(mnt, "mesh", spec)))
    world = 1
    for part in spec.split("-"):
        world *= int(part[2:])
    assert ranks == [f"rank-{r:05d}" for r in range(world)], ranks
    counts = {k: np.zeros(v.shape, dtype=np.int64) for k, v in want.items()}
    for r in ranks:
        folder = os.path.join(mnt, "mesh", spec, r)
        layout = json.load(open(os.path.join(folder, "layout.json")))
        with open(os.path.join(folder, "model.safetensors"), "rb") as f:
            got = st_load(f.read())
        assert set(got) == set(layout["tensors"]), (name, spec, r)
        for k, meta in layout["tensors"].items():
            assert k in want, f"{name} {spec} {r}: '{k}' is not a model weight"
            assert list(want[k].shape) == meta["global_shape"], (k, meta)
            sl = tuple(slice(o, o + n) for o, n in zip(meta["offsets"], meta["lengths"]))
            g = got[k].astype(np.float32) if got[k].dtype.name == "bfloat16" else got[k]
            exp = want[k][sl]
            assert g.shape == exp.shape and np.array_equal(g.view(np.uint8) if g.dtype == exp.dtype else g, exp.view(np.uint8) if g.dtype == exp.dtype else exp), (name, spec, r, k)
            counts[k][sl] += 1
    tp = int(spec.split("-")[0][2:])
    for k, c in counts.items():
        held = set(np.unique(c).tolist())
        # Split tensors: each element once; replicated (norms): once per tp rank.
        assert held in ({1}, {tp}), (name, spec, k, held)


@pytest.mark.parametrize("name", ["llama", "tsave_sharded"])
def test_mesh_refuses_tp_not_dividing_the_heads(suite, name):
    """config.json says 4 attention heads: tp3 would cut one (docs/SEMANTICS.md)."""
    info = suite["infos"][name]
    mnt = suite["mounts"].get(info["out_dir"])
    with pytest.raises(FileNotFoundError):
        os.listdir(os.path.join(mnt, "mesh", "tp3"))
