"""Real clients on a ckptfs mount: safetensors.torch, torch's own
consolidator (as an oracle), transformers, and the ckptfs CLI."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors.torch import load_file

import ckpt_gen
from conftest import SPLIT_SIZE



def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def st_tensors(path: str) -> dict[str, tuple[str, list, bytes]]:
    """{fqn: (dtype, shape, raw bytes)} parsed straight from a file."""
    data = read_file(path)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    start = 8 + n
    return {k: (v["dtype"], v["shape"],
                data[start + v["data_offsets"][0]:start + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def consolidated_files(mount) -> list[str]:
    return sorted(f for f in os.listdir(mount.p("consolidated")) if f.endswith(".safetensors"))


# ---------------------------------------------------------------------------
# (a) safetensors.torch.load_file through the mount
# ---------------------------------------------------------------------------

MOUNTS = {
    "main": ("main_mount", "main_ckpt"),
    "split": ("main_split_mount", "main_ckpt"),
    "mapping": ("mapping_mount", "mapping_ckpt"),
    "llama": ("llama_mount", "llama_ckpt"),
}


@pytest.mark.parametrize("which", list(MOUNTS))
def test_load_file_equals_originals(request, which):
    mount = request.getfixturevalue(MOUNTS[which][0])
    info = request.getfixturevalue(MOUNTS[which][1])
    expected = info["expected"]
    files = consolidated_files(mount)
    assert files, os.listdir(mount.p("consolidated"))
    if which == "split":
        assert len(files) > 1
    seen = {}
    for f in files:
        loaded = load_file(mount.p("consolidated", f))
        for k, t in loaded.items():
            assert k not in seen, f"{k} in both {seen[k]} and {f}"
            seen[k] = f
            want = expected[k]
            assert t.dtype == want.dtype, k
            assert t.shape == want.shape, k
            assert raw(t) == raw(want), k
    assert set(seen) == set(expected)


# ---------------------------------------------------------------------------
# (b) torch's consolidate_safetensors_files as an oracle
# ---------------------------------------------------------------------------


def _oracle_mapping(info: dict, mapping: dict[str, int]) -> tuple[dict, list[str]]:
    """Drops what torch's consolidator cannot do (ints/bool: TypeError in
    torch.finfo; 0-d tensors: written as zeros). Returns (mapping, dropped)."""
    keep, dropped = {}, []
    for k, v in mapping.items():
        t = info["expected"][k]
        if not t.dtype.is_floating_point or t.dim() == 0:
            dropped.append(k)
        else:
            keep[k] = v
    return keep, dropped


@pytest.fixture(scope="module")
def oracle_main(main_ckpt, tmp_path_factory):
    mapping, dropped = _oracle_mapping(main_ckpt, dict.fromkeys(main_ckpt["expected"], 1))
    out = str(tmp_path_factory.mktemp("oracle-main"))
    res = ckpt_gen.consolidate_with_torch(main_ckpt["out_dir"], out,
                                          fqn_to_index_mapping=mapping, copy_config=False)
    return res, dropped


@pytest.fixture(scope="module")
def oracle_mapping(mapping_ckpt, tmp_path_factory):
    mapping, dropped = _oracle_mapping(mapping_ckpt, mapping_ckpt["fqn_to_index_mapping"])
    out = str(tmp_path_factory.mktemp("oracle-mapping"))
    res = ckpt_gen.consolidate_with_torch(mapping_ckpt["out_dir"], out,
                                          fqn_to_index_mapping=mapping, copy_config=False)
    return res, dropped


def test_torch_oracle_matches_tensor_by_tensor(main_mount, main_ckpt, oracle_main):
    res, dropped = oracle_main
    ours = st_tensors(main_mount.p("consolidated", "model.safetensors"))
    theirs = {}
    for f in res["files"]:
        if f.endswith(".safetensors"):
            theirs.update(st_tensors(os.path.join(res["out_dir"], f)))
    # the oracle covered every float tensor (so the comparison is not vacuous)
    assert set(theirs) == set(main_ckpt["expected"]) - set(dropped)
    assert len(theirs) >= 12
    for k, (dtype, shape, data) in theirs.items():
        assert ours[k][0] == dtype and ours[k][1] == shape, k
        assert ours[k][2] == data, f"{k}: bytes differ from torch's consolidation"
    # what the oracle cannot do is compared with the originals
    assert {"model.position_ids", "model.token_type_ids", "extra.scalar", "extra.flag",
            "extra.bytes", "extra.short"} <= set(dropped)
    for k in dropped:
        want = main_ckpt["expected"][k]
        assert ours[k][0] == ckpt_gen.ST_DTYPE[want.dtype], k
        assert ours[k][1] == list(want.shape), k
        assert ours[k][2] == raw(want), k


def test_torch_oracle_matches_file_by_file_with_mapping(mapping_mount, mapping_ckpt,
                                                        oracle_mapping):
    res, dropped = oracle_mapping
    theirs_files = [f for f in res["files"] if f.endswith(".safetensors")]
    ours_files = consolidated_files(mapping_mount)
    assert ours_files == theirs_files and len(ours_files) == 3
    for f in ours_files:
        ours = st_tensors(mapping_mount.p("consolidated", f))
        theirs = st_tensors(os.path.join(res["out_dir"], f))
        assert set(ours) - set(dropped) == set(theirs), f
        for k, v in theirs.items():
            assert ours[k] == v, (f, k)
        for k in set(ours) & set(dropped):
            want = mapping_ckpt["expected"][k]
            assert ours[k][2] == raw(want), (f, k)
    # index.json: same weight map for what both have
    ours_idx = json.loads(read_file(mapping_mount.p("consolidated", "model.safetensors.index.json")))
    theirs_idx = json.loads(read_file(os.path.join(res["out_dir"], "model.safetensors.index.json")))
    for k, v in theirs_idx["weight_map"].items():
        assert ours_idx["weight_map"][k] == v, k


# ---------------------------------------------------------------------------
# (c) transformers from_pretrained on the mount
# ---------------------------------------------------------------------------


def _logits_from(path: str, logits_path: str):
    from transformers import AutoModelForCausalLM
    ref = torch.load(logits_path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        got = model(input_ids=ref["input_ids"]).logits.float()
    return model, got, ref["logits"]


def test_llama_from_pretrained_logits(llama_mount, llama_ckpt):
    cons = llama_mount.p("consolidated")
    assert sorted(os.listdir(cons)) == ["config.json", "model.safetensors"]
    model, got, want = _logits_from(cons, llama_ckpt["logits_path"])
    assert got.dtype == torch.float32
    assert got.shape == want.shape
    assert torch.equal(got, want)
    sd = model.state_dict()
    for k, t in llama_ckpt["expected"].items():
        assert torch.equal(sd[k], t), k


def test_llama_from_pretrained_split(llama_ckpt, mount_factory):
    # a sharded HF folder (index.json + several files) loads the same
    with mount_factory(llama_ckpt["out_dir"], "--max-file-size", "100KB") as m:
        cons = m.p("consolidated")
        files = consolidated_files(m)
        assert len(files) > 2
        assert os.path.exists(os.path.join(cons, "model.safetensors.index.json"))
        # Not the model: its weights map the mount's files, and held they
        # would keep the mount busy through the unmount (4 s of retries,
        # then a lazy unmount).
        got, want = _logits_from(cons, llama_ckpt["logits_path"])[1:]
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------
# (d) the CLI: cat, export, ls, --help, exit codes
# ---------------------------------------------------------------------------

VIEW_ARGS = {"main": ("main_mount", ()), "split": ("main_split_mount", ("--max-file-size", SPLIT_SIZE))}


def files_under(d: str) -> list[str]:
    """Relative paths of the regular files below d, sorted."""
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


@pytest.mark.parametrize("which", list(VIEW_ARGS))
def test_cat_matches_mount(request, ckptfs, main_ckpt, which):
    mount = request.getfixturevalue(VIEW_ARGS[which][0])
    args = VIEW_ARGS[which][1]
    names = files_under(mount.p("consolidated"))
    assert "config.json" in names and "scripts/run.sh" in names  # sidecar folders come along
    for name in names:
        r = ckptfs("cat", main_ckpt["out_dir"], "consolidated/" + name, *args)
        assert r.returncode == 0, r.stderr.decode()
        assert r.stdout == read_file(mount.p("consolidated", name)), name
    # a source-mirrored file too
    r = ckptfs("cat", main_ckpt["out_dir"], "scripts/run.sh")
    assert r.returncode == 0 and r.stdout == read_file(mount.p("scripts", "run.sh"))


@pytest.mark.parametrize("which", list(VIEW_ARGS))
def test_export_matches_mount(request, ckptfs, main_ckpt, tmp_path, which):
    mount = request.getfixturevalue(VIEW_ARGS[which][0])
    args = VIEW_ARGS[which][1]
    dest = tmp_path / "hf"
    r = ckptfs("export", main_ckpt["out_dir"], "consolidated", str(dest), *args)
    assert r.returncode == 0, r.stderr.decode()
    got = files_under(str(dest))
    want = files_under(mount.p("consolidated"))
    assert got == want
    for name in want:
        assert read_file(str(dest / name)) == read_file(mount.p("consolidated", name)), name
    assert not [f for f in got if "partial" in f]
    # a single file
    dest2 = tmp_path / "one"
    target = [n for n in want if n.endswith(".safetensors")][0]
    r = ckptfs("export", main_ckpt["out_dir"], "consolidated/" + target, str(dest2), *args)
    assert r.returncode == 0, r.stderr.decode()
    assert os.listdir(dest2) == [target]
    assert read_file(str(dest2 / target)) == read_file(mount.p("consolidated", target))


def test_export_then_load_with_transformers(ckptfs, llama_ckpt, tmp_path):
    dest = tmp_path / "llama-hf"
    r = ckptfs("export", llama_ckpt["out_dir"], "consolidated", str(dest))
    assert r.returncode == 0, r.stderr.decode()
    _, got, want = _logits_from(str(dest), llama_ckpt["logits_path"])
    assert torch.equal(got, want)


@pytest.mark.parametrize("which", list(VIEW_ARGS))
def test_ls_json(request, ckptfs, main_ckpt, which):
    mount = request.getfixturevalue(VIEW_ARGS[which][0])
    args = VIEW_ARGS[which][1]
    r = ckptfs("ls", main_ckpt["out_dir"], "consolidated", "--json", *args)
    assert r.returncode == 0, r.stderr.decode()
    entries = json.loads(r.stdout)
    names = os.listdir(mount.p("consolidated"))
    want = {n: os.stat(mount.p("consolidated", n)).st_size
            for n in names if os.path.isfile(mount.p("consolidated", n))}
    assert {e["name"]: e["size"] for e in entries if e["type"] == "file"} == want
    # the one sidecar folder (scripts/ of the model folder) is a virtual dir
    assert {e["name"] for e in entries if e["type"] == "dir"} == set(names) - set(want) == {"scripts"}
    assert all(e["virtual"] is True for e in entries)
    assert [e["name"] for e in entries] == sorted(names)
    # the top level ("." = the root of the tree): source entries and the
    # virtual consolidated/ dir
    r = ckptfs("ls", main_ckpt["out_dir"], ".", "--json", *args)
    assert r.returncode == 0, r.stderr.decode()
    top = {e["name"]: e for e in json.loads(r.stdout)}
    assert set(top) == set(os.listdir(mount.path))
    assert top["consolidated"]["type"] == "dir" and top["consolidated"]["virtual"] is True
    assert top["scripts"]["type"] == "dir" and top["scripts"]["virtual"] is False
    assert top["README.md"]["size"] == os.stat(mount.p("README.md")).st_size
    assert top["README.md"]["virtual"] is False
    # a single file
    r = ckptfs("ls", main_ckpt["out_dir"], "consolidated/config.json", "--json", *args)
    assert r.returncode == 0
    assert json.loads(r.stdout) == [{"name": "config.json", "type": "file",
                                      "size": want["config.json"], "virtual": True}]


def test_ls_tensor_table(ckptfs, main_ckpt):
    # `ls ROOT` without PATH: one row per tensor, as the originals are
    r = ckptfs("ls", main_ckpt["out_dir"], "--json")
    assert r.returncode == 0, r.stderr.decode()
    rows = {e["name"]: e for e in json.loads(r.stdout)}
    expected = main_ckpt["expected"]
    assert set(rows) == set(expected)
    for k, t in expected.items():
        assert rows[k]["dtype"] == ckpt_gen.ST_DTYPE[t.dtype], k
        assert rows[k]["shape"] == list(t.shape), k
        assert rows[k]["bytes"] == len(raw(t)), k
        assert not rows[k]["problem"], k
    r = ckptfs("ls", main_ckpt["out_dir"], "--json", "--filter", "*embed*")
    assert r.returncode == 0, r.stderr.decode()
    assert [e["name"] for e in json.loads(r.stdout)] == ["model.embed_tokens.weight"]


def test_ls_plain(ckptfs, main_ckpt, main_mount):
    r = ckptfs("ls", main_ckpt["out_dir"], "consolidated")
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    size = os.stat(main_mount.p("consolidated", "model.safetensors")).st_size
    line = [ln for ln in out.splitlines() if ln.endswith("model.safetensors")]
    assert len(line) == 1 and str(size) in line[0].split()


@pytest.mark.parametrize("sub", [None, "index", "mount", "ls", "inspect", "check", "verify",
                                 "cat", "export"])
def test_help(ckptfs, sub):
    r = ckptfs(*([sub] if sub else []), "--help")
    assert r.returncode == 0, r.stderr.decode()
    text = r.stdout.decode() + r.stderr.decode()
    assert "Example" in text
    assert "ckptfs " + (sub or "") in text


def test_exit_codes(ckptfs, main_ckpt, tmp_path):
    root = main_ckpt["out_dir"]
    cases = [
        (["cat", root, "consolidated/nope.safetensors"], 3),
        (["cat", str(tmp_path / "missing-root"), "x"], 3),
        (["ls", root, "no/such/dir"], 3),
        (["export", root, "nope", str(tmp_path / "x")], 3),
        (["cat", root, "consolidated"], 2),                     # a directory
        (["cat", root], 2),                                     # missing PATH
        (["ls", root, "--no-such-flag"], 2),
        (["cat", root, "consolidated/config.json", "--max-file-size", "lots"], 2),
        (["frobnicate"], 2),
        (["mount", root, str(tmp_path / "no-such-mountpoint")], 7),
    ]
    bad = []
    for args, want in cases:
        r = ckptfs(*args)
        if r.returncode != want:
            bad.append((args, want, r.returncode, r.stderr.decode()[-300:]))
    assert not bad, bad


def test_index_exit_5_on_problems(ckptfs, copy_ckpt, main_ckpt, tmp_path):
    root = copy_ckpt(main_ckpt["out_dir"])
    os.unlink(os.path.join(root, "shard-00001-model-00001-of-00001.safetensors"))
    r = ckptfs("index", root)
    assert r.returncode == 5, r.stderr.decode()
    lines = [ln for ln in r.stderr.decode().splitlines() if ln.startswith("ckptfs: problem in ")]
    assert lines, r.stderr.decode()
    # cat of an affected file: read error (6); a sidecar still reads
    r = ckptfs("cat", root, "consolidated/model.safetensors")
    assert r.returncode == 6, (r.returncode, r.stderr.decode())
    r = ckptfs("cat", root, "consolidated/config.json")
    assert r.returncode == 0 and r.stdout == read_file(os.path.join(root, "config.json"))
    # export of the folder fails (6) and leaves no partial file
    dest = tmp_path / "exp"
    r = ckptfs("export", root, "consolidated", str(dest))
    assert r.returncode == 6, r.stderr.decode()
    left = [f for _, _, fs in os.walk(dest) for f in fs] if dest.exists() else []
    assert not [f for f in left if "partial" in f or f == "model.safetensors"], left


def test_stale_source_exit_4(ckptfs, copy_ckpt, main_ckpt, mount_factory, tmp_path):
    root = copy_ckpt(main_ckpt["out_dir"])
    r = ckptfs("index", root)
    assert r.returncode == 0, r.stderr.decode()
    shard = os.path.join(root, "shard-00002-model-00001-of-00001.safetensors")
    st = os.stat(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    for args in (["cat", root, "consolidated/model.safetensors"],
                 ["ls", root, "consolidated"],
                 ["export", root, "consolidated", str(tmp_path / "e")]):
        r = ckptfs(*args)
        assert r.returncode == 4, (args, r.returncode, r.stderr.decode())
    with pytest.raises(Exception) as ei:
        with mount_factory(root):
            pass
    assert getattr(ei.value, "rc", None) == 4, ei.value
    # --reindex makes it servable again, with the right bytes
    with mount_factory(root, "--reindex") as m:
        got = load_file(m.p("consolidated", "model.safetensors"))
        assert set(got) == set(main_ckpt["expected"])
        for k, t in got.items():
            assert raw(t) == raw(main_ckpt["expected"][k]), k
        del got, t  # they map the mount's file: held, the unmount would find it busy


def test_index_mapping_flag(ckptfs, copy_ckpt, main_ckpt, tmp_path):
    root = copy_ckpt(main_ckpt["out_dir"])
    names = sorted(main_ckpt["expected"])
    mapping = {k: 1 + (i % 2) for i, k in enumerate(names)}
    mpath = tmp_path / "mapping.json"
    mpath.write_text(json.dumps(mapping))
    r = ckptfs("index", root, "--mapping", str(mpath))
    assert r.returncode == 0, r.stderr.decode()
    r = ckptfs("ls", root, "consolidated", "--json")
    assert r.returncode == 0, r.stderr.decode()
    files = sorted(e["name"] for e in json.loads(r.stdout) if e["name"].endswith(".safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    r = ckptfs("cat", root, "consolidated/model.safetensors.index.json")
    assert r.returncode == 0
    wm = json.loads(r.stdout)["weight_map"]
    assert wm == {k: f"model-0000{v}-of-00002.safetensors" for k, v in mapping.items()}


def test_index_lives_in_ckptfs_index_dir(index_dir, main_ckpt, mapping_mount, llama_mount):
    # CKPTFS_INDEX_DIR is honoured (tests never touch ~/.cache): `index` and
    # the auto-indexing mounts all put their index there
    names = os.listdir(index_dir)
    for ckpt in ("main", "mapping", "llama"):
        assert any(n.startswith(ckpt + "-") for n in names), names
