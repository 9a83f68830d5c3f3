"""mesh/ presets for DeepSeek-V3 (MLA), Llama-4 (fused experts stored
[E, H, 2I]) and GPT-2 (Conv1D weights stored [in, out], fused c_attn)
(docs/SEMANTICS.md, "Model families").

Oracle: transformers' own logits of each tiny model (families_gen.py),
against a tensor-parallel forward over the rank views alone:
- DeepSeek-V3 and Llama-4: each tp rank is a transformers model of the same
  class built from a config with that rank's sizes (heads / tp, intermediate
  sizes / tp, vocab / tp, as Megatron and vLLM size a rank's modules), loaded
  strictly with the rank's files, so a tensor cut on the wrong dim, or not
  cut, cannot load. Per layer, the ranks' attention and MLP outputs are
  summed (the all-reduce after o_proj and down_proj); the embedding and the
  head are vocab-parallel.
- GPT-2: written out here from the model's math (its attention cannot be
  built at a rank's size): Conv1D is x @ W + b, c_attn's columns [q | k | v]
  per rank, row-parallel c_proj with its bias added once after the sum.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load as st_load

E2E_DIR = os.path.dirname(os.path.abspath(__file__))
if E2E_DIR not in sys.path:
    sys.path.insert(0, E2E_DIR)

import families_gen  # noqa: E402
import harness  # noqa: E402

CKPTS = {"deepseek_v3": ("deepseek_v3", "fused"), "llama4": ("llama4", "fused"), "gpt2": ("gpt2", "fused"),
         "llama4_names_only": ("llama4", "names_only")}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("presets"))


@pytest.fixture(scope="module")
def env(base) -> dict:
    d = os.path.join(base, "index")
    os.makedirs(d, exist_ok=True)
    return dict(os.environ, CKPTFS_INDEX_DIR=d, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


@pytest.fixture(scope="module")
def root(base) -> str:
    return os.path.join(base, "root")


@pytest.fixture(scope="module")
def models(root) -> dict:
    out = {name: families_gen.write_family(fam, os.path.join(root, name), layout=layout)
           for name, (fam, layout) in CKPTS.items()}
    out["llama4_mm"] = families_gen.write_llama4_multimodal(os.path.join(root, "llama4_mm"))
    return out


@pytest.fixture(scope="module")
def mount(models, root, base, env):
    with harness.Mounted(root, base_dir=base, env=env, wait=0) as m:
        yield m


def read_rank(m, ckpt: str, spec: str, rank: int) -> tuple[dict, dict]:
    """({name: tensor}, layout.json) of one rank, read with plain read()."""
    d = m.p(ckpt, "mesh", spec, f"rank-{rank:05d}")
    with open(os.path.join(d, "layout.json")) as f:
        layout = json.load(f)
    tensors = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            with open(os.path.join(d, name), "rb") as f:
                tensors.update(st_load(f.read()))
    return tensors, layout


def read_ranks(m, ckpt: str, spec: str, tp: int) -> list[tuple[dict, dict]]:
    views = [read_rank(m, ckpt, spec, r) for r in range(tp)]
    for t, layout in views:
        assert not layout["notes"], layout["notes"]
        # A tensor held whole must be the same on every rank.
        for name, lj in layout["tensors"].items():
            if lj.get("lengths") == lj["global_shape"] and "parts" not in lj:
                assert torch.equal(t[name], views[0][0][name]), name
    return views


def _offset0(layout, name):
    t = layout["tensors"][name]
    return (t["parts"][0] if "parts" in t else t)["offsets"][0]


def vocab_embed(views, name, ids):
    """Vocab-parallel embedding: each rank looks up its rows, the sum is the lookup."""
    x = torch.zeros(len(ids), views[0][0][name].shape[1])
    for t, layout in views:
        lo, w = _offset0(layout, name), t[name]
        mine = (ids >= lo) & (ids < lo + w.shape[0])
        x[mine] += w[ids[mine] - lo]
    return x


def vocab_head(views, name, x):
    parts = sorted((_offset0(layout, name), x @ t[name].T) for t, layout in views)
    return torch.cat([y for _, y in parts], dim=-1)


# ---------------------------------------------------------------------------
# DeepSeek-V3 and Llama-4: one transformers model per rank, at the rank's sizes
# ---------------------------------------------------------------------------


def rank_config(fam: str, tp: int):
    """The family's config with one tp rank's sizes."""
    import transformers
    cfg_cls, _, kw = families_gen.FAMILIES[fam]
    kw = dict(kw, vocab_size=kw["vocab_size"] // tp, num_attention_heads=kw["num_attention_heads"] // tp,
              num_key_value_heads=max(kw["num_key_value_heads"] // tp, 1),
              intermediate_size=kw["intermediate_size"] // tp)
    if fam == "deepseek_v3":
        kw["moe_intermediate_size"] //= tp
    else:
        kw["intermediate_size_mlp"] //= tp
    config = getattr(transformers, cfg_cls)(**kw)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # grouped_mm wants 16-byte strides; a tp4 expert is 2 wide
    return config


def rank_models(fam: str, views, tp: int) -> list:
    import transformers
    model_cls = getattr(transformers, families_gen.FAMILIES[fam][1])
    out = []
    for t, _ in views:
        model = model_cls(rank_config(fam, tp)).eval()
        model.load_state_dict(t, strict=True)  # shapes: exactly this rank's
        out.append(model)
    return out


def tp_forward_modules(fam: str, views, tp: int, ids):
    models = rank_models(fam, views, tp)
    T = len(ids)
    x = vocab_embed(views, "model.embed_tokens.weight", ids)[None]
    m0 = models[0].model
    pos = m0.rotary_emb(x, torch.arange(T)[None])
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    for i in range(len(m0.layers)):
        layers = [m.model.layers[i] for m in models]
        h = layers[0].input_layernorm(x)
        x = x + sum(l.self_attn(hidden_states=h, position_embeddings=pos, attention_mask=mask)[0] for l in layers)
        h = layers[0].post_attention_layernorm(x)
        outs = [(l.mlp if fam == "deepseek_v3" else l.feed_forward)(h) for l in layers]
        x = x + sum((o[0] if isinstance(o, tuple) else o).view_as(x) for o in outs)
    x = m0.norm(x)[0]
    return vocab_head(views, "lm_head.weight", x)


# ---------------------------------------------------------------------------
# GPT-2, from its math
# ---------------------------------------------------------------------------


def tp_forward_gpt2(cfg: dict, views, ids):
    H, nh, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    tp, T = len(views), len(ids)
    hd, lh = H // nh, nh // tp
    rep = views[0][0]
    ln = lambda x, p: F.layer_norm(x, (H,), rep[p + ".weight"], rep[p + ".bias"], eps)  # noqa: E731
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    x = vocab_embed(views, "transformer.wte.weight", ids) + rep["transformer.wpe.weight"][:T]
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        h, attn = ln(x, p + "ln_1"), 0
        for t, _ in views:
            q, k, v = (h @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]).split(lh * hd, dim=-1)
            q, k, v = (y.view(T, lh, hd).transpose(0, 1) for y in (q, k, v))
            s = ((q @ k.transpose(1, 2)) / math.sqrt(hd)).masked_fill(~causal, float("-inf")).softmax(-1)
            attn = attn + (s @ v).transpose(0, 1).reshape(T, lh * hd) @ t[p + "attn.c_proj.weight"]
        x = x + attn + rep[p + "attn.c_proj.bias"]
        h, mlp = ln(x, p + "ln_2"), 0
        for t, _ in views:
            a = F.gelu(h @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"], approximate="tanh")
            mlp = mlp + a @ t[p + "mlp.c_proj.weight"]
        x = x + mlp + rep[p + "mlp.c_proj.bias"]
    return vocab_head(views, "transformer.wte.weight", ln(x, "transformer.ln_f"))


FORWARDS = [("deepseek_v3", "tp2"), ("deepseek_v3", "tp4"), ("llama4", "tp2"), ("llama4", "tp4"),
            ("gpt2", "tp2"), ("gpt2", "tp4")]


@pytest.mark.parametrize("ckpt,spec", FORWARDS, ids=[f"{c}-{s}" for c, s in FORWARDS])
def test_tp_forward_from_rank_views_equals_transformers(ckpt, spec, models, mount):
    info = models[ckpt]
    tp = int(spec[2:])
    views = read_ranks(mount, ckpt, spec, tp)
    assert views[0][1]["rules"] == ckpt
    ids = info["input_ids"][0]
    with torch.no_grad():
        got = (tp_forward_gpt2(info["config"], views, ids) if ckpt == "gpt2"
               else tp_forward_modules(ckpt, views, tp, ids))
    want = info["logits"][0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"max |diff| {(got - want).abs().max().item()}"


def test_llama4_fused_experts_are_cut_on_the_intermediate_dim(models, mount):
    """gate_up_proj [E, H, 2I]: rank r holds gate columns and up columns r of
    each half (dim 2), joined; down_proj [E, I, H]: rows r of dim 1. Expected
    slices from torch indexing of the saved tensors."""
    sd = models["llama4"]["state_dict"]
    gu, down = "model.layers.1.feed_forward.experts.gate_up_proj", "model.layers.1.feed_forward.experts.down_proj"
    inter = sd[down].shape[1]
    for r, (t, layout) in enumerate(read_ranks(mount, "llama4", "tp2", 2)):
        half = inter // 2
        gate, up = sd[gu][:, :, :inter], sd[gu][:, :, inter:]
        want = torch.cat([gate[:, :, r * half:(r + 1) * half], up[:, :, r * half:(r + 1) * half]], dim=2)
        assert torch.equal(t[gu], want), r
        assert torch.equal(t[down], sd[down][:, r * half:(r + 1) * half]), r
        assert layout["tensors"][gu]["join_dim"] == 2


def test_gpt2_c_attn_holds_the_ranks_heads_of_q_k_and_v(models, mount):
    sd = models["gpt2"]["state_dict"]
    w, b = "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"
    H = sd[w].shape[0]
    for r, (t, _) in enumerate(read_ranks(mount, "gpt2", "tp2", 2)):
        cols = [c for part in range(3) for c in range(part * H + r * H // 2, part * H + (r + 1) * H // 2)]
        assert torch.equal(t[w], sd[w][:, cols]), r
        assert torch.equal(t[b], sd[b][cols]), r


NOTE = "fused experts (experts.gate_up_proj, experts.down_proj) are held whole on every tp rank"


def test_without_config_json_fused_experts_are_held_whole_with_a_note(models, mount, root, env):
    """Regression: names alone picked the Llama preset, which cut Llama-4's
    experts.down_proj [E, I, H] on H. Now they stay whole, the note says why
    (layout.json, the log, `ckptfs ls --mesh`), and the rest is still cut."""
    sd = models["llama4_names_only"]["state_dict"]
    assert not os.path.exists(os.path.join(root, "llama4_names_only", "config.json"))
    experts = [k for k in sd if ".experts." in k]
    assert experts
    for r in range(2):
        t, layout = read_rank(mount, "llama4_names_only", "tp2", r)
        assert len(layout["notes"]) == 1 and NOTE in layout["notes"][0], layout["notes"]
        for k in experts:
            assert torch.equal(t[k], sd[k]), k
        q = "model.layers.0.self_attn.q_proj.weight"
        assert t[q].shape[0] == sd[q].shape[0] // 2
    assert sum(NOTE in line for line in mount.log().splitlines()) >= 1, mount.log()
    r = harness.run_ckptfs("ls", os.path.join(root, "llama4_names_only"), "--mesh", "tp2", env=env)
    assert r.returncode == 0 and NOTE in r.stderr, harness.describe(r)


def strip_prefix(views, prefix: str):
    """The views' tensors under `prefix`, renamed without it (layout.json too)."""
    out = []
    for t, layout in views:
        tensors = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
        entries = {k[len(prefix):]: v for k, v in layout["tensors"].items() if k.startswith(prefix)}
        out.append((tensors, dict(layout, tensors=entries)))
    return out


def test_llama4_multimodal_cuts_the_language_model_and_holds_the_vision_tower_whole(models, mount):
    """Llama4ForConditionalGeneration as save_pretrained writes it: the
    language model (head counts from text_config) is cut, so a TP forward
    over its rank tensors gives the model's logits; the vision tower (3
    heads, which tp2 cannot hold whole) and the projector are whole."""
    info = models["llama4_mm"]
    sd = info["state_dict"]
    views = read_ranks(mount, "llama4_mm", "tp2", 2)
    assert views[0][1]["rules"] == "llama4"
    whole = [k for k in sd if k.startswith(("vision_model.", "multi_modal_projector."))]
    assert any("self_attn.q_proj" in k for k in whole)
    for t, _ in views:
        assert all(torch.equal(t[k], sd[k]) for k in whole)
    with torch.no_grad():
        got = tp_forward_modules("llama4", strip_prefix(views, "language_model."), 2, info["input_ids"][0])
    want = info["logits"][0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"max |diff| {(got - want).abs().max().item()}"
