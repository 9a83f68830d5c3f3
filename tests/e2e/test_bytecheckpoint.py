"""End-to-end tests of ckptfs on real ByteCheckpoint (bytecheckpoint 0.0.2)
checkpoints.

Checkpoints come from ``bytecheckpoint_gen.py`` (real bcp.save on 2 gloo CPU
ranks, bytecheckpoint installed in an isolated ``pip install --target`` dir,
$BYTECHECKPOINT_SITE or /tmp/bcp-site). Variants: FSDP1 with
``save_decomposed_model_optimizer`` (flat params + fsdp_* tables in the
model .metadata's user_defined_dict; f32 and bf16), FSDP1 SHARDED_STATE_DICT,
FSDP2 and DDP. Each root R = ``bcp_<variant>_<dtype>/`` holds ``model/``,
``optimizer/`` (bcp .metadata + ``__R_N.distcp``) and ``extra_state/``. The
oracle ``<name>-oracle.pt`` is the training-side full state gathered from
torch before the save, with flat params already decomposed.

Contract under test, for a ByteCheckpoint root R:
- ``ckptfs index R`` exits 0 with no problems, and R is ONE checkpoint:
  ``model/`` and ``optimizer/`` are not checkpoints of their own (no rows
  from them in ``ls --json``, no virtual entries inside them);
- ``ckptfs ls R --json`` lists ``model.<name>`` for every tensor of the
  oracle's "model" dict (decomposed FSDP: the original parameter names) and
  ``optimizer.<key>`` for every tensor of its "optimizer" dict, each with the
  oracle's safetensors dtype and shape; nothing else except the KNOWN EXTRAS
  listed below;
- ``ckptfs cat R tensors/<escaped name>.npy``: numpy loads exactly the
  oracle's values (BF16 presented as float32);
- ``ckptfs cat R consolidated/model.safetensors``: exactly the oracle's model
  tensors, under their own names (no ``model.`` prefix), same dtype, same
  values;
- ``ckptfs ls R bytes --json`` / ``cat R bytes/<escaped key>.pt``: the
  optimizer's param_groups (a BYTE_IO item) as ``optimizer.param_groups``
  (or flattened pieces ``optimizer.param_groups.<i>.<k>``), which
  ``torch.load(weights_only=False)`` turns back into the oracle's value.

Every ckptfs run uses a private CKPTFS_INDEX_DIR and ``ckptfs cat`` (no
mount). Nothing skips: a failing generator is a pytest.fail with its output.
Whole module: ~30 s on 2 cores (install ~2 s when the site dir is missing,
generation ~22-25 s, the ckptfs checks ~3 s).

Run: CKPTFS_BIN=build/ckptfs python3 -m pytest tests/e2e/test_bytecheckpoint.py -q
"""

from __future__ import annotations

import io
import json
import os
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
import bytecheckpoint_gen as bcpgen  # noqa: E402
from harness import describe, run_ckptfs  # noqa: E402

GEN = str(E2E_DIR / "bytecheckpoint_gen.py")
EXIT_OK = 0
WORLD = 2

# (variant, dtype) -> checkpoint name bcp_<variant>_<dtype>
JOBS = {"f32": ["fsdp_decomposed", "fsdp", "fsdp2", "ddp"], "bf16": ["fsdp_decomposed"]}
NAMES = [f"bcp_{v}_{d}" for d, vs in JOBS.items() for v in vs]

# ---------------------------------------------------------------------------
# KNOWN EXTRAS: what ckptfs may list beyond the oracle, explicitly.
# ---------------------------------------------------------------------------

