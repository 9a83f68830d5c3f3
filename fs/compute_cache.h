// The cache of the compute stage: blocks of computed tensors (dtype casts,
// LoRA merges; core/compute.h), each computed once and kept while readers
// fault its pages.
//
// An mmap reader faults 4 KiB pages in any order, and the kernel asks for
// each page (or read-ahead window) separately: without the cache each of
// those requests would read and compute its whole block again. With it, the
// first request for a block computes it; requests arriving meanwhile wait
// for that one computation instead of starting their own; later ones copy
// from memory.
//
// Memory: cached blocks take at most `budget` bytes (least recently used
// dropped first). Blocks being computed are not counted, so the daemon's
// peak is budget + (FUSE threads computing at once) x (a block's inputs and
// output), each block being ~kComputeBlockBytes of output. A block larger
// than the whole budget is computed for its readers and not kept.
//
// Exact or an error: a hit re-checks the identity of the source files the
// block was computed from (SourceReader::CheckSources), so a source changed
// after the computation is Stale, as a fresh read would be; Drop() forgets a
// checkpoint's blocks when it is unloaded or seen changed. Keys are
// Computation ids, never reused within a process.
//
// Thread-safe; mu_ is never held while reading or computing.
#pragma once

#include <cstdint>
#include <future>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/planner.h"
#include "core/status.h"
#include "source/source_reader.h"

namespace ckptfs {

class ComputeCache {
 public:
  explicit ComputeCache(uint64_t budget_bytes) : budget_(budget_bytes) {}

  // Fills dst at each op's dst_offset with its bytes: blocks from the cache
  // or computed now from inputs read through `reader`. `owner` (the
  // checkpoint) tags new entries for Drop().
  Status Fill(const std::vector<ComputeOp>& ops, char* dst, SourceReader& reader, int owner);

  // Forgets every block of `owner` (waiters of one in flight still get it).
  void Drop(int owner);

  struct Stats {
    uint64_t computed = 0;  // blocks computed
    uint64_t hits = 0;      // requests served from a kept or in-flight block
    uint64_t bytes = 0;     // bytes kept now
  };
  Stats stats() const;

 private:
  struct Block {
    std::shared_ptr<const BlockBytes> bytes;
    std::vector<FileId> files;  // the sources it was computed from
  };
  using Key = std::pair<uint64_t, uint64_t>;  // (Computation id, block)
  struct Slot {
    std::shared_future<Result<Block>> ready;
    int owner = -1;
    uint64_t serial = 0;  // tells this slot from one made after a Drop()
    uint64_t size = 0;  // bytes counted against the budget once kept
    bool kept = false;
    std::list<Key>::iterator lru;
  };

  Result<Block> Get(const Computation& c, uint64_t b, SourceReader& reader, int owner);
  static Result<Block> ComputeBlock(const Computation& c, uint64_t b, SourceReader& reader);
  // Keeps a finished block, dropping least recently used ones beyond the
  // budget. REQUIRES: mu_ held.
  void KeepLocked(const Key& key, uint64_t size);
  void EraseLocked(std::map<Key, Slot>::iterator it);

  const uint64_t budget_;
  mutable std::mutex mu_;  // guards everything below
  std::map<Key, Slot> slots_;
  std::list<Key> lru_;  // kept blocks, most recent first
  uint64_t kept_bytes_ = 0;
  uint64_t serial_ = 0;
  uint64_t computed_ = 0;
  uint64_t hits_ = 0;
};

}  // namespace ckptfs
