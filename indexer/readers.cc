// Helpers the format readers share (indexer/readers.h).
#include "indexer/readers.h"

#include <algorithm>

#include <set>

#include <nlohmann/json.hpp>

#include "core/coverage.h"

namespace ckptfs {
namespace {

// Files that are weights (of this or another framework) or describe how the
// shards were cut: consolidated/ serves its own weights and index instead.
bool IsWeightOrShardIndex(const std::string& name) {
  static const char* const kWeightSuffixes[] = {".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp",
                                                ".h5", ".msgpack", ".gguf", ".index.json"};
  for (const char* suffix : kWeightSuffixes)
    if (name.ends_with(suffix)) return true;
  return name == "fqn_to_file_index_mapping.json";
}

// Regular files and directories (links to either followed) of `rel`, sorted.
SourceListing ListEntries(const Source& source, const std::string& rel) {
  auto l = source.List(rel);
  if (!l.ok()) return {};
  l->dirs.insert(l->dirs.end(), l->linked_dirs.begin(), l->linked_dirs.end());
  std::sort(l->dirs.begin(), l->dirs.end());
  return std::move(*l);
}

// Deep enough for any model folder (sentence-transformers nests one level);
// bounded so that a checkpoint dir holding a whole training tree is not walked.
constexpr int kMaxSidecarDepth = 4;
constexpr size_t kMaxSidecarFiles = 10'000;

// Adds the files under `rel` (relative to the root) as sidecars named
// `prefix` + their path below it. Hidden entries are skipped (DCP's
// .metadata, NeMo's .hf_metadata, which the caller reads first); weights
// only when `with_weights` (a folder modules.json names).
void AddFolder(const std::string& rel, const std::string& prefix, int depth, bool with_weights, FileTable& files,
               Checkpoint& out) {
  const SourceListing e = ListEntries(files.source(), rel);
  for (const std::string& name : e.files) {
    if (name[0] == '.' || (!with_weights && IsWeightOrShardIndex(name))) continue;
    if (out.sidecars.size() >= kMaxSidecarFiles || out.sidecars.count(prefix + name)) continue;
    if (auto id = files.Add(JoinRel(rel, name)); id.ok()) out.sidecars[prefix + name] = *id;
  }
  if (depth >= kMaxSidecarDepth) return;
  for (const std::string& name : e.dirs)
    if (name[0] != '.') AddFolder(JoinRel(rel, name), prefix + name + "/", depth + 1, with_weights, files, out);
}

// Whether a folder holds weights anywhere below it (a checkpoint of its
// own, say), within the same bounds as AddFolder.
bool HoldsWeights(const Source& source, const std::string& rel, int depth) {
  const SourceListing e = ListEntries(source, rel);
  if (std::any_of(e.files.begin(), e.files.end(), IsWeightOrShardIndex)) return true;
  if (depth >= kMaxSidecarDepth) return !e.dirs.empty();
  return std::any_of(e.dirs.begin(), e.dirs.end(),
                     [&](const std::string& d) { return d[0] != '.' && HoldsWeights(source, JoinRel(rel, d), depth + 1); });
}

// The module folders sentence-transformers' modules.json names ("path":
// "2_Dense"): the model needs them whole, weights included.
std::set<std::string> ModuleFolders(const Source& source, const std::string& modules_json) {
  std::set<std::string> out;
  auto text = source.ReadWhole(modules_json);
  auto j = text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
  if (!j.is_array()) return out;
  for (const auto& m : j)
    if (m.is_object() && m.contains("path") && m["path"].is_string()) out.insert(m["path"].get<std::string>());
  return out;
}

}  // namespace

void AddProblem(Checkpoint& out, const std::string& message, bool incomplete) {
  out.problems.push_back(message);
  if (incomplete && out.incomplete.empty()) out.incomplete = message;
}

bool NoteReadFailure(FileTable& files, const Status& st) {
  switch (st.code()) {
    case Status::Code::kIOError:
    case Status::Code::kStale:
    case Status::Code::kPermissionDenied: files.NoteReadFailure(st); return true;
    default: return false;
  }
}

void AddReadProblem(Checkpoint& out, FileTable& files, const std::string& context, const Status& st,
                    bool incomplete) {
  const Status where = context.empty() ? st : st.WithContext(context);
  if (!NoteReadFailure(files, where)) AddProblem(out, where.message(), incomplete);
}

std::vector<uint64_t> NormalizeStrides(const std::vector<uint64_t>& shape, const std::vector<uint64_t>& strides) {
  auto rm = RowMajorStrides(shape);
  for (size_t d = 0; d < shape.size(); ++d)
    if (shape[d] > 1 && strides[d] != rm[d]) return strides;
  return {};
}

std::vector<std::string> IndexedFiles(FileTable& files, const DirListing& dir, const std::string& index_name,
                                      Checkpoint& out, std::map<std::string, std::string>* weight_map) {
  auto text = files.source().ReadWhole(JoinRel(dir.rel, index_name));
  if (!text.ok() && NoteReadFailure(files, text.status())) return {};
  auto j = text.ok() ? nlohmann::json::parse(*text, nullptr, false) : nlohmann::json();
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    AddProblem(out, JoinRel(dir.rel, index_name) + ": no weight_map object", true);
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
    // No view can hold a tensor of more than 2^64 bytes (a .npy header or a
    // safetensors entry would promise bytes that are not there): left out,
    // and the checkpoint is incomplete without it.
    const std::optional<uint64_t> numel = CheckedNumel(t.shape);
    if (!numel || !ByteSize(t.dtype, *numel)) {
      AddProblem(out, "tensor '" + fqn + "' " + ShapeToString(t.shape) + " " + std::string(DTypeName(t.dtype)) +
                          ": its size overflows 64 bits; left out of every view", true);
      continue;
    }
    DropReplicas(t);
    for (const std::string& p : CheckCoverage(t)) t.problem += (t.problem.empty() ? "" : "; ") + p;
    if (!t.problem.empty()) out.problems.push_back(t.problem);
    out.tensors.push_back(std::make_shared<const TensorMeta>(std::move(t)));
  }
  tensors.clear();
}

void AddSidecarFiles(const DirListing& dir, FileTable& files, Checkpoint& out) {
  // NeMo keeps the model folder's files in .hf_metadata/ (they win); a plain
  // folder keeps them beside the weights.
  const std::string meta_rel = JoinRel(dir.rel, ".hf_metadata");
  if (std::find(dir.dirs.begin(), dir.dirs.end(), ".hf_metadata") != dir.dirs.end())
    AddFolder(meta_rel, "", 0, false, files, out);
  std::set<std::string> modules;
  if (dir.has_file("modules.json")) modules = ModuleFolders(files.source(), JoinRel(dir.rel, "modules.json"));
  for (const std::string& name : dir.files) {
    if (name[0] == '.' || IsWeightOrShardIndex(name) || out.sidecars.count(name)) continue;
    auto id = files.Add(JoinRel(dir.rel, name));
    if (id.ok()) out.sidecars[name] = *id;
    else NoteReadFailure(files, id.status());
  }
  for (const std::string& name : dir.dirs) {
    if (name[0] == '.') continue;
    const bool module = modules.count(name) > 0;
    if (!module && HoldsWeights(files.source(), JoinRel(dir.rel, name), 1)) continue;  // another checkpoint, not metadata
    AddFolder(JoinRel(dir.rel, name), name + "/", 1, module, files, out);
  }
}

}  // namespace ckptfs
