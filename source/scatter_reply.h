// A read's result as a scatter list: pieces in file order, each pointing
// into memory the reply owns (the buffers the source reads filled, a gather
// buffer for bytes computed or copied here). The mount sends it with one
// writev (fuse_reply_iov), so a byte read from the source is not copied
// again to put it in place (docs/BENCHMARKS.md, "Cold reads").
//
// Built by SourceReader::ExecuteScatter and VirtualFs::ReadScatter; no FUSE
// type appears here.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "source/direct_io.h"

namespace ckptfs {

class ScatterReply {
 public:
  // A writev takes at most IOV_MAX (1024) pieces and FUSE puts its header
  // in the first, so a reply sends at most this many of its own.
  static constexpr size_t kMaxPieces = 1023;

  ScatterReply() = default;
  ScatterReply(ScatterReply&&) = default;
  ScatterReply& operator=(ScatterReply&&) = default;

  // Sets aside `bytes` of gather memory, handed out by Reserve. Call once,
  // before Reserve.
  void ReserveGather(uint64_t bytes);
  // `length` bytes of the gather memory, placed at `dst_offset` of the
  // result; the caller writes them.
  char* Reserve(uint64_t dst_offset, uint64_t length);
  // `length` bytes at `data`, placed at `dst_offset`; `data` must stay valid
  // as long as the reply (in a Keep()t buffer, say).
  void Add(uint64_t dst_offset, const char* data, uint64_t length);
  void Keep(Buffer buffer) { buffers_.push_back(std::move(buffer)); }
  void Keep(std::shared_ptr<const void> bytes) { shared_.push_back(std::move(bytes)); }

  // Orders the pieces, checks they tile [0, length()) with no hole or
  // overlap (Corruption if not: a planning bug, never served) and joins
  // neighbours adjacent in memory. When more than `max_pieces` remain, the
  // run of neighbours with the fewest bytes that brings them down to
  // `max_pieces` is copied into one gathered piece (a 1 MiB request of a
  // tensor split over 8 ranks by columns of 1 KiB rows has 1024 pieces:
  // two are copied, not all).
  Status Finish(size_t max_pieces = kMaxPieces);

  // After Finish: the pieces, and their total length.
  const std::vector<struct iovec>& iov() const { return iov_; }
  uint64_t length() const { return length_; }
  // Copies the bytes, in order, to `dst` (length() bytes).
  void CopyTo(char* dst) const;

 private:
  // Replaces the `run` neighbouring pieces with the fewest bytes by one
  // gathered copy of them.
  void GatherRun(size_t run);

  struct Piece {
    uint64_t dst_offset;
    const char* data;
    uint64_t length;
  };
  std::vector<Piece> pieces_;
  std::vector<struct iovec> iov_;
  uint64_t length_ = 0;
  Buffer gather_;
  uint64_t gather_used_ = 0;
  std::vector<Buffer> buffers_;
  std::vector<std::shared_ptr<const void>> shared_;
};

}  // namespace ckptfs
