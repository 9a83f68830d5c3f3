"""The commit record of ckptfs's writer against the files it describes
(docs/WRITER.md, "The commit record"; indexer/commit_record.h).

- A step saved by StorageWriter gives the same views however it is indexed:
  ``ckptfs index`` (which reads the commit record), the same files without
  their record, and torch's own FileSystemWriter save of the same state all
  serve byte-identical ``consolidated/`` and ``mesh/tp4/`` files, with the
  step folder's config.json; transformers loads ``consolidated/`` to the
  saved model's logits.
- A byte flipped after the save (size and mtime kept), in tensor data or in
  a ``.distcp`` file's zip framing: after ``ckptfs index``, ``verify`` exits
  non-zero naming the chunk or the file, and ``mount --verify-checksums``
  fails the flipped tensor.
- Commit records altered with valid CRCs (offsets shifted, chunks swapped, a
  transposed shape, f32 declared bf16, no tensors): the index says the
  record disagrees and serves what the files say; ``verify`` exits non-zero.

Expected values: the state dicts torch saved, transformers' own forward,
and torch's own FileSystemWriter.
"""

from __future__ import annotations

import errno
import json
import os
import shutil

import numpy as np
import pytest
import torch

from harness import Mounted, run_ckptfs, spawn_ranks

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_gen.py")


def _tree_bytes(top: str) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(top):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), top)] = fh.read()
    return out


def _views(m: Mounted) -> dict[str, bytes]:
    """Every file of step_1's consolidated/ and mesh/tp4/ (opened by name)."""
    views = {"consolidated/" + k: v for k, v in _tree_bytes(m.p("step_1", "consolidated")).items()}
    views.update({"mesh/tp4/" + k: v for k, v in _tree_bytes(m.p("step_1", "mesh", "tp4")).items()})
    return views


# ---------------------------------------------------------------------------
# 1. the same views however the step was indexed
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    base = tmp_path_factory.mktemp("record_llama")
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    state = str(base / "state.pt")
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, state)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return {"base": base, "cfg": cfg, "state": state, "ids": ids, "logits": logits}


def _save_llama(llama: dict, root, writer: str, layout: str = "dcp") -> str:
    step = os.path.join(str(root), "step_1")
    os.makedirs(step, exist_ok=True)
    if layout == "hf":  # config.json before the save for one layout, after it for the other
        llama["cfg"].to_json_file(os.path.join(step, "config.json"))
    spawn_ranks(GEN, 1, {"kind": "flat", "state": llama["state"], "dir": step, "writer": writer, "layout": layout},
                name=f"{writer} save ({layout})")
    if layout != "hf":
        llama["cfg"].to_json_file(os.path.join(step, "config.json"))
    return step


@pytest.mark.parametrize("layout", ["dcp", "hf"])
def test_a_writer_step_has_the_same_views_however_it_is_indexed(llama, tmp_path, layout):
    from transformers import AutoModelForCausalLM
    saved = _save_llama(llama, tmp_path / "writer", "ckptfs", layout)
    assert os.path.isfile(os.path.join(saved, ".ckptfs", "commit.sst"))
    # The same files without their commit record: read from the files alone.
    bare = tmp_path / "bare"
    shutil.copytree(saved, bare / "step_1", ignore=shutil.ignore_patterns(".ckptfs"))
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", str(tmp_path / "writer"), index_dir=idx)
    assert p.returncode == 0 and "not used" not in p.stderr and "warning" not in p.stderr, p.stderr
    with Mounted(str(tmp_path / "writer"), index_dir=idx, base_dir=str(tmp_path)) as m:
        assert os.path.isfile(m.p("step_1", "consolidated", "config.json")), os.listdir(m.p("step_1", "consolidated"))
        indexed = _views(m)
        model = AutoModelForCausalLM.from_pretrained(m.p("step_1", "consolidated")).eval()
        with torch.no_grad():
            assert torch.equal(model(llama["ids"]).logits, llama["logits"])
        del model  # it maps the mount's file: held, the unmount would find it busy
    with Mounted(str(bare), index_dir=str(tmp_path / "idx_bare"), base_dir=str(tmp_path)) as m:
        from_files = _views(m)
    assert sorted(indexed) == sorted(from_files)
    assert [k for k in indexed if indexed[k] != from_files[k]] == []
    assert any(k.startswith("mesh/tp4/rank-00002/") for k in indexed), sorted(indexed)
    if layout == "dcp":  # torch's own writer, the same state: the same views
        _save_llama(llama, tmp_path / "stock", "stock")
        with Mounted(str(tmp_path / "stock"), index_dir=str(tmp_path / "idx_stock"), base_dir=str(tmp_path)) as m:
            stock = _views(m)
        assert sorted(stock) == sorted(indexed)
        assert [k for k in indexed if indexed[k] != stock[k]] == []
    p = run_ckptfs("verify", str(tmp_path / "writer"), "--json", index_dir=idx, text_stdout=True)
    report = json.loads(p.stdout)
    assert p.returncode == 0 and report["checksummed_chunks"] > 0 and report["warnings"] == [], report


