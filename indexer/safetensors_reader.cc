// Reader for safetensors checkpoints (docs/FORMATS.md):
//  - plain Hugging Face folders: model.safetensors, or an index.json naming
//    model-0000i-of-0000N.safetensors shards, each tensor whole in one file;
//  - sharded safetensors (torch's HuggingFaceStorageWriter, NeMo AutoModel):
//    shard-RRRRR-model-IIIII-of-NNNNN.safetensors, each holding the writing
//    rank's local chunks, placed by `saved_offsets` in the
//    DCP_SHARDING_INFO (or dcp_custom_metadata) entry of __metadata__.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <regex>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/coverage.h"
#include "core/safetensors.h"
#include "indexer/format_reader.h"
#include "source/in_parallel.h"
#include "source/posix_io.h"
#include "indexer/readers.h"
#include "indexer/sharding_info.h"

namespace ckptfs {
namespace {

using nlohmann::json;

Result<SafetensorsHeader> ReadHeader(const FileTable& files, FileId id, uint64_t size) {
  if (size < 8) return DecodeHeaderLength(std::string_view(), size).status();
  ASSIGN_OR_RETURN(std::unique_ptr<SourceObject> in, files.Open(id));
  char prefix[8];
  RETURN_IF_ERROR(in->ReadAt(0, 8, prefix));
  ASSIGN_OR_RETURN(uint64_t n, DecodeHeaderLength(std::string_view(prefix, 8), size));
  std::string text(n, '\0');
  RETURN_IF_ERROR(in->ReadAt(8, n, text.data()));
  return ParseSafetensorsHeader(text, n);
}

// The file's DCP_SHARDING_INFO (or dcp_custom_metadata); nullopt when the
// file is not sharded.
Result<std::optional<ShardingInfo>> ReadShardingInfo(const SafetensorsHeader& h) {
  auto it = h.metadata.find("DCP_SHARDING_INFO");
  if (it == h.metadata.end()) it = h.metadata.find("dcp_custom_metadata");
  if (it == h.metadata.end()) return std::optional<ShardingInfo>();
  ASSIGN_OR_RETURN(ShardingInfo info, ShardingInfo::Parse(it->first, it->second));
  return std::optional(std::move(info));
}

// The shard files record no world size, so a missing last rank shrinks
// shapes without leaving a hole. config.json, when there is one, says what
// the shapes should be: a disagreement marks the checkpoint incomplete.
void CheckAgainstConfig(const FileTable& files, FileId config, Checkpoint& out) {
  auto text = files.ReadWhole(config);
  json cfg = text.ok() ? json::parse(*text, nullptr, false) : json();
  if (!cfg.is_object()) return;
  auto dim = [&](const char* key) -> std::optional<uint64_t> {
    if (cfg.contains(key) && cfg[key].is_number_unsigned()) return cfg[key].get<uint64_t>();
    return std::nullopt;
  };
  auto vocab = dim("vocab_size"), hidden = dim("hidden_size");
  for (const auto& t : out.tensors) {
    bool embedding = t->fqn.ends_with("embed_tokens.weight") || t->fqn == "lm_head.weight" ||
                     t->fqn.ends_with(".lm_head.weight");
    if (!embedding || t->shape.size() != 2) continue;
    if ((vocab && t->shape[0] != *vocab) || (hidden && t->shape[1] != *hidden))
      AddProblem(out,
                 "tensor '" + t->fqn + "' is " + ShapeToString(t->shape) + " but config.json says vocab_size " +
                     (vocab ? std::to_string(*vocab) : "?") + ", hidden_size " +
                     (hidden ? std::to_string(*hidden) : "?") + " (a shard file missing?)",
                 true);
  }
}

// What the files of one directory hold, gathered file by file.
struct SafetensorsScan {
  std::map<std::string, TensorMeta> tensors;
  bool sharded = false;
  std::set<uint64_t> ranks;  // RRRRR of shard-RRRRR-model-IIIII-of-NNNNN.safetensors
};

// Adds the entries of one file's header as chunks.
void AddEntries(const std::string& rel, const std::string& name, FileId id, uint64_t file_size,
                const SafetensorsHeader& header,
                const std::optional<ShardingInfo>& info,
                const std::map<std::string, std::string>& weight_map, SafetensorsScan& scan, Checkpoint& out) {
  for (const SafetensorsEntry& e : header.entries) {
    const Dims* offsets = info ? info->Find(e.name) : nullptr;
    if (info && (!offsets || offsets->size() != e.shape.size())) {
      AddProblem(out,
                 rel + ": tensor '" + e.name + "' has no saved_offsets of rank " + std::to_string(e.shape.size()) +
                     " in DCP_SHARDING_INFO",
                 true);
      continue;
    }
    Box box{offsets ? *offsets : Dims(e.shape.size(), 0), e.shape};
    // An F4 entry was a torch.float4_e2m1fn_x2 chunk: its saved_offsets count
    // torch elements (bytes of two values), its header shape values.
    if (offsets && e.dtype == DType::kF4 && !box.offsets.empty()) box.offsets.back() *= 2;
    Chunk c(box, {id, header.data_start() + e.begin, e.end - e.begin}, e.dtype);
    if (c.offset() + c.length() > file_size)
      c.set_unavailable(rel + " is truncated: " + std::to_string(file_size) + " bytes, but this chunk ends at byte " +
                        std::to_string(c.offset() + c.length()));
    if (auto w = weight_map.find(e.name); w != weight_map.end() && w->second != name)
      AddProblem(out, rel + ": holds '" + e.name + "', which the index places in " + w->second, false);
    TensorMeta& t = scan.tensors[e.name];
    if (t.chunks.empty()) {
      t.fqn = e.name;
      t.dtype = e.dtype;
    }
    t.chunks.push_back(std::move(c));
  }
}

// Headers read side by side, this many at a time: on object storage each is
// two round trips (length, then header), and a step may have hundreds of files.
constexpr size_t kHeaderReaders = 8;

// A safetensors file of the directory, registered, its header to be read.
struct Pending {
  std::string name;
  FileId id;
  std::optional<Result<SafetensorsHeader>> header;
};

// Registers the files named; one missing or unusable is a problem.
std::vector<Pending> Register(const DirListing& dir, FileTable& files, const std::vector<std::string>& names,
                              Checkpoint& out) {
  std::vector<Pending> pending;
  for (const std::string& name : names) {
    const std::string rel = JoinRel(dir.rel, name);
    if (!dir.has_file(name)) {
      AddProblem(out, rel + ": listed in model.safetensors.index.json but missing", true);
      continue;
    }
    auto id = files.Add(rel);
    if (!id.ok()) {
      AddReadProblem(out, files, "", id.status(), true);
      continue;
    }
    pending.push_back({name, *id, std::nullopt});
  }
  return pending;
}

void ReadHeaders(const FileTable& files, std::vector<Pending>& pending) {
  ForEachInParallel(pending.size(), kHeaderReaders, [&](size_t i) {
    pending[i].header.emplace(ReadHeader(files, pending[i].id, files.at(pending[i].id).size));
  });
}

// One safetensors file of the directory: its entries added; a file that
// cannot be used is a problem.
void ReadFile(const DirListing& dir, FileTable& files, const Pending& p,
              const std::map<std::string, std::string>& weight_map, SafetensorsScan& scan, Checkpoint& out) {
  static const std::regex kShardName(R"(^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$)");
  const std::string rel = JoinRel(dir.rel, p.name);
  const SourceFile& sf = files.at(p.id);
  const Result<SafetensorsHeader>& header = *p.header;
  if (!header.ok()) return AddReadProblem(out, files, rel, header.status(), true);
  Status size_ok = CheckSafetensorsFileSize(*header, sf.size);
  if (!size_ok.ok()) AddProblem(out, rel + ": " + size_ok.message(), false);
  auto info = ReadShardingInfo(*header);
  if (!info.ok()) return AddProblem(out, rel + ": " + info.status().message(), true);
  if (info->has_value()) scan.sharded = true;
  std::smatch m;
  if (std::regex_match(p.name, m, kShardName)) scan.ranks.insert(std::stoull(m[1]));
  AddEntries(rel, p.name, p.id, sf.size, *header, *info, weight_map, scan, out);
}

void CheckShardRanks(const DirListing& dir, const std::set<uint64_t>& ranks, Checkpoint& out) {
  if (ranks.empty() || (*ranks.begin() == 1 && *ranks.rbegin() == ranks.size())) return;
  std::string found;
  for (uint64_t r : ranks) found += (found.empty() ? "" : ",") + std::to_string(r);
  AddProblem(out,
             JoinRel(dir.rel, "shard-*") + ": shard files of some ranks are missing (ranks found: " + found +
                 "); tensors or parts only they held would be missing",
             // torch writes no file for a rank with nothing to save, but it
             // gives replicated tensors to the rank with the least data, so
             // a rank without a file is all but impossible: treat it as loss.
             true);
}

// Each tensor's shape is the extent of its chunks; tensors whose chunks
// disagree on the number of dimensions get that problem instead.
void SetShapes(std::map<std::string, TensorMeta>& tensors) {
  for (auto& [fqn, t] : tensors) {
    const size_t rank = t.chunks.front().rank();
    bool ranks_agree = std::all_of(t.chunks.begin(), t.chunks.end(),
                                   [rank](const Chunk& c) { return c.rank() == rank; });
    if (!ranks_agree) {
      t.problem = "tensor '" + fqn + "': chunks disagree on the number of dimensions";
      continue;
    }
    t.shape.assign(rank, 0);
    for (const Chunk& c : t.chunks)
      for (size_t d = 0; d < rank; ++d)
        t.shape[d] = std::max(t.shape[d], c.box().offsets[d] + c.box().lengths[d]);
  }
}

// config.json and tokenizer files, checked against the shapes; NeMo's
// fqn_to_file_index_mapping.json, checked against the tensors found.
void AddSidecars(const DirListing& dir, FileTable& files, Checkpoint& out) {
  const std::string meta_rel = JoinRel(dir.rel, ".hf_metadata");
  AddSidecarFiles(dir, files, out);
  if (auto it = out.sidecars.find("config.json"); it != out.sidecars.end()) CheckAgainstConfig(files, it->second, out);
  const std::string mapping = JoinRel(meta_rel, "fqn_to_file_index_mapping.json");
  if (!dir.has_dir(".hf_metadata")) return;
  if (!files.source().Identify(mapping).ok()) return;
  auto text = files.source().ReadWhole(mapping);
  Status st = text.ok() ? ParseFileIndexMapping(*text, mapping, out) : text.status();
  if (!st.ok()) AddReadProblem(out, files, "", st, false);
  // The mapping is the one record of which tensors were saved: a tensor it
  // names that no shard holds means a shard file is missing. A set, not a
  // search of the tensor list per name: NeMo maps every tensor.
  std::set<std::string_view> present;
  for (const auto& t : out.tensors) present.insert(t->fqn);
  for (const auto& [fqn, index] : out.file_index)
    if (!present.count(fqn))
      AddProblem(out,
                 JoinRel(meta_rel, "fqn_to_file_index_mapping.json") + " names tensor '" + fqn +
                     "', which no shard file holds (missing shard?)",
                 true);
}

class SafetensorsReader : public FormatReader {
 public:
  std::string name() const override { return "safetensors"; }

