"""PEFT adapter folders under a mount, checked with peft itself.

An adapter folder (adapter_config.json + adapter_model.safetensors, as
`PeftModel.save_pretrained` writes it) is a checkpoint like any other; its
consolidated/ must again be a folder `PeftModel.from_pretrained` loads.

Adapters of fused MoE experts (`target_parameters`, peft's ParamWrapper) get
a merged/ too, checked against peft's `merge_and_unload()` and the unmerged
PeftModel's forward (lora_gen.EXPERT_ADAPTERS; the rest of merged/:
test_merged.py).
"""

from __future__ import annotations

import glob
import os

import pytest
import torch

import lora_gen
import peft
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def save_adapter(root: str, lora: peft.LoraConfig, seed: int = 1) -> tuple[str, str]:
    """A base model folder and an adapter folder for it under `root`; the
    adapter's weights are random (lora_B is zeros when freshly made)."""
    base_dir, adapter_dir = os.path.join(root, "base"), os.path.join(root, "adapter")
    tiny_llama().save_pretrained(base_dir)
    model = peft.get_peft_model(tiny_llama(), lora)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(adapter_dir)
    return base_dir, adapter_dir


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("peft"))
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    base_dir, adapter_dir = save_adapter(root, lora)
    return root, base_dir, adapter_dir


def test_adapter_consolidated_is_an_adapter_folder(adapter_root, mount_factory):
    root, base_dir, adapter_dir = adapter_root
    with mount_factory(root) as m:
        view = m.p("adapter", "consolidated")
        names = sorted(os.listdir(view))
        assert "adapter_model.safetensors" in names, names
        assert "model.safetensors" not in names, names
        assert "adapter_config.json" in names, names
        # Byte-for-byte the tensors peft saved.
        want = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
        got = load_file(os.path.join(view, "adapter_model.safetensors"))
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        # peft loads it, and computes what the original adapter computes.
        ids = torch.tensor([[1, 5, 9, 13, 2, 40]])
        ref = peft.PeftModel.from_pretrained(tiny_llama(), adapter_dir).eval()
        through = peft.PeftModel.from_pretrained(tiny_llama(), view).eval()
        with torch.no_grad():
            assert torch.equal(through(ids).logits, ref(ids).logits)
        del got, through  # they map the mount's file: held, the unmount would find it busy


def test_adapter_naming_no_base_gets_no_merged_and_says_why(adapter_root, mount_factory, ckptfs):
    """An adapter saved from a model made in memory names no base
    (base_model_name_or_path is null): no merged/ is served (never a wrong
    one); the log and `ckptfs check` say why and what to set. Adapters that
    are merged: test_merged.py."""
    root, _, _ = adapter_root
    with mount_factory(root) as m:
        assert not os.path.exists(m.p("adapter", "merged"))
        assert "adapter/merged/: not created: adapter_config.json names no base model" in m.log()
    r = ckptfs("check", root)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, out + err  # the adapter itself is sound
    assert "note: adapter: merged/: not created: adapter_config.json names no base model" in err, err
    assert "set it to the base checkpoint's path" in err, err


IDS = torch.tensor([[1, 5, 9, 13, 2, 40, 77, 96]])


@pytest.fixture(scope="module")
def expert_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("experts"))
    lora_gen.make_expert_root(root)
    return root


@pytest.fixture(scope="module")
def expert_mount(expert_root, mount_factory):
    with mount_factory(expert_root) as m:
        yield m


def load_folder(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, name: str, rel: float = 1e-5) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    err = (got - want).abs().max().item()
    assert err <= rel * (want.abs().max().item() or 1.0), f"{name}: max error {err}"


# adapter folder -> (family, its base folder, the HF folder of the same weights)
EXPERT_CASES = {"qwen_moe_experts": ("moe_fused", "base_moe_fused", "base_moe_fused"),
                "qwen_moe_experts_on_dcp": ("moe_fused", "base_moe_fused_dcp", "base_moe_fused"),
                "llama4_experts": ("llama4", "base_llama4", "base_llama4"),
                "mixtral_experts": ("mixtral", "base_mixtral", "base_mixtral"),
                "gpt_oss_experts": ("gpt_oss", "base_gpt_oss", "base_gpt_oss")}