# Decomposed FSDP: the optimizer .metadata holds, per flat param, a 0-d I64
# `state.<prefix>_flat_param.fsdp_optimizer_requires_grad_numel` (the number
# of trainable elements of the flat param). It is no parameter's state, so
# the oracle lacks it; ckptfs may list it (with these values) or leave it out.
_FLAT_PREFIXES = ["", "blocks.0.", "blocks.1."]
KNOWN_EXTRA_TENSORS: dict[str, dict[str, tuple[str, list[int]]]] = {
    name: {f"optimizer.state.{p}_flat_param.fsdp_optimizer_requires_grad_numel": ("I64", [])
           for p in _FLAT_PREFIXES}
    for name in NAMES if "_fsdp_decomposed_" in name
}

# extra_state/extra_state_rank_<r>.pt are plain torch.save files
# ({"step": 2, "rng": ByteTensor}) that bcp writes next to model/ and
# optimizer/. Today ckptfs indexes extra_state/ as a torch.save checkpoint of
# its own, listing these rows (checkpoint "extra_state"). They are not part
# of the ByteCheckpoint contract and are allowed, by exact (checkpoint, name).
KNOWN_EXTRA_ROWS: set[tuple[str, str]] = {
    ("extra_state", f"extra_state_rank_{r}.rng") for r in range(WORLD)}

# Byte items other than the param_groups (none expected).
KNOWN_EXTRA_BYTES: set[str] = set()

ST_DTYPE = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
NP_DTYPE = {
    torch.float32: np.dtype("<f4"), torch.bfloat16: np.dtype("<f4"),  # BF16 as float32
    torch.float16: np.dtype("<f2"), torch.float64: np.dtype("<f8"),
    torch.int64: np.dtype("<i8"), torch.int32: np.dtype("<i4"), torch.int16: np.dtype("<i2"),
    torch.int8: np.dtype("|i1"), torch.uint8: np.dtype("|u1"), torch.bool: np.dtype("|b1"),
}


def escape_name(name: str) -> str:
    """File name ckptfs gives a tensor / byte item (docs/SEMANTICS.md)."""
    if name == "":
        return "%"
    if name in (".", ".."):
        return "%2E" * len(name)
    return name.replace("%", "%25").replace("/", "%2F")


def unescape_name(fn: str) -> str:
    if fn == "%":
        return ""
    out, i = [], 0
    while i < len(fn):
        if fn[i] == "%" and i + 3 <= len(fn):
            out.append(chr(int(fn[i + 1:i + 3], 16)))
            i += 3
        else:
            out.append(fn[i])
            i += 1
    return "".join(out)


# ---------------------------------------------------------------------------
# running ckptfs
# ---------------------------------------------------------------------------


class Runner:
    def __init__(self, index_dir: str):
        self.index_dir = index_dir

    def __call__(self, *args, timeout: float = 120) -> subprocess.CompletedProcess:
        """`ckptfs ARGS` with CKPTFS_INDEX_DIR set; stdout bytes, stderr text
        (harness.run_ckptfs)."""
        return run_ckptfs(*args, index_dir=self.index_dir, timeout=timeout)


def ls_json(ck: Runner, *args) -> list:
    p = ck("ls", *args, "--json")
    assert p.returncode == EXIT_OK, describe(p)
    try:
        rows = json.loads(p.stdout)
    except ValueError as e:
        pytest.fail(f"`ckptfs ls {' '.join(map(str, args))} --json` printed no JSON ({e}): "
                    f"{p.stdout[:300]!r}")
    assert isinstance(rows, list), rows
    return rows


# ---------------------------------------------------------------------------
# fixture: install + generate once for the module
# ---------------------------------------------------------------------------