  bool Recognise(const DirListing& dir) const override {
    return std::any_of(dir.files.begin(), dir.files.end(),
                       [](const std::string& f) { return f.ends_with(".safetensors"); });
  }

  Status Read(const DirListing& dir, FileTable& files, Checkpoint& out) const override {
    // Which files: the index's, when there is one; else every .safetensors.
    std::vector<std::string> names;
    std::map<std::string, std::string> weight_map;
    if (dir.has_file("model.safetensors.index.json")) {
      names = IndexedFiles(files, dir, "model.safetensors.index.json", out, &weight_map);
    } else {
      for (const auto& f : dir.files)
        if (f.ends_with(".safetensors")) names.push_back(f);
    }
    SafetensorsScan scan;
    std::vector<Pending> pending = Register(dir, files, names, out);
    ReadHeaders(files, pending);
    for (const Pending& p : pending) ReadFile(dir, files, p, weight_map, scan, out);
    for (const auto& [fqn, file] : weight_map)
      if (!scan.tensors.count(fqn))
        AddProblem(out, JoinRel(dir.rel, file) + ": tensor '" + fqn + "' listed in the index is not in the file", true);
    CheckShardRanks(dir, scan.ranks, out);
    SetShapes(scan.tensors);
    // Tensors whose chunks disagree on rank keep that problem; the rest get
    // the coverage check.
    FinishTensors(scan.tensors, out);
    out.format = scan.sharded ? "sharded-safetensors" : "hf-safetensors";
    AddSidecars(dir, files, out);
    return Status::OK();
  }
};

}  // namespace

Status LoadFileIndexMapping(const std::string& path, Checkpoint& out) {
  ASSIGN_OR_RETURN(std::string text, ReadWholeFile(path));
  return ParseFileIndexMapping(text, path, out);
}

Status ParseFileIndexMapping(const std::string& text, const std::string& path, Checkpoint& out) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return Status::Corruption(path + ": not a JSON object {fqn: file index}");
  std::map<std::string, int> mapping;
  for (auto& [fqn, v] : j.items()) {
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 99999)
      return Status::Corruption(path + ": '" + fqn + "' must map to a file index from 1 to 99999");
    mapping[fqn] = v.get<int>();
  }
  out.file_index = std::move(mapping);
  return Status::OK();
}

std::unique_ptr<FormatReader> MakeSafetensorsReader() { return std::make_unique<SafetensorsReader>(); }

}  // namespace ckptfs
