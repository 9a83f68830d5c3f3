#include "core/views.h"

#include <cstdio>
#include <map>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"

namespace ckptfs {
namespace {

using TensorList = std::vector<std::shared_ptr<const TensorMeta>>;

const std::map<std::string, std::string> kHfMetadata = {{"format", "pt"}};

// Groups tensors into output files: by the checkpoint's own mapping when it
// has one, else greedily in name order, starting a new file when the next
// tensor would pass max_file_bytes or the header cap.
Result<std::vector<TensorList>> SplitIntoFiles(const Checkpoint& ckpt, const ConsolidatedOptions& o) {
  std::vector<TensorList> groups;
  if (!ckpt.file_index.empty()) {
    int max_index = 0;
    for (const auto& [fqn, idx] : ckpt.file_index) max_index = std::max(max_index, idx);
    groups.resize(max_index);
    for (const auto& t : ckpt.tensors) {
      auto it = ckpt.file_index.find(t->fqn);
      if (it == ckpt.file_index.end())
        return Status::InvalidArgument("fqn_to_file_index_mapping.json has no entry for tensor '" +
                                       t->fqn + "'");
      if (it->second < 1)
        return Status::InvalidArgument("fqn_to_file_index_mapping.json maps '" + t->fqn +
                                       "' to file index " + std::to_string(it->second) +
                                       " (indices start at 1)");
      groups[it->second - 1].push_back(t);
    }
    return groups;
  }
  uint64_t bytes = 0;
  for (const auto& t : ckpt.tensors) {
    bool start_new = groups.empty();
    if (!start_new && bytes > 0 && bytes + t->nbytes() > o.max_file_bytes) start_new = true;
    if (!start_new) {
      // Header growth is ~100 bytes a tensor; only recompute near the cap.
      uint64_t approx = 128 * (groups.back().size() + 1) + t->fqn.size() * 2;
      if (approx > kMaxSafetensorsHeader / 2) {
        TensorList probe = groups.back();
        probe.push_back(t);
        if (SafetensorsHeaderSize(probe, kHfMetadata) > kMaxSafetensorsHeader) start_new = true;
      }
    }
    if (start_new) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(t);
    bytes += t->nbytes();
  }
  return groups;
}

std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

}  // namespace

Result<std::vector<ViewFile>> ConsolidatedView(const Checkpoint& ckpt,
                                               const std::vector<SourceFile>& files,
                                               const ConsolidatedOptions& options) {
  ASSIGN_OR_RETURN(auto groups, SplitIntoFiles(ckpt, options));
  std::vector<ViewFile> out;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total = 0;
  std::map<std::string, std::string> names;  // fqn -> file, sorted for the index
  for (size_t i = 0; i < groups.size(); ++i) {
    TensorList list = groups[i];
    SortForSafetensors(list);
    ASSIGN_OR_RETURN(Layout layout, SafetensorsFileLayout(list, kHfMetadata));
    std::string name = groups.size() == 1 ? "model.safetensors" : ShardName(i, groups.size());
    for (const auto& t : list) {
      names[t->fqn] = name;
      total += t->nbytes();
    }
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ckpt.incomplete});
  }
  if (groups.size() > 1) {
    for (const auto& [fqn, file] : names) weight_map[fqn] = file;
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    Layout layout;
    layout.AddLiteral(index.dump(2) + "\n");
    out.push_back({"model.safetensors.index.json", std::make_shared<const Layout>(std::move(layout)),
                   ckpt.incomplete});
  }
  for (const auto& [name, id] : ckpt.sidecars) {
    Layout layout;
    layout.AddSource(id, 0, files.at(id).size);
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ""});
  }
  return out;
}

}  // namespace ckptfs
