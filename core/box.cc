#include "core/box.h"

#include <algorithm>
#include <limits>

namespace ckptfs {

uint64_t Box::numel() const {
  uint64_t n = 1;
  for (uint64_t l : lengths) n *= l;
  return n;
}

Box Box::Whole(const Shape& shape) {
  return Box{std::vector<uint64_t>(shape.size(), 0), shape};
}

std::optional<uint64_t> CheckedNumel(const Shape& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / d) return std::nullopt;
    n *= d;
  }
  return n;
}

bool Contains(const Box& outer, const Box& inner) {
  if (outer.rank() != inner.rank()) return false;
  for (size_t i = 0; i < outer.rank(); ++i) {
    if (inner.offsets[i] < outer.offsets[i]) return false;
    if (inner.offsets[i] + inner.lengths[i] > outer.offsets[i] + outer.lengths[i]) return false;
  }
  return true;
}

bool InBounds(const Box& box, const Shape& shape) {
  if (box.rank() != shape.size()) return false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (box.offsets[i] > shape[i] || box.lengths[i] > shape[i] - box.offsets[i]) return false;
  }
  return true;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) return std::nullopt;
  Box out;
  out.offsets.resize(a.rank());
  out.lengths.resize(a.rank());
  for (size_t i = 0; i < a.rank(); ++i) {
    uint64_t lo = std::max(a.offsets[i], b.offsets[i]);
    uint64_t hi = std::min(a.offsets[i] + a.lengths[i], b.offsets[i] + b.lengths[i]);
    if (hi <= lo) return std::nullopt;
    out.offsets[i] = lo;
    out.lengths[i] = hi - lo;
  }
  return out;
}

std::vector<uint64_t> RowMajorStrides(const std::vector<uint64_t>& lengths) {
  std::vector<uint64_t> s(lengths.size(), 1);
  for (size_t i = lengths.size(); i-- > 1;) s[i - 1] = s[i] * lengths[i];
  return s;
}

std::string ToString(const Box& box) {
  std::string s = "[";
  for (size_t i = 0; i < box.rank(); ++i) {
    if (i) s += ", ";
    s += std::to_string(box.offsets[i]) + ":" + std::to_string(box.offsets[i] + box.lengths[i]);
  }
  return s + "]";
}

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace ckptfs
