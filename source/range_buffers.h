// Memory for the source ranges a mount's source-order fetches hold
// (source/ordered_fetch.h): aligned, so that a range can be read into it
// with O_DIRECT (SourceObject::ReadOnce), and recycled.
//
// Why recycled. A fresh mapping of a range's size is faulted in page by
// page, each page zeroed first, on every range: measured at 15% of the
// daemon's CPU while it loaded a DCP step from disk. A freed buffer of the
// usual size (the fetch's range bytes) is kept for the next range instead,
// at most kKeepIdle of them, so the memory a mount keeps between loads stays
// a few ranges. Buffers of other sizes (the last range of a span) are
// mapped for the range and unmapped when freed.
//
// Thread-safe. A buffer may outlive the RangeBuffers it came from (the
// copies a reader holds keep it): it is then unmapped when freed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace ckptfs {

class RangeBuffers {
 public:
  // Enough for the fetch threads of a few open files to find one waiting.
  static constexpr size_t kKeepIdle = 8;

  // `usual`: the size of most buffers taken (a multiple of the page size);
  // only buffers of exactly this size are kept for reuse.
  explicit RangeBuffers(uint64_t usual);

  // `bytes` of memory aligned to kDirectAlign (source/direct_io.h), not
  // zeroed when recycled; null when it cannot be mapped.
  std::shared_ptr<char[]> Take(uint64_t bytes);

  uint64_t usual() const { return usual_; }
  size_t idle() const;  // kept for reuse now (tests)

 private:
  struct Shelf;  // the kept buffers, shared with the deleters of those handed out
  const uint64_t usual_;
  std::shared_ptr<Shelf> shelf_;
};

}  // namespace ckptfs
