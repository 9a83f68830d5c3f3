"""Sidecars written next to a saved step leave its commit record in force
(indexer/commit_record.h; docs/INDEX.md, "Writers' commit records").

3 gloo ranks save with ckptfs.torch.StorageWriter (both layouts, dcp.save
and dcp.async_save); then, as a training script does, config.json
(transformers' ``save_pretrained``), generation_config.json, tokenizer
files and a README.md are written into the step folder. The record is
judged by the files it describes, not by those:

- ``ckptfs verify`` checks the CRC32C of every chunk (the count derived
  from the saved state's sharding, not from ckptfs);
- a byte flipped inside a tensor's data in a shard file (size and mtime
  kept, as bit rot leaves them) is named by ``verify``, and a mount with
  ``--verify-checksums`` fails that tensor (EIO) while serving the others;
- a re-save by torch's own writer (FileSystemWriter, or
  HuggingFaceStorageWriter) into the same folder still retires the record.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import struct
import time
import zipfile

import numpy as np
import pytest
import torch

from harness import Mounted, run_ckptfs, spawn_ranks
from writer_dtypes_gen import chunk_count

GEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "writer_dtypes_gen.py")
WORLD = 3
DTYPES = ["bfloat16", "float32", "int64", "float4_e2m1fn_x2"]
VICTIM, VICTIM_OFFSETS = "int64.row", [2, 0]  # rank 1's chunk


def _write_sidecars(step: str) -> list[str]:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast
    before = set(os.listdir(step))
    LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(step)
    GenerationConfig(max_new_tokens=4).save_pretrained(step)
    tok = Tokenizer(WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(step)
    with open(os.path.join(step, "README.md"), "w") as f:
        f.write("# step 1\n")
    return sorted(set(os.listdir(step)) - before)


def _verify(path: str, index_dir: str) -> tuple[int, dict]:
    p = run_ckptfs("verify", path, "--json", index_dir=index_dir, text_stdout=True)
    return p.returncode, json.loads(p.stdout)


def _victim_byte(step: str, layout: str) -> tuple[str, int]:
    """(file, offset) of a byte inside VICTIM's chunk data, found by the
    formats' definitions: the safetensors header, or DCP's .metadata (read
    by torch) and the item's zip local header."""
    if layout == "hf":
        name = "shard-00002-model-00001-of-00001.safetensors"
        with open(os.path.join(step, name), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            begin, end = json.loads(f.read(n))[VICTIM]["data_offsets"]
        return name, 8 + n + (begin + end) // 2
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex
    info = FileSystemReader(step).read_metadata().storage_data[MetadataIndex(VICTIM, torch.Size(VICTIM_OFFSETS))]
    with open(os.path.join(step, info.relative_path), "rb") as f:
        f.seek(info.offset)
        item = f.read(info.length)
    z = next(z for z in zipfile.ZipFile(io.BytesIO(item)).infolist() if z.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", item[z.header_offset + 26:z.header_offset + 30])
    data = z.header_offset + 30 + name_len + extra_len
    return info.relative_path, info.offset + data + z.file_size // 2


def _flip(path: str, offset: int) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as they were


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("layout", ["dcp", "hf"])
def test_sidecars_after_the_save_leave_the_record_in_force(tmp_path, layout, mode):
    step = str(tmp_path / "run" / "step_1")
    job = {"dtypes": DTYPES, "layout": layout, "mode": mode, "dir": step, "oracle": str(tmp_path / "oracle.pt")}
    spawn_ranks(GEN, WORLD, job, name=f"save then sidecars ({layout}, {mode})")
    full = torch.load(job["oracle"], weights_only=True)
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    sidecars = _write_sidecars(step)
    assert {"config.json", "generation_config.json", "tokenizer.json", "README.md"} <= set(sidecars), sidecars
    record = os.stat(os.path.join(step, ".ckptfs", "commit.sst")).st_mtime_ns
    assert all(os.stat(os.path.join(step, s)).st_mtime_ns > record for s in sidecars)

    rc, report = _verify(step, str(tmp_path / "idx"))
    assert rc == 0 and report["problems"] == [] and report["warnings"] == [], report
    assert report["checksummed_chunks"] == chunk_count(full, WORLD), report

    # Bit rot inside a tensor's data: named by verify, EIO under --verify-checksums.
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)  # copy2: mtimes kept
    name, offset = _victim_byte(step, layout)
    _flip(os.path.join(copy, "step_1", name), offset)
    rc, report = _verify(str(copy / "step_1"), str(tmp_path / "idx_copy"))
    assert rc != 0 and len(report["problems"]) == 1, report
    assert VICTIM in report["problems"][0] and "CRC32C" in report["problems"][0], report
    with Mounted(str(copy), "--verify-checksums", index_dir=str(tmp_path / "idx_mount"), base_dir=str(tmp_path)) as m:
        with pytest.raises(OSError) as err:
            np.load(m.p("step_1", "tensors", f"{VICTIM}.npy"))
        assert err.value.errno == errno.EIO
        got = np.load(m.p("step_1", "tensors", "float32.row.npy"))
        assert np.array_equal(got, full["float32.row"].numpy())
        assert "no writer checksums" not in m.log() and VICTIM in m.log(), m.log()

    # torch's own writer saves into the folder again: the record is retired.
    spawn_ranks(GEN, WORLD, {**job, "writer": "stock" if layout == "dcp" else "stock-hf", "seed": 2,
                             "oracle": None}, name=f"torch re-save ({layout})")
    rc, report = _verify(step, str(tmp_path / "idx_resaved"))
    assert rc == 0 and report["checksummed_chunks"] == 0, report
    assert any("older than the save" in w for w in report["warnings"]), report