def _run_gen(args: list[str], what: str, timeout: float) -> float:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, GEN, *args], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"bytecheckpoint_gen.py {what} took more than {timeout} s:\n"
                    f"{(e.output or b'').decode(errors='replace')[-6000:]}")
    if p.returncode != 0:
        pytest.fail(f"bytecheckpoint_gen.py {what} failed (exit {p.returncode}):\n"
                    f"{p.stdout.decode(errors='replace')[-8000:]}")
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def bcp(tmp_path_factory):
    """Installs bytecheckpoint into its site dir if missing, writes every
    checkpoint (the two dtypes in parallel), returns infos, oracles and a
    ckptfs runner with a private index dir."""
    base = tmp_path_factory.mktemp("bcp")
    site = os.environ.get("BYTECHECKPOINT_SITE", bcpgen.DEFAULT_SITE)
    timings = {}
    if not bcpgen.site_ok(site):
        timings["install"] = _run_gen(["install", "--site", site], f"install --site {site}", 600)
    ckpts = str(base / "ckpts")
    t0 = time.monotonic()
    procs = {}
    for dtype, variants in JOBS.items():
        log = tempfile.TemporaryFile()
        procs[dtype] = (subprocess.Popen(
            [sys.executable, GEN, "gen", ckpts, "--variants", ",".join(variants),
             "--dtype", dtype, "--world", str(WORLD), "--site", site],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log)
    failed = []
    for dtype, (p, log) in procs.items():
        try:
            p.wait(timeout=400)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
        log.close()
        if p.returncode != 0:
            failed.append(f"--- bytecheckpoint_gen.py gen --dtype {dtype} "
                          f"--variants {','.join(JOBS[dtype])}: exit {p.returncode}\n{text[-8000:]}")
    if failed:
        pytest.fail("the ByteCheckpoint generator failed:\n" + "\n".join(failed))
    timings["gen"] = time.monotonic() - t0
    infos, oracles = {}, {}
    for name in NAMES:
        with open(os.path.join(ckpts, f"{name}-info.json")) as f:
            infos[name] = json.load(f)
        oracles[name] = torch.load(infos[name]["oracle_path"], weights_only=False)
    index_dir = base / "index"
    index_dir.mkdir()
    yield {"infos": infos, "oracles": oracles, "ck": Runner(str(index_dir)),
           "timings": timings, "site": site}


def oracle_tensors(oracle: dict) -> dict[str, torch.Tensor]:
    """The names ckptfs must list -> oracle tensor."""
    out = {}
    for part in ("model", "optimizer"):
        for k, v in oracle[part].items():
            if isinstance(v, torch.Tensor):
                out[f"{part}.{k}"] = v
    return out


def extra_values(info: dict) -> dict[str, torch.Tensor]:
    """Values of the known extras, from the reference reader (the
    optimizer .metadata's own items)."""
    md, _ = bcpgen.load_metadata(os.path.join(info["out_dir"], "optimizer", ".metadata"))
    items = bcpgen.assemble(os.path.join(info["out_dir"], "optimizer"), md)
    return {f"optimizer.{k}": items[k] for k in info["extra_items"]}


def item_bytes(ckdir: str, key: str) -> bytes:
    """Raw bytes of one BYTE_IO item of a bcp model/ or optimizer/ dir."""
    md, _ = bcpgen.load_metadata(os.path.join(ckdir, ".metadata"))
    (si,) = [s for idx, s in md.storage_data.items() if idx.fqn == key]
    with open(os.path.join(ckdir, si.relative_path), "rb") as f:
        f.seek(si.offset)
        return f.read(si.length)


def raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return b"" if t.numel() == 0 else t.reshape(-1).view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------
# 0. the generator and its oracle (pass without any reader)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_generated_checkpoint_matches_oracle(bcp, name):
    """The reference reader (bytecheckpoint_gen.read_checkpoint: pickle +
    torch only) gives exactly the oracle from the bcp files; the known extras
    are exactly the generator's extra_items."""
    info, oracle = bcp["infos"][name], bcp["oracles"][name]
    for sub in ("model/.metadata", "optimizer/.metadata"):
        assert sub in info["files"], info["files"]
    got = bcpgen.read_checkpoint(info["out_dir"])
    for part in ("model", "optimizer"):
        assert set(got[part]) == set(oracle[part]), (
            part, sorted(set(got[part]) ^ set(oracle[part])))
        for k, v in oracle[part].items():
            if isinstance(v, torch.Tensor):
                assert got[part][k].dtype == v.dtype and torch.equal(got[part][k], v), (part, k)
            else:
                assert got[part][k] == v, (part, k)
    assert isinstance(oracle["optimizer"]["param_groups"], list)
    known = KNOWN_EXTRA_TENSORS.get(name, {})
    assert sorted(known) == sorted(f"optimizer.{k}" for k in info["extra_items"])
    for k, t in extra_values(info).items():
        assert (ST_DTYPE[t.dtype], list(t.shape)) == known[k], (k, t.dtype, t.shape)
    want_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[info["dtype"]]
    assert {t.dtype for t in oracle["model"].values()} == {want_dtype}
    if "_fsdp_decomposed_" in name:
        assert set(info["flat_params"]) == {p + "_flat_param" for p in _FLAT_PREFIXES}
        mmd, _ = bcpgen.load_metadata(os.path.join(info["out_dir"], "model", ".metadata"))
        assert not set(oracle["model"]) & set(mmd.state_dict_metadata) - {"pos"}, (
            "decomposed: the .metadata holds flat params, not the oracle's names")


# ---------------------------------------------------------------------------
# 1. index: one checkpoint, no problems
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_index_one_checkpoint(bcp, name):
    info, ck = bcp["infos"][name], bcp["ck"]
    root = info["out_dir"]
    p = ck("index", root)
    assert p.returncode == EXIT_OK, f"{name}: `ckptfs index` should exit 0\n{describe(p)}"
    assert "problem" not in p.stderr, f"{name}: index reported problems\n{describe(p)}"
    rows = ls_json(ck, root)
    dirs = sorted({r.get("checkpoint") for r in rows})
    assert "" in dirs, (f"{name}: the root is not a checkpoint of its own; tensors come "
                        f"only from {dirs}")
    inside = [d for d in dirs if d and d.split("/")[0] in ("model", "optimizer")]
    assert not inside, (f"{name}: {inside} indexed as separate checkpoints; model/ and "
                        f"optimizer/ belong to the ByteCheckpoint root")
    for sub in ("model", "optimizer"):
        entries = ls_json(ck, root, sub)
        virtual = sorted(e["name"] for e in entries if e.get("virtual"))
        assert not virtual, (f"{name}: {sub}/ has virtual entries {virtual}: it is treated as "
                             f"a checkpoint of its own")
    top = {e["name"]: e for e in ls_json(ck, root, "/")}
    for v in ("consolidated", "tensors", "bytes"):
        assert v in top and top[v].get("virtual") and top[v].get("type") == "dir", (
            f"{name}: the root has no virtual {v}/: {sorted(top)}")


# ---------------------------------------------------------------------------
# 2. ls --json: names, dtypes, shapes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_ls_json_names_dtypes_shapes(bcp, name):
    info, ck = bcp["infos"][name], bcp["ck"]
    want = {k: (ST_DTYPE[t.dtype], list(t.shape)) for k, t in oracle_tensors(bcp["oracles"][name]).items()}
    extras = KNOWN_EXTRA_TENSORS.get(name, {})
    rows = ls_json(ck, info["out_dir"])
    by_name: dict[str, dict] = {}
    unknown_rows = []
    for r in rows:
        assert "name" in r and "checkpoint" in r, r
        if r["checkpoint"] != "":
            if (r["checkpoint"], r["name"]) not in KNOWN_EXTRA_ROWS:
                unknown_rows.append(f"{r['checkpoint']}/{r['name']}")
            continue
        assert r["name"] not in by_name, f"{name}: duplicate row {r['name']!r}"
        by_name[r["name"]] = r
    missing = sorted(set(want) - set(by_name))
    unknown = sorted(set(by_name) - set(want) - set(extras)) + unknown_rows
    assert not missing and not unknown, (
        f"{name}: `ckptfs ls --json` lists {len(by_name)} tensors of the root for "
        f"{len(want)} in the oracle; missing {missing[:12]}{'...' if len(missing) > 12 else ''} "
        f"({len(missing)}); neither in the oracle nor a known extra: {unknown[:12]}")
    bad = []
    for k, (dt, shape) in {**want, **{k: v for k, v in extras.items() if k in by_name}}.items():
        r = by_name[k]
        if r.get("dtype") != dt or r.get("shape") != shape:
            bad.append(f"{k}: {r.get('dtype')} {r.get('shape')}, want {dt} {shape}")
        if r.get("problem"):
            bad.append(f"{k}: problem {r['problem']!r}")
    assert not bad, f"{name}: " + "; ".join(bad[:12])


# ---------------------------------------------------------------------------
# 3. tensors/*.npy through ckptfs cat
# ---------------------------------------------------------------------------


def _npy_mismatch(data: bytes, want: torch.Tensor) -> str | None:
    try:
        arr = np.load(io.BytesIO(data), allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - reported as the test's failure
        return f"numpy cannot load it: {e!r} ({len(data)} bytes: {data[:64]!r})"
    exp_dtype = NP_DTYPE[want.dtype]
    if arr.dtype != exp_dtype:
        return f"npy dtype {arr.dtype.str}, want {exp_dtype.str} (torch {want.dtype})"
    if arr.shape != tuple(want.shape):
        return f"npy shape {arr.shape}, want {tuple(want.shape)}"
    exp = want.float() if want.dtype == torch.bfloat16 else want
    e = exp.contiguous().numpy()
    if np.ascontiguousarray(arr).tobytes() != raw(exp):
        g = np.ascontiguousarray(arr).reshape(-1)
        ee = e.reshape(-1)
        bad = np.flatnonzero(g.view(f"<u{g.itemsize}") != ee.view(f"<u{ee.itemsize}")) \
            if g.dtype.kind != "b" else np.flatnonzero(g != ee)
        i = int(bad[0])
        return f"{len(bad)} of {ee.size} elements differ; first at flat index {i}: got {g[i]!r}, want {ee[i]!r}"
    return None


@pytest.mark.parametrize("name", NAMES)
def test_tensors_npy_through_cat(bcp, name):
    info, ck = bcp["infos"][name], bcp["ck"]
    want = oracle_tensors(bcp["oracles"][name])
    # the known extras too, when ckptfs lists them
    listed = {r["name"] for r in ls_json(ck, info["out_dir"]) if r.get("checkpoint") == ""}
    want.update({k: v for k, v in extra_values(info).items() if k in listed})
    bad = []
    for k in sorted(want):
        rel = "tensors/" + escape_name(k) + ".npy"
        p = ck("cat", info["out_dir"], rel)
        if p.returncode != EXIT_OK:
            bad.append(f"cat {rel}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
            continue
        why = _npy_mismatch(p.stdout, want[k])
        if why:
            bad.append(f"cat {rel}: {why}")
    assert not bad, (f"{name}: {len(bad)} of {len(want)} tensors/*.npy wrong:\n  "
                     + "\n  ".join(bad[:15]) + ("\n  ..." if len(bad) > 15 else ""))


# ---------------------------------------------------------------------------
# 4. consolidated/model.safetensors: the model tensors, own names
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_consolidated_model_safetensors(bcp, name):
    from safetensors.torch import load as st_load
    info, ck = bcp["infos"][name], bcp["ck"]
    want = bcp["oracles"][name]["model"]
    p = ck("cat", info["out_dir"], "consolidated/model.safetensors")
    assert p.returncode == EXIT_OK, f"{name}\n{describe(p)}"
    try:
        got = st_load(p.stdout)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{name}: safetensors cannot load consolidated/model.safetensors "
                    f"({len(p.stdout)} bytes): {e!r}")
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"{name}: consolidated/model.safetensors names differ from the model's: "
        f"missing {missing[:10]}, not model weights {extra[:10]}")
    bad = []
    for k, w in sorted(want.items()):
        g = got[k]
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            bad.append(f"{k}: {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}")
        elif raw(g) != raw(w):
            d = (g.float() - w.float()).abs()
            bad.append(f"{k}: values differ (max |diff| {float(d.max())}, "
                       f"{int((d != 0).sum())} elements)")
    assert not bad, f"{name}: consolidated/model.safetensors: " + "; ".join(bad[:10])


# ---------------------------------------------------------------------------
# 5. bytes/*.pt: the optimizer's param_groups
# ---------------------------------------------------------------------------

PG_KEY = "optimizer.param_groups"
_MISSING = object()


def _resolve(obj, parts: list[str]):
    for part in parts:
        if isinstance(obj, dict):
            if part not in obj:
                return _MISSING
            obj = obj[part]
        elif isinstance(obj, (list, tuple)) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return _MISSING
    return obj


def _leaves(obj, prefix=()):
    """Paths of the leaves of lists and dicts (what a flattener could split)."""
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, prefix + (str(k),))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, prefix + (str(i),))
    else:
        yield prefix


