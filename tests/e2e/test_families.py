"""Mesh and consolidated views for every model family the presets know
(docs/SEMANTICS.md, "mesh/" and "Model families").

Oracles, independent of ckptfs:
- transformers' own logits of each tiny model (families_gen.py), against a
  tensor-parallel forward written here from the rank views alone:
  vocab-parallel embedding, column-parallel q/k/v (or Phi-3's fused qkv) in
  whole heads with KV heads replicated where tp exceeds them (vLLM's
  QKVParallelLinear), row-parallel o_proj/down_proj, all-reduce = a sum over
  the ranks' partials, experts summed over the ep ranks that hold them;
- SentenceTransformer's own embeddings of the model it saved, against
  SentenceTransformer(consolidated/) of its weights re-saved sharded;
- the bytes of every non-weight source file, against consolidated/'s copy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
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

EXIT_NO_SOURCE = 3  # cli/cli.h

CKPTS = {"llama": ("llama", "fused"), "qwen2": ("qwen2", "fused"), "phi3": ("phi3", "fused"),
         "gemma": ("gemma", "fused"), "mixtral": ("mixtral", "fused"),
         "mixtral_per_expert": ("mixtral", "per_expert")}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("families"))


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
    return {name: families_gen.write_family(fam, os.path.join(root, name), layout=layout)
            for name, (fam, layout) in CKPTS.items()}


@pytest.fixture(scope="module")
def extras(root, base) -> dict:
    out = families_gen.write_lightning_and_deepspeed(root)
    out["st"] = families_gen.write_sentence_transformer(os.path.join(root, "st"), os.path.join(base, "staging"))
    return out


@pytest.fixture(scope="module")
def mount(models, extras, root, base, env):
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


# ---------------------------------------------------------------------------
# the tensor-parallel forward, written from the frameworks' math
# ---------------------------------------------------------------------------


def _rms(x, w, eps, gemma):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w.float()) if gemma else w * y


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _offset0(layout, name):
    t = layout["tensors"][name]
    return (t["parts"][0] if "parts" in t else t)["offsets"][0]


class Ranks:
    """One spec's rank views: `tp` ranks per ep group, ep groups in order."""

    def __init__(self, m, ckpt, spec, tp, ep):
        self.tp, self.ep = tp, ep
        self.views = [read_rank(m, ckpt, spec, r) for r in range(tp * ep)]

    def group(self):  # the tp ranks of ep group 0 (attention is the same in every group)
        return self.views[: self.tp]

    def rep(self, name):
        ts = [t[name] for t, _ in self.views]
        for t in ts[1:]:
            assert torch.equal(t, ts[0]), f"{name}: a replicated tensor differs between ranks"
        return ts[0]


