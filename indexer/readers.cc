// Helpers the format readers share (indexer/readers.h).
#include "indexer/readers.h"

#include <unistd.h>

#include <set>

#include <nlohmann/json.hpp>

#include "core/coverage.h"
#include "indexer/posix_io.h"

namespace ckptfs {
namespace {

// Config and tokenizer files a Hugging Face folder carries next to weights.
const char* const kSidecarNames[] = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json"};

}  // namespace

std::string JoinPath(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

void AddProblem(Checkpoint& out, const std::string& message, bool incomplete) {
  out.problems.push_back(message);
  if (incomplete && out.incomplete.empty()) out.incomplete = message;
}

std::vector<uint64_t> NormalizeStrides(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& strides) {
  auto rm = RowMajorStrides(shape);
  for (size_t d = 0; d < shape.size(); ++d)
    if (shape[d] > 1 && strides[d] != rm[d]) return strides;
  return {};
}

std::vector<std::string> IndexedFiles(const DirListing& dir, const std::string& index_name, Checkpoint& out,
                                      std::map<std::string, std::string>* weight_map) {
  auto text = ReadWholeFile(dir.abs + "/" + index_name);
  auto j = text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    AddProblem(out, JoinPath(dir.rel, index_name) + ": no weight_map object", true);
    return {};
  }
  std::set<std::string> unique;
  for (auto& [fqn, f] : j["weight_map"].items()) {
    if (!f.is_string()) continue;
    if (weight_map) (*weight_map)[fqn] = f.get<std::string>();
    unique.insert(f.get<std::string>());
  }
  return {unique.begin(), unique.end()};
}

void FinishTensors(std::map<std::string, TensorMeta>& tensors, Checkpoint& out) {
  for (auto& [fqn, t] : tensors) {
    DropReplicas(t);
    for (const std::string& p : CheckCoverage(t)) t.problem += (t.problem.empty() ? "" : "; ") + p;
    if (!t.problem.empty()) out.problems.push_back(t.problem);
    out.tensors.push_back(std::make_shared<const TensorMeta>(std::move(t)));
  }
  tensors.clear();
}

void AddSidecarFiles(const DirListing& dir, FileTable& files, Checkpoint& out) {
  // NeMo keeps them in .hf_metadata/; a plain folder keeps them beside the weights.
  const std::string meta_rel = JoinPath(dir.rel, ".hf_metadata");
  for (const char* name : kSidecarNames) {
    for (const std::string& rel : {JoinPath(meta_rel, name), JoinPath(dir.rel, name)}) {
      if (::access((files.root() + "/" + rel).c_str(), R_OK) != 0) continue;
      auto id = files.Add(rel);
      if (id.ok()) out.sidecars[name] = *id;
      break;
    }
  }
}

}  // namespace ckptfs