@pytest.mark.parametrize("adapter", sorted(EXPERT_CASES))
def test_expert_adapter_merged_is_pefts_merge(expert_root, expert_mount, adapter, tmp_path):
    """Every tensor within 1e-5 of peft's merge_and_unload(), under the base's
    names: transformers saves Qwen-MoE's fused experts per expert
    (experts.<e>.gate_proj.weight, ...), Llama-4's fused; a DCP step holds
    the model's own fused parameters."""
    family, base, hf_base = EXPERT_CASES[adapter]
    hf_dir, adapter_dir = os.path.join(expert_root, hf_base), os.path.join(expert_root, adapter)
    view = expert_mount.p(adapter, "merged")
    got = load_folder(view)
    peft_model = lora_gen.peft_merged(family, hf_dir, adapter_dir)
    if base == hf_base:
        base_tensors = load_folder(hf_dir)
        peft_model.save_pretrained(str(tmp_path / "peft-merged"))
        want = load_folder(str(tmp_path / "peft-merged"))
    else:  # the DCP step: the model's parameter names
        base_tensors = lora_gen.FAMILIES[family]().state_dict()
        want = peft_model.state_dict()
    assert set(got) == set(base_tensors), sorted(set(got) ^ set(base_tensors))
    experts = [n for n in got if ".experts." in n and not n.endswith("_bias")]  # gpt-oss: biases not targeted
    assert len(experts) >= 4, sorted(got)
    for name, t in got.items():
        assert_close_rel(t, want[name], name)
    for name in experts + [n for n in got if n.endswith("q_proj.weight")]:  # adapted: none is the base's
        assert not torch.allclose(got[name], base_tensors[name], atol=1e-3), name
    merged = AutoModelForCausalLM.from_pretrained(view, dtype=torch.float32).eval()
    ref = lora_gen.peft_unmerged(family, hf_dir, adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, ref(IDS).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("adapter", ["qwen_moe_experts", "llama4_experts", "gpt_oss_experts"])
def test_expert_adapter_merged_bf16_is_the_fp32_merge_rounded(expert_mount, adapter):
    fp32 = load_folder(expert_mount.p(adapter, "merged"))
    bf16 = load_folder(expert_mount.p(adapter, "merged.bf16"))
    assert set(bf16) == set(fp32)
    for name, t in bf16.items():
        want = fp32[name].to(torch.bfloat16)
        assert t.dtype == torch.bfloat16, name
        g, w = t.float(), want.float()
        # One bf16 ulp of x = m * 2^e (m in [0.5, 1)) is 2^(e - 8).
        ulp = torch.ldexp(torch.ones_like(w), torch.frexp(torch.maximum(g.abs(), w.abs())).exponent - 8)
        assert bool(((g - w).abs() <= ulp).all()), f"{name}: differs by more than one bf16 ulp"


def test_expert_adapter_fitting_no_base_parameter_is_refused_naming_it(tmp_path, mount_factory, ckptfs):
    """An expert adapter over a base with other expert sizes: no merged/, the factor named."""
    root = str(tmp_path)
    lora_gen.qwen2_moe().save_pretrained(os.path.join(root, "base"))  # moe_intermediate_size 16, not 20
    kwargs = dict(lora_gen.EXPERT_ADAPTERS["qwen_moe_experts"][1])
    lora_gen.save_expert_adapter(lora_gen.qwen2_moe_fused(), os.path.join(root, "adapter"), kwargs)
    lora_gen.point_at_base(os.path.join(root, "adapter"), "../base")
    with mount_factory(root) as m:
        assert not os.path.exists(m.p("adapter", "merged"))
        assert ("adapter/merged/: not created: adapter tensor "
                "'base_model.model.model.layers.0.mlp.experts.lora_A.weight' [16, 20] (lora_B [32, 16]) "
                "fits none of the targeted parameters of 'model.layers.0.mlp.experts'") in m.log(), m.log()
    r = ckptfs("check", root)
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 5, out + err  # a misfit adapter is a problem of the checkpoint
    assert "adapter: merged/: not created: adapter tensor" in out and "fits none of the targeted" in out, out
