"""merged/ and merged.<dtype>/: PEFT LoRA adapters merged into their base on read.

Oracles: peft's own `PeftModel.from_pretrained(base).merge_and_unload()` (every
tensor, fp32; bit for bit where the adapter's factors make the merge exact),
the unmerged PeftModel's forward (logits of transformers on merged/), and
torch's `.to(bfloat16)` of peft's merge. The models and adapters are made by
transformers, peft and torch's FSDP2 + DCP (lora_gen.py, fsdp_lora_gen.py),
never by ckptfs.
"""

from __future__ import annotations

import glob
import json
import math
import mmap
import os
import random
import sys
import threading
import time
from pathlib import Path

import peft
import pytest
import torch
from safetensors.torch import load, load_file, save
from transformers import AutoModelForCausalLM

import fsdp_lora_gen
import lora_gen

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_churn import daemon_pid  # noqa: E402

IDS = torch.tensor([[1, 5, 9, 13, 2, 40, 77, 96]])


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    lora_gen.make_root(root)
    return root


@pytest.fixture(scope="module")
def lora_mount(lora_root, mount_factory):
    with mount_factory(lora_root) as m:
        yield m


def load_folder(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def base_names(base_dir: str) -> set[str]:
    return set(load_folder(base_dir)) if glob.glob(os.path.join(base_dir, "*.safetensors")) else None


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-5) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    scale = want.abs().max().item() or 1.0
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * scale, f"{name}: max error {err} vs scale {scale}"


def assert_within_bf16_ulp(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype == torch.bfloat16, (name, got.dtype, want.dtype)
    g, w = got.float(), want.float()
    # bfloat16 keeps 8 significant bits: one ulp of x is 2^(e - 8) for x = m * 2^e, m in [0.5, 1).
    ulp = torch.ldexp(torch.ones_like(w), torch.frexp(torch.maximum(g.abs(), w.abs())).exponent - 8)
    assert bool(((g - w).abs() <= ulp).all()), f"{name}: differs by more than one bf16 ulp"


@pytest.mark.parametrize("adapter", sorted(lora_gen.ADAPTERS))
def test_every_tensor_is_pefts_merge(lora_root, lora_mount, adapter, tmp_path):
    family, _ = lora_gen.ADAPTERS[adapter]
    base_dir = os.path.join(lora_root, f"base_{family}")
    view = lora_mount.p(adapter, "merged")
    got = load_folder(view)
    # The base's tensors under the base's names, no adapter tensor.
    assert set(got) == base_names(base_dir), sorted(set(got) ^ base_names(base_dir))
    # As saved by transformers: the file names of fused MoE experts are the base's, not the module's.
    saved = str(tmp_path / "peft-merged")
    lora_gen.peft_merged(family, base_dir, os.path.join(lora_root, adapter)).save_pretrained(saved)
    want = load_folder(saved)
    changed = 0
    base = load_folder(base_dir)
    for name, t in got.items():
        assert_close_rel(t, want[name], name)
        changed += not torch.equal(t, base[name])
    assert changed > 0
    # transformers on merged/ computes what the unmerged adapter computes.
    merged = AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32).eval()
    ref = lora_gen.peft_unmerged(family, base_dir, os.path.join(lora_root, adapter))
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("view", ["merged", "merged.bf16"])
def test_bf16_base_is_within_one_ulp_of_peft(lora_root, lora_mount, view):
    base_dir = os.path.join(lora_root, "base_llama_bf16")
    got = load_folder(lora_mount.p("llama_plain_on_bf16", view))
    want = lora_gen.peft_merged("llama", base_dir, os.path.join(lora_root, "llama_plain_on_bf16"),
                                dtype=torch.bfloat16).state_dict()
    assert set(got) == base_names(base_dir)
    for name, t in got.items():
        assert_within_bf16_ulp(t, want[name], name)


