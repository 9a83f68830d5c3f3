// Builds a Catalog by walking a source tree and offering each directory to
// the format readers (indexer/format_reader.h).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

struct ScanOptions {
  // Called after each directory with (directories done, checkpoints found).
  std::function<void(size_t, size_t)> progress;
  // Overrides every checkpoint's fqn -> file index mapping (JSON file).
  std::string file_index_mapping;
  // Told why a checkpoint's commit record of ckptfs's writer was not used
  // (indexer/commit_record.h); the checkpoint is read from its files then.
  std::function<void(const std::string&)> warn;
  // Over object storage, DCP items are placed by prediction and their
  // framing is read with their bytes on first read (indexer/dcp_item.h):
  // a mount asks for it, `ckptfs index` reads every item's framing.
  bool predict_items = false;
};

// Fails only when the root cannot be read at all; problems inside
// checkpoints are recorded on them, and checkpoints whose files could not be
// read now are left out, named in Catalog::unread. Catalog::root is
// source.root().
Result<Catalog> ScanSource(const Source& source, const ScanOptions& options = {});
// The same for the local directory `root` (resolved first).
Result<Catalog> ScanSource(const std::string& root, const ScanOptions& options = {});

// Directories of the source that hold shard files no
// reader recognises as a checkpoint, each with what is missing: a DCP save
// interrupted before its .metadata was written, say. They are never served;
// `ckptfs check` names them.
std::vector<std::string> FindInterruptedSaves(const Source& source);

// Directories of the source that some reader recognises
// as a checkpoint, found from file names alone (nothing is parsed): what
// ScanSource would read. Lets a command see checkpoints saved since the
// index was built.
std::vector<std::string> FindCheckpointDirs(const Source& source);

// ckptfs's writer's commit record, relative to its checkpoint's directory,
// and its absolute path for checkpoint directory `dir` ("" for the root
// itself) of `root`.
inline constexpr char kCommitDir[] = ".ckptfs";
inline constexpr char kCommitRecord[] = ".ckptfs/commit.sst";
std::string CommitRecordPath(const std::string& root, const std::string& dir);
// Its path relative to the source root.
std::string CommitRecordRel(const std::string& dir);

// True when directory `rel` of the source holds ckptfs's writer's commit
// record and it belongs to the save the directory holds now: written no
// earlier than that save's own commit point (DCP's .metadata) or, without
// one, than any of its files. Another writer saving into the same
// directory later leaves the record behind, describing files rewritten or
// gone: it is then ignored, never trusted.
bool CommitRecordIsCurrent(const Source& source, const std::string& rel);
// The same for the local directory `root` (absolute, resolved).
bool CommitRecordIsCurrent(const std::string& root, const std::string& rel);

// True when directory `rel` of the source holds a commit point written
// after every other file in it: ckptfs's writer's commit record when it is
// current (above), else DCP's .metadata, which torch renames into place
// after all shards are durable. A checkpoint saved again into the same
// directory may be indexed again only then; before, its old .metadata
// would describe new, half-written shards. Formats without such a file
// (safetensors folders not written by ckptfs, torch.save files) have none:
// they are indexed again only by `ckptfs index`.
bool CommitPointIsNewest(const Source& source, const std::string& rel);

// What makes directory `rel` of the source a checkpoint now, judged from
// its file names alone (as FindCheckpointDirs judges): the name of the
// reader that recognises it, with "+record" while ckptfs's writer's commit
// record is there. "" when no reader does: its commit point (DCP's
// .metadata, the safetensors shards, ...) is gone. nullopt when the
// directory cannot be listed now (an I/O error): nothing is known. A live
// mount compares it with what it was when the checkpoint was served.
std::optional<std::string> CheckpointMark(const Source& source, const std::string& rel);

// Reads directory `rel` of the source alone, as the scan would: a
// checkpoint, or nullopt when no reader recognises it; an error when its
// files could not be read now.
Result<std::optional<Checkpoint>> ScanCheckpointDir(const Source& source, const std::string& rel,
                                                    const ScanOptions& options = {});

}  // namespace ckptfs
