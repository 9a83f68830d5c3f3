// Pushes whole tensors of a virtual file into the kernel's page cache ahead
// of their reader (ReadOptions::push_tensor_bytes): transformers' load
// touches the first and last MiB of each tensor and reads it whole only
// later, when a source without a page cache (object storage) would fetch it
// again. The first touch of a small enough tensor that continues no stream
// has its sources prefetched (SourcePrefetch), then the tensor read a piece
// at a time by the reader's own checked Execute and handed to a PageSink.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/layout.h"
#include "core/planner.h"
#include "core/status.h"
#include "source/readahead.h"
#include "source/source_prefetch.h"

namespace ckptfs {

// Bytes of a virtual file handed to a PageSink: `len` bytes at `data`.
// Where `fd` >= 0 the same bytes also lie at `fd_offset` of that open file,
// which cannot change until the sink returns (a pinned source,
// SourceObject::Pin): the sink may splice them from the file's page cache
// instead of copying `data`.
struct PageBytes {
  const char* data = nullptr;
  size_t len = 0;
  int fd = -1;
  uint64_t fd_offset = 0;
};

// Receives bytes [offset, offset + bytes.len) of a virtual file, computed
// ahead of its reader, for the kernel's page cache.
using PageSink = std::function<void(uint64_t offset, const PageBytes& bytes)>;

// The mount's push_tensor_bytes over sources that do not cache reads
// (Source::CachesReads): the matrices of models up to a few billion
// parameters; larger tensors (an embedding, say) are read ahead as streams.
inline constexpr uint64_t kPushTensorBytes = 64ull << 20;

class TensorPusher {
 public:
  // Fills dst[0, plan.length) as the plan says, with every check of a read.
  using Execute = std::function<Status(const ReadPlan& plan, char* dst)>;

  // Pushes tensors of at most `max_bytes`; `prefetch` (not owned) brings
  // their sources in first. Both must outlive Stop().
  TensorPusher(uint64_t max_bytes, SourcePrefetch* prefetch, Execute execute)
      : max_bytes_(max_bytes), prefetch_(prefetch), execute_(std::move(execute)) {}
  TensorPusher(const TensorPusher&) = delete;
  TensorPusher& operator=(const TensorPusher&) = delete;

  // Queues the push of segment `unit` of `layout`, from the request at
  // `offset` on, then what lies before, when it is a tensor small enough
  // and `stream` had not claimed it. Never blocks on I/O.
  void Push(ReadStream& stream, const std::shared_ptr<const Layout>& layout, size_t unit, uint64_t offset,
            const PageSink& sink);

  // Drops the pushes not started and waits for the running ones.
  void Stop();

 private:
  // On a push thread, once the sources of windows `ws` are prefetched:
  // reads them a piece at a time into `sink` while `life` holds `want`. A
  // failed read ends the push: the reader's own request reports the cause.
  void Run(const Layout& layout, const std::vector<ReadStream::Window>& ws, const std::atomic<uint64_t>& life,
           uint64_t want, const PageSink& sink);

  uint64_t max_bytes_;
  SourcePrefetch* prefetch_;
  Execute execute_;
  // A tensor at a time each, so that a few tensors' sources are fetched
  // side by side.
  static constexpr size_t kPushers = 4;
  std::array<HintQueue, kPushers> queues_;
  std::atomic<size_t> next_{0};
};

}  // namespace ckptfs
