// The rows of the store, schema 2 (docs/INDEX.md): how a Checkpoint becomes
// keys and values and back. Pure encoding; the store's .cc files
// (indexer/index_store.h) write and read them with RocksDB.
//
// Every key of one checkpoint starts with "c/<dir>" (its checkpoint row) or
// "d/<dir>\0" (its data rows), so a checkpoint is replaced, removed or loaded
// without touching another, and one tensor ("d/<dir>\0t<fqn>"), one
// checkpoint's tensors ("d/<dir>\0t") and one mapped consolidated file's
// tensors ("d/<dir>\0v<index>/") are prefix scans. A directory path holds no
// NUL, so "d/a\0" never prefixes the rows of "a/b".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

// A checkpoint row, decoded: what List() reports per committed checkpoint,
// without loading its tensors.
struct CheckpointEntry {
  std::string dir;     // relative to the source root ("" = the root itself)
  std::string format;  // "" when the checkpoint row cannot be decoded (Load says why)
  std::string source;  // "scan" (ckptfs index / a live mount) or "writer" (an ingested commit record)
  int64_t committed_at_ns = 0;
  uint64_t tensors = 0, chunks = 0, files = 0;
};

namespace rows {

inline constexpr int kSchemaVersion = 2;
inline constexpr char kFormatKey[] = "meta/format";  // {"schema": 2}
inline constexpr char kRootKey[] = "meta/root";      // absolute source root, raw
inline constexpr char kCheckpointRowPrefix[] = "c/";
inline constexpr char kDataPrefix[] = "d/";
inline constexpr char kSourceScan[] = "scan";
inline constexpr char kSourceWriter[] = "writer";

struct Row {
  std::string key, value;
};

std::string CheckpointRowKey(const std::string& dir);
// [DataBegin, DataEnd) holds every data row of `dir` and nothing else.
std::string DataBegin(const std::string& dir);
std::string DataEnd(const std::string& dir);
// Every file row of `dir` starts with this (they come first among its rows).
std::string FilesPrefix(const std::string& dir);

// The checkpoint's data rows, then its checkpoint row (always last: the
// commit point). Fails when the checkpoint cannot be stored faithfully (a
// chunk naming a file that is not in its table, a NUL in a name).
Result<std::vector<Row>> EncodeCheckpoint(const Checkpoint& ckpt, const std::string& source,
                                          int64_t committed_at_ns);

// The checkpoint directory a checkpoint row's key names, or Corruption.
Result<std::string> DirOfCheckpointRowKey(std::string_view key);
Result<CheckpointEntry> DecodeCheckpointRow(std::string_view key, std::string_view value);

// Rebuilds one checkpoint from its data rows, given in key order.
class CheckpointDecoder {
 public:
  // `strict` (rows from outside the store: a writer's commit record) also
  // requires every source path to be a plain relative path inside the
  // checkpoint directory.
  CheckpointDecoder(const CheckpointEntry& entry, bool strict);
  Status Add(std::string_view key, std::string_view value);
  // Checks the rows against the checkpoint row's counts and the file table.
  Result<Checkpoint> Finish();
  // The files added so far, unchecked: for a staleness check that reads
  // only the file rows (Store::LoadFiles).
  std::vector<SourceFile> TakeFiles() { return std::move(ckpt_.files); }

 private:
  Status AddFile(std::string_view path, std::string_view value);
  Status AddTensor(std::string_view fqn, std::string_view value);
  Status AddHeader(std::string_view value);
  Status AddMapping(std::string_view rest);

  CheckpointEntry entry_;
  bool strict_;
  std::string prefix_;
  Checkpoint ckpt_;
  std::vector<bool> have_file_;
  bool have_header_ = false;
  uint64_t chunks_ = 0;
};

// One row decoded for people (`ckptfs index --dump`): {"key", "value"}.
nlohmann::json RowToJson(std::string_view key, std::string_view value);

}  // namespace rows
}  // namespace ckptfs
