#include "core/hf_folder.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/cast.h"
#include "core/convert.h"
#include "core/safetensors.h"

namespace ckptfs {
namespace {

const std::map<std::string, std::string> kHfMetadata = {{"format", "pt"}};

// Groups slices into files greedily in the given order, starting a new file
// when the next slice would pass max_file_bytes or the header cap.
std::vector<SliceList> SplitBySize(const SliceList& slices, uint64_t max_file_bytes) {
  std::vector<SliceList> groups;
  uint64_t bytes = 0;
  for (const TensorSlice& s : slices) {
    bool start_new = groups.empty();
    if (!start_new && bytes > 0 && bytes + s.nbytes() > max_file_bytes) start_new = true;
    if (!start_new) {
      // Header growth is ~100 bytes a tensor; only recompute near the cap.
      uint64_t approx = 128 * (groups.back().size() + 1) + s.entry_name().size() * 2;
      if (approx > kMaxSafetensorsHeader / 2) {
        SliceList probe = groups.back();
        probe.push_back(s);
        if (SafetensorsHeaderSize(probe, kHfMetadata) > kMaxSafetensorsHeader) start_new = true;
      }
    }
    if (start_new) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(s);
    bytes += s.nbytes();
  }
  return groups;
}

// Groups by the checkpoint's own {fqn: 1-based file index} mapping.
Result<std::vector<SliceList>> SplitByMapping(const SliceList& slices, const std::map<std::string, int>& mapping) {
  int max_index = 0;
  for (const auto& [fqn, idx] : mapping) max_index = std::max(max_index, idx);
  std::vector<SliceList> groups(max_index);
  for (const TensorSlice& s : slices) {
    auto it = mapping.find(s.entry_name());
    if (it == mapping.end())
      return Status::InvalidArgument("fqn_to_file_index_mapping.json has no entry for tensor '" + s.entry_name() + "'");
    if (it->second < 1)
      return Status::InvalidArgument("fqn_to_file_index_mapping.json maps '" + s.entry_name() + "' to file index " +
                                     std::to_string(it->second) + " (indices start at 1)");
    groups[it->second - 1].push_back(s);
  }
  return groups;
}

std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// Why no byte of `s` can be read ("" when some can): the tensor's own
// problem, or an unavailable chunk under every one of its boxes.
std::string Unservable(const TensorSlice& s) {
  if (!s.tensor->problem.empty()) return s.tensor->problem;
  std::string why;
  for (const Box& b : s.joined.empty() ? std::vector<Box>{s.box} : s.joined) {
    if (b.empty()) continue;
    bool readable = true;
    for (const Chunk& c : s.tensor->chunks)
      if (!c.unavailable().empty() && Intersect(c.box(), b)) {
        readable = false;
        if (why.empty()) why = c.unavailable();
      }
    if (readable) return "";
  }
  return why;
}

// A weight file none of whose tensors can be served is refused at open
// (EIO): safetensors maps files, and a read error under a mapping is a bus
// error that kills the process, where a failed open is a Python exception.
std::string FileProblem(const SliceList& list, const Checkpoint& ckpt) {
  if (!ckpt.incomplete.empty()) return "checkpoint incomplete: " + ckpt.incomplete;
  std::string first;
  for (const TensorSlice& s : list) {
    std::string why = Unservable(s);
    if (why.empty()) return "";
    if (first.empty()) first = "tensor '" + s.entry_name() + "': " + why;
  }
  if (list.empty()) return "";
  return "none of its " + std::to_string(list.size()) + " tensors can be served (" + first + ")";
}

// Safetensors files (+ index.json when more than one) for `groups`, then
// the sidecars. Fills *file_of (fqn -> file name) when given. A PEFT adapter
// keeps its weights in one file named as peft names it: peft reads no other
// name and no sharded adapter.
Result<std::vector<ViewFile>> HfFolder(const std::vector<SliceList>& groups, const Checkpoint& ckpt,
                                       const std::vector<SourceFile>& files,
                                       std::map<std::string, std::string>* file_of = nullptr,
                                       const DTypeView* dtype = nullptr) {
  const bool adapter = IsPeftAdapter(ckpt);
  if (adapter && groups.size() > 1)
    return Status::NotSupported("a PEFT adapter's weights must fit one adapter_model.safetensors (peft reads no "
                                "sharded adapter); these would take " + std::to_string(groups.size()) +
                                " files: raise --max-file-size");
  std::vector<ViewFile> out;
  uint64_t total = 0;
  std::map<std::string, std::string> names;  // fqn -> file, sorted for the index
  for (size_t i = 0; i < groups.size(); ++i) {
    SliceList list = groups[i];
    SortForSafetensors(list);
    ASSIGN_OR_RETURN(Layout layout, SafetensorsFileLayout(list, kHfMetadata));
    std::string name = adapter ? kPeftWeightsName
                       : groups.size() == 1 ? "model.safetensors" : ShardName(i, groups.size());
    for (const TensorSlice& s : list) {
      names.emplace_hint(names.end(), s.entry_name(), name);
      total += s.nbytes();
    }
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), FileProblem(list, ckpt)});
  }
  if (groups.size() > 1) {
    // nlohmann::json keeps keys sorted (a std::map): "metadata" before
    // "weight_map", names in order, each insert O(log n). ordered_json would
    // search linearly on every insert.
    nlohmann::json weight_map = nlohmann::json::object();
    for (const auto& [fqn, file] : names) weight_map.emplace(fqn, file);
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
    Layout layout;
    layout.AddLiteral(index.dump(2) + "\n");
    out.push_back({"model.safetensors.index.json", std::make_shared<const Layout>(std::move(layout)),
                   ckpt.incomplete.empty() ? "" : "checkpoint incomplete: " + ckpt.incomplete});
  }
  for (const auto& [name, id] : ckpt.sidecars) {
    Layout layout;
    if (dtype && name == "config.json") {
      ASSIGN_OR_RETURN(std::string text, ConfigForDType(dtype->config_json, dtype->to));
      layout.AddLiteral(std::move(text));
      out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ""});
      continue;
    }
    layout.AddSource(id, 0, files.at(id).size);
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ""});
  }
  if (file_of) *file_of = std::move(names);
  return out;
}

