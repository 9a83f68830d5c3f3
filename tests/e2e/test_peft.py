"""PEFT adapter folders under a mount, checked with peft itself.

An adapter folder (adapter_config.json + adapter_model.safetensors, as
`PeftModel.save_pretrained` writes it) is a checkpoint like any other; its
consolidated/ must again be a folder `PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import os

import pytest
import torch

import peft
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM


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
