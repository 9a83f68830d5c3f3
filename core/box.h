// Boxes: n-dimensional index ranges of a tensor (the ShardMeta geometry).
//
// A Box is `offsets` and `lengths` per dimension in element coordinates of
// the global tensor. A 0-d tensor has the empty box (rank 0, numel 1).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

namespace ckptfs {

using Shape = std::vector<uint64_t>;

// The offsets or the lengths of a Box: a vector of uint64_t that holds up to
// kInline values in place and only longer ones on the heap. A checkpoint
// keeps one box per chunk (a million for a large MoE checkpoint), nearly all
// of rank <= 2; as two std::vectors each box cost two heap blocks (64 bytes
// with malloc's headers) on top of its 48. Same size as a std::vector; reads
// as one (converts to Shape, compares with it).
class Dims {
 public:
  using value_type = uint64_t;
  using size_type = size_t;
  using iterator = uint64_t*;
  using const_iterator = const uint64_t*;
  static constexpr uint32_t kInline = 2;

  Dims() = default;
  Dims(std::initializer_list<uint64_t> v) { Assign(v.begin(), v.size()); }
  Dims(const Shape& v) { Assign(v.data(), v.size()); }  // NOLINT: implicit, reads as a Shape
  Dims(size_t n, uint64_t value) { assign(n, value); }
  Dims(const Dims& o) { Assign(o.data(), o.size()); }
  Dims(Dims&& o) noexcept { Steal(o); }
  Dims& operator=(const Dims& o);
  Dims& operator=(Dims&& o) noexcept;
  ~Dims() { Free(); }
  operator Shape() const { return Shape(begin(), end()); }  // NOLINT: implicit

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  uint64_t* data() { return on_heap() ? heap_ : inline_; }
  const uint64_t* data() const { return on_heap() ? heap_ : inline_; }
  uint64_t* begin() { return data(); }
  uint64_t* end() { return data() + size_; }
  const uint64_t* begin() const { return data(); }
  const uint64_t* end() const { return data() + size_; }
  uint64_t& operator[](size_t i) { return data()[i]; }
  uint64_t operator[](size_t i) const { return data()[i]; }
  uint64_t& back() { return data()[size_ - 1]; }
  uint64_t back() const { return data()[size_ - 1]; }

  void push_back(uint64_t v);
  void resize(size_t n, uint64_t value = 0);
  void assign(size_t n, uint64_t value);
  void clear() { size_ = 0; }

  friend bool operator==(const Dims& a, const Dims& b) { return Equal(a, b.data(), b.size()); }
  friend bool operator==(const Dims& a, const Shape& b) { return Equal(a, b.data(), b.size()); }

 private:
  bool on_heap() const { return capacity_ > kInline; }
  void Assign(const uint64_t* v, size_t n);
  void Reserve(size_t n);
  void Steal(Dims& o);
  void Free();
  static bool Equal(const Dims& a, const uint64_t* b, size_t n);

  union {
    uint64_t inline_[kInline];
    uint64_t* heap_;
  };
  uint32_t size_ = 0;
  uint32_t capacity_ = kInline;
};

struct Box {
  Dims offsets;
  Dims lengths;

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