@pytest.mark.parametrize("name", NAMES)
def test_bytes_param_groups(bcp, name):
    info, ck = bcp["infos"][name], bcp["ck"]
    pg = bcp["oracles"][name]["optimizer"]["param_groups"]
    entries = ls_json(ck, info["out_dir"], "bytes")
    keys = {}
    for e in entries:
        assert e.get("type") == "file" and e["name"].endswith(".pt"), (
            f"{name}: unexpected entry in bytes/: {e}")
        keys[unescape_name(e["name"][:-3])] = e["name"]
    pieces = {k: k[len(PG_KEY):].lstrip(".") for k in keys
              if k == PG_KEY or k.startswith(PG_KEY + ".")}
    unknown = sorted(set(keys) - set(pieces) - KNOWN_EXTRA_BYTES)
    assert pieces, (f"{name}: bytes/ has no {PG_KEY}.pt (nor flattened "
                    f"{PG_KEY}.<i>.<k>.pt pieces); it holds {sorted(keys)}")
    assert not unknown, f"{name}: bytes/ holds items that are not the param_groups: {unknown}"
    # The pieces cover every leaf of param_groups exactly once.
    paths = {k: tuple(rest.split(".")) if rest else () for k, rest in pieces.items()}
    for leaf in _leaves(pg):
        cover = [k for k, p in paths.items() if leaf[:len(p)] == p]
        assert len(cover) == 1, (f"{name}: param_groups{''.join(f'[{x}]' for x in leaf)} is in "
                                 f"{len(cover)} bytes/ items: {cover}")
    bad = []
    for k, path in sorted(paths.items()):
        want = _resolve(pg, list(path))
        if want is _MISSING:
            bad.append(f"{k}: no such piece in param_groups {pg!r}")
            continue
        rel = "bytes/" + keys[k]
        p = ck("cat", info["out_dir"], rel)
        if p.returncode != EXIT_OK:
            bad.append(f"cat {rel}: exit {p.returncode}: {p.stderr.strip()[-300:]}")
            continue
        if k == PG_KEY:  # the whole BYTE_IO item: its bytes exactly as saved
            item = item_bytes(os.path.join(info["out_dir"], "optimizer"), "param_groups")
            if p.stdout != item:
                i = next((j for j, (x, y) in enumerate(zip(p.stdout, item)) if x != y),
                         min(len(p.stdout), len(item)))
                bad.append(f"cat {rel}: not the saved item's bytes ({len(p.stdout)} bytes, the "
                           f"item has {len(item)}; first difference at byte {i})")
                continue
        try:
            obj = torch.load(io.BytesIO(p.stdout), weights_only=False)
        except Exception as e:  # noqa: BLE001
            bad.append(f"cat {rel}: torch.load fails: {e!r}")
            continue
        if obj != want:
            bad.append(f"cat {rel}: torch.load gives {obj!r}, want {want!r}")
    assert not bad, f"{name}: " + "; ".join(bad)