const char* const kModelKeys[] = {"model", "module", "model_state_dict", "state_dict"};
const char* const kTrainingStateKeys[] = {
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state_dict", "optim_state_dict",
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "dataloader", "data_loader", "dataloaders",
    "sampler", "rng", "rng_state", "rng_states", "rng_tracker_states", "random_state", "scaler", "grad_scaler",
    "trainer", "train_state", "args", "extra_state", "iteration", "step", "epoch", "checkpoint_version"};

std::vector<std::string> KeyPath(const TensorMeta& t) {
  return t.path.empty() ? std::vector<std::string>{t.fqn} : t.path;
}

// The first component of a flat name: "optim" in "optim.state.w.exp_avg".
std::string TopKey(const TensorMeta& t) {
  auto path = KeyPath(t);
  if (path.size() > 1) return path[0];
  return path[0].substr(0, path[0].find('.'));
}

}  // namespace

bool IsPeftAdapter(const Checkpoint& ckpt) { return ckpt.sidecars.count(kPeftConfigName) > 0; }

Result<SliceList> ModelWeights(const Checkpoint& ckpt, const ConsolidatedOptions& options) {
  SliceList out;
  std::map<std::string, std::string> seen;  // name -> fqn
  auto add = [&](const std::shared_ptr<const TensorMeta>& t, std::string name) -> Status {
    if (auto [it, fresh] = seen.emplace(name, t->fqn); !fresh)
      return Status::InvalidArgument("tensors '" + it->second + "' and '" + t->fqn + "' would both be named '" + name +
                                     "' in consolidated/ (pass --names FILE to choose)");
    TensorSlice s = TensorSlice::Whole(t);
    if (name != t->fqn) s.name = std::move(name);
    out.push_back(std::move(s));
    return Status::OK();
  };
  if (!options.names.empty()) {
    for (const auto& t : ckpt.tensors)
      if (auto it = options.names.find(t->fqn); it != options.names.end()) RETURN_IF_ERROR(add(t, it->second));
    return out;
  }
  std::set<std::string> tops;
  for (const auto& t : ckpt.tensors)
    if (KeyPath(*t).size() > 1) tops.insert(KeyPath(*t)[0]);
  for (const char* key : kModelKeys) {
    if (!tops.count(key)) continue;
    for (const auto& t : ckpt.tensors) {
      auto path = KeyPath(*t);
      if (path.size() < 2 || path[0] != key) continue;
      std::string name;
      for (size_t i = 1; i < path.size(); ++i) name += (i > 1 ? "." : "") + path[i];
      RETURN_IF_ERROR(add(t, name));
    }
    return out;
  }
  for (const auto& t : ckpt.tensors) {
    std::string top = TopKey(*t);
    bool training = std::find(std::begin(kTrainingStateKeys), std::end(kTrainingStateKeys), top) !=
                    std::end(kTrainingStateKeys);
    if (training) continue;
    std::string name;
    for (const std::string& part : KeyPath(*t)) name += (name.empty() ? "" : ".") + part;
    RETURN_IF_ERROR(add(t, name));
  }
  return out;
}

