#include "indexer/scan.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <set>

#include "indexer/commit_record.h"
#include "indexer/format_reader.h"
#include "indexer/readers.h"
#include "source/file_table.h"
#include "source/posix_io.h"
#include "source/posix_source.h"

namespace ckptfs {

bool DirListing::has_file(const std::string& name) const {
  return std::binary_search(files.begin(), files.end(), name);
}

bool DirListing::has_dir(const std::string& name) const {
  return std::binary_search(dirs.begin(), dirs.end(), name) ||
         std::find(linked_dirs.begin(), linked_dirs.end(), name) != linked_dirs.end();
}

namespace {

Result<DirListing> ListDir(const Source& source, const std::string& rel) {
  ASSIGN_OR_RETURN(SourceListing l, source.List(rel));
  DirListing d;
  d.source = &source;
  d.rel = rel;
  d.files = std::move(l.files);
  d.dirs = std::move(l.dirs);
  d.linked_dirs = std::move(l.linked_dirs);
  d.known = std::move(l.known);
  return d;
}

// Offers `listing` to the readers; the first that recognises it reads the
// checkpoint. nullopt when none does, or (with `unread`) when its files
// could not be read now: *unread then says why; without `unread` that is
// the error.
Result<std::optional<Checkpoint>> ReadCheckpoint(const Source& source, const DirListing& listing,
                                                 const std::vector<std::unique_ptr<FormatReader>>& readers,
                                                 const ScanOptions& options, std::vector<std::string>* claimed,
                                                 std::string* unread = nullptr) {
  for (const auto& r : readers) {
    if (!r->Recognise(listing)) continue;
    Checkpoint ckpt;
    ckpt.dir = listing.rel;
    std::map<std::string, SourceFile> listed;
    for (const auto& [name, f] : listing.known) listed.emplace(JoinRel(listing.rel, name), f);
    FileTable files(source, std::move(listed));
    files.set_predict_items(options.predict_items);
    RETURN_IF_ERROR(r->Read(listing, files, ckpt));
    if (claimed) *claimed = r->ClaimedSubdirs(listing);
    // A source that could not be read now says nothing about the
    // checkpoint: stored as its problem, it would outlast the failure.
    if (Status failed = files.read_failure(); !failed.ok()) {
      failed = failed.WithContext((listing.rel.empty() ? "." : listing.rel) +
                                  ": not indexed (a source could not be read; nothing of it was stored, so the next "
                                  "index or mount tries again)");
      if (!unread) return failed;
      *unread = failed.message();
      return std::optional<Checkpoint>();
    }
    ckpt.files = files.Take();
    if (!options.file_index_mapping.empty()) RETURN_IF_ERROR(LoadFileIndexMapping(options.file_index_mapping, ckpt));
    // Looked for only where the listing shows its directory (a link to
    // one included, which UseCommitRecord refuses, saying why).
    Status record = listing.has_dir(kCommitDir) ? UseCommitRecord(source, ckpt)
                                                  : Status::NotFound("no " + std::string(kCommitDir));
    if (!record.ok() && record.code() != Status::Code::kNotFound && options.warn)
      options.warn(CommitRecordPath(source.root(), ckpt.dir) + " not used (" + record.message() +
                   "); indexed from the files alone, without the writer's checksums");
    return std::optional<Checkpoint>(std::move(ckpt));
  }
  return std::optional<Checkpoint>();
}

}  // namespace

namespace {

// What an unrecognised directory that holds shard files lacks, or "".
std::string MissingCommitPoint(const DirListing& d) {
  size_t distcp = 0, safetensors = 0, unpublished = 0;
  for (const std::string& f : d.files) {
    distcp += f.ends_with(".distcp");
    safetensors += f.ends_with(".safetensors");
    unpublished += f.ends_with(".safetensors.tmp");
  }
  if (distcp) return std::to_string(distcp) + " .distcp file(s) but no .metadata: an interrupted DCP save";
  // ckptfs's writer (layout="hf") renames NAME.tmp to NAME only at commit.
  if (unpublished && !safetensors)
    return std::to_string(unpublished) + " .safetensors.tmp file(s) and no shard published: an interrupted save";
  if (safetensors) return std::to_string(safetensors) + " .safetensors file(s) no format reads as a checkpoint";
  if (std::binary_search(d.dirs.begin(), d.dirs.end(), kCommitDir))
    return ".ckptfs/ without a commit record: an interrupted ckptfs save";
  return "";
}

}  // namespace

namespace {

// Walks the directories of `source` depth-first, in name order, each once
// (bind mounts can loop): `visit` gets each listing and returns the
// subdirectories not to enter (those its checkpoint claims). A root that
// cannot be listed, or an error from `visit`, ends the walk with it.
Status WalkDirs(const Source& source,
                const std::function<Result<std::vector<std::string>>(const DirListing&)>& visit) {
  std::vector<std::string> pending{""};
  std::set<std::string> seen;
  while (!pending.empty()) {
    std::string rel = pending.back();
    pending.pop_back();
    auto listing = ListDir(source, rel);
    if (!listing.ok()) {
      if (rel.empty()) return listing.status();
      continue;
    }
    if (!seen.insert(source.DirKey(rel)).second) continue;
    ASSIGN_OR_RETURN(std::vector<std::string> claimed, visit(*listing));
    for (auto it = listing->dirs.rbegin(); it != listing->dirs.rend(); ++it)
      if (std::find(claimed.begin(), claimed.end(), *it) == claimed.end()) pending.push_back(JoinRel(rel, *it));
  }
  return Status::OK();
}

// Walks `root` by file names alone, as ScanSource walks it: `visit` gets each
// directory with the reader that recognises it (null when none does), and
// the walk goes on into its subdirectories except those that reader claims.
void WalkByNames(const Source& source,
                 const std::function<void(const DirListing&, const FormatReader*)>& visit) {
  auto readers = AllReaders();
  (void)WalkDirs(source, [&](const DirListing& listing) -> Result<std::vector<std::string>> {
    const FormatReader* reader = nullptr;
    for (const auto& r : readers)
      if (r->Recognise(listing)) {
        reader = r.get();
        break;
      }
    visit(listing, reader);
    return reader ? reader->ClaimedSubdirs(listing) : std::vector<std::string>{};
  });
}

}  // namespace

std::vector<std::string> FindCheckpointDirs(const Source& source) {
  std::vector<std::string> out;
  WalkByNames(source, [&](const DirListing& d, const FormatReader* reader) {
    if (reader) out.push_back(d.rel);
  });
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

enum class Clock { kMtime, kCtime };

// The time `name` in `dir` was last written (kMtime) or changed (kCtime),
// in ns; nullopt when it is missing.
std::optional<int64_t> FileTime(const DirListing& dir, const std::string& name, Clock clock) {
  // A listing that told the file's identity told its times (an object's
  // Last-Modified stands for both).
  if (auto known = dir.known.find(name); known != dir.known.end())
    return clock == Clock::kMtime ? known->second.mtime_ns : known->second.ctime_ns;
  const std::string rel = JoinRel(dir.rel, name);
  return clock == Clock::kMtime ? dir.source->ModifyTimeNs(rel) : dir.source->ChangeTimeNs(rel);
}

// True when no file of `dir` but `except` was written (or changed) after `at`.
bool NothingAfter(const DirListing& dir, int64_t at, Clock clock, const std::string& except) {
  for (const std::string& f : dir.files)
    if (f != except && FileTime(dir, f, clock).value_or(INT64_MAX) > at) return false;
  return true;
}

bool RecordIsCurrent(const DirListing& dir) {
  if (!dir.has_dir(kCommitDir)) return false;
  auto record = FileTime(dir, kCommitRecord, Clock::kMtime);
  if (!record) return false;
  // Modification times, not ctimes: a copy that keeps them (cp -a, rsync -a)
  // keeps its record. A shard rewritten after the save changes its own
  // mtime, never .metadata's: that is corruption for the record's checksums
  // to find, not a new save.
  if (dir.has_file(".metadata")) return *FileTime(dir, ".metadata", Clock::kMtime) <= *record;
  return NothingAfter(dir, *record, Clock::kMtime, "");
}

}  // namespace

bool CommitRecordIsCurrent(const Source& source, const std::string& rel) {
  auto listing = ListDir(source, rel);
  return listing.ok() && RecordIsCurrent(*listing);
}

bool CommitRecordIsCurrent(const std::string& root, const std::string& rel) {
  return CommitRecordIsCurrent(*PosixSourceAt(root), rel);
}

bool CommitPointIsNewest(const Source& source, const std::string& rel) {
  auto listing = ListDir(source, rel);
  if (!listing.ok()) return false;
  if (RecordIsCurrent(*listing)) {
    auto record = FileTime(*listing, kCommitRecord, Clock::kCtime);
    return record && NothingAfter(*listing, *record, Clock::kCtime, "");
  }
  auto metadata = FileTime(*listing, ".metadata", Clock::kCtime);
  return metadata && NothingAfter(*listing, *metadata, Clock::kCtime, ".metadata");
}

std::string CommitRecordPath(const std::string& root, const std::string& dir) {
  return root + "/" + CommitRecordRel(dir);
}

std::string CommitRecordRel(const std::string& dir) { return JoinRel(dir, kCommitRecord); }

std::vector<std::string> FindInterruptedSaves(const Source& source) {
  std::vector<std::string> out;
  WalkByNames(source, [&](const DirListing& d, const FormatReader* reader) {
    if (reader) return;  // a checkpoint: its problems are the reader's to report
    if (std::string what = MissingCommitPoint(d); !what.empty())
      out.push_back((d.rel.empty() ? "." : d.rel) + ": " + what + " (not served; save it again or remove it)");
  });
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> CheckpointMark(const Source& source, const std::string& rel) {
  auto listing = ListDir(source, rel);
  if (!listing.ok()) return std::nullopt;
  for (const auto& r : AllReaders()) {
    if (!r->Recognise(*listing)) continue;
    const bool record = std::binary_search(listing->dirs.begin(), listing->dirs.end(), std::string(".ckptfs")) &&
                        source.ModifyTimeNs(CommitRecordRel(rel)).has_value();
    return r->name() + (record ? "+record" : "");
  }
  return std::string();
}

Result<std::optional<Checkpoint>> ScanCheckpointDir(const Source& source, const std::string& rel,
                                                    const ScanOptions& options) {
  ASSIGN_OR_RETURN(DirListing listing, ListDir(source, rel));
  return ReadCheckpoint(source, listing, AllReaders(), options, nullptr);
}

Result<Catalog> ScanSource(const std::string& root, const ScanOptions& options) {
  ASSIGN_OR_RETURN(std::shared_ptr<PosixSource> source, PosixSource::OpenRoot(root));
  return ScanSource(*source, options);
}

Result<Catalog> ScanSource(const Source& source, const ScanOptions& options) {
  Catalog catalog;
  catalog.root = source.root();
  auto readers = AllReaders();
  size_t done = 0;
  RETURN_IF_ERROR(WalkDirs(source, [&](const DirListing& listing) -> Result<std::vector<std::string>> {
    std::vector<std::string> claimed;
    std::string unread;
    ASSIGN_OR_RETURN(std::optional<Checkpoint> ckpt,
                     ReadCheckpoint(source, listing, readers, options, &claimed, &unread));
    if (ckpt) catalog.checkpoints.push_back(std::move(*ckpt));
    if (!unread.empty()) catalog.unread.push_back(std::move(unread));
    ++done;
    if (options.progress) options.progress(done, catalog.checkpoints.size());
    return claimed;
  }));
  std::sort(catalog.checkpoints.begin(), catalog.checkpoints.end(),
            [](const Checkpoint& a, const Checkpoint& b) { return a.dir < b.dir; });
  catalog.indexed_at_ns = WallClockNs();
  return catalog;
}

}  // namespace ckptfs
