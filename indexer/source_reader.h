// Executes read plans against the source files of a catalog: the one place
// where the read path touches the disk, shared by the mount and the CLI.
//
// Files are opened lazily on first use. At open, the file's size, mtime and
// inode must match what was indexed; on every read, fstat re-checks size and
// mtime (cheap next to a 1 MiB pread), so a source modified in place after
// indexing is answered with Stale, never with stale or mixed bytes.
#pragma once

#include <atomic>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/planner.h"
#include "core/status.h"

namespace ckptfs {

// Derived sources (decoded transformed items) are decoded on first read and
// kept in an LRU cache bounded by `decoded_cache_bytes`.
class SourceReader {
 public:
  // `catalog` must outlive the reader.
  explicit SourceReader(const Catalog* catalog, GroupPolicy policy = {}, uint64_t decoded_cache_bytes = 1ull << 30);
  ~SourceReader();
  SourceReader(const SourceReader&) = delete;
  SourceReader& operator=(const SourceReader&) = delete;

  // Fills dst[0, plan.length) as the plan says. Thread-safe.
  Status Execute(const ReadPlan& plan, char* dst);

  // Bytes read from source files so far (for benchmarks).
  uint64_t bytes_read() const;

 private:
  Result<int> Fd(FileId id);
  Status CheckUnchanged(FileId id, int fd);
  // The decoded bytes of derived source `id`, from the cache or decoded now.
  Result<std::shared_ptr<const std::string>> Decoded(FileId id);

  const Catalog* catalog_;
  GroupPolicy policy_;
  std::mutex mu_;            // guards fds_; never held during I/O
  std::vector<int> fds_;     // -1 until opened
  std::unique_ptr<std::atomic<uint64_t>> bytes_read_;

  uint64_t decoded_budget_;
  std::mutex cache_mu_;  // guards the cache; decoding happens outside it
  std::list<FileId> lru_;  // most recent first
  std::map<FileId, std::pair<std::shared_ptr<const std::string>, std::list<FileId>::iterator>> cache_;
  uint64_t cached_bytes_ = 0;
};

}  // namespace ckptfs
