// merged/: the base's HF folder with the adapter's tensors merged in
// (core/lora.h). The adapter's tensor names are PEFT's:
//   base_model.model.<module>.lora_A.weight / lora_B.weight / lora_B.bias
//   base_model.model.<module>.lora_embedding_A / lora_embedding_B
//   base_model.model.<module>.lora_magnitude_vector        (DoRA)
//   base_model.model.<module>.base_layer.<param>           (a saved base weight)
//   base_model.model.<name>                                (modules_to_save, bias="all")
//   base_model.model.<module>(.base_layer)*.lora_A.weight  (target_parameters:
//                                                           one per parameter)
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>

#include "core/box.h"
#include "core/cast.h"
#include "core/lora.h"

namespace ckptfs {
namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

// The LoRA tensors of one module.
struct ModuleParts {
  std::shared_ptr<const TensorMeta> a, b, bias, magnitude;
  bool embedding = false;
};

// Files of `base` first, unchanged; then those of `adapter`, shifted.
std::shared_ptr<const TensorMeta> Shifted(const TensorMeta& t, FileId by) {
  auto out = std::make_shared<TensorMeta>(t);
  for (Chunk& c : out->chunks) {
    ByteMeta bytes = c.bytes();
    bytes.file += by;
    c.set_bytes(bytes);
    if (c.item_check()) c.set_item_check(c.item_check()->Renumbered(by));
  }
  return out;
}

// Sorts the adapter's tensors into modules and whole-tensor replacements
// (name in the base -> tensor). Anything else is refused by name.
Status Classify(const std::vector<std::shared_ptr<const TensorMeta>>& tensors,
                std::map<std::string, ModuleParts>* modules,
                std::map<std::string, std::shared_ptr<const TensorMeta>>* replacements) {
  struct Suffix {
    const char* text;
    std::shared_ptr<const TensorMeta> ModuleParts::*part;
    bool embedding;
  };
  const Suffix suffixes[] = {
      {".lora_A.weight", &ModuleParts::a, false},         {".lora_B.weight", &ModuleParts::b, false},
      {".lora_B.bias", &ModuleParts::bias, false},        {".lora_embedding_A", &ModuleParts::a, true},
      {".lora_embedding_B", &ModuleParts::b, true},       {".lora_magnitude_vector", &ModuleParts::magnitude, false},
      {".lora_magnitude_vector.weight", &ModuleParts::magnitude, false}};
  for (const auto& t : tensors) {
    if (t->fqn.rfind(kPeftPrefix, 0) != 0)
      return Status::InvalidArgument("adapter tensor '" + t->fqn + "' is not named as PEFT names LoRA weights (" +
                                     kPeftPrefix + "<module>...); not merged");
    const std::string name = t->fqn.substr(std::string(kPeftPrefix).size());
    bool matched = false;
    for (const Suffix& s : suffixes) {
      if (!name.ends_with(s.text)) continue;
      ModuleParts& m = (*modules)[name.substr(0, name.size() - std::string(s.text).size())];
      m.*(s.part) = t;
      m.embedding = m.embedding || s.embedding;
      matched = true;
      break;
    }
    if (matched) continue;
    if (name.find(".lora_") != std::string::npos)
      return Status::InvalidArgument("adapter tensor '" + t->fqn + "' is a LoRA tensor this version does not merge");
    std::string target = name;
    if (const size_t at = name.find(".base_layer."); at != std::string::npos)
      target = name.substr(0, at) + name.substr(at + std::string(".base_layer").size());
    (*replacements)[target] = t;
  }
  return Status::OK();
}

}  // namespace

LoraMergeInput JoinAdapter(const Checkpoint& adapter, const Checkpoint& base, LoraConfig config) {
  LoraMergeInput in;
  in.config = std::move(config);
  Checkpoint& j = in.joined;
  j.dir = adapter.dir;
  j.format = base.format;
  j.files = base.files;
  j.tensors = base.tensors;
  j.sidecars = base.sidecars;
  j.file_index = base.file_index;
  j.incomplete = base.incomplete.empty() ? "" : "base " + (base.dir.empty() ? "." : base.dir) + ": " + base.incomplete;
  if (!adapter.incomplete.empty()) j.incomplete = "adapter: " + adapter.incomplete;
  const FileId shift = FileId(base.files.size());
  for (SourceFile f : adapter.files) {
    if (f.derived()) f.base += shift;
    j.files.push_back(std::move(f));
  }
  for (const auto& [name, id] : adapter.sidecars)
    if (name != kPeftConfigName) j.sidecars[name] = id + shift;
  for (const auto& t : adapter.tensors) in.adapter_tensors.push_back(Shifted(*t, shift));
  return in;
}

