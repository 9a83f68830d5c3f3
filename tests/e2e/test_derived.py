"""Derived views: `consolidated.<dtype>/` and `mesh/<spec>.<dtype>/`.

Oracles: torch's own `Tensor.to(dtype)` of every source tensor (loaded with
torch from the source, never through ckptfs), and transformers' logits of the
fp32 model cast with `.to(torch.bfloat16)`.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

VIEW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def special_state() -> dict[str, torch.Tensor]:
    """Tensors whose casts exercise rounding, range and special values."""
    g = torch.Generator().manual_seed(11)
    fp32 = torch.randn(300, 257, generator=g) * 3
    specials = torch.tensor([
        0.0, -0.0, 1.0, float("inf"), float("-inf"), float("nan"), -float("nan"),
        65504.0, 65519.99, 65520.0, 70000.0, -1e5, 1e38, 3.4e38, -3.4e38,  # fp16 max, past it
        1e-40, -1e-45, 1.1754942e-38, 5.96e-8, 2.98e-8, 2.99e-8, 6.1e-5, 1e-7,  # subnormals
        1.00390625, 1.01171875, 1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9,  # bf16 ties
        1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11,  # fp16 ties
    ], dtype=torch.float32)
    nan16 = torch.tensor([float("nan"), -float("nan"), float("inf"), 1e-30])
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4099,), generator=g, dtype=torch.int64).to(torch.int32)
    return {
        "model.w32": fp32,
        "model.big": torch.randn(64, 64, generator=g) * 4e4,  # much of it past fp16's range
        "model.special": specials,
        "model.bits": bits.view(torch.float32),  # every exponent, NaN payloads included
        "model.w16": torch.cat([(torch.randn(557, generator=g) * 100), nan16]).to(torch.bfloat16),
        "model.h16": torch.cat([torch.randn(356, generator=g), nan16]).to(torch.float16),
        "model.f64": torch.cat([torch.randn(101, generator=g, dtype=torch.float64) * 1e3,
                                nan16.double(), torch.tensor([1e300, 1 + 2 ** -8 + 2 ** -30])]),
        "model.f8": torch.cat([torch.randn(61, generator=g) * 50,
                               torch.tensor([float("nan"), -0.0, 1e-3, 500.0])]).to(torch.float8_e4m3fn),
        "model.ids": torch.arange(50, dtype=torch.int64),
        "model.mask": torch.tensor([True, False, True]),
        "model.scalar": torch.tensor(2.5),
        # Rows wider than a compute block (4 MiB of output): cut within the
        # row, and in a 3-d tensor within the last dim.
        "model.wide": torch.randn(1, 2_300_000, generator=g) * 3,
        "model.wide3": torch.randn(1, 2, 1_100_000, generator=g).to(torch.bfloat16),
    }


def write_sources(root: str, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """The same state as DCP, sharded safetensors and torch.save."""
    dirs = {k: os.path.join(root, k) for k in ("dcp", "st", "pt")}
    dcp.save({k: v.clone() for k, v in state.items()}, checkpoint_id=dirs["dcp"], no_dist=True)
    os.makedirs(dirs["st"])
    keys = sorted(state)
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k].contiguous() for k in part}, os.path.join(dirs["st"], name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(dirs["st"], "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    os.makedirs(dirs["pt"])
    torch.save(state, os.path.join(dirs["pt"], "pytorch_model.bin"))
    for d in dirs.values():
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "synthetic", "torch_dtype": "float32"}, f)
    return dirs


def load_view(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str, nan_bits: bool = False) -> None:
    assert got.dtype == want.dtype, f"{what}: {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, what
    if not want.is_floating_point():
        assert torch.equal(got, want), what
        return
    # Bits; NaNs as NaNs (torch's own NaN bits for Half -> float depend on
    # where the element sits, core/cast.h), except where `nan_bits` says
    # torch writes them the same everywhere.
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), what
    gi, wi = got.view(INT_VIEW[want.dtype]), want.view(INT_VIEW[want.dtype])
    diff = gi != wi if nan_bits else (gi != wi) & ~nan
    assert not diff.any(), (f"{what}: {int(diff.sum())} elements differ, first at "
                            f"{diff.nonzero()[0].tolist()}: {got[diff][0]} vs {want[diff][0]}")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("derived"))
    state = special_state()
    return root, state, write_sources(root, state)


@pytest.mark.parametrize("fmt", ["dcp", "st", "pt"])
def test_dtype_views_equal_torch_to(sources, mount_factory, fmt):
    root, state, dirs = sources
    with mount_factory(root) as m:
        base = os.path.relpath(dirs[fmt], root)
        assert "consolidated.bf16" not in os.listdir(m.p(base))  # opened by name, not listed
        for suffix, dtype in VIEW_DTYPES.items():
            view = m.p(base, f"consolidated.{suffix}")
            got = load_view(view)
            assert sorted(got) == sorted(state), suffix
            for name, src in state.items():
                want = src.to(dtype) if src.is_floating_point() else src
                # From float32, torch writes every NaN one way: bits exact.
                assert_bits_equal(got[name], want, f"{fmt} {suffix} {name}",
                                  nan_bits=src.dtype == torch.float32)
            with open(os.path.join(view, "config.json")) as f:
                cfg = json.load(f)
            assert cfg["dtype"] == str(dtype).removeprefix("torch.")
            assert cfg["torch_dtype"] == cfg["dtype"]
            assert cfg["model_type"] == "synthetic"
        del got  # it maps the mount's files: held, the unmount would find it busy


def test_dtype_view_pages_in_random_order(sources, mount_factory):
    """4 KiB reads in random order give the bytes of one sequential read."""
    root, state, dirs = sources
    with mount_factory(root) as m:
        path = m.p("st", "consolidated.bf16", "model.safetensors")
        size = os.path.getsize(path)
        pages = list(range(0, size, 4096))
        random.Random(5).shuffle(pages)
        fd = os.open(path, os.O_RDONLY)
        try:
            parts = {p: os.pread(fd, 4096, p) for p in pages}
        finally:
            os.close(fd)
        got = b"".join(parts[p] for p in sorted(parts))
        with open(path, "rb") as f:
            assert got == f.read()


def test_unknown_dtype_view_is_enoent_with_reason(sources, mount_factory):
    root, _, _ = sources
    with mount_factory(root) as m:
        assert not os.path.exists(m.p("st", "consolidated.int8"))
        assert "the dtype views are .bf16, .fp16 and .fp32" in m.log()


def test_keep_dtype_keeps_matching_tensors(sources, mount_factory):
    root, state, _ = sources
    with mount_factory(root, "--keep-dtype", r"^model\.(w32|h16)$") as m:
        got = load_view(m.p("st", "consolidated.bf16"))
        assert_bits_equal(got["model.w32"], state["model.w32"], "kept w32")
        assert_bits_equal(got["model.h16"], state["model.h16"], "kept h16")
        assert_bits_equal(got["model.big"], state["model.big"].to(torch.bfloat16), "cast big")
        del got  # it maps the mount's files: held, the unmount would find it busy


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_transformers_loads_bf16_view_with_the_cast_models_logits(tmp_path, mount_factory):
    # The reference: transformers itself casting the fp32 folder as it loads
    # it (a model built in fp32 and then .to(bf16) also casts its rotary
    # buffers, so its logits differ from any bf16 folder's).
    model = tiny_llama()
    model.save_pretrained(str(tmp_path / "llama"))
    ids = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "llama"), dtype=torch.bfloat16).eval()
    cast = model.to(torch.bfloat16).state_dict()
    with torch.no_grad():
        want = ref(ids).logits
    with mount_factory(str(tmp_path)) as m:
        loaded = AutoModelForCausalLM.from_pretrained(m.p("llama", "consolidated.bf16"), dtype="auto").eval()
        assert loaded.dtype == torch.bfloat16
        for k, v in loaded.state_dict().items():
            if k in cast:
                assert_bits_equal(v, cast[k], k)
        with torch.no_grad():
            got = loaded(ids).logits
        assert torch.equal(got, want)
        # mesh/<spec>.<dtype>: each rank's tensors are its fp32 ones cast.
        for rank in ("rank-00000", "rank-00001"):
            cast = load_view(m.p("llama", "mesh", "tp2.bf16", rank))
            plain = load_view(m.p("llama", "mesh", "tp2", rank))
            assert sorted(cast) == sorted(plain)
            for k, v in plain.items():
                assert_bits_equal(cast[k], v.to(torch.bfloat16), f"tp2.bf16 {rank} {k}")
            with open(m.p("llama", "mesh", "tp2.bf16", rank, "layout.json")) as f:
                assert all(t["dtype"] == "BF16" for t in json.load(f)["tensors"].values())
        # They map the mount's files: held, the unmount would find it busy.
        del loaded, cast, plain, v


def test_eight_readers_by_mmap_and_read_get_exact_bytes(tmp_path, mount_factory):
    """8 readers at once (4 mapping the file and touching pages in random
    order, 4 reading it with read() in 1 MiB calls) of a bf16 view whose
    blocks outnumber what the cache may keep: every byte as torch casts it."""
    import mmap
    import struct
    import threading
    g = torch.Generator().manual_seed(2)
    src = torch.randn(6000, 2048, generator=g)  # 24 MiB of bf16: 6 blocks
    os.makedirs(tmp_path / "m")
    save_file({"w": src}, str(tmp_path / "m" / "model.safetensors"))
    want = src.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with mount_factory(str(tmp_path), "--compute-cache-mib", "8") as m:
        path = m.p("m", "consolidated.bf16", "model.safetensors")
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        start = 8 + n + header["w"]["data_offsets"][0]
        results, errors = {}, []

        def by_mmap(k):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                pages = list(range(start, start + len(want), 4096))
                random.Random(k).shuffle(pages)
                got = bytearray(len(want))
                for p in pages:
                    end = min(p + 4096, start + len(want))
                    got[p - start:end - start] = mm[p:end]
                results[k] = bytes(got)

        def by_read(k):
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                results[k] = f.read(len(want))

        def run(fn, k):
            try:
                fn(k)
            except Exception as e:  # reported below, with the reader's number
                errors.append(f"reader {k}: {e!r}")

        threads = [threading.Thread(target=run, args=(by_mmap if k < 4 else by_read, k)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        for k in range(8):
            assert results[k] == want, f"reader {k} got other bytes"
