#include "core/sharding.h"

#include <algorithm>
#include <map>

#include <nlohmann/json.hpp>

namespace ckptfs {

Result<MeshSpec> ParseMeshSpec(const std::string& text) {
  MeshSpec spec;
  std::map<std::string, uint64_t> seen;
  size_t at = 0;
  if (text.empty()) return Status::InvalidArgument("empty mesh spec (try tp2 or tp2-pp2)");
  while (at <= text.size()) {
    size_t dash = text.find('-', at);
    std::string part = text.substr(at, dash == std::string::npos ? std::string::npos : dash - at);
    at = dash == std::string::npos ? text.size() + 1 : dash + 1;
    size_t digits = part.find_first_of("0123456789");
    std::string axis = part.substr(0, digits);
    if (axis != "tp" && axis != "pp" && axis != "ep")
      return Status::InvalidArgument("mesh spec '" + text + "': unknown axis '" + axis +
                                     "' (axes are tp, pp, ep; e.g. tp2-pp2)");
    if (digits == std::string::npos || part.find_first_not_of("0123456789", digits) != std::string::npos ||
        part.size() - digits > 6)
      return Status::InvalidArgument("mesh spec '" + text + "': '" + part + "' needs a size, like " + axis + "2");
    uint64_t n = std::stoull(part.substr(digits));
    if (n == 0) return Status::InvalidArgument("mesh spec '" + text + "': " + axis + " must be at least 1");
    if (seen.count(axis)) return Status::InvalidArgument("mesh spec '" + text + "': " + axis + " given twice");
    seen[axis] = n;
  }
  if (seen.count("tp")) spec.tp = seen["tp"];
  if (seen.count("pp")) spec.pp = seen["pp"];
  if (seen.count("ep")) spec.ep = seen["ep"];
  if (spec.world() > 1'000'000) return Status::InvalidArgument("mesh spec '" + text + "': too many ranks");
  // Canonical order: tp, pp, ep (only the axes given).
  for (const char* axis : {"tp", "pp", "ep"})
    if (seen.count(axis)) spec.name += (spec.name.empty() ? "" : "-") + std::string(axis) + std::to_string(seen[axis]);
  return spec;
}

MeshCoord CoordOf(const MeshSpec& spec, uint64_t rank) {
  MeshCoord c;
  c.tp = rank % spec.tp;
  c.ep = (rank / spec.tp) % spec.ep;
  c.pp = rank / (spec.tp * spec.ep);
  return c;
}

namespace {

ShardingRule Rule(const std::string& pattern, SplitKind kind, int dim = 0) {
  return ShardingRule{pattern, kind, dim, std::regex(pattern)};
}

// A rule for weights stored [in, out].
ShardingRule Transposed(const std::string& pattern, SplitKind kind) {
  ShardingRule r = Rule(pattern, kind);
  r.transposed = true;
  return r;
}

// Number after `key.` in fqn ("layers.12.mlp" -> 12), or nullopt.
std::optional<uint64_t> IndexAfter(const std::string& fqn, const std::string& key) {
  std::string needle = key + ".";
  size_t at = 0;
  while ((at = fqn.find(needle, at)) != std::string::npos) {
    if (at == 0 || fqn[at - 1] == '.') {
      size_t b = at + needle.size(), e = b;
      while (e < fqn.size() && std::isdigit(static_cast<unsigned char>(fqn[e]))) ++e;
      if (e > b && (e == fqn.size() || fqn[e] == '.')) return std::stoull(fqn.substr(b, e - b));
    }
    at += needle.size();
  }
  return std::nullopt;
}

// transformers 5 keeps a layer's experts in one tensor per projection:
// `mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`
// (no expert index in the name; dim 0 is the expert).
bool IsFusedExperts(const std::string& fqn, const Shape& shape) {
  if (shape.size() < 2 || IndexAfter(fqn, "experts")) return false;
  size_t at = fqn.rfind("experts.");
  return at != std::string::npos && (at == 0 || fqn[at - 1] == '.') &&
         fqn.find('.', at + 8) == std::string::npos;
}

const SplitKind kAllKinds[] = {SplitKind::kReplicate, SplitKind::kColumn, SplitKind::kRow,
                               SplitKind::kVocab,     SplitKind::kDim,    SplitKind::kQHeads,
                               SplitKind::kKvHeads,   SplitKind::kQkv,    SplitKind::kGateUp};

}  // namespace

const char* SplitKindName(SplitKind k) {
  switch (k) {
    case SplitKind::kReplicate: return "replicate";
    case SplitKind::kColumn: return "column";
    case SplitKind::kRow: return "row";
    case SplitKind::kVocab: return "vocab";
    case SplitKind::kDim: return "dim";
    case SplitKind::kQHeads: return "q_heads";
    case SplitKind::kKvHeads: return "kv_heads";
    case SplitKind::kQkv: return "qkv";
    case SplitKind::kGateUp: return "gate_up";
  }
  return "?";
}

ModelFacts ParseModelFacts(const std::string& config_json) {
  ModelFacts f;
  nlohmann::json j = nlohmann::json::parse(config_json, nullptr, false);
  if (!j.is_object()) return f;
  if (j.contains("model_type") && j["model_type"].is_string()) f.model_type = j["model_type"];
  if (j.contains("architectures") && j["architectures"].is_array())
    for (const auto& a : j["architectures"])
      if (a.is_string()) f.architectures.push_back(a);
  // Multimodal configs (Gemma 3, Llava) keep the language model's numbers here.
  const nlohmann::json& c = j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  auto count = [&](const char* key) -> uint64_t {
    return c.contains(key) && c[key].is_number_unsigned() ? c[key].get<uint64_t>() : 0;
  };
  f.num_heads = count("num_attention_heads");
  if (f.num_heads == 0) f.num_heads = count("n_head");  // GPT-2's name for it
  f.num_kv_heads = count("num_key_value_heads");
  if (f.num_kv_heads == 0) f.num_kv_heads = f.num_heads;  // transformers' default: MHA
  return f;
}

namespace {

// A family's preset is chosen by config.json's model_type, else by its
// architectures (Kimi-K2 states model_type "kimi_k2" with DeepseekV3ForCausalLM).
struct Family {
  const char* preset;
  std::vector<std::string> model_types, architectures;
};

const std::vector<Family>& Families() {
  static const std::vector<Family> kFamilies = {
      {"llama",
       {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
        "phi3", "olmo2"},
       {"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "Phi3ForCausalLM", "Olmo2ForCausalLM"}},
      {"deepseek_v3", {"deepseek_v3"}, {"DeepseekV3ForCausalLM"}},
      {"llama4", {"llama4", "llama4_text"}, {"Llama4ForConditionalGeneration", "Llama4ForCausalLM"}},
      {"gpt2", {"gpt2"}, {"GPT2LMHeadModel"}},
  };
  return kFamilies;
}

const Family* FamilyOf(const ModelFacts& facts) {
  auto has = [](const std::vector<std::string>& v, const std::string& x) {
    return std::find(v.begin(), v.end(), x) != v.end();
  };
  for (const Family& f : Families())
    if (has(f.model_types, facts.model_type)) return &f;
  for (const std::string& arch : facts.architectures)
    for (const Family& f : Families())
      if (has(f.architectures, arch)) return &f;
  return nullptr;
}

// Without config.json: DeepSeek's MLA names, else the Llama family's.
const char* PresetByNames(const std::vector<std::string>& fqns) {
  auto any = [&](std::initializer_list<const char*> keys) {
    return std::any_of(fqns.begin(), fqns.end(), [&](const std::string& f) {
      return std::any_of(keys.begin(), keys.end(), [&](const char* k) { return f.find(k) != std::string::npos; });
    });
  };
  if (any({"kv_a_proj_with_mqa", "kv_b_proj"})) return "deepseek_v3";
  if (any({"q_proj", "qkv_proj", "embed_tokens"})) return "llama";
  return nullptr;
}

// Llama, Mistral, Qwen, Gemma, Phi-3, OLMo-2, Mixtral/Qwen-MoE experts
// (per-expert, and transformers 5's fused [E, 2I, H] / [E, H, I]).
std::vector<ShardingRule> LlamaRules() {
  return {
      Rule(R"((^|\.)q_proj\.(weight|bias)$)", SplitKind::kQHeads),
      Rule(R"((^|\.)(k_proj|v_proj)\.(weight|bias)$)", SplitKind::kKvHeads),
      Rule(R"((^|\.)qkv_proj\.(weight|bias)$)", SplitKind::kQkv),
      Rule(R"((^|\.)gate_up_proj(\.weight|\.bias)?$)", SplitKind::kGateUp),
      Rule(R"((^|\.)(gate_proj|up_proj|w1|w3)\.(weight|bias)$)", SplitKind::kColumn),
      Rule(R"((^|\.)(o_proj|down_proj|w2)(\.weight)?$)", SplitKind::kRow),
      Rule(R"((^|\.)(embed_tokens|lm_head)\.weight$)", SplitKind::kVocab),
      Rule(R"(norm\.(weight|bias)$)", SplitKind::kReplicate),
  };
}

// The rules that go before LlamaRules() (or replace them, for GPT-2).
std::vector<ShardingRule> FamilyRules(const std::string& preset) {
  if (preset == "deepseek_v3")
    return {
        // MLA as vLLM's DeepseekV2MLAAttention and Megatron's MLASelfAttention
        // cut it: the low-rank down-projections are replicated, the
        // up-projections (q_b_proj rows: heads x qk_head_dim; kv_b_proj rows:
        // heads x (qk_nope_head_dim + v_head_dim)) column-parallel in whole
        // heads; o_proj row-parallel (LlamaRules).
        Rule(R"((^|\.)(q_a_proj|kv_a_proj_with_mqa)\.(weight|bias)$)", SplitKind::kReplicate),
        Rule(R"((^|\.)(q_b_proj|kv_b_proj)\.weight$)", SplitKind::kQHeads),
        Rule(R"((^|\.)shared_head\.head\.weight$)", SplitKind::kVocab),  // the MTP layer's head
    };
  if (preset == "llama4")
    return {
        // The vision tower's heads are not the text model's (text_config's);
        // vLLM can run it data-parallel, whole on each rank.
        Rule(R"((^|\.)(vision_model|multi_modal_projector)\.)", SplitKind::kReplicate),
        // Fused experts are stored [E, H, 2I] and [E, I, H]: vLLM transposes
        // them on load, then cuts gate and up (and down's input) over tp.
        Transposed(R"((^|\.)experts\.gate_up_proj$)", SplitKind::kGateUp),
        Transposed(R"((^|\.)experts\.down_proj$)", SplitKind::kRow),
    };
  if (preset == "gpt2")
    return {
        // Conv1D stores [in, out]; vLLM's GPT-2 loader transposes c_attn,
        // c_fc and c_proj and loads them as QKVParallelLinear,
        // ColumnParallelLinear and RowParallelLinear. wpe stays whole.
        Transposed(R"((^|\.)attn\.c_attn\.(weight|bias)$)", SplitKind::kQkv),
        Transposed(R"((^|\.)mlp\.c_fc\.(weight|bias)$)", SplitKind::kColumn),
        Transposed(R"((^|\.)(attn|mlp)\.c_proj\.weight$)", SplitKind::kRow),
        Rule(R"((^|\.)(wte|lm_head)\.weight$)", SplitKind::kVocab),
    };
  return {};
}

// Names alone cannot tell a fused experts tensor's layout: [E, 2I, H]
// (transformers 5's Mixtral, Qwen-MoE, DeepSeek-V3) or [E, H, 2I]
// (Llama-4). Cutting it on the wrong dim would give wrong experts, so it is
// held whole on every tp rank and the note says so.
ShardingRule FusedExpertsByNames() {
  ShardingRule r = Rule(R"((^|\.)experts\.(gate_up_proj|down_proj)$)", SplitKind::kReplicate);
  r.note =
      "fused experts (experts.gate_up_proj, experts.down_proj) are held whole on every tp rank: without "
      "config.json's model_type their layout is unknown ([E, 2I, H] as transformers 5 saves Mixtral, Qwen-MoE "
      "and DeepSeek-V3, or Llama-4's [E, H, 2I]). Put config.json next to the weights, or say how to cut them "
      "with `ckptfs mount --rules FILE` (\"transposed\": true for [E, H, 2I])";
  return r;
}

}  // namespace

ShardingRules PresetRules(const ModelFacts& facts, const std::vector<std::string>& fqns) {
  const std::string& type = facts.model_type;
  const Family* family = FamilyOf(facts);
  const bool by_names = !family && type.empty();
  const char* preset = family ? family->preset : by_names ? PresetByNames(fqns) : nullptr;
  ShardingRules r;
  r.facts = facts;
  r.preset = preset ? preset : "generic";
  if (!preset) {
    // Unknown family: nothing is split unless a rules file says how.
    r.unknown_model = "no sharding preset for " + (type.empty() ? "these tensor names" : "model_type '" + type + "'");
    return r;
  }
  if (by_names) r.rules.push_back(FusedExpertsByNames());
  for (ShardingRule& rule : FamilyRules(r.preset)) r.rules.push_back(std::move(rule));
  if (r.preset != "gpt2")
    for (ShardingRule& rule : LlamaRules()) r.rules.push_back(std::move(rule));
  return r;
}

Result<ShardingRules> LoadRulesFile(const std::string& text, ShardingRules base) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("rules") || !j["rules"].is_array())
    return Status::InvalidArgument("rules file: expected {\"rules\": [{\"pattern\": ..., \"kind\": ...}]}");
  std::vector<ShardingRule> rules;
  for (const auto& r : j["rules"]) {
    if (!r.is_object() || !r.contains("pattern") || !r["pattern"].is_string() || !r.contains("kind") ||
        !r["kind"].is_string())
      return Status::InvalidArgument("rules file: each rule needs a string \"pattern\" and \"kind\"");
    std::string kind = r["kind"];
    auto k = std::find_if(std::begin(kAllKinds), std::end(kAllKinds),
                          [&](SplitKind c) { return kind == SplitKindName(c); });
    if (k == std::end(kAllKinds))
      return Status::InvalidArgument("rules file: unknown kind '" + kind +
                                     "' (column, row, vocab, replicate, dim, q_heads, kv_heads, qkv, gate_up)");
    int dim = r.contains("dim") && r["dim"].is_number_integer() ? r["dim"].get<int>() : 0;
    if (r.contains("transposed") && !r["transposed"].is_boolean())
      return Status::InvalidArgument("rules file: \"transposed\" is true or false (true: weights stored [in, out])");
    try {
      rules.push_back(Rule(r["pattern"].get<std::string>(), *k, dim));
    } catch (const std::regex_error& e) {
      return Status::InvalidArgument("rules file: bad pattern '" + r["pattern"].get<std::string>() + "': " + e.what());
    }
    rules.back().transposed = r.value("transposed", false);
  }
  rules.insert(rules.end(), base.rules.begin(), base.rules.end());
  base.rules = std::move(rules);
  base.preset += "+file";
  base.unknown_model.clear();
  return base;
}

std::pair<uint64_t, uint64_t> ChunkRange(uint64_t n, uint64_t parts, uint64_t i) {
  uint64_t step = (n + parts - 1) / parts;
  uint64_t b = std::min(n, i * step), e = std::min(n, (i + 1) * step);
  return {b, e};
}


namespace {

std::string Where(const std::string& name, const Shape& shape) {
  return "tensor '" + name + "' " + ShapeToString(shape);
}

// Contiguous layer ranges (torch.chunk sizes); embeddings and anything
// outside the layer stack on the first stage, the final norm and lm_head on
// the last.
uint64_t StageOf(const std::string& name, uint64_t pp, uint64_t layers) {
  if (auto layer = IndexAfter(name, "layers")) return *layer / ((layers + pp - 1) / pp);
  static const std::regex kFinal(R"((^|\.)(lm_head|norm|final_layernorm|ln_f)\.(weight|bias)$)");
  return std::regex_search(name, kFinal) ? pp - 1 : 0;
}

// Whether `tp` can cut `part` of dim `dim` the way vLLM's QKVParallelLinear
// and Megatron's ColumnParallelLinear would (the reason when not).
Status CheckPart(const TensorPlacement::Part& part, const std::string& where, int dim, uint64_t tp) {
  const std::string t = "tp" + std::to_string(tp);
  const std::string span = "dim " + std::to_string(dim) + " (" + std::to_string(part.size) + ")";
  if (part.heads == 0) {
    if (part.size < tp) return Status::InvalidArgument(where + ": " + t + " is larger than " + span);
    return Status::OK();
  }
  const std::string heads = part.replicate_heads ? "num_key_value_heads " : "num_attention_heads ";
  const std::string count = heads + std::to_string(part.heads);
  if (part.size % part.heads != 0)
    return Status::InvalidArgument(where + ": " + span + " is not a whole number of heads (" + count + ")");
  if (tp <= part.heads) {
    if (part.heads % tp == 0) return Status::OK();
    return Status::InvalidArgument(where + ": " + t + " does not divide " + count +
                                   " (vLLM and Megatron-LM give every rank the same number of whole heads)");
  }
  if (!part.replicate_heads)
    return Status::InvalidArgument(where + ": " + t + " is larger than " + count +
                                   " (a rank cannot hold part of a query head)");
  if (tp % part.heads != 0)
    return Status::InvalidArgument(where + ": " + t + " is not a multiple of " + count +
                                   " (vLLM replicates each KV head on tp / num_key_value_heads ranks)");
  return Status::OK();
}

// The parts of dim `n` a rule cuts separately: q, k, v of a fused qkv_proj,
// gate and up of a fused gate_up_proj, else the whole dim.
Result<std::vector<TensorPlacement::Part>> PartsOf(SplitKind kind, uint64_t n, const ModelFacts& f,
                                                   const std::string& where) {
  using Part = TensorPlacement::Part;
  switch (kind) {
    case SplitKind::kQHeads: return std::vector<Part>{{0, n, f.num_heads, false}};
    case SplitKind::kKvHeads: return std::vector<Part>{{0, n, f.num_kv_heads, true}};
    case SplitKind::kGateUp:
      if (n % 2) return Status::InvalidArgument(where + ": a fused gate/up dim (" + std::to_string(n) + ") must be even");
      return std::vector<Part>{{0, n / 2, 0, false}, {n / 2, n / 2, 0, false}};
    case SplitKind::kQkv: {
      if (f.num_heads == 0)
        return Status::InvalidArgument(where + ": a fused qkv tensor is split by heads, and config.json states no "
                                       "num_attention_heads");
      const uint64_t units = f.num_heads + 2 * f.num_kv_heads;
      if (n % units)
        return Status::InvalidArgument(where + ": " + std::to_string(n) + " rows are not (num_attention_heads + 2 * " +
                                       "num_key_value_heads) = " + std::to_string(units) + " heads");
      const uint64_t q = f.num_heads * (n / units), kv = f.num_kv_heads * (n / units);
      return std::vector<Part>{{0, q, f.num_heads, false}, {q, kv, f.num_kv_heads, true},
                               {q + kv, kv, f.num_kv_heads, true}};
    }
    default: return std::vector<Part>{{0, n, 0, false}};
  }
}

// Sets p.dim and p.parts for `rule`; leaves them unset (replicated) for a
// rule that does not split, or a row rule on a bias.
Status SplitByRule(TensorPlacement& p, const ShardingRule& rule, const std::string& name, const ModelFacts& facts,
                   uint64_t tp) {
  const size_t lead = p.fused_experts ? 1 : 0;  // rules describe the per-expert matrix
  const std::string where = Where(name, p.shape);
  const bool matrix = p.shape.size() >= lead + 2;  // else a bias: its one dim is the output
  // nn.Linear stores [out, in]; a transposed rule's weights are [in, out].
  const int out_dim = int(lead) + (rule.transposed && matrix ? 1 : 0);
  const int in_dim = int(lead) + (rule.transposed ? 0 : 1);
  int dim = out_dim;
  if (rule.kind == SplitKind::kReplicate) return Status::OK();
  if (rule.kind == SplitKind::kRow) {
    if (!matrix) return Status::OK();  // a row-parallel bias is added once, whole
    dim = in_dim;
  } else if (rule.kind == SplitKind::kDim) {
    dim = rule.dim;
  }
  if (dim < 0 || size_t(dim) >= p.shape.size())
    return Status::InvalidArgument(where + ": rule '" + rule.pattern + "' (" + SplitKindName(rule.kind) +
                                   ") splits dim " + std::to_string(dim) + ", which it does not have");
  ASSIGN_OR_RETURN(auto parts, PartsOf(rule.kind, p.shape[dim], facts, where));
  for (const auto& part : parts) RETURN_IF_ERROR(CheckPart(part, where, dim, tp));
  p.dim = dim;
  p.parts = std::move(parts);
  return Status::OK();
}

// [begin, end) of `part` that tp rank `r` holds.
std::pair<uint64_t, uint64_t> PartRange(const TensorPlacement::Part& part, uint64_t tp, uint64_t r) {
  if (part.heads == 0) return ChunkRange(part.size, tp, r);
  const uint64_t head = part.size / part.heads;
  if (tp <= part.heads) {
    const uint64_t per = part.heads / tp;
    return {r * per * head, (r + 1) * per * head};
  }
  const uint64_t h = r / (tp / part.heads);  // vLLM: shard_id = tp_rank // num_kv_head_replicas
  return {h * head, (h + 1) * head};
}

}  // namespace

Status CheckHeads(const MeshSpec& spec, const ShardingRules& rules) {
  const ModelFacts& f = rules.facts;
  if (spec.tp == 1 || f.num_heads == 0) return Status::OK();
  auto uses = [&](std::initializer_list<SplitKind> kinds) {
    return std::any_of(rules.rules.begin(), rules.rules.end(), [&](const ShardingRule& r) {
      return std::find(kinds.begin(), kinds.end(), r.kind) != kinds.end();
    });
  };
  const std::string where = "config.json";
  if (uses({SplitKind::kQHeads, SplitKind::kQkv}))
    RETURN_IF_ERROR(CheckPart({0, f.num_heads, f.num_heads, false}, where, 0, spec.tp));
  if (uses({SplitKind::kKvHeads, SplitKind::kQkv}))
    RETURN_IF_ERROR(CheckPart({0, f.num_kv_heads, f.num_kv_heads, true}, where, 0, spec.tp));
  return Status::OK();
}

Shape RankSlice::shape() const {
  Shape s = boxes.at(0).lengths;
  for (size_t i = 1; i < boxes.size(); ++i) s[join_dim] += boxes[i].lengths[join_dim];
  return s;
}

ModelCounts CountModel(const std::vector<std::pair<std::string, Shape>>& weights) {
  ModelCounts c;
  for (const auto& [name, shape] : weights) {
    if (auto i = IndexAfter(name, "layers")) c.layers = std::max(c.layers, *i + 1);
    if (auto e = IndexAfter(name, "experts")) c.experts = std::max(c.experts, *e + 1);
    if (IsFusedExperts(name, shape)) c.experts = std::max(c.experts, shape[0]);
  }
  return c;
}

Result<TensorPlacement> PlaceTensor(const Shape& shape, const std::string& name, const MeshSpec& spec,
                                    const ShardingRules& rules, const ModelCounts& counts) {
  TensorPlacement p;
  p.shape = shape;
  if (spec.pp > 1) {
    if (counts.layers < spec.pp)
      return Status::InvalidArgument("pp" + std::to_string(spec.pp) + " needs at least " + std::to_string(spec.pp) +
                                     " layers; the checkpoint has " + std::to_string(counts.layers));
    p.stage = StageOf(name, spec.pp, counts.layers);
  }
  p.fused_experts = IsFusedExperts(name, shape);
  if (spec.ep > 1) {
    const std::string ep = "ep" + std::to_string(spec.ep);
    if (counts.experts == 0) return Status::InvalidArgument(ep + ": the checkpoint has no experts");
    uint64_t experts = p.fused_experts ? shape[0] : counts.experts;
    if (experts < spec.ep)
      return Status::InvalidArgument(ep + " needs at least " + std::to_string(spec.ep) + " experts; " +
                                     (p.fused_experts ? Where(name, shape) + " holds " : "the checkpoint has ") +
                                     std::to_string(experts));
    if (auto e = IndexAfter(name, "experts")) {
      for (uint64_t g = 0; g < spec.ep && !p.ep_group; ++g) {
        auto [b, end] = ChunkRange(counts.experts, spec.ep, g);
        if (*e >= b && *e < end) p.ep_group = g;
      }
    }
  }
  if (spec.tp == 1) return p;
  for (const auto& r : rules.rules)
    if (std::regex_search(name, r.re)) {
      p.note = r.note;
      RETURN_IF_ERROR(SplitByRule(p, r, name, rules.facts, spec.tp));
      break;
    }
  return p;
}

std::optional<RankSlice> SliceOf(const TensorPlacement& p, const MeshSpec& spec, uint64_t rank) {
  const MeshCoord c = CoordOf(spec, rank);
  if (p.stage && *p.stage != c.pp) return std::nullopt;
  if (p.ep_group && *p.ep_group != c.ep) return std::nullopt;
  Box base = Box::Whole(p.shape);
  if (p.fused_experts && spec.ep > 1) {
    auto [b, e] = ChunkRange(p.shape[0], spec.ep, c.ep);
    if (b == e) return std::nullopt;  // more ep groups than this layer has experts for
    base.offsets[0] = b;
    base.lengths[0] = e - b;
  }
  RankSlice out;
  if (p.dim < 0) {
    out.boxes.push_back(std::move(base));
    return out;
  }
  out.join_dim = p.dim;
  for (const auto& part : p.parts) {
    auto [b, e] = PartRange(part, spec.tp, c.tp);
    Box box = base;
    box.offsets[p.dim] = part.begin + b;
    box.lengths[p.dim] = e - b;
    if (e > b || out.boxes.empty()) out.boxes.push_back(std::move(box));
  }
  // A rank whose first part came out empty keeps that empty box only when
  // no later part gave it anything.
  if (out.boxes.size() > 1 && out.boxes.front().lengths[p.dim] == 0) out.boxes.erase(out.boxes.begin());
  return out;
}

}  // namespace ckptfs