namespace {

// Whether ΔW is transposed. peft decides by the layer's type, whatever the
// config says (it sets fan_in_fan_out to False for a Linear, True for a
// Conv1D), and the type shows in W's shape unless W is square: Linear W is
// [out, in] = [B rows, A cols], Conv1D's [in, out]. A square W keeps the
// config's flag, which peft leaves as its layers' type makes it.
bool Transposed(const ModuleParts& m, const TensorMeta& w, const LoraConfig& config) {
  if (m.embedding) return true;
  const Shape &ws = w.shape, &a = m.a->shape, &b = m.b->shape;
  if (ws.size() != 2 || a.size() != 2 || b.size() != 2) return config.fan_in_fan_out;
  const bool plain = ws[0] == b[0] && ws[1] == a[1];
  const bool transposed = ws[0] == a[1] && ws[1] == b[0];
  return plain == transposed ? config.fan_in_fan_out : transposed;
}

// A LoRA factor is 2-d and non-empty. An empty or 1-d one is what a save
// writes from parameters it did not gather: DeepSpeed ZeRO-3 and FSDP leave
// each rank an empty placeholder or a flat slice (peft warns about the same
// shapes when it saves them). Said before the rank and shape checks, whose
// messages would point at the config or the base instead.
Status CheckGathered(const ModuleParts& m) {
  for (const auto* f : {&m.a, &m.b}) {
    const Shape& s = (*f)->shape;
    if (s.size() == 2 && s[0] > 0 && s[1] > 0) continue;
    return Status::InvalidArgument(
        "adapter tensor '" + (*f)->fqn + "' is " + ShapeToString(s) +
        ", not a 2-d LoRA factor: the adapter was saved from parameters FSDP or DeepSpeed ZeRO-3 had not gathered; "
        "save it again from the gathered state dict (FSDP2: get_model_state_dict(model, "
        "options=StateDictOptions(full_state_dict=True)), then PeftModel.save_pretrained(dir, state_dict=...) on "
        "rank 0; ZeRO-3: inside deepspeed.zero.GatheredParameters)");
  }
  return Status::OK();
}

// One module's merged weight (and bias) into its slices of `slices`.
Status MergeModule(const std::string& module, const ModuleParts& m, const LoraConfig& config,
                   const std::unordered_map<std::string, size_t>& index, SliceList& slices) {
  const std::string weight = module + ".weight";
  if (!m.a || !m.b)
    return Status::InvalidArgument("adapter module '" + module + "' has " + (m.a ? "lora_A" : "lora_B") +
                                   " without its other half; not merged");
  RETURN_IF_ERROR(CheckGathered(m));
  auto it = index.find(weight);
  if (it == index.end())
    return Status::InvalidArgument("adapter tensor '" + m.b->fqn + "' targets '" + weight +
                                   "', which the base does not have; is base_model_name_or_path the model this "
                                   "adapter was trained on?");
  if (m.magnitude && !config.use_dora)
    return Status::InvalidArgument("adapter tensor '" + m.magnitude->fqn + "' is DoRA's, but use_dora is false");
  if (!m.magnitude && config.use_dora)
    return Status::InvalidArgument("use_dora is true but module '" + module + "' has no lora_magnitude_vector");
  const double r = LoraRank(config, module);
  if (m.a->shape.empty() || double(m.a->shape[0]) != r)
    return Status::InvalidArgument("adapter tensor '" + m.a->fqn + "' has rank " +
                                   (m.a->shape.empty() ? std::string("?") : std::to_string(m.a->shape[0])) +
                                   " but adapter_config.json gives r = " + std::to_string(r) + " for '" + module + "'");
  const double scaling = LoraScaling(config, module);
  TensorSlice& w = slices[it->second];
  LoraTerm term{w.tensor, m.a, m.b, m.magnitude, scaling, Transposed(m, *w.tensor, config)};
  ASSIGN_OR_RETURN(w.computed, MakeLoraMerge(std::move(term), w.cast.value_or(w.tensor->dtype)));
  w.cast = w.computed->dtype();
  if (!m.bias) return Status::OK();
  auto bias = index.find(module + ".bias");
  if (bias == index.end())
    return Status::InvalidArgument("adapter tensor '" + m.bias->fqn + "' is a LoRA bias, but the base has no '" +
                                   module + ".bias'");
  TensorSlice& bs = slices[bias->second];
  ASSIGN_OR_RETURN(bs.computed, MakeLoraMerge({bs.tensor, nullptr, m.bias, nullptr, scaling, false},
                                              bs.cast.value_or(bs.tensor->dtype)));
  bs.cast = bs.computed->dtype();
  return Status::OK();
}

// peft's strip_base_layer_from_name: the module's name in the base model
// (a nested ParamWrapper's factors are under "<module>.base_layer...").
std::string Unwrapped(std::string module) {
  static const std::string kBase = ".base_layer";
  for (size_t at; (at = module.rfind(kBase)) != std::string::npos;) module.erase(at, kBase.size());
  return module;
}

// A targeted parameter as the model holds it, and where the base stores it:
// whole, or per expert, as transformers 5 saves fused experts.
struct ParamTarget {
  std::string name;  // "<module>.<param>": peft's key for rank_pattern / alpha_pattern
  Shape shape;       // the model's parameter
  size_t slice = 0;  // the base tensor holding it whole, when `pieces` is empty
  struct Piece {
    size_t slice;
    uint64_t expert, row0;  // rows row0 .. of expert `expert`'s [out, in]
  };
  std::vector<Piece> pieces;
};

// How transformers 5 splits a fused parameter on save (conversion_mapping.py):
// `<module>.gate_up_proj` [E, 2I, H] into `<module>.<e>.gate_proj.weight` and
// `up_proj` ([I, H] each, gate first), `down_proj` [E, H, I] into
// `<module>.<e>.down_proj.weight` (Qwen2/3-MoE, DeepSeek-V2/3, OLMoE, GLM-4
// MoE, ...); Mixtral's `w1`/`w3`, `w2` under `block_sparse_moe`.
struct SplitNaming {
  const char* fused;
  const char *from, *to;  // module-name rename, the model's to the file's
  std::vector<const char*> parts;
};
const SplitNaming kSplits[] = {{"gate_up_proj", "", "", {"gate_proj", "up_proj"}},
                               {"down_proj", "", "", {"down_proj"}},
                               {"gate_up_proj", ".mlp.", ".block_sparse_moe.", {"w1", "w3"}},
                               {"down_proj", ".mlp.", ".block_sparse_moe.", {"w2"}}};

// `owner`'s parameter `split.fused` from its per-expert parts, if the base
// has all of them (experts 0, 1, ... each with every part, of one width).
std::optional<ParamTarget> SplitTarget(const std::string& owner, const SplitNaming& split, const SliceList& slices,
                                       const std::unordered_map<std::string, size_t>& index) {
  std::string stored = owner;
  if (*split.from) {
    const size_t at = stored.find(split.from);
    if (at == std::string::npos) return std::nullopt;
    stored.replace(at, std::strlen(split.from), split.to);
  }
  ParamTarget t;
  t.name = owner + "." + split.fused;
  uint64_t rows = 0, cols = 0;
  for (uint64_t e = 0;; ++e) {
    uint64_t row0 = 0;
    for (size_t i = 0; i < split.parts.size(); ++i) {
      auto it = index.find(stored + "." + std::to_string(e) + "." + split.parts[i] + ".weight");
      if (it == index.end()) {
        if (i == 0 && e > 0 && !t.pieces.empty()) {
          t.shape = {e, rows, cols};
          return t;
        }
        return std::nullopt;
      }
      const Shape& s = slices[it->second].tensor->shape;
      if (s.size() != 2 || (cols && s[1] != cols)) return std::nullopt;
      cols = s[1];
      t.pieces.push_back({it->second, e, row0});
      row0 += s[0];
    }
    if (e > 0 && row0 != rows) return std::nullopt;
    rows = row0;
  }
}

// peft's _inject_parameters: `name` ("<module>.<param>") is targeted when it
// is a target or ends in "." + one.
bool Targeted(const std::string& name, const LoraConfig& config) {
  for (const std::string& t : config.target_parameters)
    if (name == t || name.ends_with("." + t)) return true;
  return false;
}

// The base tensors peft would target, by module: "<module>" -> slice indices.
std::map<std::string, std::vector<size_t>> TargetedTensors(const LoraConfig& config,
                                                           const std::unordered_map<std::string, size_t>& index) {
  std::map<std::string, std::vector<size_t>> out;
  for (const auto& [name, i] : index)
    if (const size_t dot = name.rfind('.'); dot != std::string::npos && Targeted(name, config))
      out[name.substr(0, dot)].push_back(i);
  return out;
}

// The targeted parameters of module `owner`: tensors of the base (`direct`,
// TargetedTensors'), and fused experts the base stores per expert.
std::vector<ParamTarget> TargetsOf(const std::string& owner, const LoraConfig& config, const SliceList& slices,
                                   const std::unordered_map<std::string, size_t>& index,
                                   const std::map<std::string, std::vector<size_t>>& direct) {
  std::vector<ParamTarget> out;
  if (auto it = direct.find(owner); it != direct.end())
    for (size_t i : it->second) out.push_back({slices[i].entry_name(), slices[i].tensor->shape, i, {}});
  for (const SplitNaming& split : kSplits) {
    const std::string name = owner + "." + split.fused;
    if (!Targeted(name, config) || index.count(name)) continue;
    if (auto t = SplitTarget(owner, split, slices, index)) out.push_back(std::move(*t));
  }
  return out;
}

// Whether a wrapper's factors fit parameter shape `w` with rank `r` as peft
// lays them out (lora.h): as [E, out, in] (*plain) or [E, in, out] (*transposed).
bool Fits(const ModuleParts& m, const Shape& w, double r, bool* plain, bool* transposed) {
  const Shape &a = m.a->shape, &b = m.b->shape;
  const uint64_t experts = w.size() == 3 ? w[0] : 1;
  if (a.size() != 2 || b.size() != 2 || (w.size() != 2 && w.size() != 3) || double(a[0]) != r * double(experts) ||
      b[1] != a[0])
    return false;
  const uint64_t d1 = w[w.size() - 2], d2 = w[w.size() - 1];
  *plain = b[0] == d1 && a[1] == d2;
  *transposed = w.size() == 3 && a[1] == d1 && b[0] == d2;
  return *plain || *transposed;
}

// The merge of parameter `t` with wrapper `m` into its slices.
Status MergeParameter(const ParamTarget& t, const ModuleParts& m, const LoraMergeInput& in, bool plain,
                      bool transposed, SliceList& slices) {
  const double r = LoraRank(in.config, t.name), scaling = LoraScaling(in.config, t.name);
  auto merge = [&](TensorSlice& w, LoraExpertTerm term) -> Status {
    const DType to = w.cast.value_or(w.tensor->dtype);
    term.base = w.tensor;
    ASSIGN_OR_RETURN(w.computed, MakeLoraExpertMerge(std::move(term), to));
    w.cast = to;
    return Status::OK();
  };
  if (t.shape.size() == 2) {  // ParamWrapper with one expert: a Linear's merge
    TensorSlice& w = slices[t.slice];
    const DType to = w.cast.value_or(w.tensor->dtype);
    ASSIGN_OR_RETURN(w.computed, MakeLoraMerge({w.tensor, m.a, m.b, nullptr, scaling, false}, to));
    w.cast = to;
    return Status::OK();
  }
  if (!t.pieces.empty()) {  // per-expert Linear weights: [E, out, in] by construction
    if (!plain)
      return Status::InvalidArgument("adapter tensor '" + m.a->fqn + "' fits '" + t.name + "' " +
                                     ShapeToString(t.shape) + " only as [E, in, out], which its per-expert weights "
                                     "are not");
    for (const ParamTarget::Piece& p : t.pieces)
      RETURN_IF_ERROR(merge(slices[p.slice], {nullptr, m.a, m.b, scaling, uint64_t(r), false, t.shape[0], p.expert,
                                              p.row0}));
    return Status::OK();
  }
  if (plain && transposed) {  // [E, d, d]: the model's type says
    if (in.base_model_type.empty())
      return Status::InvalidArgument("expert parameter '" + t.name + "' is " + ShapeToString(t.shape) +
                                     ": whether it is stored [E, in, out] or [E, out, in] is the model's, and the base "
                                     "has no config.json stating its model_type");
    transposed = ExpertsTransposed(in.base_model_type);
  }
  if (transposed && t.shape[0] == 1)
    return Status::NotSupported("expert parameter '" + t.name + "' holds one expert stored [1, in, out]: peft merges "
                                "it as a Linear, which this does not reproduce; merge it with peft's "
                                "PeftModel.merge_and_unload()");
  return merge(slices[t.slice], {nullptr, m.a, m.b, scaling, uint64_t(r), transposed, t.shape[0], 0, 0});
}

// The one targeted parameter of `targets` the wrapper `m` fits.
Result<const ParamTarget*> FittingTarget(const std::string& owner, const ModuleParts& m,
                                         const std::vector<ParamTarget>& targets, const LoraConfig& config,
                                         bool* plain, bool* transposed) {
  const ParamTarget* found = nullptr;
  for (const ParamTarget& t : targets) {
    bool p = false, tr = false;
    if (!Fits(m, t.shape, LoraRank(config, t.name), &p, &tr)) continue;
    if (found)
      return Status::InvalidArgument("adapter tensor '" + m.a->fqn + "' fits both '" + found->name + "' and '" +
                                     t.name + "' (target_parameters); which one peft wrapped is not in the file");
    found = &t;
    *plain = p;
    *transposed = tr;
  }
  if (!found)
    return Status::InvalidArgument("adapter tensor '" + m.a->fqn + "' " + ShapeToString(m.a->shape) + " (lora_B " +
                                   ShapeToString(m.b->shape) + ") fits none of the targeted parameters of '" + owner +
                                   "' at the rank adapter_config.json gives; is base_model_name_or_path the model "
                                   "this adapter was trained on?");
  return found;
}

// The wrappers of target_parameters (taken out of `modules`), each merged
// into the one targeted parameter of its module its factors fit.
Status MergeParameters(const LoraMergeInput& in, const std::unordered_map<std::string, size_t>& index,
                       std::map<std::string, ModuleParts>* modules, SliceList& slices) {
  if (in.config.target_parameters.empty()) return Status::OK();
  const auto direct = TargetedTensors(in.config, index);
  std::map<std::string, std::string> merged;  // parameter -> the adapter tensor merged into it
  for (auto it = modules->begin(); it != modules->end();) {
    const std::string owner = Unwrapped(it->first);
    const std::vector<ParamTarget> targets = TargetsOf(owner, in.config, slices, index, direct);
    if (targets.empty() || it->second.embedding) {
      ++it;
      continue;
    }
    const ModuleParts& m = it->second;
    if (!m.a || !m.b)
      return Status::InvalidArgument("adapter module '" + it->first + "' has " + (m.a ? "lora_A" : "lora_B") +
                                     " without its other half; not merged");
    if (m.bias || m.magnitude)
      return Status::InvalidArgument("adapter tensor '" + (m.bias ? m.bias : m.magnitude)->fqn +
                                     "' is a lora_bias or DoRA tensor, which peft's target_parameters do not have");
    RETURN_IF_ERROR(CheckGathered(m));
    bool plain = false, transposed = false;
    ASSIGN_OR_RETURN(const ParamTarget* t, FittingTarget(owner, m, targets, in.config, &plain, &transposed));
    if (auto twice = merged.find(t->name); twice != merged.end())
      return Status::InvalidArgument("adapter tensors '" + twice->second + "' and '" + m.a->fqn + "' both fit '" +
                                     t->name + "' and no other targeted parameter; not merged");
    merged[t->name] = m.a->fqn;
    RETURN_IF_ERROR(MergeParameter(*t, m, in, plain, transposed, slices));
    it = modules->erase(it);
  }
  return Status::OK();
}

}  // namespace

