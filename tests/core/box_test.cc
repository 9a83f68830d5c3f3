#include "core/box.h"

#include <gtest/gtest.h>

#include <limits>

namespace ckptfs {
namespace {

TEST(Box, IntersectOverlappingBoxes) {
  Box a{{0, 2}, {4, 4}}, b{{3, 0}, {4, 3}};
  auto i = Intersect(a, b);
  ASSERT_TRUE(i.has_value());
  EXPECT_EQ(*i, (Box{{3, 2}, {1, 1}}));
}

TEST(Box, IntersectDisjointIsEmpty) {
  EXPECT_FALSE(Intersect(Box{{0}, {3}}, Box{{3}, {2}}).has_value());
}

TEST(Box, RankZeroIntersectsItself) {
  auto i = Intersect(Box{}, Box{});
  ASSERT_TRUE(i.has_value());
  EXPECT_EQ(i->numel(), 1u);
}

TEST(Box, CheckedNumelDetectsOverflow) {
  uint64_t big = std::numeric_limits<uint64_t>::max() / 2;
  EXPECT_FALSE(CheckedNumel({big, 3}).has_value());
  EXPECT_EQ(*CheckedNumel({big, 0}), 0u);
  EXPECT_EQ(*CheckedNumel({}), 1u);
}

TEST(Box, InBoundsRejectsOffsetPlusLengthPastShape) {
  EXPECT_TRUE(InBounds(Box{{2}, {3}}, {5}));
  EXPECT_FALSE(InBounds(Box{{3}, {3}}, {5}));
  // offset + length would wrap around uint64.
  EXPECT_FALSE(InBounds(Box{{1}, {std::numeric_limits<uint64_t>::max()}}, {5}));
}

// Every flat range of every small shape: the boxes are in order, contiguous
// in C order, and cover exactly the range.
TEST(Box, FlatRangeToBoxesCoversExactlyTheRange) {
  for (Shape shape : {Shape{5}, Shape{3, 4}, Shape{2, 3, 4}, Shape{2, 1, 3, 2}}) {
    uint64_t n = Box::Whole(shape).numel();
    for (uint64_t b = 0; b <= n; ++b)
      for (uint64_t e = b; e <= n; ++e) {
        auto boxes = FlatRangeToBoxes(shape, b, e);
        EXPECT_LE(boxes.size(), 2 * shape.size());
        uint64_t at = b;
        for (const auto& [box, start] : boxes) {
          EXPECT_EQ(start, at) << ShapeToString(shape) << " " << b << ".." << e;
          // Row-major walk of the box must visit flat indices start, start+1, ...
          std::vector<uint64_t> idx = box.offsets;
          for (uint64_t k = 0; k < box.numel(); ++k) {
            uint64_t flat = 0;
            for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + idx[d];
            ASSERT_EQ(flat, start + k) << ToString(box);
            for (size_t d = shape.size(); d-- > 0;) {
              if (++idx[d] < box.offsets[d] + box.lengths[d]) break;
              idx[d] = box.offsets[d];
            }
          }
          at += box.numel();
        }
        EXPECT_EQ(at, e) << ShapeToString(shape) << " " << b << ".." << e;
      }
  }
}

TEST(Box, ToStringIsHalfOpenRanges) {
  EXPECT_EQ(ToString(Box{{0, 16}, {7, 16}}), "[0:7, 16:32]");
  EXPECT_EQ(ToString(Box{}), "[]");
}

// Dims keeps ranks <= kInline inside the Box and longer ones on the heap;
// either way it must read exactly as the std::vector it replaced.
bool StoredInside(const Box& b, const Dims& d) {
  const char* p = reinterpret_cast<const char*>(d.data());
  const char* self = reinterpret_cast<const char*>(&b);
  return p >= self && p < self + sizeof b;
}

TEST(Dims, RoundTripsBoxesOfRankZeroToEight) {
  for (size_t rank = 0; rank <= 8; ++rank) {
    std::vector<uint64_t> offsets, lengths;
    for (size_t d = 0; d < rank; ++d) {
      offsets.push_back(1000 * d + 7);
      lengths.push_back((uint64_t{1} << 40) + d);
    }
    Box b{offsets, lengths};
    ASSERT_EQ(b.rank(), rank);
    EXPECT_EQ(Shape(b.offsets), offsets);
    EXPECT_EQ(Shape(b.lengths), lengths);
    for (size_t d = 0; d < rank; ++d) EXPECT_EQ(b.lengths[d], (uint64_t{1} << 40) + d);
    EXPECT_EQ(StoredInside(b, b.offsets), rank <= Dims::kInline) << rank;
    Box copy = b;
    EXPECT_EQ(copy, b);
    EXPECT_NE(copy.offsets.data(), b.offsets.data());
    Box moved = std::move(copy);
    EXPECT_EQ(moved, b);
    EXPECT_EQ(copy.rank(), 0u);
    EXPECT_TRUE(StoredInside(moved, moved.offsets) == (rank <= Dims::kInline));
  }
}

TEST(Dims, GrowsPastInlineByPushBackAndResize) {
  Dims d;
  std::vector<uint64_t> want;
  for (uint64_t v = 1; v <= 9; ++v) {
    d.push_back(v * v);
    want.push_back(v * v);
    EXPECT_TRUE(d == want) << v;
  }
  d.resize(12, 5);
  want.resize(12, 5);
  EXPECT_EQ(Shape(d), want);
  d.resize(1);
  EXPECT_EQ(Shape(d), (std::vector<uint64_t>{1}));
  d.assign(3, 0);
  EXPECT_EQ(Shape(d), (std::vector<uint64_t>{0, 0, 0}));
}

TEST(Dims, ComparesWithShapesBothWays) {
  Box b{{0, 4}, {2, 3}};
  EXPECT_TRUE(b.lengths == (Shape{2, 3}));
  EXPECT_TRUE((Shape{2, 3}) == b.lengths);
  EXPECT_TRUE(b.lengths != (Shape{2, 3, 1}));
  EXPECT_FALSE(b.offsets == b.lengths);
}

TEST(Dims, BoxOfRankTwoNeedsNoHeap) {
  EXPECT_EQ(sizeof(Dims), sizeof(std::vector<uint64_t>));
  Box b = Box::Whole({7, 9});
  EXPECT_TRUE(StoredInside(b, b.offsets));
  EXPECT_TRUE(StoredInside(b, b.lengths));
}

}  // namespace
}  // namespace ckptfs
