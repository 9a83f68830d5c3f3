// merged/: the base's HF folder with the adapter's tensors merged in
// (core/lora.h). The adapter's tensor names are PEFT's:
//   base_model.model.<module>.lora_A.weight / lora_B.weight / lora_B.bias
//   base_model.model.<module>.lora_embedding_A / lora_embedding_B
//   base_model.model.<module>.lora_magnitude_vector        (DoRA)
//   base_model.model.<module>.base_layer.<param>           (a saved base weight)
//   base_model.model.<name>                                (modules_to_save, bias="all")
#include <map>
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

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Files of `base` first, unchanged; then those of `adapter`, shifted.
std::shared_ptr<const TensorMeta> Shifted(const TensorMeta& t, FileId by) {
  auto out = std::make_shared<TensorMeta>(t);
  for (Chunk& c : out->chunks) {
    ByteMeta bytes = c.bytes();
    bytes.file += by;
    c.set_bytes(bytes);
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
      if (!EndsWith(name, s.text)) continue;
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
  for (const auto& [module, parts] : modules) RETURN_IF_ERROR(MergeModule(module, parts, in.config, index, slices));
  return HfFolderOf(in.joined, in.joined.files, slices, options, dtype);
}

}  // namespace ckptfs
