// The store: one RocksDB database per source root, holding its checkpoints
// as rows (schema 2, docs/INDEX.md; the rows themselves: indexer/store_rows.h).
// Its .cc files (index_store.cc: the rows API; store_open.cc: where a store
// lives and how it opens; commit_record_sst.cc: writers' commit records)
// are the only places that know RocksDB exists.
//
// On disk the store is a directory carrying a marker file, CKPTFS_STORE
// ({"schema": 2, "root": ...}), beside RocksDB's own files. ckptfs writes
// into, and deletes from, only a directory that carries the marker (or an
// index of schema 1, which it recognises and rebuilds).
//
// Each checkpoint is committed in one atomic write ending with its
// checkpoint row (its commit point, rows::CheckpointRowKey); a checkpoint
// without one does not exist for readers. Committing or removing one
// checkpoint touches no row of another.
//
// One process writes a store at a time (kReadWrite holds RocksDB's lock and
// writes its pid into `writer.pid` next to the marker); any number read it
// (kReadOnly), each seeing the commits that existed when it opened or last
// called CatchUp().
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "indexer/store_rows.h"

namespace rocksdb {
class DB;
}

namespace ckptfs {

inline constexpr int kIndexSchemaVersion = rows::kSchemaVersion;
inline constexpr char kStoreMarker[] = "CKPTFS_STORE";
inline constexpr char kStorePidFile[] = "writer.pid";

// Where an index for `root` lives unless --index says otherwise:
// $CKPTFS_INDEX_DIR, else $XDG_CACHE_HOME/ckptfs, else ~/.cache/ckptfs,
// then "<basename>-<hash of the absolute path>".
std::string DefaultIndexPath(const std::string& abs_root);

class Store {
 public:
  enum class Access { kReadOnly, kReadWrite };

  // kReadWrite creates the store when `index_path` is absent or an empty
  // directory, and refuses (InvalidArgument, saying what to do) a file, a
  // directory without the marker, or the store of another root. A schema 1
  // index, or a store whose database is damaged, is rebuilt empty (see
  // notices()). A second kReadWrite open while one is held fails with
  // Status::Busy naming the holder's pid.
  // kReadOnly writes nothing; NotFound when there is no store yet or it is
  // of schema 1 (`ckptfs index` rebuilds it).
  static Result<std::unique_ptr<Store>> Open(const std::string& index_path, const std::string& abs_root,
                                             Access access);
  ~Store();  // flushes and releases the lock (kReadWrite)
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const std::string& path() const { return path_; }
  const std::string& root() const { return root_; }
  bool rebuilt_from_v1() const { return rebuilt_from_v1_; }
  // One line per thing Open did that a user should hear of (a schema 1
  // index or a damaged store rebuilt, stale temporary directories removed).
  const std::vector<std::string>& notices() const { return notices_; }

  // Every committed checkpoint, by dir. An entry whose checkpoint row cannot
  // be decoded has an empty `format`; Load() of it says why.
  std::vector<CheckpointEntry> List() const;
  // All rows of one committed checkpoint; NotFound without a checkpoint row.
  Result<Checkpoint> Load(const std::string& dir) const;
  // Only the source files of one committed checkpoint (their identity when
  // indexed): what a staleness check needs, without reading its tensors.
  Result<std::vector<SourceFile>> LoadFiles(const std::string& dir) const;
  // Replaces the rows of ckpt.dir (one WriteBatch, checkpoint row last).
  // Rows reach SST files when the memtable fills and when the store closes.
  Status Commit(const Checkpoint& ckpt);
  Status Remove(const std::string& dir);
  // A writer's commit record (WriteCommitRecord). Its rows are checked as
  // untrusted input first (keys of one checkpoint only, paths inside it,
  // counts and file ids consistent). When it lies at
  // `<root>/<dir>/.ckptfs/commit.sst` the checkpoint is stored as `<dir>`,
  // whatever root its writer had; elsewhere, as the dir it names.
  Status Ingest(const std::string& sst_path);
  // kReadOnly: see the commits made since Open (or the last CatchUp).
  Status CatchUp();

  // Reads every block of every table file and checks its checksum: a full
  // scan of the store, what Open cannot afford (it reads only the tables'
  // footers and indexes). kReadWrite flushes the memtable first, so the
  // rows committed so far are checked too. Corruption names the damage.
  Status VerifyChecksums();
  // kReadWrite: VerifyChecksums, and a store found damaged is removed and
  // recreated empty, as Open does with one that cannot be opened (the store
  // is derived data: the caller commits every checkpoint again). Returns
  // true when it rebuilt the store; notices() says why.
  Result<bool> RebuildIfDamaged();

  // Every row as one JSON object per line ({"key", "value"}, values decoded).
  Status Dump(std::ostream& out) const;
  // The raw rows of `dir`: its checkpoint row then its data rows.
  Result<std::vector<rows::Row>> RawRows(const std::string& dir) const;
  // Writes ckpt's data rows without their checkpoint row, as a commit killed
  // before that row was written would leave them. For tests.
  Status WriteRowsWithoutCheckpointRowForTesting(const Checkpoint& ckpt);

 private:
  Store(std::string path, std::string root, Access access);
  Status OpenDatabase();
  Status OpenReadWrite();
  Status OpenReadOnly();
  Status OpenReadOnlyOnce();
  Status CheckSchema();
  Status Rebuild(const std::string& why);
  Status WriteRows(const std::vector<rows::Row>& rows, const std::string& dir, bool replace);
  Status Flush();
  Result<std::string> DirForIngest(const std::string& sst_path, const std::string& named) const;

  std::string path_, root_;
  Access access_;
  std::unique_ptr<rocksdb::DB> db_;
  int lock_fd_ = -1;  // writer.pid, flock()ed while kReadWrite
  bool rebuilt_from_v1_ = false;
  std::vector<std::string> notices_;
  // Readers hold it shared; CatchUp() swaps db_ under it exclusively.
  // Writes (Commit, Remove, Ingest) also take it exclusively, one at a time.
  mutable std::shared_mutex mu_;
};

}  // namespace ckptfs