def attention(fam, cfg, ranks: Ranks, p, h, cos, sin):
    T, H = h.shape
    nh, nkv, tp = cfg["num_attention_heads"], cfg["num_key_value_heads"], ranks.tp
    hd = cfg.get("head_dim") or H // nh
    lq, lkv = nh // tp, max(nkv // tp, 1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.zeros(T, H)
    for t, _ in ranks.group():
        a = p + "self_attn."
        if fam == "phi3":
            q, k, v = (h @ t[a + "qkv_proj.weight"].T).split([lq * hd, lkv * hd, lkv * hd], dim=-1)
        else:
            q, k, v = (h @ t[a + f"{x}_proj.weight"].T + t.get(a + f"{x}_proj.bias", 0) for x in "qkv")
        assert q.shape[-1] == lq * hd and k.shape[-1] == lkv * hd, "a rank holds the wrong number of heads"
        q, k, v = (y.view(T, -1, hd).transpose(0, 1) for y in (q, k, v))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k, v = k.repeat_interleave(lq // lkv, 0), v.repeat_interleave(lq // lkv, 0)
        s = ((q @ k.transpose(1, 2)) / math.sqrt(hd)).masked_fill(~causal, float("-inf")).softmax(-1)
        out = out + (s @ v).transpose(0, 1).reshape(T, lq * hd) @ t[a + "o_proj.weight"].T
    return out


def dense_mlp(fam, ranks: Ranks, p, h):
    out = 0
    for t, _ in ranks.group():
        if fam == "phi3":
            g, u = (h @ t[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        else:
            g, u = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        act = F.gelu(g, approximate="tanh") if fam == "gemma" else F.silu(g)
        out = out + (act * u) @ t[p + "mlp.down_proj.weight"].T
    return out


def local_experts(t, layout, p):
    """{global expert: (gate, up, down)} a rank holds, fused or per expert."""
    out = {}
    fused = p + "mlp.experts.gate_up_proj"
    if fused in t:
        e0 = _offset0(layout, fused)
        gate, up = t[fused].chunk(2, dim=1)
        for i in range(gate.shape[0]):
            out[e0 + i] = (gate[i], up[i], t[p + "mlp.experts.down_proj"][i])
        return out
    pre = p + "block_sparse_moe.experts."
    for name in t:
        if name.startswith(pre) and name.endswith(".w1.weight"):
            e = int(name[len(pre):].split(".")[0])
            out[e] = (t[f"{pre}{e}.w1.weight"], t[f"{pre}{e}.w3.weight"], t[f"{pre}{e}.w2.weight"])
    return out


def moe(cfg, ranks: Ranks, p, h):
    gate_name = p + ("mlp.gate.weight" if p + "mlp.gate.weight" in ranks.views[0][0]
                     else "block_sparse_moe.gate.weight")
    probs = (h @ ranks.rep(gate_name).T).softmax(-1, dtype=torch.float)
    w, idx = probs.topk(cfg["num_experts_per_tok"], dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    seen = {}
    for t, layout in ranks.views:
        for e, (g, u, d) in local_experts(t, layout, p).items():
            seen[e] = seen.get(e, 0) + 1
            weight = (w * (idx == e)).sum(-1, keepdim=True)
            out = out + weight * ((F.silu(h @ g.T) * (h @ u.T)) @ d.T)
    assert seen == {e: ranks.tp for e in range(cfg["num_local_experts"])}, seen
    return out


def tp_forward(fam, cfg, ranks: Ranks, ids):
    H, eps, gemma = cfg["hidden_size"], cfg["rms_norm_eps"], fam == "gemma"
    T = ids.shape[0]
    x = torch.zeros(T, H)
    for t, layout in ranks.group():  # vocab-parallel embedding
        lo, wte = _offset0(layout, "model.embed_tokens.weight"), t["model.embed_tokens.weight"]
        mine = (ids >= lo) & (ids < lo + wte.shape[0])
        x[mine] += wte[ids[mine] - lo]
    if gemma:
        x = x * torch.tensor(H ** 0.5, dtype=x.dtype)
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    freqs = torch.outer(torch.arange(T, dtype=torch.float), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = x + attention(fam, cfg, ranks, p, _rms(x, ranks.rep(p + "input_layernorm.weight"), eps, gemma), cos, sin)
        h = _rms(x, ranks.rep(p + "post_attention_layernorm.weight"), eps, gemma)
        x = x + (moe(cfg, ranks, p, h) if fam == "mixtral" else dense_mlp(fam, ranks, p, h))
    x = _rms(x, ranks.rep("model.norm.weight"), eps, gemma)
    head = "model.embed_tokens.weight" if gemma else "lm_head.weight"
    parts = sorted((_offset0(layout, head), x @ t[head].T) for t, layout in ranks.group())
    return torch.cat([y for _, y in parts], dim=-1)


def rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or {}
    return rp.get("rope_theta", cfg.get("rope_theta", 10000.0))


FORWARDS = [("llama", "tp2"), ("llama", "tp4"), ("qwen2", "tp2"), ("qwen2", "tp4"), ("phi3", "tp2"),
            ("phi3", "tp4"), ("gemma", "tp2"), ("mixtral", "ep2"), ("mixtral", "tp2-ep2"),
            ("mixtral_per_expert", "ep2"), ("mixtral_per_expert", "tp2-ep2")]


@pytest.mark.parametrize("ckpt,spec", FORWARDS, ids=[f"{c}-{s}" for c, s in FORWARDS])
def test_tp_forward_from_rank_views_equals_transformers(ckpt, spec, models, mount):
    fam = CKPTS[ckpt][0]
    info = models[ckpt]
    cfg = dict(info["config"], rope_theta=rope_theta(info["config"]))
    tp = int(spec.split("tp")[1].split("-")[0]) if "tp" in spec else 1
    ep = int(spec.split("ep")[1]) if "ep" in spec else 1
    ranks = Ranks(mount, ckpt, spec, tp, ep)
    with torch.no_grad():
        got = tp_forward(fam, cfg, ranks, info["input_ids"][0])
    want = info["logits"][0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), f"max |diff| {(got - want).abs().max().item()}"
    # Nothing came whole where it should be split: every split weight is a
    # tp-th of the original (per expert for MoE).
    sd = info["state_dict"]
    for t, layout in ranks.views:
        assert not layout["notes"], layout["notes"]
        for name, lj in layout["tensors"].items():
            assert lj["global_shape"] == list(sd[name].shape), name
            if tp > 1 and name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight", "experts.down_proj")):
                assert t[name].shape[-1] == sd[name].shape[-1] // tp, name


def test_kv_heads_replicated_at_tp4_and_the_forward_notices_a_wrong_head(models, mount):
    """4 query / 2 KV heads at tp4: ranks 0-1 hold KV head 0, ranks 2-3 head 1
    (vLLM: shard_id = tp_rank // num_kv_head_replicas)."""
    info, sd = models["llama"], models["llama"]["state_dict"]
    ranks = Ranks(mount, "llama", "tp4", 4, 1)
    k = "model.layers.0.self_attn.k_proj.weight"
    hd = 32 // 4
    for r, (t, layout) in enumerate(ranks.views):
        head = r // 2
        assert torch.equal(t[k], sd[k][head * hd:(head + 1) * hd]), r
        assert layout["tensors"][k]["offsets"] == [head * hd, 0]
    cfg = dict(info["config"], rope_theta=rope_theta(info["config"]))
    ranks.views[1][0][k], ranks.views[2][0][k] = ranks.views[2][0][k], ranks.views[1][0][k]
    with torch.no_grad():
        bad = tp_forward("llama", cfg, ranks, info["input_ids"][0])
    assert not torch.allclose(bad, info["logits"][0], rtol=1e-3, atol=1e-3)


def test_phi3_fused_qkv_is_joined_from_parts(models, mount):
    sd = models["phi3"]["state_dict"]
    name = "model.layers.0.self_attn.qkv_proj.weight"
    q, kv, hd = 4 * 8, 2 * 8, 8
    for r in range(2):
        t, layout = read_rank(mount, "phi3", "tp2", r)
        rows = list(range(r * 16, r * 16 + 16)) + list(range(q + r * hd, q + (r + 1) * hd)) + \
            list(range(q + kv + r * hd, q + kv + (r + 1) * hd))
        assert torch.equal(t[name], sd[name][rows]), r
        lj = layout["tensors"][name]
        assert lj["join_dim"] == 0 and len(lj["parts"]) == 3 and lj["lengths"] == [32, 32]


IMPOSSIBLE = [("llama", "tp3", "tp3 does not divide num_attention_heads 4"),
              ("phi3", "tp8", "tp8 is larger than num_attention_heads 4"),
              ("mixtral", "ep8", "needs at least 8 experts")]


@pytest.mark.parametrize("ckpt,spec,reason", IMPOSSIBLE, ids=[f"{c}-{s}" for c, s, _ in IMPOSSIBLE])
def test_layouts_the_frameworks_refuse_are_enoent_with_the_reason(ckpt, spec, reason, mount, root, env):
    with pytest.raises(FileNotFoundError):
        os.listdir(mount.p(ckpt, "mesh", spec))
    assert any(f"mesh/{spec}:" in l and reason in l for l in mount.log().splitlines()), mount.log()
    r = harness.run_ckptfs("ls", os.path.join(root, ckpt), "--mesh", spec, env=env)
    assert r.returncode == EXIT_NO_SOURCE and reason in r.stderr, harness.describe(r)


def test_a_family_no_preset_knows_split_nothing_is_said_in_layout_and_log(extras, mount):
    """The sentence-transformer's BERT: no preset, every rank holds whole copies."""
    with open(mount.p("st", "consolidated", "model.safetensors"), "rb") as f:
        whole = st_load(f.read())
    for r in range(2):
        t, layout = read_rank(mount, "st", "tp2", r)
        assert layout["rules"] == "generic"
        assert len(layout["notes"]) == 1 and "tp2 split nothing" in layout["notes"][0], layout["notes"]
        assert "model_type 'bert'" in layout["notes"][0]
        assert t.keys() == whole.keys() and all(torch.equal(t[k], whole[k]) for k in t)
    assert any("st/mesh/tp2:" in l and "split nothing" in l for l in mount.log().splitlines()), mount.log()


# ---------------------------------------------------------------------------
# consolidated/: a whole model folder, whatever the family
# ---------------------------------------------------------------------------


def source_tree(d: str) -> dict[str, bytes]:
    """{relative path: bytes} of the non-weight files a model folder carries."""
    out = {}
    for dirpath, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        for f in files:
            if f.startswith(".") or f.endswith((".safetensors", ".index.json")):
                continue
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = fh.read()
    return out


def test_sentence_transformer_loads_consolidated_with_the_same_embeddings(extras, mount, root):
    from sentence_transformers import SentenceTransformer
    cons = mount.p("st", "consolidated")
    src = source_tree(os.path.join(root, "st"))
    assert {"modules.json", "1_Pooling/config.json", "sentence_bert_config.json", "modeling_tiny.py",
            "spiece.model", "chat_template.jinja", "extra/nested/notes.txt", "config_sentence_transformers.json"} <= set(src), sorted(src)
    got = source_tree(cons)
    assert got == src, sorted(set(got) ^ set(src))
    # The weights: consolidated's own files only (the sharded index is stale there).
    weights = sorted(f for f in os.listdir(cons) if f.endswith((".safetensors", ".index.json")))
    assert weights == ["model.safetensors"], weights
    model = SentenceTransformer(cons, device="cpu")
    assert [type(m).__name__ for m in model] == ["Transformer", "Pooling", "Normalize"]
    with torch.no_grad():
        emb = model.encode(extras["st"]["sentences"], convert_to_tensor=True)
    want = extras["st"]["embeddings"]
    assert torch.allclose(emb, want, rtol=1e-5, atol=1e-6), (emb - want).abs().max()


@pytest.mark.parametrize("ckpt", ["lightning", "deepspeed/global_step10"])
def test_lightning_and_deepspeed_files_consolidate_to_the_model(ckpt, extras, mount):
    """The weights under state_dict / module, nothing of the training state."""
    from transformers import AutoModelForCausalLM
    cons = mount.p(ckpt, "consolidated")
    with open(os.path.join(cons, "model.safetensors"), "rb") as f:
        got = st_load(f.read())
    sd = extras["state_dict"]
    assert got.keys() == sd.keys()
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    model = AutoModelForCausalLM.from_pretrained(cons).eval()
    with torch.no_grad():
        logits = model(input_ids=extras["input_ids"]).logits.float()
    assert torch.allclose(logits, extras["logits"], rtol=1e-5, atol=1e-5)
