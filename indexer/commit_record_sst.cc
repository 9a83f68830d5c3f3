// A writer's commit record as an SST file of store rows: written
// (WriteCommitRecord), read as untrusted input (ReadCommitRecord), and
// ingested into a store (Store::Ingest).
#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/table_properties.h>

#include "indexer/commit_record.h"
#include "indexer/index_store.h"
#include "indexer/store_internal.h"
#include "source/posix_io.h"

namespace ckptfs {
namespace {

using store_internal::FromRocks;
using store_internal::StoreOptions;

// Every row of an SST file, its block checksums verified. Deletions are
// refused: ingesting one would remove rows the file does not show.
Result<std::vector<rows::Row>> ReadSst(const std::string& path) {
  rocksdb::SstFileReader reader(StoreOptions());
  RETURN_IF_ERROR(FromRocks(reader.Open(path), "open commit record " + path));
  RETURN_IF_ERROR(FromRocks(reader.VerifyChecksum(), "commit record " + path));
  auto props = reader.GetTableProperties();
  if (!props || props->num_deletions != 0 || props->num_range_deletions != 0 || props->num_merge_operands != 0)
    return Status::Corruption("commit record " + path + " holds deletions or merges; a commit record only adds rows");
  std::unique_ptr<rocksdb::Iterator> it(reader.NewIterator(rocksdb::ReadOptions()));
  std::vector<rows::Row> out;
  for (it->SeekToFirst(); it->Valid(); it->Next()) out.push_back({it->key().ToString(), it->value().ToString()});
  RETURN_IF_ERROR(FromRocks(it->status(), "read commit record " + path));
  if (out.size() != props->num_entries) return Status::Corruption("commit record " + path + " has unreadable rows");
  return out;
}

// The checkpoint a writer's rows describe, checked as untrusted input: one
// checkpoint row, every other row inside that checkpoint's key range.
Result<Checkpoint> DecodeCommitRows(const std::vector<rows::Row>& all, CheckpointEntry* entry) {
  const rows::Row* head = nullptr;
  for (const rows::Row& r : all) {
    if (!r.key.starts_with(rows::kCheckpointRowPrefix)) continue;
    if (head) return Status::Corruption("two checkpoint rows");
    head = &r;
  }
  if (!head) return Status::Corruption("no checkpoint row");
  ASSIGN_OR_RETURN(*entry, rows::DecodeCheckpointRow(head->key, head->value));
  rows::CheckpointDecoder decoder(*entry, /*strict=*/true);
  for (const rows::Row& r : all)
    if (&r != head) RETURN_IF_ERROR(decoder.Add(r.key, r.value));
  return decoder.Finish();
}

// Moves a checkpoint's file paths from under `from` to under `to`.
void Rebase(Checkpoint& ckpt, const std::string& from, const std::string& to) {
  for (SourceFile& f : ckpt.files) {
    std::string rest = from.empty() ? f.path : f.path.substr(from.size() + 1);
    f.path = to.empty() ? rest : to + "/" + rest;
  }
  ckpt.dir = to;
}

}  // namespace

Result<std::string> Store::DirForIngest(const std::string& sst_path, const std::string& named) const {
  static const std::string kSuffix = "/.ckptfs/commit.sst";
  char real[PATH_MAX];
  if (!::realpath(sst_path.c_str(), real)) return Status::IOError(sst_path + ": " + std::strerror(errno));
  std::string r = real;
  if (r.size() <= kSuffix.size() || r.compare(r.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) return named;
  r.resize(r.size() - kSuffix.size());
  if (r == root_) return std::string();
  if (r.size() > root_.size() && r.compare(0, root_.size(), root_) == 0 && r[root_.size()] == '/')
    return r.substr(root_.size() + 1);
  return named;
}

Status Store::Ingest(const std::string& sst_path) {
  if (access_ != Access::kReadWrite) return Status::InvalidArgument("index " + path_ + " is open read-only");
  ASSIGN_OR_RETURN(std::vector<rows::Row> all, ReadSst(sst_path));
  CheckpointEntry entry;
  auto ckpt = DecodeCommitRows(all, &entry);
  if (!ckpt.ok()) return ckpt.status().WithContext("commit record " + sst_path);
  ASSIGN_OR_RETURN(std::string dir, DirForIngest(sst_path, entry.dir));
  std::unique_lock lock(mu_);
  if (dir != entry.dir) {
    // Written for another root (the writer saw /ckpts/run1, this store
    // indexes /ckpts): the same rows under this store's name for the dir.
    Rebase(*ckpt, entry.dir, dir);
    ASSIGN_OR_RETURN(std::vector<rows::Row> again, rows::EncodeCheckpoint(*ckpt, entry.source, entry.committed_at_ns));
    return WriteRows(again, dir, /*replace=*/true);
  }
  // Old rows go first: an ingested file only adds rows. A crash between the
  // two steps leaves the checkpoint absent, never mixed.
  RETURN_IF_ERROR(WriteRows({}, dir, /*replace=*/true));
  rocksdb::IngestExternalFileOptions io;
  io.move_files = false;  // the commit record stays with its checkpoint
  io.write_global_seqno = false;
  return FromRocks(db_->IngestExternalFile({sst_path}, io), "ingest " + sst_path + " into " + path_);
}

Result<Checkpoint> ReadCommitRecord(const std::string& sst_path) {
  ASSIGN_OR_RETURN(std::vector<rows::Row> all, ReadSst(sst_path));
  CheckpointEntry entry;
  auto ckpt = DecodeCommitRows(all, &entry);
  if (!ckpt.ok()) return ckpt.status().WithContext("commit record " + sst_path);
  return ckpt;
}

Status WriteCommitRecord(const std::string& abs_root, const Checkpoint& ckpt, const std::string& sst_path) {
  if (abs_root.empty() || (abs_root[0] != '/' && abs_root.rfind("s3://", 0) != 0))
    return Status::InvalidArgument("commit record: the source root must be an absolute path or an s3:// URL, not '" +
                                   abs_root + "'");
  ASSIGN_OR_RETURN(std::vector<rows::Row> all, rows::EncodeCheckpoint(ckpt, rows::kSourceWriter, WallClockNs()));
  std::sort(all.begin(), all.end(), [](const rows::Row& a, const rows::Row& b) { return a.key < b.key; });
  rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), StoreOptions());
  RETURN_IF_ERROR(FromRocks(writer.Open(sst_path), "create commit record " + sst_path));
  for (const rows::Row& r : all) RETURN_IF_ERROR(FromRocks(writer.Put(r.key, r.value), "write commit record " + sst_path));
  return FromRocks(writer.Finish(), "finish commit record " + sst_path);
}
}  // namespace ckptfs
