"""Base models and PEFT adapters for the merged/ tests (test_merged.py; the fused-expert ones: test_peft.py).

Every base is a tiny random transformers model saved with save_pretrained
(or as a DCP step); every adapter is made by peft's get_peft_model with
non-zero B (init_lora_weights=False), saved with save_pretrained, its
base_model_name_or_path then pointed at the base's folder (relative) the
way a fine-tune run writes it.
"""

from __future__ import annotations

import json
import os
import shutil

import peft
import torch
import torch.distributed.checkpoint as dcp
from transformers import (GPT2Config, GPT2LMHeadModel, GptOssConfig, GptOssForCausalLM, Llama4ForCausalLM,
                          Llama4TextConfig, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM)

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def llama(seed: int = 0, hidden: int = 32, intermediate: int = 48, vocab: int = 97) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)).eval()


def qwen2_moe(seed: int = 0) -> Qwen2MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)).eval()


def qwen2_moe_fused(seed: int = 0) -> Qwen2MoeForCausalLM:
    """Fused experts gate_up_proj [E, 2I, H] = [4, 40, 32], down_proj
    [4, 32, 20]: no square one, so the factors' shapes say which is which."""
    torch.manual_seed(seed)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=20,
        shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)).eval()


def llama4(seed: int = 0) -> Llama4ForCausalLM:
    """Llama-4's text model: gate_up_proj [E, H, 2I] = [4, 32, 48], down_proj
    [4, 24, 32], a shared expert, MoE on every layer."""
    torch.manual_seed(seed)
    return Llama4ForCausalLM(Llama4TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=1, max_position_embeddings=64, attn_implementation="eager")).eval()


def mixtral(seed: int = 0) -> MixtralForCausalLM:
    """Saved per expert under Mixtral's names: block_sparse_moe.experts.<e>.w1 / w3 / w2."""
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)).eval()


def gpt_oss(seed: int = 0) -> GptOssForCausalLM:
    """is_transposed experts: gate_up_proj [E, H, 2I] = [4, 32, 64] and a
    square down_proj [4, 32, 32], whose orientation only model_type tells."""
    torch.manual_seed(seed)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        layer_types=["full_attention"] * 2)).eval()


FAMILIES = {"llama": llama, "qwen2": qwen2, "gpt2": gpt2, "moe": qwen2_moe, "moe_fused": qwen2_moe_fused,
            "llama4": llama4, "mixtral": mixtral, "gpt_oss": gpt_oss}

# name -> (family, LoraConfig kwargs): fused experts adapted through
# target_parameters (peft's ParamWrapper) next to ordinary modules.
EXPERT_ADAPTERS: dict[str, tuple[str, dict]] = {
    "qwen_moe_experts": ("moe_fused", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
                                           "shared_expert.down_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        rank_pattern={"layers.1.mlp.experts.down_proj": 2, "o_proj": 6},
        alpha_pattern={"gate_up_proj": 3, "layers.0.self_attn.q_proj": 5})),
    "llama4_experts": ("llama4", dict(
        r=4, lora_alpha=16, use_rslora=True,
        target_modules=["q_proj", "v_proj", "o_proj", "shared_expert.up_proj"],
        target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
        rank_pattern={"down_proj": 3}, alpha_pattern={"layers.1.feed_forward.experts.gate_up_proj": 2})),
    "mixtral_experts": ("mixtral", dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], rank_pattern={"gate_up_proj": 2})),
    "gpt_oss_experts": ("gpt_oss", dict(
        r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], alpha_pattern={"down_proj": 3})),
}

# name -> (family, LoraConfig kwargs). Each adapter exercises one part of
# PEFT's merge; all are checked against merge_and_unload().
ADAPTERS: dict[str, tuple[str, dict]] = {
    "llama_plain": ("llama", dict(r=4, lora_alpha=8, target_modules=ATTN + MLP)),
    "llama_rslora_patterns": ("llama", dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=ATTN + MLP,
        rank_pattern={"model.layers.1.self_attn.q_proj": 2, "down_proj": 6},
        alpha_pattern={"v_proj": 3, "layers.0.mlp.up_proj": 5})),
    "llama_dora": ("llama", dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"])),
    "llama_embed_save": ("llama", dict(r=4, lora_alpha=16, target_modules=["embed_tokens", "q_proj"],
                                       modules_to_save=["lm_head"])),
    "qwen2_bias": ("qwen2", dict(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "k_proj", "v_proj"])),
    "qwen2_bias_all": ("qwen2", dict(r=4, lora_alpha=8, bias="all", target_modules=["q_proj", "o_proj"])),
    "gpt2_conv1d": ("gpt2", dict(r=4, lora_alpha=8, fan_in_fan_out=True, lora_bias=True,
                                 target_modules=["c_attn", "c_proj", "c_fc"])),
    "moe_shared": ("moe", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj",
                                                                 "down_proj", "shared_expert_gate"])),
}


