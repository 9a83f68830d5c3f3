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

const char* KindName(SplitKind k) {
  switch (k) {
    case SplitKind::kReplicate: return "replicate";
    case SplitKind::kColumn: return "column";
    case SplitKind::kRow: return "row";
    case SplitKind::kVocab: return "vocab";
    case SplitKind::kDim: return "dim";
  }
  return "?";
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

}  // namespace

uint64_t CountIndexed(const std::vector<std::string>& fqns, const std::string& key) {
  uint64_t n = 0;
  for (const auto& f : fqns)
    if (auto i = IndexAfter(f, key)) n = std::max(n, *i + 1);
  return n;
}

ShardingRules PresetRules(const std::string& model_type, const std::vector<std::string>& fqns) {
  static const char* const kLlamaFamily[] = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe",
                                             "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2"};
  bool llama = std::find(std::begin(kLlamaFamily), std::end(kLlamaFamily), model_type) != std::end(kLlamaFamily);
  if (model_type.empty())
    llama = std::any_of(fqns.begin(), fqns.end(), [](const std::string& f) {
      return f.find("q_proj") != std::string::npos || f.find("embed_tokens") != std::string::npos;
    });
  ShardingRules r;
  r.preset = llama ? "llama" : "generic";
  if (!llama) return r;  // unknown family: replicate everything unless a rules file says otherwise
  r.rules = {
      Rule(R"((^|\.)(q_proj|k_proj|v_proj|gate_proj|up_proj|w1|w3)\.(weight|bias)$)", SplitKind::kColumn),
      Rule(R"((^|\.)(o_proj|down_proj|w2)\.weight$)", SplitKind::kRow),
      Rule(R"((^|\.)(embed_tokens|lm_head)\.weight$)", SplitKind::kVocab),
      Rule(R"(norm\.(weight|bias)$)", SplitKind::kReplicate),
  };
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
    SplitKind k;
    if (kind == "column") k = SplitKind::kColumn;
    else if (kind == "row") k = SplitKind::kRow;
    else if (kind == "vocab") k = SplitKind::kVocab;
    else if (kind == "replicate") k = SplitKind::kReplicate;
    else if (kind == "dim") k = SplitKind::kDim;
    else return Status::InvalidArgument("rules file: unknown kind '" + kind + "' (column, row, vocab, replicate, dim)");
    int dim = r.value("dim", 0);
    try {
      rules.push_back(Rule(r["pattern"].get<std::string>(), k, dim));
    } catch (const std::regex_error& e) {
      return Status::InvalidArgument("rules file: bad pattern '" + r["pattern"].get<std::string>() + "': " + e.what());
    }
  }
  rules.insert(rules.end(), base.rules.begin(), base.rules.end());
  base.rules = std::move(rules);
  base.preset += "+file";
  return base;
}

std::pair<uint64_t, uint64_t> ChunkRange(uint64_t n, uint64_t parts, uint64_t i) {
  uint64_t step = (n + parts - 1) / parts;
  uint64_t b = std::min(n, i * step), e = std::min(n, (i + 1) * step);
  return {b, e};
}

Result<std::optional<Box>> RankBox(const TensorMeta& t, const std::string& name, const MeshSpec& spec,
                                   uint64_t rank, const ShardingRules& rules, uint64_t num_layers,
                                   uint64_t num_experts) {
  const MeshCoord c = CoordOf(spec, rank);
  Box box = Box::Whole(t.shape);

  // Pipeline stage.
  if (spec.pp > 1) {
    if (num_layers < spec.pp)
      return Status::InvalidArgument("pp" + std::to_string(spec.pp) + " needs at least " + std::to_string(spec.pp) +
                                     " layers; the checkpoint has " + std::to_string(num_layers));
    uint64_t stage;
    if (auto layer = IndexAfter(name, "layers")) {
      uint64_t step = (num_layers + spec.pp - 1) / spec.pp;
      stage = *layer / step;
    } else if (static const std::regex kFinal(R"((^|\.)(lm_head|norm|final_layernorm|ln_f)\.(weight|bias)$)");
               std::regex_search(name, kFinal)) {
      stage = spec.pp - 1;
    } else {
      stage = 0;  // embeddings and anything outside the layer stack
    }
    if (stage != c.pp) return std::optional<Box>();
  }

  // Expert group.
  if (auto expert = IndexAfter(name, "experts")) {
    if (spec.ep > 1) {
      if (num_experts < spec.ep)
        return Status::InvalidArgument("ep" + std::to_string(spec.ep) + " needs at least " + std::to_string(spec.ep) +
                                       " experts; the checkpoint has " + std::to_string(num_experts));
      auto [b, e] = ChunkRange(num_experts, spec.ep, c.ep);
      if (*expert < b || *expert >= e) return std::optional<Box>();
    }
  } else if (spec.ep > 1 && num_experts == 0) {
    return Status::InvalidArgument("ep" + std::to_string(spec.ep) + ": the checkpoint has no experts");
  }

  // Tensor-parallel split.
  const ShardingRule* rule = nullptr;
  for (const auto& r : rules.rules)
    if (std::regex_search(name, r.re)) {
      rule = &r;
      break;
    }
  if (!rule || rule->kind == SplitKind::kReplicate || spec.tp == 1) return std::optional<Box>(box);
  int dim = rule->kind == SplitKind::kRow ? 1 : rule->kind == SplitKind::kDim ? rule->dim : 0;
  if (rule->kind == SplitKind::kRow && t.shape.size() < 2) return std::optional<Box>(box);  // row bias: replicated
  if (dim < 0 || size_t(dim) >= t.shape.size())
    return Status::InvalidArgument("tensor '" + name + "' " + ShapeToString(t.shape) + ": rule '" + rule->pattern +
                                   "' (" + KindName(rule->kind) + ") splits dim " + std::to_string(dim) +
                                   ", which it does not have");
  if (t.shape[dim] < spec.tp)
    return Status::InvalidArgument("tensor '" + name + "' " + ShapeToString(t.shape) + ": tp" +
                                   std::to_string(spec.tp) + " is larger than dim " + std::to_string(dim) +
                                   " (" + std::to_string(t.shape[dim]) + ")");
  auto [b, e] = ChunkRange(t.shape[dim], spec.tp, c.tp);
  box.offsets[dim] = b;
  box.lengths[dim] = e - b;
  return std::optional<Box>(box);
}

}  // namespace ckptfs
