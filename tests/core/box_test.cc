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

}  // namespace
}  // namespace ckptfs