def point_at_base(adapter_dir: str, base: str) -> None:
    """Sets base_model_name_or_path, as a fine-tune of `base` saves it."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def save_adapter(model, adapter_dir: str, lora_kwargs: dict, seed: int = 1, config_cls=peft.LoraConfig) -> None:
    torch.manual_seed(seed)
    kwargs = dict(lora_kwargs)
    if config_cls is peft.LoraConfig:
        kwargs["init_lora_weights"] = False
    pm = peft.get_peft_model(model, config_cls(**kwargs))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:  # far from the base's row norms
                p.mul_(torch.rand_like(p) + 0.5)
            elif p.requires_grad and "lora_" not in name:  # trained copies (modules_to_save, biases): not the base's
                p.add_(torch.randn_like(p) * 0.1)
    pm.save_pretrained(adapter_dir)


def save_expert_adapter(model, adapter_dir: str, lora_kwargs: dict, seed: int = 1) -> None:
    """An adapter with random A and B (peft would start B at zero)."""
    pm = peft.get_peft_model(model, peft.LoraConfig(**lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    pm.save_pretrained(adapter_dir)


def make_expert_root(root: str) -> None:
    """base_<family>/ for the expert families (Llama-4's in sharded
    safetensors, the Qwen-MoE one also as a DCP step) and an adapter per
    EXPERT_ADAPTERS entry; qwen_moe_experts_on_dcp is the Qwen-MoE one
    pointed at the DCP step."""
    fused = os.path.join(root, "base_moe_fused")
    qwen2_moe_fused().save_pretrained(fused)
    llama4().save_pretrained(os.path.join(root, "base_llama4"), max_shard_size="40KB")
    mixtral().save_pretrained(os.path.join(root, "base_mixtral"))
    gpt_oss().save_pretrained(os.path.join(root, "base_gpt_oss"))
    save_dcp_base(qwen2_moe_fused(), os.path.join(root, "base_moe_fused_dcp"), fused)
    for name, (family, kwargs) in EXPERT_ADAPTERS.items():
        save_expert_adapter(FAMILIES[family](), os.path.join(root, name), kwargs)
        point_at_base(os.path.join(root, name), f"../base_{family}")
    shutil.copytree(os.path.join(root, "qwen_moe_experts"), os.path.join(root, "qwen_moe_experts_on_dcp"))
    point_at_base(os.path.join(root, "qwen_moe_experts_on_dcp"), "../base_moe_fused_dcp")


def make_root(root: str) -> None:
    """base_<family>/ for the families of ADAPTERS (llama also in bf16 and as a DCP
    step), and one adapter folder per ADAPTERS entry, plus adapters that
    must get no merged/ (refused_*)."""
    for family in sorted({family for family, _ in ADAPTERS.values()}):
        FAMILIES[family]().save_pretrained(os.path.join(root, f"base_{family}"))
    llama().to(torch.bfloat16).save_pretrained(os.path.join(root, "base_llama_bf16"))
    save_dcp_base(llama(), os.path.join(root, "base_llama_dcp"), os.path.join(root, "base_llama"))
    for name, (family, kwargs) in ADAPTERS.items():
        adapter = os.path.join(root, name)
        save_adapter(FAMILIES[family](), adapter, kwargs)
        point_at_base(adapter, f"../base_{family}")
    for name, base in (("llama_plain_on_bf16", "base_llama_bf16"), ("llama_plain_on_dcp", "base_llama_dcp")):
        shutil.copytree(os.path.join(root, "llama_plain"), os.path.join(root, name))
        point_at_base(os.path.join(root, name), os.path.join(root, base))  # absolute this time
    save_adapter(llama(), os.path.join(root, "refused_loha"), dict(r=4, alpha=8, target_modules=["q_proj"]),
                 config_cls=peft.LoHaConfig)
    point_at_base(os.path.join(root, "refused_loha"), "../base_llama")
    shutil.copytree(os.path.join(root, "llama_plain"), os.path.join(root, "refused_no_base"))
    point_at_base(os.path.join(root, "refused_no_base"), "../no_such_base")
    # Trained on a wider model: its factors do not fit base_llama.
    save_adapter(llama(hidden=64), os.path.join(root, "refused_shapes"), dict(r=4, lora_alpha=8, target_modules=["q_proj"]))
    point_at_base(os.path.join(root, "refused_shapes"), "../base_llama")


def save_dcp_base(model, dcp_dir: str, hf_dir: str) -> None:
    """The model as a DCP step ({"model": state_dict}, one process), with
    the HF folder's config beside it."""
    dcp.save({"model": {k: v.clone() for k, v in model.state_dict().items()}}, checkpoint_id=dcp_dir, no_dist=True)
    shutil.copy(os.path.join(hf_dir, "config.json"), dcp_dir)


def peft_merged(family: str, base_dir: str, adapter_dir: str, dtype=torch.float32):
    """peft's own merge of the adapter into the base loaded from base_dir."""
    model = type(FAMILIES[family]()).from_pretrained(base_dir, dtype=dtype).eval()
    return peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()


def peft_unmerged(family: str, base_dir: str, adapter_dir: str):
    model = type(FAMILIES[family]()).from_pretrained(base_dir, dtype=torch.float32).eval()
    return peft.PeftModel.from_pretrained(model, adapter_dir).eval()