Status CastSlices(SliceList& slices, const DTypeView& view) {
  std::regex keep;
  try {
    if (!view.keep.empty()) keep = std::regex(view.keep);
  } catch (const std::regex_error& e) {
    return Status::InvalidArgument("--keep-dtype '" + view.keep + "' is not a valid regular expression: " + e.what());
  }
  for (TensorSlice& s : slices) {
    const DType from = s.tensor->dtype;
    if (!IsCastable(from) || from == view.to) continue;
    if (!view.keep.empty() && std::regex_search(s.entry_name(), keep)) continue;
    s.cast = view.to;  // a computed slice (a LoRA merge) is then stored as `to`
  }
  return Status::OK();
}

Result<std::string> ConfigForDType(const std::string& config_json, DType to) {
  auto j = nlohmann::ordered_json::parse(config_json, nullptr, false);
  if (!j.is_object()) return Status::InvalidArgument("config.json is not a JSON object; cannot name the served dtype");
  const std::string name(TorchDTypeName(to));
  j["dtype"] = name;
  if (j.contains("torch_dtype")) j["torch_dtype"] = name;
  // Composite models (text_config, vision_config) carry their own.
  for (auto& [key, sub] : j.items())
    if (sub.is_object())
      for (const char* field : {"dtype", "torch_dtype"})
        if (sub.contains(field)) sub[field] = name;
  return j.dump(2) + "\n";
}

Result<std::vector<ViewFile>> ConsolidatedView(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                               const ConsolidatedOptions& options, const DTypeView* dtype) {
  ASSIGN_OR_RETURN(SliceList slices, ModelWeights(ckpt, options));
  if (dtype) RETURN_IF_ERROR(CastSlices(slices, *dtype));
  return HfFolderOf(ckpt, files, slices, options, dtype);
}

Result<std::vector<ViewFile>> HfFolderOf(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                         const SliceList& slices, const ConsolidatedOptions& options,
                                         const DTypeView* dtype) {
  std::vector<SliceList> groups;
  if (!ckpt.file_index.empty()) {
    ASSIGN_OR_RETURN(groups, SplitByMapping(slices, ckpt.file_index));
  } else {
    groups = SplitBySize(slices, options.max_file_bytes);
  }
  return HfFolder(groups, ckpt, files, nullptr, dtype);
}

Result<std::vector<ViewFile>> HfFolderBySize(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                             const SliceList& slices, uint64_t max_file_bytes,
                                             std::map<std::string, std::string>* file_of, const DTypeView* dtype) {
  return HfFolder(SplitBySize(slices, max_file_bytes), ckpt, files, file_of, dtype);
}

}  // namespace ckptfs
