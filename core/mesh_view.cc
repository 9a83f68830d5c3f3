#include "core/mesh_view.h"

#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/cast.h"

namespace ckptfs {
namespace {

// Appends to a JSON object in O(1): ordered_json's own insert searches the
// keys linearly (quadratic over 100k tensors). Keys here are unique.
void Append(nlohmann::ordered_json& object, std::string key, nlohmann::ordered_json value) {
  using Base = std::vector<std::pair<const std::string, nlohmann::ordered_json>>;
  static_cast<Base&>(object.get_ref<nlohmann::ordered_json::object_t&>())
      .emplace_back(std::move(key), std::move(value));
}

nlohmann::ordered_json BoxJson(const Box& b) { return {{"offsets", Shape(b.offsets)}, {"lengths", Shape(b.lengths)}}; }

// layout.json's entry for one slice: its box, or for a fused tensor the
// boxes joined along join_dim.
nlohmann::ordered_json SliceJson(const TensorSlice& s, const std::string& file) {
  nlohmann::ordered_json j = {{"dtype", std::string(DTypeName(s.dtype()))},
                              {"global_shape", s.tensor->shape}};
  if (s.joined.empty()) {
    j["offsets"] = Shape(s.box.offsets);
    j["lengths"] = Shape(s.box.lengths);
  } else {
    j["lengths"] = s.shape();
    j["join_dim"] = s.join_dim;
    nlohmann::ordered_json parts = nlohmann::ordered_json::array();
    for (const Box& b : s.joined) parts.push_back(BoxJson(b));
    j["parts"] = std::move(parts);
  }
  j["file"] = file;
  return j;
}

// What a user should know about the spec as a whole (layout.json "notes",
// and the log): tensors a rule holds whole for a reason (each reason once),
// a tp spec that split nothing, and why.
std::vector<std::string> MeshNotes(const MeshSpec& spec, const ShardingRules& rules,
                                   const std::vector<TensorPlacement>& placements) {
  if (spec.tp == 1) return {};
  std::vector<std::string> notes;
  for (const TensorPlacement& p : placements)
    if (!p.note.empty() && std::find(notes.begin(), notes.end(), p.note) == notes.end()) notes.push_back(p.note);
  bool split = std::any_of(placements.begin(), placements.end(), [](const TensorPlacement& p) { return p.dim >= 0; });
  if (split) return notes;
  std::string why = !rules.unknown_model.empty()
                        ? rules.unknown_model
                        : "no rule of the '" + rules.preset + "' rules matched a tensor it could split";
  notes.push_back("tp" + std::to_string(spec.tp) + " split nothing: " + why + "; every rank holds whole copies. " +
                  "Say how to split with `ckptfs mount --rules FILE` (see mesh/README)");
  return notes;
}

// One rank's folder: its slices in safetensors file(s), the sidecars, and
// layout.json.
Result<std::vector<ViewFile>> MeshRankFiles(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                            const MeshSpec& spec, uint64_t rank, const ShardingRules& rules,
                                            const SliceList& slices, const std::vector<std::string>& notes,
                                            const ConsolidatedOptions& options, const DTypeView* dtype) {
  std::map<std::string, std::string> file_of;
  ASSIGN_OR_RETURN(std::vector<ViewFile> out,
                   HfFolderBySize(ckpt, files, slices, options.max_file_bytes, &file_of, dtype));
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (const TensorSlice& s : slices) Append(tensors, s.entry_name(), SliceJson(s, file_of[s.entry_name()]));
  const MeshCoord c = CoordOf(spec, rank);
  nlohmann::ordered_json layout = {{"mesh", spec.name},
                                   {"rank", rank},
                                   {"world_size", spec.world()},
                                   {"coords", {{"tp", c.tp}, {"pp", c.pp}, {"ep", c.ep}}},
                                   {"rules", rules.preset},
                                   {"notes", notes}};
  Append(layout, "tensors", std::move(tensors));
  Layout lj;
  lj.AddLiteral(layout.dump(2) + "\n");
  out.push_back({"layout.json", std::make_shared<const Layout>(std::move(lj)), ""});
  return out;
}

}  // namespace

Result<MeshFiles> MeshView(const Checkpoint& ckpt, const std::vector<SourceFile>& files, const MeshSpec& spec,
                           const ShardingRules& rules, const ConsolidatedOptions& options,
                           const DTypeView* dtype) {
  ASSIGN_OR_RETURN(SliceList weights, ModelWeights(ckpt, options));
  if (dtype) RETURN_IF_ERROR(CastSlices(weights, *dtype));
  std::vector<std::pair<std::string, Shape>> shapes;
  shapes.reserve(weights.size());
  for (const auto& w : weights) shapes.emplace_back(w.entry_name(), w.tensor->shape);
  const ModelCounts counts = CountModel(shapes);
  // Every tensor is placed (and the spec checked) before any file is built.
  std::vector<TensorPlacement> placements;
  placements.reserve(weights.size());
  for (const auto& w : weights) {
    auto p = PlaceTensor(w.tensor->shape, w.entry_name(), spec, rules, counts);
    if (!p.ok()) {
      // A head split refused on some tensor (k_proj sorts before q_proj) is
      // reported for the model: "tp3 does not divide num_attention_heads 4".
      const std::string& why = p.status().message();
      Status model = CheckHeads(spec, rules);
      bool heads = why.find("num_attention_heads") != std::string::npos ||
                   why.find("num_key_value_heads") != std::string::npos;
      return heads && !model.ok() ? model : p.status();
    }
    placements.push_back(std::move(*p));
  }
  MeshFiles out;
  out.notes = MeshNotes(spec, rules, placements);
  for (uint64_t rank = 0; rank < spec.world(); ++rank) {
    SliceList slices;
    for (size_t i = 0; i < weights.size(); ++i) {
      std::optional<RankSlice> r = SliceOf(placements[i], spec, rank);
      if (!r) continue;
      TensorSlice s{weights[i].tensor, r->boxes[0], weights[i].name, {}, 0, weights[i].cast};
      if (r->boxes.size() > 1) {
        s.joined = std::move(r->boxes);
        s.join_dim = r->join_dim;
      }
      slices.push_back(std::move(s));
    }
    ASSIGN_OR_RETURN(std::vector<ViewFile> rank_files, MeshRankFiles(ckpt, files, spec, rank, rules, slices,
                                                                     out.notes, options, dtype));
    out.ranks.push_back(std::move(rank_files));
  }
  return out;
}

std::string MeshReadme(const ShardingRules& rules) {
  std::string s =
      "mesh/ -- per-rank views of this checkpoint under a new parallel layout\n"
      "\n"
      "Open a directory named by a layout spec and it appears, for example:\n"
      "  ls mesh/tp4/                  rank-00000 .. rank-00003\n"
      "  mesh/tp2-pp2/rank-00003/      model.safetensors, layout.json, config.json, ...\n"
      "\n"
      "Spec: axes tp (tensor), pp (pipeline), ep (expert), each at most once, joined\n"
      "by '-': tp4, tp2-pp2, tp2-ep4. Ranks are numbered tp fastest, then ep, then pp:\n"
      "  rank = (pp_rank * ep + ep_rank) * tp + tp_rank\n"
      "\n"
      "Plain splits follow DTensor Shard semantics (torch.chunk sizes: ceil(n/parts)\n"
      "per rank, the last ranks smaller or empty). Attention heads are never cut:\n"
      "q_heads/kv_heads/qkv split in whole heads (num_attention_heads and\n"
      "num_key_value_heads from config.json); when tp exceeds the KV heads each KV\n"
      "head is replicated on tp/num_key_value_heads ranks, as vLLM loads it. Fused\n"
      "tensors (qkv, gate_up) are split per part and a rank's parts joined again.\n"
      "Pipeline stages take contiguous ranges of layers.<i>; embeddings go to the\n"
      "first stage, the final norm and lm_head to the last. Experts (experts.<e>.,\n"
      "or dim 0 of fused experts.gate_up_proj / experts.down_proj) go to ep ranks in\n"
      "contiguous blocks; tp then splits within each expert.\n"
      "\n"
      "layout.json in each rank folder gives every tensor's global shape and this\n"
      "rank's box (offsets, lengths; for a fused tensor its parts and join_dim), so a\n"
      "loader can check what it got; its \"notes\" say when a spec split nothing.\n"
      "An impossible spec (tp larger than a split dimension or not dividing the\n"
      "heads, an unknown axis) is ENOENT, with the reason in the log and in\n"
      "`ckptfs ls ROOT --mesh SPEC`.\n"
      "\n";
  if (!rules.unknown_model.empty()) s += "Nothing is split over tp: " + rules.unknown_model + ".\n\n";
  s += "Rules in use (" + rules.preset + "; first match wins, no match = replicated):\n";
  for (const auto& r : rules.rules)
    s += "  " + r.pattern + "  ->  " + SplitKindName(r.kind) +
         (r.kind == SplitKind::kDim ? " " + std::to_string(r.dim) : "") + (r.transposed ? " (stored [in, out])" : "") +
         (r.note.empty() ? "" : "\n      " + r.note) + "\n";
  s += "\nOverride or extend with `ckptfs mount --rules FILE` (JSON: {\"rules\": [{\"pattern\": REGEX,\n"
       "\"kind\": column|row|vocab|replicate|dim|q_heads|kv_heads|qkv|gate_up, \"dim\": N,\n"
       "\"transposed\": true for weights stored [in, out]}]}).\n";
  return s;
}

}  // namespace ckptfs
