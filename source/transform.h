// Decoding of transformed items (DCP `transform_descriptors`, torch >= 2.7):
// today "stream.zstd/1", a zstd stream around the item's bytes.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

// "zstd" for a descriptor this build decodes ("stream.zstd/1"); "" otherwise.
std::string TransformName(const std::string& descriptor);

// Decodes [offset, offset + length) of `in` with `transform`. Fails
// (Corruption) on a malformed stream or one decoding to more than
// `max_bytes` (a bound on memory for hostile input).
Result<std::string> DecodeItem(const std::string& transform, const SourceObject& in, uint64_t offset, uint64_t length,
                               uint64_t max_bytes, const std::string& what);

// Decoded items of one checkpoint kept for their next reads, the least
// recently used dropped first beyond `budget` bytes (the one just added is
// always kept). Thread-safe; decoding happens outside it.
class DecodedCache {
 public:
  explicit DecodedCache(uint64_t budget) : budget_(budget) {}
  // Item `id`'s bytes, now the most recently used; null when not kept.
  std::shared_ptr<const std::string> Find(FileId id);
  // Keeps `value` as item `id`, unless another thread kept it first.
  void Add(FileId id, std::shared_ptr<const std::string> value);

 private:
  uint64_t budget_;
  std::mutex mu_;  // guards the fields below
  std::list<FileId> lru_;  // most recent first
  std::map<FileId, std::pair<std::shared_ptr<const std::string>, std::list<FileId>::iterator>> cache_;
  uint64_t cached_bytes_ = 0;
};

}  // namespace ckptfs
