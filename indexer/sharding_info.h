// DCP_SHARDING_INFO of a sharded safetensors file (docs/FORMATS.md):
// {fqn: {"saved_offsets": [non-negative ints], ...}}, the place of each of
// the file's chunks in its tensor.
//
// Read by a SAX pass into one sorted vector: one allocation per entry (its
// fqn). A DOM holds five or more small blocks per entry, and a scan frees
// them file after file; 1M of them per scan kept malloc on its slow path
// (ckptfs index, docs/BENCHMARKS.md "The store at 1M chunks").
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/box.h"
#include "core/status.h"

namespace ckptfs {

class ShardingInfo {
 public:
  // Parses `text`, the value of metadata key `key` (named in messages).
  // Corruption when it is not an object, an fqn has no saved_offsets list,
  // or a list holds anything but non-negative integers. A repeated fqn (or
  // a repeated saved_offsets) keeps its last value, as JSON parsers do.
  static Result<ShardingInfo> Parse(const std::string& key, std::string_view text);

  // The saved_offsets of `fqn`, or nullptr when it has none.
  const Dims* Find(std::string_view fqn) const;
  size_t size() const { return entries_.size(); }

 private:
  std::vector<std::pair<std::string, Dims>> entries_;  // sorted by fqn, unique
};

}  // namespace ckptfs
