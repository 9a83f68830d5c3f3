// Boxes: n-dimensional index ranges of a tensor (the ShardMeta geometry).
//
// A Box is `offsets` and `lengths` per dimension in element coordinates of
// the global tensor. A 0-d tensor has the empty box (rank 0, numel 1).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ckptfs {

using Shape = std::vector<uint64_t>;

struct Box {
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> lengths;

  size_t rank() const { return lengths.size(); }
  // Product of lengths (1 for rank 0). Callers validate shapes with
  // CheckedNumel first, so this does not overflow on indexed data.
  uint64_t numel() const;
  bool empty() const { return numel() == 0; }
  bool operator==(const Box&) const = default;

  // The box covering all of `shape`.
  static Box Whole(const Shape& shape);
};

// Product of dims, or nullopt on uint64 overflow.
std::optional<uint64_t> CheckedNumel(const Shape& shape);

// True when `inner` lies inside `outer` (same rank).
bool Contains(const Box& outer, const Box& inner);
// True when `box` lies inside [0, shape).
bool InBounds(const Box& box, const Shape& shape);
// The common part of a and b, or nullopt when they share no element.
std::optional<Box> Intersect(const Box& a, const Box& b);
// Row-major element strides of `lengths`.
std::vector<uint64_t> RowMajorStrides(const std::vector<uint64_t>& lengths);

// Splits the C-order flat element range [begin, end) of `shape` into boxes,
// each contiguous in that order, in order; returns each box with the flat
// index of its first element. At most 2 * rank - 1 boxes. Used to turn
// flattened shards (distributed optimizer, FSDP flat parameters) back into
// regular chunks.
std::vector<std::pair<Box, uint64_t>> FlatRangeToBoxes(const Shape& shape, uint64_t begin, uint64_t end);

// "[0:7, 16:32]" (half-open ranges per dimension); "[]" for rank 0.
std::string ToString(const Box& box);
// "[7, 32]"
std::string ShapeToString(const Shape& shape);

}  // namespace ckptfs
