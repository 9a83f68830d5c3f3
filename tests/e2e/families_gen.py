"""Tiny models of each family the mesh presets know, saved as real sharded
checkpoints (used by test_families.py).

Each model is built from a config with transformers (no hub access), its
``state_dict()`` (transformers 5: fused 3-D MoE experts) re-saved with torch's
own Hugging Face writer (``torch.distributed.checkpoint`` +
``HuggingFaceStorageWriter``, in-process) into several files with an index,
next to its ``config.json``. The full model's logits for fixed input ids are
the oracle.

    write_family(name, out_dir) -> {"config": dict, "state_dict": {...},
                                    "input_ids": LongTensor, "logits": Tensor}
"""

from __future__ import annotations

import os
import shutil

import torch

INPUT_IDS = [[0, 5, 63, 17, 42, 8, 31, 1, 60, 12]]

_ATTN = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
             tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_ATTN, intermediate_size=48)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_ATTN, intermediate_size=48)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_ATTN, intermediate_size=48)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(_ATTN, intermediate_size=48, head_dim=8, tie_word_embeddings=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(_ATTN, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)),
    # MLA (q_lora_rank, kv_lora_rank), one dense layer then MoE with a shared
    # expert, group-limited routing. 2 * moe_intermediate_size != hidden_size,
    # so a fused experts tensor cut on the wrong dim cannot load.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_ATTN, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=8,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                         first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4,
                         qk_nope_head_dim=8, v_head_dim=6)),
    # Fused experts [E, H, 2I] / [E, I, H]; layer 0 dense, layer 1 MoE and
    # without rope (temperature tuning), as Llama-4 interleaves them.
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(_ATTN, head_dim=8, intermediate_size=24, intermediate_size_mlp=40, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2)),
}


def _randomise(model) -> None:
    """Norm weights start at 1 (Gemma's at 0), biases and routing biases at
    0: randomise them so a rank that got the wrong slice, or none, cannot
    pass by accident."""
    with torch.no_grad():
        for n, p in model.state_dict().items():
            if p.is_floating_point() and ("norm" in n or "ln_" in n or n.endswith("bias")):
                p.add_(torch.randn_like(p) * 0.1)


def build(name: str):
    import transformers
    cfg_cls, model_cls, kwargs = FAMILIES[name]
    config = getattr(transformers, cfg_cls)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).eval()
    _randomise(model)
    return config, model


def per_expert(sd: dict) -> dict:
    """transformers 5 fused experts -> the per-expert names older transformers
    and Mixtral's own release use (block_sparse_moe.experts.<e>.w1/w2/w3)."""
    out = {}
    for k, v in sd.items():
        if ".mlp.experts.gate_up_proj" in k:
            pre = k.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w1.weight"] = v[e, :inter].clone()
                out[f"{pre}.{e}.w3.weight"] = v[e, inter:].clone()
        elif ".mlp.experts.down_proj" in k:
            pre = k.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e in range(v.shape[0]):
                out[f"{pre}.{e}.w2.weight"] = v[e].clone()
        elif ".mlp.gate.weight" in k:
            out[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = v
        else:
            out[k] = v
    return out


def save_sharded(sd: dict, out_dir: str, num_files: int = 3) -> None:
    """torch's HF writer, in-process, round-robin over num_files files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    names = sorted(sd)
    mapping = {n: 1 + i % num_files for i, n in enumerate(names)}
    dcp.save({k: v.contiguous() for k, v in sd.items()},
             storage_writer=HuggingFaceStorageWriter(out_dir, fqn_to_index_mapping=mapping))


def write_family(name: str, out_dir: str, *, layout: str = "fused") -> dict:
    config, model = build(name)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if name in ("gemma", "gpt2"):
        sd.pop("lm_head.weight", None)  # tied: saved once, as embed_tokens / wte
    if layout == "per_expert":
        sd = per_expert(sd)
    os.makedirs(out_dir, exist_ok=True)
    save_sharded(sd, out_dir)
    if layout != "names_only":
        config.save_pretrained(out_dir)
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return {"config": config.to_dict(), "state_dict": sd, "input_ids": ids, "logits": logits}


# A vision tower whose 3 heads tp2 cannot hold whole, next to the llama4
# text model.
LLAMA4_VISION = dict(hidden_size=24, num_hidden_layers=1, num_attention_heads=3, intermediate_size=32, image_size=28,
                     patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                     pixel_shuffle_ratio=0.5)


def write_llama4_multimodal(out_dir: str) -> dict:
    """Llama4ForConditionalGeneration saved by its own save_pretrained (the
    names Meta's checkpoints use: language_model.model.*, vision_model.*,
    multi_modal_projector.*) in several files; its language model's logits."""
    import transformers
    config = transformers.Llama4Config(text_config=FAMILIES["llama4"][2], vision_config=LLAMA4_VISION)
    config._attn_implementation = "eager"
    torch.manual_seed(1234)
    model = transformers.Llama4ForConditionalGeneration(config).eval()
    _randomise(model)
    model.save_pretrained(out_dir, max_shard_size="40KB")
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():  # its language model: without images the full forward has nothing else to do
        logits = model.language_model(input_ids=ids).logits.float()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"config": config.to_dict(), "state_dict": sd, "input_ids": ids, "logits": logits}


SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "checkpoints are files"]

_WORDS = ("the cat sat on mat a dog ran in park checkpoints are files model data fast slow "
          "red blue green tree house car road sun moon").split()


def write_sentence_transformer(out_dir: str, staging: str) -> dict:
    """A tiny sentence-embedding model (BertModel from a config, a local
    WordPiece vocab, mean pooling, normalisation) saved by
    SentenceTransformer.save into `staging`; then its folder re-made in
    `out_dir` with the weights re-saved sharded by torch's HF writer, plus
    what other model folders carry: remote code (*.py), a sentencepiece
    model file, a chat template and a nested folder. Returns the sentences
    and the original model's embeddings."""
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import BertConfig, BertModel, BertTokenizerFast
    base = os.path.join(staging, "bert")
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(base, "vocab.txt"), "w") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + _WORDS) + "\n")
    BertTokenizerFast(os.path.join(base, "vocab.txt")).save_pretrained(base)
    torch.manual_seed(7)
    cfg = BertConfig(vocab_size=5 + len(_WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(base)
    word = models.Transformer(base)
    st = SentenceTransformer(modules=[word, models.Pooling(32, "mean"), models.Normalize()], device="cpu")
    saved = os.path.join(staging, "st")
    st.save(saved)
    with torch.no_grad():
        emb = st.encode(SENTENCES, convert_to_tensor=True).clone()
    shutil.copytree(saved, out_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    save_sharded(load_file(os.path.join(saved, "model.safetensors")), out_dir)
    extras = {"modeling_tiny.py": b"# remote code a trust_remote_code model imports\nX = 1\n",
              "spiece.model": bytes(range(256)) * 4,
              "chat_template.jinja": b"{% for m in messages %}{{ m['content'] }}{% endfor %}",
              "extra/nested/notes.txt": b"a file two folders down\n"}
    for rel, data in extras.items():
        os.makedirs(os.path.dirname(os.path.join(out_dir, rel)), exist_ok=True)
        with open(os.path.join(out_dir, rel), "wb") as f:
            f.write(data)
    return {"sentences": SENTENCES, "embeddings": emb}


def write_lightning_and_deepspeed(root: str) -> dict:
    """The Llama's weights as a PyTorch Lightning checkpoint
    (`lightning/last.ckpt`, Lightning's documented top-level keys) and as
    DeepSpeed's `deepspeed/global_step10/mp_rank_00_model_states.pt`
    ({"module": ..., "optimizer": ...}), each with training state beside the
    weights and config.json next to it."""
    config, model = build("llama")
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optim = {"state": {i: {"exp_avg": torch.randn(3)} for i in range(2)}, "param_groups": [{"lr": 1e-3}]}
    light = os.path.join(root, "lightning")
    ds = os.path.join(root, "deepspeed", "global_step10")
    for d in (light, ds):
        os.makedirs(d, exist_ok=True)
        config.save_pretrained(d)
    torch.save({"epoch": 1, "global_step": 10, "pytorch-lightning_version": "2.4.0", "state_dict": sd,
                "loops": {}, "callbacks": {}, "optimizer_states": [optim], "lr_schedulers": [],
                "hparams_name": "kwargs", "hyper_parameters": {"lr": 1e-3}}, os.path.join(light, "last.ckpt"))
    torch.save({"module": sd, "buffer_names": [], "optimizer": optim, "param_shapes": None,
                "lr_scheduler": None, "global_steps": 10, "ds_version": "0.16.0"},
               os.path.join(ds, "mp_rank_00_model_states.pt"))
    ids = torch.tensor(INPUT_IDS)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return {"state_dict": sd, "input_ids": ids, "logits": logits}
