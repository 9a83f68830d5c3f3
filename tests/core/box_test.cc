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

TEST(Box, ToStringIsHalfOpenRanges) {
  EXPECT_EQ(ToString(Box{{0, 16}, {7, 16}}), "[0:7, 16:32]");
  EXPECT_EQ(ToString(Box{}), "[]");
}

}  // namespace
}  // namespace ckptfs
