// The read planner: (layout, byte range) -> copy operations.
//
// For each segment overlapping the range, a tensor region is split into runs
// contiguous in both the target (row-major in the region's box) and a source
// chunk; the runs overlapping the range are found by binary search, so a 1 MiB
// read of a huge tensor costs O(chunks * log + runs in range), not O(tensor).
// Neighbouring copies (adjacent in target and source) are coalesced.
//
// The plan covers the range exactly or planning fails: a hole, an unreadable
// chunk or a tensor with a coverage problem is an error, never zero bytes.
//
// GroupReads() then turns many small copies from one file into a few covering
// reads plus in-memory gathers (a column-sharded tensor yields one small run
// per row per shard; reading each with its own pread would cost thousands of
// syscalls per MiB).
#pragma once

#include <cstdint>
#include <vector>

#include "core/layout.h"
#include "core/status.h"

namespace ckptfs {

struct CopyOp {
  FileId file = 0;
  uint64_t src_offset = 0;  // absolute, in the source file
  uint64_t dst_offset = 0;  // relative to the start of the read (or of scratch)
  uint64_t length = 0;
  bool to_scratch = false;  // lands in the plan's scratch buffer, for a ConvertOp
  // Non-null when the bytes are where a prediction says and its item's
  // framing was not read yet (ItemCheck, core/meta.h): served only once the
  // item is settled as predicted; settled otherwise, the plan is made again.
  ItemCheck* speculative = nullptr;
};

// Decodes elements gathered in scratch into float32 bytes of the output.
struct ConvertOp {
  DType from = DType::kF32;
  uint64_t scratch_offset = 0;  // where element 0 of this run starts in scratch
  uint64_t first = 0;           // first element to decode, from that start
  uint64_t count = 0;           // elements to decode
  uint64_t dst_offset = 0;
  uint64_t skip = 0;            // bytes of the first decoded value to drop
  uint64_t length = 0;          // bytes written to the destination
};

// Bytes [offset, offset + length) of a computed tensor's output, to be
// computed (or taken from a cache) by the executor: see core/compute.h.
struct ComputeOp {
  const Computation* computed = nullptr;  // owned by the Layout; valid while it lives
  uint64_t offset = 0;                    // in the computed tensor's output
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

struct LiteralOp {
  const char* data = nullptr;  // points into the Layout; valid while it lives
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

struct ReadPlan {
  std::vector<CopyOp> copies;      // sorted by (to_scratch, dst_offset), coalesced
  std::vector<LiteralOp> literals;
  std::vector<ConvertOp> converts;
  std::vector<ComputeOp> computes;  // not run by SourceReader::Execute
  uint64_t scratch_size = 0;       // bytes of scratch the copies fill
  uint64_t length = 0;             // bytes the plan fills (range clipped to EOF)
};

// Plans bytes [offset, offset + length) of `layout`, clipped to its size.
Result<ReadPlan> Plan(const Layout& layout, uint64_t offset, uint64_t length);

// One pread of [offset, offset + length) of `file`, scattered by `gathers`.
struct SourceRead {
  struct Gather {
    uint64_t read_offset;  // within this read
    uint64_t dst_offset;   // within the destination buffer (or scratch)
    uint64_t length;
    bool to_scratch = false;
  };
  FileId file = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<Gather> gathers;

  // True when the read lands in the destination as is (no scratch buffer).
  bool direct() const {
    return gathers.size() == 1 && gathers[0].read_offset == 0 && gathers[0].length == length &&
           !gathers[0].to_scratch;
  }
};

struct GroupPolicy {
  // Copies from one file are merged into one read while the gap between them
  // is at most `max_gap` bytes and the read stays below `max_span`. A gap
  // within one page costs no extra I/O (the kernel reads whole pages), so
  // 4 KiB merges the row pieces of column-sharded tensors into one read
  // without pulling in bytes another rank's view needs; measured with
  // bench/bench_views.py (64 KiB read 2.45x the bytes of a tp4 rank view
  // whose rows are 512 bytes; 4 KiB, see docs/BENCHMARKS.md). 8 MiB bounds
  // the scratch buffer.
  uint64_t max_gap = 4 << 10;
  uint64_t max_span = 8 << 20;
};

std::vector<SourceRead> GroupReads(const std::vector<CopyOp>& copies, const GroupPolicy& policy = {});

}  // namespace ckptfs
