// Sharding rules for mesh views: which part of each tensor one rank of a new
// parallel layout holds (docs/SEMANTICS.md, "mesh/").
//
// A layout is named by a spec such as `tp4`, `tp2-pp2`, `tp2-ep4`: axes
// tp (tensor), pp (pipeline) and ep (expert), each at most once, sizes >= 1.
// Ranks are numbered with tp fastest, then ep, then pp:
//   rank = (pp_rank * ep + ep_rank) * tp + tp_rank.
//
// Rules map tensor names to a kind: column/vocab (split dim 0 over tp), row
// (split dim 1 over tp), replicate, or a custom split dim. Splits follow
// DTensor Shard semantics: torch.chunk sizes, ceil(n / parts) per rank, the
// last ranks smaller or empty. Experts (`experts.<e>.`) go to ep ranks in
// contiguous blocks; layers (`layers.<i>.`) to pp stages in contiguous
// ranges (torch.chunk sizes), embeddings on the first stage, the final norm
// and lm_head on the last.
#pragma once

#include <cstdint>
#include <optional>
#include <regex>
#include <string>
#include <vector>

#include "core/box.h"
#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

struct MeshSpec {
  uint64_t tp = 1, pp = 1, ep = 1;
  std::string name;  // canonical, e.g. "tp2-pp2"
  uint64_t world() const { return tp * pp * ep; }
};

// Parses "tp4", "tp2-pp2", "pp2-tp2" (canonicalised to "tp2-pp2").
// InvalidArgument with the reason for unknown axes, repeats, zero sizes.
Result<MeshSpec> ParseMeshSpec(const std::string& text);

struct MeshCoord {
  uint64_t tp = 0, pp = 0, ep = 0;
};
MeshCoord CoordOf(const MeshSpec& spec, uint64_t rank);

enum class SplitKind { kReplicate, kColumn, kRow, kVocab, kDim };

struct ShardingRule {
  std::string pattern;  // ECMAScript regex, matched with regex_search against the fqn
  SplitKind kind = SplitKind::kReplicate;
  int dim = 0;          // for kDim
  std::regex re;
};

struct ShardingRules {
  std::string preset;               // "llama", "generic", ...
  std::vector<ShardingRule> rules;  // first match wins; no match = replicate
};

// The preset for a model family: "llama" covers Llama, Mistral, Qwen(2/3),
// Mixtral-style MoE names. `model_type` comes from config.json ("" if none);
// without it, the preset is chosen from the tensor names.
ShardingRules PresetRules(const std::string& model_type, const std::vector<std::string>& fqns);

// Reads a rules file: {"rules": [{"pattern": "...", "kind": "column|row|vocab|replicate", "dim": N}]}
// ("dim" with kind "dim"). Its rules go before `base`'s.
Result<ShardingRules> LoadRulesFile(const std::string& json_text, ShardingRules base);

// torch.chunk sizes: the [begin, end) of part `i` of `n` split into `parts`.
std::pair<uint64_t, uint64_t> ChunkRange(uint64_t n, uint64_t parts, uint64_t i);

// The box of `t` (named `name` in the view; rules match the name) that rank
// `rank` of `spec` holds, or nullopt when the rank holds none of it (another
// pipeline stage or expert group). InvalidArgument when the split is
// impossible (tp larger than the split dimension, say).
Result<std::optional<Box>> RankBox(const TensorMeta& t, const std::string& name, const MeshSpec& spec,
                                   uint64_t rank, const ShardingRules& rules, uint64_t num_layers,
                                   uint64_t num_experts);

// Highest `layers.<i>.` index + 1, and `experts.<e>.` index + 1, over fqns.
uint64_t CountIndexed(const std::vector<std::string>& fqns, const std::string& key);

}  // namespace ckptfs