def test_merged_bf16_view_of_an_fp32_base(lora_root, lora_mount):
    base_dir = os.path.join(lora_root, "base_llama")
    view = lora_mount.p("llama_plain", "merged.bf16")
    got = load_folder(view)
    want = lora_gen.peft_merged("llama", base_dir, os.path.join(lora_root, "llama_plain")).state_dict()
    assert set(got) == base_names(base_dir)
    for name, t in got.items():
        assert_within_bf16_ulp(t, want[name].to(torch.bfloat16), name)
    with open(os.path.join(view, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"


def test_dcp_base(lora_root, lora_mount):
    """A base saved as a DCP step ({"model": state_dict}): merged/ is an HF folder under the HF names."""
    hf_base = os.path.join(lora_root, "base_llama")
    adapter = os.path.join(lora_root, "llama_plain_on_dcp")
    view = lora_mount.p("llama_plain_on_dcp", "merged")
    got = load_folder(view)
    assert set(got) == base_names(hf_base)
    want = lora_gen.peft_merged("llama", hf_base, adapter).state_dict()
    for name, t in got.items():
        assert_close_rel(t, want[name], name)
    merged = AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = lora_gen.peft_unmerged("llama", hf_base, adapter)
        torch.testing.assert_close(merged(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def fsdp_root(tmp_path_factory):
    """(root, reference): fsdp_lora_gen's step and adapter, and the step's weights unsharded."""
    root = str(tmp_path_factory.mktemp("fsdp-lora"))
    reference = str(tmp_path_factory.mktemp("fsdp-reference"))
    fsdp_lora_gen.make(root, reference)
    return root, reference


def test_an_fsdp2_finetune_over_a_dcp_step(fsdp_root, mount_factory):
    """An adapter saved from an FSDP2 fine-tune (the full state dict gathered
    to rank 0, saved by PeftModel.save_pretrained) whose base is the DCP
    step an FSDP2 run saved: merged/ is peft's merge into the unsharded base."""
    root, reference = fsdp_root
    adapter = os.path.join(root, fsdp_lora_gen.ADAPTER)
    factors = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    lora_b = {n: t for n, t in factors.items() if ".lora_B." in n}
    assert len(lora_b) == 2 * len(fsdp_lora_gen.LORA["target_modules"])  # both decoder layers
    assert all(t.abs().max() > 0 for t in lora_b.values()), "lora_B is still zero: not trained"
    ref_base = load_folder(reference)
    with mount_factory(root) as m:
        # The step in the mount is the reference the oracles read.
        consolidated = load_folder(m.p(fsdp_lora_gen.BASE, "consolidated"))
        assert set(consolidated) == set(ref_base)
        for name, t in consolidated.items():
            assert torch.equal(t, ref_base[name]), name
        view = m.p(fsdp_lora_gen.ADAPTER, "merged")
        got = load_folder(view)
        assert set(got) == set(ref_base), sorted(set(got) ^ set(ref_base))
        want = lora_gen.peft_merged("llama", reference, adapter).state_dict()
        changed = 0
        for name, t in got.items():
            assert_close_rel(t, want[name], name)
            changed += not torch.equal(t, ref_base[name])
        assert changed == len(lora_b), changed
        merged = AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = lora_gen.peft_unmerged("llama", reference, adapter)
            torch.testing.assert_close(merged(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=0)
        # They map the mount's files: held, the unmount would find it busy.
        del consolidated, got, merged, t


def test_sidecars_come_from_the_adapter_else_the_base(lora_root, lora_mount):
    names = set(os.listdir(lora_mount.p("llama_plain", "merged")))
    assert "config.json" in names and "model.safetensors" in names, names
    assert "adapter_config.json" not in names and "adapter_model.safetensors" not in names, names
    with open(lora_mount.p("llama_plain", "merged", "README.md"), "rb") as f:  # peft writes one into the adapter
        assert f.read() == open(os.path.join(lora_root, "llama_plain", "README.md"), "rb").read()
    assert "merged" in os.listdir(lora_mount.p("llama_plain"))


def test_adapters_that_cannot_be_merged_get_no_merged_and_say_why(lora_root, lora_mount, ckptfs):
    assert not os.path.exists(lora_mount.p("refused_loha", "merged"))
    assert not os.path.exists(lora_mount.p("refused_no_base", "merged"))
    assert not os.path.exists(lora_mount.p("refused_shapes", "merged"))
    log = lora_mount.log()
    assert "refused_loha/merged/: not created: peft_type is 'LOHA'" in log, log
    assert "refused_no_base/merged/: not created: its base model '../no_such_base' is no checkpoint" in log, log
    assert ("refused_shapes/merged/: not created: adapter tensor "
            "'base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight' does not fit base tensor "
            "'model.layers.0.self_attn.q_proj.weight' [32, 32]") in log, log
    r = ckptfs("check", lora_root)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 5, out + err  # the misfit adapter is a problem; the others are notes
    assert "note: refused_loha: merged/: not created: peft_type is 'LOHA'" in err, err
    assert "note: refused_no_base: merged/: not created: its base model" in err, err
    assert "refused_shapes: merged/: not created: adapter tensor" in out, out
    assert "llama_plain:" not in out + err


def test_an_adapter_saved_from_ungathered_shards_is_refused_saying_so(tmp_path, mount_factory, ckptfs):
    """DeepSpeed ZeRO-3 (and FSDP outside summon_full_params) leaves each
    parameter an empty placeholder between steps: peft's save_pretrained
    then writes empty factors (and warns). merged/ is refused naming the
    tensor and the save that went wrong, not the base."""
    root = str(tmp_path)
    adapter = os.path.join(root, "adapter")
    lora_gen.llama().save_pretrained(os.path.join(root, "base"))
    pm = peft.get_peft_model(lora_gen.llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    for name, p in pm.named_parameters():
        if "lora_" in name:
            p.data = torch.empty(0)  # what ZeRO-3's partitioning leaves on a module
    with pytest.warns(peft.utils.warning.PeftWarning, match="not gathered"):  # peft's own check agrees
        pm.save_pretrained(adapter)
    lora_gen.point_at_base(adapter, "../base")
    why = ("adapter tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' is [0], not a 2-d "
           "LoRA factor: the adapter was saved from parameters FSDP or DeepSpeed ZeRO-3 had not gathered")
    with mount_factory(root) as m:
        assert not os.path.exists(m.p("adapter", "merged"))
        assert "adapter/merged/: not created: " + why in m.log(), m.log()
    r = ckptfs("check", root)
    assert r.returncode == 5 and why in r.stdout.decode(), r.stdout.decode() + r.stderr.decode()


MIB = 1 << 20


def dyadic_adapter(model, adapter_dir: str, lora_kwargs: dict, seed: int = 1) -> None:
    """An adapter whose factors are multiples of 1/8 in [-1, 1], with a
    scaling that is a power of two: every sum of B @ A is exact in float32
    in any order (multiples of 1/64 no larger than r), so W + scaling * B @ A is
    one rounding and peft's merge and any correct merge agree bit for bit."""
    assert math.frexp(lora_kwargs["lora_alpha"] / lora_kwargs["r"])[0] == 0.5, "scaling must be a power of two"
    pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randint(-8, 9, p.shape, generator=g).float() / 8)
    pm.save_pretrained(adapter_dir)


def safetensors_entries(data: bytes) -> tuple[int, dict]:
    """(where the data starts, {name: (dtype, shape, begin, end)}), by the format's definition."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return 8 + n, {k: (v["dtype"], v["shape"], *v["data_offsets"]) for k, v in header.items()}


def expected_bytes(served_header: bytes, reference: bytes) -> bytes:
    """The served file as it must be, byte for byte: its header (checked
    here to list the reference's tensors, dtypes and shapes, tiling the data
    without gaps), then each tensor's bytes as safetensors wrote them in
    `reference`."""
    start, got = safetensors_entries(served_header)
    ref_start, want = safetensors_entries(reference)
    assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in want.items()}
    out, at = bytearray(served_header[:start]), 0
    for name, (_, _, begin, end) in sorted(got.items(), key=lambda kv: kv[1][2]):
        assert begin == at, f"{name} starts at {begin}, not {at}"
        _, _, rb, re_ = want[name]
        assert end - begin == re_ - rb, name
        out += reference[ref_start + rb:ref_start + re_]
        at = end
    return bytes(out)


def first_difference(got: bytes, want: bytes, at: int) -> str | None:
    if got == want:
        return None
    i = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
    return f"byte {at + i}: {got[i:i + 8].hex() or 'end of data'}, not {want[i:i + 8].hex()}"


def mmap_pages(path: str, want: bytes, seed: int) -> list[str]:
    """Faults every 4 KiB page of the file through a mapping, in random
    order; the pages that differ from `want`."""
    order = list(range((len(want) + 4095) // 4096))
    random.Random(seed).shuffle(order)
    wrong = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert len(m) == len(want)
        for i in order:
            at = i * 4096
            if (d := first_difference(m[at:at + 4096], want[at:at + 4096], at)):
                wrong.append(d)
    return wrong


def pread_ranges(path: str, want: bytes, seed: int) -> list[str]:
    """Reads the file with read() in ranges of 0.5 to 1.5 MiB at unaligned
    offsets, in random order; the ranges that differ from `want`."""
    rng = random.Random(seed)
    ranges, at = [], 0
    while at < len(want):
        n = min(rng.randint(MIB // 2, 3 * MIB // 2) + rng.randint(1, 4095), len(want) - at)
        ranges.append((at, n))
        at += n
    rng.shuffle(ranges)
    wrong = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for at, n in ranges:
            data = b""
            while len(data) < n and (more := os.pread(fd, n - len(data), at + len(data))):
                data += more
            if (d := first_difference(data, want[at:at + n], at)):
                wrong.append(d)
    finally:
        os.close(fd)
    return wrong


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


HIDDEN, INTERMEDIATE = 256, 16384  # ~100 MiB of float32 weights, most in 4 MiB blocks
CACHE_MIB = 8
# Two FUSE threads: blocks are computed side by side and readers wait on
# each other's computations, while the working set of the threads (below)
# stays small beside a cache that kept every block.
THREADS = 2
# What one FUSE thread computing a block holds besides the cache: the
# block's source rows, their float32 copy, B @ A and the output, each about
# one block (core/compute.h: 4 MiB), plus its request and reply buffers
# (fs/mount.cc: 1 MiB each).
PER_THREAD_MIB = 4 * 4 + 2
SLACK_MIB = 16  # the allocator's arenas and rounding (measured peaks: 43 to 47 MiB above `before`)


def test_eight_readers_by_mmap_and_read_get_exact_bytes_in_bounded_memory(tmp_path, mount_factory):
    """4 readers mapping merged/'s file and faulting its pages in random
    order and 4 reading random ~1 MiB ranges, at once on a fresh mount, each
    get every byte of peft's merge as safetensors writes it; the merged
    tensors are many times the compute cache, and the daemon's peak RSS stays
    within the cache, a block's working set per FUSE thread and some slack above its
    RSS before the first read."""
    root = str(tmp_path / "root")
    base_dir, adapter = os.path.join(root, "base"), os.path.join(root, "adapter")
    lora_gen.llama(hidden=HIDDEN, intermediate=INTERMEDIATE).save_pretrained(base_dir)
    dyadic_adapter(lora_gen.llama(hidden=HIDDEN, intermediate=INTERMEDIATE), adapter,
                   dict(r=8, lora_alpha=16, target_modules=lora_gen.ATTN + lora_gen.MLP))
    lora_gen.point_at_base(adapter, "../base")
    reference = save(lora_gen.peft_merged("llama", base_dir, adapter).state_dict())
    # A cache that kept every block would hold more than the bound allows.
    assert len(reference) > (CACHE_MIB + THREADS * PER_THREAD_MIB + SLACK_MIB) * MIB
    with mount_factory(root, "--compute-cache-mib", str(CACHE_MIB), "--threads", str(THREADS)) as m:
        path = m.p("adapter", "merged", "model.safetensors")
        size = os.path.getsize(path)  # the view is built: its layouts, no tensor read
        pid = daemon_pid(m.path)
        before = vm_kib(pid, "VmRSS") * 1024
        with open(path, "rb") as f:
            header = f.read(8)
            header += f.read(int.from_bytes(header, "little"))
        want = expected_bytes(header, reference)
        del reference
        assert size == len(want)
        wrong, errors = [[] for _ in range(8)], []

        def run(k):
            try:
                wrong[k] = (mmap_pages if k % 2 else pread_ranges)(path, want, k)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = vm_kib(pid, "VmHWM") * 1024
    assert not errors, errors
    for k, w in enumerate(wrong):
        assert not w, f"reader {k} ({'mmap' if k % 2 else 'read()'}): {len(w)} wrong, e.g. {w[:3]}"
    bound = before + (CACHE_MIB + THREADS * PER_THREAD_MIB + SLACK_MIB) * MIB
    print(f"daemon RSS {before / MIB:.1f} MiB before, peak {peak / MIB:.1f} MiB (bound {bound / MIB:.1f}) "
          f"reading {len(want) / MIB:.1f} MiB of merged/")
    assert peak <= bound, (f"daemon peak RSS {peak / MIB:.1f} MiB > {bound / MIB:.1f} MiB "
                           f"({before / MIB:.1f} MiB before reading {len(want) / MIB:.1f} MiB of merged/)")


@pytest.mark.parametrize("changed", ["base/model.safetensors", "adapter/adapter_model.safetensors"])
def test_a_changed_source_of_either_checkpoint_reads_as_eio(tmp_path, mount_factory, changed):
    """The pages already served are dropped too: a read after the change is
    EIO, never the bytes merged from the old sources."""
    root = str(tmp_path)
    base_dir, adapter = os.path.join(root, "base"), os.path.join(root, "adapter")
    lora_gen.llama().save_pretrained(base_dir)
    lora_gen.save_adapter(lora_gen.llama(), adapter, dict(r=4, lora_alpha=8, target_modules=["q_proj"]))
    lora_gen.point_at_base(adapter, "../base")
    with mount_factory(root) as m:
        path = m.p("adapter", "merged", "model.safetensors")
        before = open(path, "rb").read()  # served once: pages in the kernel's cache
        assert len(before) == os.path.getsize(path)
        src = os.path.join(root, changed)
        st = os.stat(src)
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, another identity
        deadline = time.monotonic() + 30
        while True:
            try:
                with open(path, "rb") as f:
                    f.read()
            except OSError as e:
                assert e.errno == 5, e  # EIO
                break
            assert time.monotonic() < deadline, "merged/ still served after its base changed"
            time.sleep(0.5)
        assert "adapter/: merged view: " in m.log(), m.log()


def test_merged_is_built_again_after_its_adapter_is_unloaded(lora_root, mount_factory):
    """With --max-loaded 1, reading other checkpoints unloads the adapter (and
    its merged view's rows); its merged/ files then open and read the same."""
    with mount_factory(lora_root, "--max-loaded", "1") as m:
        path = m.p("llama_plain", "merged", "model.safetensors")

        def read_closed():  # load_file's tensors may keep the file mapped, and so open
            with open(path, "rb") as f:
                return load(f.read())
        first = read_closed()
        with open(m.p("qwen2_bias", "merged", "model.safetensors"), "rb") as f:
            f.read()
        load_folder(m.p("base_gpt2", "consolidated"))
        assert "llama_plain/: unloaded" in m.log(), m.log()
        again = read_closed()
        assert set(again) == set(first)
        for name in first:
            assert torch.equal(again[name], first[name]), name


def test_cli_export_writes_the_merged_folder(lora_root, lora_mount, ckptfs, tmp_path):
    """`ckptfs export` reads merged/ through the same read path, without FUSE."""
    out = str(tmp_path / "out")
    r = ckptfs("export", lora_root, "qwen2_bias/merged", out)
    assert r.returncode == 0, r.stderr.decode()
    for name in os.listdir(lora_mount.p("qwen2_bias", "merged")):
        with open(os.path.join(out, name), "rb") as a, open(lora_mount.p("qwen2_bias", "merged", name), "rb") as b:
            assert a.read() == b.read(), name


@pytest.mark.parametrize("adapter,name", [("llama_embed_save", "lm_head.weight"),
                                          ("qwen2_bias_all", "model.layers.1.self_attn.k_proj.bias")])
def test_saved_copies_replace_the_bases_tensor(lora_root, lora_mount, adapter, name):
    """modules_to_save and bias="all" save trained copies: merged/ serves them, not the base's."""
    family, _ = lora_gen.ADAPTERS[adapter]
    saved = load_file(os.path.join(lora_root, adapter, "adapter_model.safetensors"))["base_model.model." + name]
    got = load_folder(lora_mount.p(adapter, "merged"))[name]
    assert not torch.equal(got, load_folder(os.path.join(lora_root, f"base_{family}"))[name])
    assert torch.equal(got, saved)


def test_merged_is_no_name_elsewhere(lora_root, lora_mount):
    """Looking merged/ up where there is none (a base, a refused adapter) is
    ENOENT, logged once per checkpoint load at most, not once per lookup."""
    for _ in range(3):
        for where in ("base_llama", "refused_loha"):
            for name in ("merged", "merged.bf16"):
                assert not os.path.exists(lora_mount.p(where, name))
    log = lora_mount.log()
    assert "base_llama/merged" not in log, log
    assert log.count("refused_loha/merged/: not created") == 1, log
