// StoreLoader: where a VirtualFs gets a checkpoint's rows, and where a live
// mount records the checkpoints it finds.
//
// The store is opened on first use, read-only, so that a mount opens it in
// the daemon after fork (RocksDB's threads do not survive fork) and holds no
// lock: `ckptfs index` and other mounts keep working beside it. A checkpoint
// it does not list yet (committed since) is found after catching up; after
// a load that fails otherwise (a damaged or rebuilt store) it is opened
// again for the next.
// Commit/Remove open the store for writing just for that write and close it
// (flushed), so a mount never keeps it locked; when another process holds
// it, the write is skipped with Busy and the next `ckptfs index` or mount
// indexes the checkpoint instead.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

class Store;

class StoreLoader {
 public:
  StoreLoader(std::string index_path, std::string abs_root);
  ~StoreLoader();

  // Thread-safe.
  Result<Checkpoint> Load(const std::string& dir);
  // The watcher thread's; not concurrent with each other.
  Status Commit(const Checkpoint& ckpt);
  Status Remove(const std::string& dir);

 private:
  Result<std::shared_ptr<Store>> Reader();
  void Drop(const std::shared_ptr<Store>& failed);

  const std::string index_path_, root_;
  std::mutex mu_;  // guards reader_
  std::shared_ptr<Store> reader_;  // shared: a load in flight keeps the one it uses
};

}  // namespace ckptfs
