// Sharding rules for mesh views: which part of each tensor one rank of a new
// parallel layout holds (docs/SEMANTICS.md, "mesh/").
//
// A layout is named by a spec such as `tp4`, `tp2-pp2`, `tp2-ep4`: axes
// tp (tensor), pp (pipeline) and ep (expert), each at most once, sizes >= 1.
// Ranks are numbered with tp fastest, then ep, then pp:
//   rank = (pp_rank * ep + ep_rank) * tp + tp_rank.
//
// Rules map tensor names to a kind: column/vocab (split dim 0 over tp), row
// (split dim 1 over tp), replicate, a custom split dim, or one of the
// head-aware and fused kinds the presets use (q_heads, kv_heads, qkv,
// gate_up). Plain splits follow DTensor Shard semantics: torch.chunk sizes,
// ceil(n / parts) per rank, the last ranks smaller or empty. Head-aware
// splits follow vLLM's QKVParallelLinear: whole heads per rank, KV heads
// replicated over tp / num_key_value_heads ranks when tp exceeds them, and
// refused where vLLM refuses. Fused tensors (Phi-3 qkv_proj, gate_up_proj)
// are split per part and the rank's pieces joined again.
//
// A rule can say its weights are stored transposed, [in, out] (GPT-2's
// Conv1D, Llama-4's fused experts): column kinds then cut the last dim and
// row kinds the one before it.
//
// Experts: per-expert names (`experts.<e>.`) go to ep ranks in contiguous
// blocks; fused expert tensors (`experts.gate_up_proj [E, 2I, H]`, as
// transformers 5 saves them, or Llama-4's `[E, H, 2I]`) are sliced on dim 0
// in the same blocks, and the rules apply to the per-expert matrix behind it
// (dims shifted by one). Which of the two layouts a fused tensor has is
// known only from config.json: a preset chosen from tensor names holds them
// whole on every tp rank, with a note, rather than cut a dim it cannot name.
// Layers (`layers.<i>.`) go to pp stages in contiguous ranges (torch.chunk
// sizes), embeddings on the first stage, the final norm and lm_head on the
// last.
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

enum class SplitKind {
  kReplicate,
  kColumn,   // output dim (dim 0 of a [out, in] weight, or a bias)
  kRow,      // input dim (dim 1); a 1-d row bias is replicated
  kVocab,    // dim 0 of an embedding or lm_head
  kDim,      // ShardingRule::dim
  kQHeads,   // column, in whole query heads
  kKvHeads,  // column, in whole KV heads; replicated when tp > KV heads
  kQkv,      // fused [q; k; v] rows, each part split by heads
  kGateUp,   // fused [gate; up] rows, each half split
};
const char* SplitKindName(SplitKind k);

struct ShardingRule {
  std::string pattern;  // ECMAScript regex, matched with regex_search against the fqn
  SplitKind kind = SplitKind::kReplicate;
  int dim = 0;          // for kDim
  std::regex re;
  bool transposed = false;  // weights stored [in, out]: column cuts the last dim, row the one before
  std::string note;         // why the tensors it matches are held whole (layout.json "notes", the log)
};

// What head-aware splitting and the choice of preset need from config.json;
// 0 = not stated.
struct ModelFacts {
  std::string model_type;
  uint64_t num_heads = 0;     // num_attention_heads (GPT-2: n_head)
  uint64_t num_kv_heads = 0;  // num_key_value_heads (num_heads when absent)
  std::vector<std::string> architectures;  // e.g. "DeepseekV3ForCausalLM"
};

// Reads the facts from config.json's text (text_config for multimodal
// configs). Anything missing or malformed stays 0.
ModelFacts ParseModelFacts(const std::string& config_json);

struct ShardingRules {
  std::string preset;               // "llama", "deepseek_v3", "llama4", "gpt2", "generic", ...
  std::vector<ShardingRule> rules;  // first match wins; no match = replicate
  ModelFacts facts;
  // Why nothing is split, for a model no preset knows ("" otherwise).
  std::string unknown_model;
};

// The preset for a model family, from config.json's model_type, else its
// architectures: "llama" covers Llama, Mistral, Qwen2/3, Gemma, Phi-3,
// OLMo-2 and the Mixtral/Qwen-MoE expert names, per-expert and fused;
// "deepseek_v3" adds MLA's projections; "llama4" Llama-4's transposed fused
// experts and its vision tower (whole); "gpt2" cuts Conv1D weights. Without
// either the preset is chosen from the names (DeepSeek's MLA names, else
// q_proj/qkv_proj/embed_tokens for the Llama family), and fused experts are
// held whole (ShardingRule::note says why).
ShardingRules PresetRules(const ModelFacts& facts, const std::vector<std::string>& fqns);

// Reads a rules file: {"rules": [{"pattern": "...", "kind": KIND, "dim": N,
// "transposed": BOOL}]} with KIND one of column, row, vocab, replicate, dim,
// q_heads, kv_heads, qkv, gate_up ("dim" with kind "dim"; "transposed" for
// weights stored [in, out]). Its rules go before `base`'s.
Result<ShardingRules> LoadRulesFile(const std::string& json_text, ShardingRules base);

// torch.chunk sizes: the [begin, end) of part `i` of `n` split into `parts`.
std::pair<uint64_t, uint64_t> ChunkRange(uint64_t n, uint64_t parts, uint64_t i);

// Layer and expert counts of a model, over its weight names and shapes.
struct ModelCounts {
  uint64_t layers = 0;   // highest `layers.<i>.` + 1
  uint64_t experts = 0;  // highest `experts.<e>.` + 1, or dim 0 of fused experts
};

// Where one tensor goes under a spec: computed once per tensor (rule
// matching is the costly part), then cut for each rank by SliceOf.
struct TensorPlacement {
  Shape shape;
  std::optional<uint64_t> stage;   // pp stage holding it (always set when pp > 1)
  std::optional<uint64_t> ep_group;  // ep group holding an `experts.<e>.` tensor
  bool fused_experts = false;        // dim 0 indexes experts, sliced over ep
  int dim = -1;                    // tp split dim; -1 = whole on every tp rank
  std::string note;                // the matched rule's reason for holding it whole
  struct Part {
    uint64_t begin = 0, size = 0;  // along dim
    uint64_t heads = 0;            // split in whole heads when > 0
    bool replicate_heads = false;  // KV heads: tp > heads copies each head
  };
  std::vector<Part> parts;
};

// A rank's share of one tensor: boxes in the global tensor, joined along
// join_dim in order (one box unless the tensor is fused).
struct RankSlice {
  std::vector<Box> boxes;
  int join_dim = 0;
  Shape shape() const;  // of the joined result
};

// InvalidArgument with the reason when the spec is impossible for the tensor
// (tp larger than the split dimension, heads tp does not divide, ...).
Result<TensorPlacement> PlaceTensor(const Shape& shape, const std::string& name, const MeshSpec& spec,
                                    const ShardingRules& rules, const ModelCounts& counts);
// The model-wide head check: tp must divide num_attention_heads, and divide
// or be a multiple of num_key_value_heads (when the rules have head-aware
// kinds and config.json states the counts). For the message when a tensor's
// head split was refused; rules that never match a head tensor make it moot.
Status CheckHeads(const MeshSpec& spec, const ShardingRules& rules);
std::optional<RankSlice> SliceOf(const TensorPlacement& p, const MeshSpec& spec, uint64_t rank);

// Counts over (name, shape) pairs.
ModelCounts CountModel(const std::vector<std::pair<std::string, Shape>>& weights);

}  // namespace ckptfs