# ---------------------------------------------------------------------------
# 2. bytes changed after the save, size and mtime kept
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def writer_step(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("record_step")
    job = {"kind": "save", "seed": 9, "dir": str(base / "run" / "step_9"), "oracle": str(base / "oracle.pt"),
           "rows": str(base / "rows.json")}
    spawn_ranks(GEN, 2, job, name="writer save (record)")
    with open(job["rows"]) as f:
        rows = json.load(f)
    return {**job, "base": base, "rows": rows, "oracle": torch.load(job["oracle"], weights_only=False)}


def _copy_step(writer_step: dict, to) -> str:
    """The step in a root of its own; copy2 keeps mtimes, so the record stays current."""
    root = str(to)
    shutil.copytree(os.path.dirname(writer_step["dir"]), root)
    return os.path.join(root, "step_9")


def _flip(path: str, offset: int) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as they were


def _chunk(rows: dict, fqn: str, offsets: list[int]) -> dict:
    t = next(t for t in rows["tensors"] if t["fqn"] == fqn)
    return next(c for c in t["chunks"] if c["offsets"] == offsets)


def test_verify_finds_a_byte_flipped_in_tensor_data_after_the_save(writer_step, tmp_path):
    step = _copy_step(writer_step, tmp_path / "run")
    c = _chunk(writer_step["rows"], "tp.row_i64", [3, 0])
    name = os.path.basename(c["file"])
    _flip(os.path.join(step, name), c["offset"] + c["length"] // 2)
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", str(tmp_path / "run"), index_dir=idx)
    assert p.returncode == 0 and "not used" not in p.stderr, p.stderr
    p = run_ckptfs("verify", str(tmp_path / "run"), "--json", index_dir=idx, text_stdout=True)
    assert p.returncode != 0, p.stdout
    problems = json.loads(p.stdout)["problems"]
    assert len(problems) == 1 and "tp.row_i64" in problems[0] and name in problems[0] and "CRC32C" in problems[0], problems
    with Mounted(str(tmp_path / "run"), "--verify-checksums", index_dir=idx, base_dir=str(tmp_path)) as m:
        with pytest.raises(OSError) as err:
            np.load(m.p("step_9", "tensors", "tp.row_i64.npy"))
        assert err.value.errno == errno.EIO
        got = np.load(m.p("step_9", "tensors", "tp.col_f32.npy"))
        assert np.array_equal(got, writer_step["oracle"]["tp.col_f32"].numpy())
        assert "tp.row_i64" in m.log() and "CRC32C" in m.log(), m.log()


def test_verify_finds_a_byte_flipped_in_zip_framing_after_the_save(writer_step, tmp_path):
    step = _copy_step(writer_step, tmp_path / "run")
    name = os.path.basename(_chunk(writer_step["rows"], "tp.row_i64", [3, 0])["file"])
    path = os.path.join(step, name)
    last = os.path.getsize(path) - 3  # the end of central directory of the file's last item
    assert all(not (c["offset"] <= last < c["offset"] + c["length"])
               for t in writer_step["rows"]["tensors"] for c in t["chunks"] if c["file"].endswith(name))
    _flip(path, last)
    idx = str(tmp_path / "idx")
    run_ckptfs("index", str(tmp_path / "run"), index_dir=idx)
    p = run_ckptfs("verify", str(tmp_path / "run"), "--json", index_dir=idx, text_stdout=True)
    assert p.returncode != 0, p.stdout + p.stderr
    problems = json.loads(p.stdout)["problems"] if p.stdout.strip() else [p.stderr]
    assert any(name in q for q in problems), problems


def test_a_mount_says_when_verify_checksums_has_nothing_to_check(writer_step, tmp_path):
    bare = tmp_path / "run"
    shutil.copytree(os.path.dirname(writer_step["dir"]), bare, ignore=shutil.ignore_patterns(".ckptfs"))
    with Mounted(str(bare), "--verify-checksums", index_dir=str(tmp_path / "idx"), base_dir=str(tmp_path)) as m:
        np.load(m.p("step_9", "tensors", "tp.col_f32.npy"))
        assert "no writer checksums" in m.log(), m.log()


# ---------------------------------------------------------------------------
# 3. altered commit records are refused, whatever their CRCs say
# ---------------------------------------------------------------------------


def _torch_dtype(oracle: dict, fqn: str) -> str:
    return str(oracle[fqn].dtype).removeprefix("torch.")


def _record_args(rows: dict, oracle: dict) -> tuple[list, list, list]:
    """The arguments ckptfs.torch.StorageWriter passes to _writer.commit."""
    tensors = [(t["fqn"], t["path"], _torch_dtype(oracle, t["fqn"]), list(t["shape"])) for t in rows["tensors"]]
    chunks = [(t["fqn"], list(c["offsets"]), list(c["sizes"]), os.path.basename(c["file"]), c["offset"], c["length"],
               c["crc32c"]) for t in rows["tensors"] for c in t["chunks"]]
    items = [(k, os.path.basename(f), off, n) for k, (f, off, n) in rows["bytes"].items()]
    return tensors, chunks, items


def _shift(tensors, chunks, items):
    i = next(i for i, c in enumerate(chunks) if c[0] == "tp.col_f32")
    fqn, offs, sizes, f, off, n, crc = chunks[i]
    chunks[i] = (fqn, offs, sizes, f, off + 4, n, crc)


def _swap(tensors, chunks, items):
    pairs = [(i, j) for i in range(len(chunks)) for j in range(i + 1, len(chunks))
             if chunks[i][5] == chunks[j][5] > 0 and chunks[i][4] != chunks[j][4]]
    assert pairs, "no two chunks of the same length to swap"
    i, j = pairs[0]
    a, b = chunks[i], chunks[j]
    chunks[i] = a[:3] + b[3:5] + a[5:]
    chunks[j] = b[:3] + a[3:5] + b[5:]


def _transpose(tensors, chunks, items):
    i = next(i for i, t in enumerate(tensors) if t[0] == "tp.row_bf16")
    fqn, path, dtype, shape = tensors[i]
    tensors[i] = (fqn, path, dtype, shape[::-1])
    for k, c in enumerate(chunks):
        if c[0] == fqn:
            chunks[k] = (c[0], c[1][::-1], c[2][::-1]) + c[3:]


def _f32_as_bf16(tensors, chunks, items):
    i = next(i for i, t in enumerate(tensors) if t[0] == "tp.col_f32")
    tensors[i] = tensors[i][:2] + ("bfloat16",) + tensors[i][3:]


def _no_tensors(tensors, chunks, items):
    tensors.clear()
    chunks.clear()


@pytest.mark.parametrize("tamper", [_shift, _swap, _transpose, _f32_as_bf16, _no_tensors],
                         ids=["offset-shifted", "chunks-swapped", "shape-transposed", "f32-as-bf16", "no-tensors"])
def test_an_altered_commit_record_is_refused(writer_step, tmp_path, tamper):
    from ckptfs import _writer
    step = _copy_step(writer_step, tmp_path / "run")
    tensors, chunks, items = _record_args(writer_step["rows"], writer_step["oracle"])
    tamper(tensors, chunks, items)
    os.remove(os.path.join(step, ".ckptfs", "commit.sst"))
    _writer.commit(str(tmp_path / "run"), "step_9", tensors, chunks, items, format="dcp")  # valid CRCs, wrong rows
    idx = str(tmp_path / "idx")
    p = run_ckptfs("index", str(tmp_path / "run"), index_dir=idx)
    assert p.returncode == 0, p.stderr
    assert "disagrees with the files" in p.stderr, p.stderr
    oracle = writer_step["oracle"]
    with Mounted(str(tmp_path / "run"), "--verify-checksums", index_dir=idx, base_dir=str(tmp_path)) as m:
        for fqn in ("tp.col_f32", "tp.row_bf16", "tp.row_i64", "model.0.weight"):
            want = oracle[fqn].float() if oracle[fqn].dtype == torch.bfloat16 else oracle[fqn]
            assert np.array_equal(np.load(m.p("step_9", "tensors", fqn + ".npy")), want.numpy()), fqn
    p = run_ckptfs("verify", str(tmp_path / "run"), "--json", index_dir=idx, text_stdout=True)
    assert p.returncode != 0, p.stdout
    problems = json.loads(p.stdout)["problems"]
    assert any("disagrees with the files" in q for q in problems), problems


# ---------------------------------------------------------------------------
# 4. an interrupted layout="hf" save is named by check
# ---------------------------------------------------------------------------


def test_check_names_an_hf_save_interrupted_before_its_shards_were_published(llama, tmp_path):
    """A layout="hf" save killed before its commit leaves only NAME.tmp
    shards (published by rename at commit) and no record."""
    step = _save_llama(llama, tmp_path / "run", "ckptfs", "hf")
    shutil.rmtree(os.path.join(step, ".ckptfs"))
    shards = [f for f in os.listdir(step) if f.endswith(".safetensors")]
    assert shards, os.listdir(step)
    for f in shards:
        os.rename(os.path.join(step, f), os.path.join(step, f + ".tmp"))
    p = run_ckptfs("check", str(tmp_path / "run"), index_dir=str(tmp_path / "idx"), text_stdout=True)
    assert p.returncode == 5, p.stdout + p.stderr
    assert "step_1" in p.stdout + p.stderr and ".safetensors.tmp" in p.stdout + p.stderr, p.stdout + p.stderr
