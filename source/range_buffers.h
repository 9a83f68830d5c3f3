// Memory for the source ranges a mount's source-order fetches hold
// (source/ordered_fetch.h): aligned, so that a range can be read into it
// with O_DIRECT (SourceObject::ReadOnce), and recycled.
//
// Why recycled. A fresh mapping of a range's size is faulted in page by
// page, each page zeroed first, on every range: measured at 15% of the
// daemon's CPU while it loaded a DCP step from disk. A freed buffer of the
// usual size (the fetch's range bytes) is kept for the next range instead.
// While a file is fetched, up to `keep_idle` wait (two per fetch thread:
// with 16 GETs in flight, a shelf of 8 left half the ranges on fresh
// mappings, 7% of the daemon's CPU over S3); when a fetch ends, Trim()
// leaves kKeepIdle, so the memory a mount keeps between loads stays a few
// ranges. A range of more than half the usual size (one that fills most
// of its window) gets a buffer of the usual size too; a smaller one, and a
// larger one, a mapping of its own size, unmapped when freed: a recycled
// buffer is touched whole, so a small range held in one would cost the
// usual size against the few bytes the fetch's bound counts. A new mapping of 2 MiB or more asks
// for transparent huge pages (MADV_HUGEPAGE): the ranges a fetch holds at
// its peak outnumber the shelf, and each was faulted in 4 KiB at a time.
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
  // Kept between loads (after Trim).
  static constexpr size_t kKeepIdle = 8;

  // `usual`: the size of most buffers taken (a multiple of the page size);
  // a request of up to this many bytes gets a buffer of this size, and only
  // those are kept for reuse, at most `keep_idle` (never fewer than
  // kKeepIdle).
  explicit RangeBuffers(uint64_t usual, size_t keep_idle = kKeepIdle);

  // `bytes` of memory aligned to kDirectAlign (source/direct_io.h), not
  // zeroed when recycled; null when it cannot be mapped.
  std::shared_ptr<char[]> Take(uint64_t bytes);

  // Unmaps the kept buffers beyond kKeepIdle.
  void Trim();

  uint64_t usual() const { return usual_; }
  size_t idle() const;  // kept for reuse now (tests)

 private:
  struct Shelf;  // the kept buffers, shared with the deleters of those handed out
  const uint64_t usual_;
  std::shared_ptr<Shelf> shelf_;
};

}  // namespace ckptfs
