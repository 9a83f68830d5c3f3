// The Store's rows API: list, load, commit, remove, dump. Opening the
// store is store_open.cc; ingesting a writer's commit record,
// commit_record_sst.cc.
#include "indexer/index_store.h"

#include <mutex>
#include <ostream>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "indexer/store_internal.h"
#include "source/posix_io.h"

namespace ckptfs {
namespace {

using store_internal::FromRocks;

// Positions `it` at the checkpoint row of `dir` and decodes it; NotFound
// when the checkpoint has none.
Result<CheckpointEntry> SeekCheckpointRow(rocksdb::Iterator& it, const std::string& dir, const std::string& path) {
  const std::string key = rows::CheckpointRowKey(dir);
  it.Seek(key);
  if (!it.Valid() || it.key() != key) {
    RETURN_IF_ERROR(FromRocks(it.status(), "read index " + path));
    return Status::NotFound("checkpoint '" + dir + "' is not in index " + path);
  }
  return rows::DecodeCheckpointRow(key, it.value().ToStringView());
}

}  // namespace

std::vector<CheckpointEntry> Store::List() const {
  std::shared_lock lock(mu_);
  std::vector<CheckpointEntry> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  const std::string prefix = rows::kCheckpointRowPrefix;
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    auto e = rows::DecodeCheckpointRow(it->key().ToStringView(), it->value().ToStringView());
    if (e.ok()) {
      out.push_back(std::move(*e));
    } else {
      out.emplace_back();
      out.back().dir = *rows::DirOfCheckpointRowKey(it->key().ToStringView());
    }
  }
  return out;
}

Result<Checkpoint> Store::Load(const std::string& dir) const {
  std::shared_lock lock(mu_);
  // One iterator reads the checkpoint row and the data rows from one snapshot.
  // The rows are decoded once and kept by the caller: their blocks would
  // only fill the block cache (~19 MB uncompressed for 1M chunks).
  rocksdb::ReadOptions read;
  read.fill_cache = false;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(read));
  ASSIGN_OR_RETURN(CheckpointEntry entry, SeekCheckpointRow(*it, dir, path_));
  rows::CheckpointDecoder decoder(entry, /*strict=*/false);
  const std::string end = rows::DataEnd(dir);
  for (it->Seek(rows::DataBegin(dir)); it->Valid() && it->key().compare(end) < 0; it->Next())
    RETURN_IF_ERROR(decoder.Add(it->key().ToStringView(), it->value().ToStringView()).WithContext("index " + path_));
  RETURN_IF_ERROR(FromRocks(it->status(), "read index " + path_));
  auto ckpt = decoder.Finish();
  if (!ckpt.ok()) return ckpt.status().WithContext("index " + path_);
  return ckpt;
}

Result<std::vector<SourceFile>> Store::LoadFiles(const std::string& dir) const {
  std::shared_lock lock(mu_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  ASSIGN_OR_RETURN(CheckpointEntry entry, SeekCheckpointRow(*it, dir, path_));
  rows::CheckpointDecoder decoder(entry, /*strict=*/false);
  const std::string prefix = rows::FilesPrefix(dir);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next())
    RETURN_IF_ERROR(decoder.Add(it->key().ToStringView(), it->value().ToStringView()).WithContext("index " + path_));
  RETURN_IF_ERROR(FromRocks(it->status(), "read index " + path_));
  return decoder.TakeFiles();
}

Status Store::WriteRows(const std::vector<rows::Row>& rows, const std::string& dir, bool replace) {
  if (access_ != Access::kReadWrite) return Status::InvalidArgument("index " + path_ + " is open read-only");
  rocksdb::WriteBatch batch;
  if (replace) {
    // Tombstones only where there are rows, so adding checkpoints does not
    // pile them up.
    std::string value;
    const std::string key = rows::CheckpointRowKey(dir);
    if (db_->Get(rocksdb::ReadOptions(), key, &value).ok()) batch.Delete(key);
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    it->Seek(rows::DataBegin(dir));
    if (it->Valid() && it->key().compare(rows::DataEnd(dir)) < 0)
      batch.DeleteRange(rows::DataBegin(dir), rows::DataEnd(dir));
  }
  for (const rows::Row& r : rows) batch.Put(r.key, r.value);
  if (batch.Count() == 0) return Status::OK();
  // Not synced and not flushed here: a flush per commit costs ~25 ms of
  // fsyncs (24 small checkpoints: 0.7 s instead of 0.1 s). The batch is in
  // the write-ahead log, which survives a killed process and is replayed
  // whole or not at all; the memtable reaches SST files when it fills, when
  // the store closes, or at the next read-write open after a crash.
  return FromRocks(db_->Write(rocksdb::WriteOptions(), &batch), "write index " + path_);
}

Status Store::Flush() {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  return FromRocks(db_->Flush(fo), "flush index " + path_);
}

Status Store::Commit(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(std::vector<rows::Row> rows, rows::EncodeCheckpoint(ckpt, rows::kSourceScan, WallClockNs()));
  std::unique_lock lock(mu_);
  return WriteRows(rows, ckpt.dir, /*replace=*/true);
}

Status Store::Remove(const std::string& dir) {
  std::unique_lock lock(mu_);
  return WriteRows({}, dir, /*replace=*/true);
}

Status Store::WriteRowsWithoutCheckpointRowForTesting(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(std::vector<rows::Row> rows, rows::EncodeCheckpoint(ckpt, rows::kSourceScan, WallClockNs()));
  rows.pop_back();  // the checkpoint row
  std::unique_lock lock(mu_);
  return WriteRows(rows, ckpt.dir, /*replace=*/true);
}

Result<std::vector<rows::Row>> Store::RawRows(const std::string& dir) const {
  std::shared_lock lock(mu_);
  std::vector<rows::Row> out;
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), rows::CheckpointRowKey(dir), &value);
  if (s.ok()) out.push_back({rows::CheckpointRowKey(dir), value});
  else if (!s.IsNotFound()) return FromRocks(s, "read index " + path_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  const std::string end = rows::DataEnd(dir);
  for (it->Seek(rows::DataBegin(dir)); it->Valid() && it->key().compare(end) < 0; it->Next())
    out.push_back({it->key().ToString(), it->value().ToString()});
  RETURN_IF_ERROR(FromRocks(it->status(), "read index " + path_));
  return out;
}

Status Store::Dump(std::ostream& out) const {
  std::shared_lock lock(mu_);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next())
    out << rows::RowToJson(it->key().ToStringView(), it->value().ToStringView()).dump() << "\n";
  return FromRocks(it->status(), "read index " + path_);
}

}  // namespace ckptfs
