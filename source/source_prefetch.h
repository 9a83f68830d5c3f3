// SourcePrefetch: the read-ahead of one checkpoint's sources for
// SourceReader::ReadAhead (source/source_reader.h).
//
// A window of a sequential reader's virtual file is planned on a background
// thread (HintQueue, source/readahead.h) and its source ranges read into the
// page cache through second objects of the sources, so the objects the
// requests read keep their own read-ahead state (for POSIX, sendfile() into
// /dev/null: source/posix_source.cc says why). The bytes are only cached
// here; the request that needs them still reads and checks them.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/meta.h"
#include "core/planner.h"
#include "source/readahead.h"
#include "source/source.h"

namespace ckptfs {

class SourcePrefetch {
 public:
  // The identity-checked object of source `id`; a second object is made
  // from it (SourceObject::Reopen).
  using CheckedObject = std::function<Result<const SourceObject*>(FileId id)>;
  // `files` (a checkpoint's file table) must outlive the prefetch.
  SourcePrefetch(const std::vector<SourceFile>* files, GroupPolicy policy, CheckedObject checked);

  // At most this many second objects (descriptors) are kept open, oldest
  // closed first.
  static constexpr size_t kMaxObjects = 32;

  // Queues the prefetch of window `w` of the virtual file laid out by
  // `layout`; it stops once `generation` no longer holds its value now.
  // `then`, if any, runs on the prefetch thread once the window's sources
  // are queued or read, unless the prefetch stopped or was dropped.
  void Post(std::shared_ptr<const Layout> layout, ReadStream::Window w,
            std::shared_ptr<const std::atomic<uint64_t>> generation, std::function<void()> then = {});
  // Drops the jobs not started and waits for the running one.
  void Stop() { hints_.Stop(); }

 private:
  // Prefetches the sources of window `w`, in the file's order (see
  // kHintSlice in the .cc), while `generation` still equals `want`.
  void HintWindow(const Layout& layout, ReadStream::Window w, const std::atomic<uint64_t>* generation,
                  uint64_t want);
  // Brings the ranges of `reads` into the cache, waiting for the I/O,
  // while `generation` still equals `want`.
  void Prefetch(const std::vector<SourceRead>& reads, const std::atomic<uint64_t>& generation, uint64_t want);
  // A second object of source `id`, or null when there is none to have.
  const SourceObject* PrefetchObject(FileId id);

  const std::vector<SourceFile>* files_;
  GroupPolicy policy_;
  CheckedObject checked_;
  // The hint thread's own objects, oldest first:
  std::vector<std::pair<FileId, std::unique_ptr<SourceObject>>> objects_;
  HintQueue hints_;  // declared last: stopped before the objects its jobs use go
};

}  // namespace ckptfs
