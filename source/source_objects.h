// The open objects of a checkpoint's source files, and whether each is
// still the file that was indexed. A read is exact only while its sources
// are: every reader checks a source's identity after reading it (the open
// object, and the path unless the backend pins reads to a version), and a
// change found once fails every later read of that file with Stale, naming
// what changed. Thread-safe; no lock is held during I/O.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

class SourceObjects {
 public:
  // `files` (a checkpoint's file table) must outlive this.
  SourceObjects(std::shared_ptr<const Source> source, const std::vector<SourceFile>* files);

  // File `id`'s object, opened (and its identity checked) on first use and
  // kept; Stale once the file was seen changed.
  Result<const SourceObject*> Get(FileId id);
  // Compares the file's identity now (open object and path) with the
  // indexed one; a change (a deletion included) is recorded and returned
  // as Stale; a failure to look (an outage) is returned, not recorded.
  Status CheckUnchanged(FileId id, const SourceObject& obj);
  // Get, then CheckUnchanged: after a read of `id`.
  Status Check(FileId id);
  // Identifies every (non-derived) source by path now (IdentitiesNow: a
  // listing per directory where listings tell); Stale naming the first one
  // that changed since indexing, else OK; a failure to look is returned as
  // it is, not recorded (the caller looks again later).
  Status Recheck();
  // True once any source was seen changed.
  bool any_stale() const { return any_stale_.load(); }
  const Source& source() const { return *source_; }

 private:
  // Records `what` changed about file `id`; returns the Stale error.
  Status MarkStale(FileId id, const std::string& what);

  std::shared_ptr<const Source> source_;
  const std::vector<SourceFile>* files_;
  std::mutex mu_;  // guards objects_ and stale_
  std::vector<std::unique_ptr<SourceObject>> objects_;  // null until opened, then never replaced
  std::vector<std::string> stale_;  // non-empty: why file i may no longer be read
  std::atomic<bool> any_stale_{false};
};

}  // namespace ckptfs
