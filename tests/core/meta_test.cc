#include "core/meta.h"

#include <gtest/gtest.h>

namespace ckptfs {
namespace {

TEST(OutOfLine, EmptyUntilAssignedAndFreedByEmpty) {
  OutOfLine<std::string> why;
  EXPECT_TRUE(why.empty());
  EXPECT_EQ(why.get(), "");
  why = "shard.safetensors is truncated";
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(why.get(), "shard.safetensors is truncated");
  EXPECT_EQ(std::string("chunk [0:2]: ") + why, "chunk [0:2]: shard.safetensors is truncated");
  why = std::string();
  EXPECT_TRUE(why.empty());
}

TEST(OutOfLine, CopiesAreIndependent) {
  OutOfLine<std::vector<uint64_t>> a = std::vector<uint64_t>{4, 1};
  OutOfLine<std::vector<uint64_t>> b = a;
  a = std::vector<uint64_t>{8, 2, 1};
  EXPECT_EQ(b.get(), (std::vector<uint64_t>{4, 1}));
  EXPECT_EQ(a.size(), 3u);
  EXPECT_EQ(a[0], 8u);
  EXPECT_FALSE(a == b);
  b = a;
  EXPECT_TRUE(a == b);
}

// The figure meta.h gives: what a million chunks cost.
TEST(Chunk, RowMajorReadableChunkIsSmall) {
  EXPECT_EQ(sizeof(OutOfLine<std::string>), sizeof(void*));
  EXPECT_LE(sizeof(Chunk), 104u);
}

}  // namespace
}  // namespace ckptfs
