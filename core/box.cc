#include "core/box.h"

#include <algorithm>
#include <limits>

namespace ckptfs {

Dims& Dims::operator=(const Dims& o) {
  if (this != &o) Assign(o.data(), o.size());
  return *this;
}

Dims& Dims::operator=(Dims&& o) noexcept {
  if (this != &o) {
    Free();
    Steal(o);
  }
  return *this;
}

void Dims::push_back(uint64_t v) {
  if (size_ == capacity_) Reserve(size_t(capacity_) * 2);
  data()[size_++] = v;
}

void Dims::resize(size_t n, uint64_t value) {
  Reserve(n);
  for (size_t i = size_; i < n; ++i) data()[i] = value;
  size_ = uint32_t(n);
}

void Dims::assign(size_t n, uint64_t value) {
  size_ = 0;
  resize(n, value);
}

// Keeps the current storage when it is large enough (no shrinking: a box
// reassigned to a lower rank keeps its block until destroyed).
void Dims::Assign(const uint64_t* v, size_t n) {
  size_ = 0;
  Reserve(n);
  std::copy(v, v + n, data());
  size_ = uint32_t(n);
}

void Dims::Reserve(size_t n) {
  if (n <= capacity_) return;
  uint64_t* block = new uint64_t[n];
  std::copy(begin(), end(), block);
  Free();
  heap_ = block;
  capacity_ = uint32_t(n);
}

void Dims::Steal(Dims& o) {
  if (o.on_heap()) {
    heap_ = o.heap_;
  } else {
    std::copy(o.inline_, o.inline_ + o.size_, inline_);
  }
  size_ = o.size_;
  capacity_ = o.capacity_;
  o.size_ = 0;
  o.capacity_ = kInline;
}

void Dims::Free() {
  if (on_heap()) delete[] heap_;
  capacity_ = kInline;
}

bool Dims::Equal(const Dims& a, const uint64_t* b, size_t n) {
  return a.size() == n && std::equal(a.begin(), a.end(), b);
}

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

namespace {

// Boxes for [begin, end) of the sub-block at dimension `d` whose leading
// indices are `prefix` (flat offsets relative to that sub-block).
void Decompose(const Shape& shape, size_t d, std::vector<uint64_t>& prefix, uint64_t begin, uint64_t end,
               uint64_t base, std::vector<std::pair<Box, uint64_t>>& out) {
  if (begin >= end) return;
  const size_t n = shape.size();
  uint64_t inner = 1;
  for (size_t k = d + 1; k < n; ++k) inner *= shape[k];
  auto emit = [&](uint64_t lo, uint64_t hi) {  // full rows [lo, hi) at dim d
    Box b;
    for (uint64_t p : prefix) b.offsets.push_back(p), b.lengths.push_back(1);
    b.offsets.push_back(lo);
    b.lengths.push_back(hi - lo);
    for (size_t k = d + 1; k < n; ++k) b.offsets.push_back(0), b.lengths.push_back(shape[k]);
    out.push_back({b, base + lo * inner});
  };
  uint64_t i0 = begin / inner, i1 = (end - 1) / inner;
  auto recurse = [&](uint64_t i, uint64_t lo, uint64_t hi) {
    prefix.push_back(i);
    Decompose(shape, d + 1, prefix, lo, hi, base + i * inner, out);
    prefix.pop_back();
  };
  if (i0 == i1 && !(begin % inner == 0 && end - begin == inner)) return recurse(i0, begin - i0 * inner, end - i0 * inner);
  uint64_t first_full = i0, last_full = i1 + 1;  // full rows [first_full, last_full)
  if (begin % inner != 0) {
    recurse(i0, begin % inner, inner);
    first_full = i0 + 1;
  }
  if (end % inner != 0) last_full = i1;
  if (first_full < last_full) emit(first_full, last_full);
  if (end % inner != 0) recurse(i1, 0, end % inner);
}

}  // namespace

std::vector<std::pair<Box, uint64_t>> FlatRangeToBoxes(const Shape& shape, uint64_t begin, uint64_t end) {
  std::vector<std::pair<Box, uint64_t>> out;
  if (shape.empty()) {
    if (begin == 0 && end == 1) out.push_back({Box{}, 0});
    return out;
  }
  std::vector<uint64_t> prefix;
  Decompose(shape, 0, prefix, begin, end, 0, out);
  return out;
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
