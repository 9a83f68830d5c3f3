// Executes read plans against the source files of one checkpoint: the one
// place where the read path touches the disk, shared by the mount and the CLI.
//
// Files are opened lazily on first use; at open their identity (size, mtime,
// ctime, inode) must match what was indexed. Every request checks it again
// AFTER its reads, on the open descriptor and on the path: a writer updates
// mtime/ctime before its data becomes visible, so bytes read before an
// unchanged identity was seen are the indexed bytes. A source changed,
// truncated, rewritten with its mtime set back, renamed over or deleted
// after indexing is answered with Stale, never with stale, mixed or zeroed
// bytes (a short read is Corruption). Once a file is seen changed, every
// later read of it fails at once.
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
  // `root` is the absolute source root; `files` (a checkpoint's file table)
  // must outlive the reader.
  SourceReader(std::string root, const std::vector<SourceFile>* files, GroupPolicy policy = {},
               uint64_t decoded_cache_bytes = 1ull << 30);
  ~SourceReader();
  SourceReader(const SourceReader&) = delete;
  SourceReader& operator=(const SourceReader&) = delete;

  // Fills dst[0, plan.length) as the plan says. Thread-safe.
  Status Execute(const ReadPlan& plan, char* dst);

  // Bytes read from source files so far (for benchmarks).
  uint64_t bytes_read() const;

  // True once any source was seen changed (reads of it fail from then on).
  bool any_stale() const { return any_stale_->load(); }

  // Stats every (non-derived) source by path now; Stale naming the first
  // one that changed since indexing (it then fails every read), else OK.
  Status Recheck();

 private:
  Result<int> Fd(FileId id);
  // Compares the file's identity now (descriptor and path) with the indexed one.
  Status CheckUnchanged(FileId id, int fd);
  Status ReadOne(const SourceRead& r, char* dst, char* converted, std::vector<char>& scratch);
  const std::string& PathOf(FileId id) const { return (*files_)[id].path; }
  // The decoded bytes of derived source `id`, from the cache or decoded now.
  Result<std::shared_ptr<const std::string>> Decoded(FileId id);

  std::string root_;
  const std::vector<SourceFile>* files_;
  GroupPolicy policy_;
  std::mutex mu_;            // guards fds_ and stale_; never held during I/O
  std::vector<int> fds_;     // -1 until opened
  std::vector<std::string> stale_;  // non-empty: why file i may no longer be read
  std::unique_ptr<std::atomic<uint64_t>> bytes_read_;
  std::unique_ptr<std::atomic<bool>> any_stale_;

  uint64_t decoded_budget_;
  std::mutex cache_mu_;  // guards the cache; decoding happens outside it
  std::list<FileId> lru_;  // most recent first
  std::map<FileId, std::pair<std::shared_ptr<const std::string>, std::list<FileId>::iterator>> cache_;
  uint64_t cached_bytes_ = 0;
};

}  // namespace ckptfs
