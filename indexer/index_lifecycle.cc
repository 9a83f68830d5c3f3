#include "indexer/index_lifecycle.h"

#include <algorithm>
#include <set>

#include "indexer/scan.h"
#include "indexer/source_check.h"

namespace ckptfs {

Result<std::unique_ptr<Store>> OpenForUpdate(const std::string& index_path, const std::string& abs_root,
                                             const Notes& note, bool* rebuilt) {
  ASSIGN_OR_RETURN(std::unique_ptr<Store> store, Store::Open(index_path, abs_root, Store::Access::kReadWrite));
  for (const std::string& line : store->notices()) note(line);
  ASSIGN_OR_RETURN(*rebuilt, store->RebuildIfDamaged());
  if (*rebuilt) note(store->notices().back() + "; indexing every checkpoint again");
  return store;
}

Status ApplyScan(Store& store, const Catalog& catalog, bool rebuilt) {
  std::set<std::string> found;
  for (const Checkpoint& ck : catalog.checkpoints) {
    found.insert(ck.dir);
    RETURN_IF_ERROR(store.Commit(ck));
  }
  for (const CheckpointEntry& e : store.List())
    if (!found.count(e.dir)) RETURN_IF_ERROR(store.Remove(e.dir));
  if (!rebuilt) return Status::OK();
  Status s = store.VerifyChecksums();
  if (s.ok()) return s;
  return Status::Corruption(s.message() + "; the index was rebuilt just now and reads back damaged: check the disk "
                            "under " + store.path() + " (or give --index a directory on another disk)");
}

Result<Catalog> ReadCatalog(const Store& store) {
  Catalog catalog;
  catalog.root = store.root();
  for (const CheckpointEntry& e : store.List()) {
    ASSIGN_OR_RETURN(Checkpoint ck, store.Load(e.dir));
    catalog.indexed_at_ns = std::max(catalog.indexed_at_ns, e.committed_at_ns);
    catalog.checkpoints.push_back(std::move(ck));
  }
  return catalog;
}

bool MissesCheckpoints(const Store& store, const Source& source) {
  std::set<std::string> stored;
  for (const CheckpointEntry& e : store.List()) stored.insert(e.dir);
  for (const std::string& dir : FindCheckpointDirs(source))
    if (!stored.count(dir)) return true;
  return false;
}

Result<std::vector<std::string>> FreshCheckpoints(const Source& source, const Store& store) {
  std::vector<std::string> dirs;
  for (const CheckpointEntry& e : store.List()) {
    auto files = store.LoadFiles(e.dir);
    if (!files.ok()) return files.status();
    Status st = CheckSources(source, *files);
    if (!st.ok()) return st.code() == Status::Code::kStale ? st : Status::Stale(st.message());
    dirs.push_back(e.dir);
  }
  return dirs;
}

Result<std::unique_ptr<Store>> OpenForReading(const Source& source, const std::string& index_path,
                                              const std::string& abs_root, const ReadOpenOptions& options) {
  auto store = Store::Open(index_path, abs_root, Store::Access::kReadOnly);
  const bool newer = store.ok() && !options.reindex && MissesCheckpoints(**store, source);
  if (newer) {
    options.note("checkpoints were saved under " + abs_root + " since it was indexed; indexing them");
    store = Status::NotFound("re-index");  // closes the read-only store before writing
  }
  if (options.reindex || newer || (!store.ok() && store.status().code() == Status::Code::kNotFound)) {
    Status built = options.build();
    if (newer && built.code() == Status::Code::kBusy)
      options.note("warning: the newer checkpoints are not listed until that process is done");
    else if (!built.ok())
      return built;
    store = Store::Open(index_path, abs_root, Store::Access::kReadOnly);
  }
  return store;
}

}  // namespace ckptfs