Result<std::vector<ViewFile>> MergedView(const LoraMergeInput& in, const ConsolidatedOptions& options,
                                         const DTypeView* dtype) {
  ASSIGN_OR_RETURN(SliceList slices, ModelWeights(in.joined, options));
  std::unordered_map<std::string, size_t> index;
  for (size_t i = 0; i < slices.size(); ++i) index[slices[i].entry_name()] = i;
  std::map<std::string, ModuleParts> modules;
  std::map<std::string, std::shared_ptr<const TensorMeta>> replacements;
  RETURN_IF_ERROR(Classify(in.adapter_tensors, &modules, &replacements));
  for (const auto& [name, t] : replacements) {
    auto it = index.find(name);
    if (it == index.end())
      return Status::InvalidArgument("adapter tensor '" + t->fqn + "' replaces '" + name +
                                     "', which the base does not have; not merged");
    if (t->shape != slices[it->second].tensor->shape)
      return Status::InvalidArgument("adapter tensor '" + t->fqn + "' has another shape than base tensor '" + name +
                                     "' it replaces");
    slices[it->second].name = name;  // the base's name, not the adapter's
    slices[it->second].tensor = t;
  }
  if (dtype) RETURN_IF_ERROR(CastSlices(slices, *dtype));
  RETURN_IF_ERROR(MergeParameters(in, index, &modules, slices));
  for (const auto& [module, parts] : modules) RETURN_IF_ERROR(MergeModule(module, parts, in.config, index, slices));
  return HfFolderOf(in.joined, in.joined.files, slices, options, dtype);
}

}  // namespace ckptfs
