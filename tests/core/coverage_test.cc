#include "core/coverage.h"

#include <gtest/gtest.h>

namespace ckptfs {
namespace {

Chunk MakeChunk(Box box, DType dtype = DType::kF32) {
  Chunk c;
  c.set_box(box);
  c.set_dtype(dtype);
  c.set_bytes({0, 0, *ByteSize(dtype, box.numel())});
  return c;
}

TensorMeta Tensor(Shape shape, std::vector<Box> boxes) {
  TensorMeta t;
  t.fqn = "w";
  t.shape = shape;
  for (auto& b : boxes) t.chunks.push_back(MakeChunk(b));
  return t;
}

TEST(Coverage, ExactTilingHasNoProblems) {
  auto t = Tensor({7, 6}, {Box{{0, 0}, {4, 3}}, Box{{0, 3}, {4, 3}}, Box{{4, 0}, {3, 6}}});
  EXPECT_TRUE(CheckCoverage(t).empty());
}

TEST(Coverage, HoleIsReportedWithItsBox) {
  auto t = Tensor({7, 6}, {Box{{0, 0}, {4, 6}}, Box{{4, 0}, {3, 3}}});
  auto p = CheckCoverage(t);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find("9 of 42 elements are in no chunk"), std::string::npos) << p[0];
  EXPECT_NE(p[0].find("[4:7, 3:6]"), std::string::npos) << p[0];
  EXPECT_NE(p[0].find("'w'"), std::string::npos);
}

TEST(Coverage, OverlapIsReportedWithBothBoxes) {
  auto t = Tensor({8}, {Box{{0}, {5}}, Box{{4}, {4}}});
  auto p = CheckCoverage(t);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find("overlap in [4:5]"), std::string::npos) << p[0];
}

TEST(Coverage, ReplicasThatDisagreeInShapeAreNamedAsSuch) {
  auto t = Tensor({8, 4}, {Box{{0, 0}, {8, 4}}, Box{{0, 0}, {4, 4}}});
  auto p = CheckCoverage(t);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find("disagree in shape"), std::string::npos) << p[0];
}

TEST(Coverage, OutOfBoundsChunk) {
  auto t = Tensor({4}, {Box{{0}, {4}}, Box{{3}, {2}}});
  auto p = CheckCoverage(t);
  ASSERT_FALSE(p.empty());
  EXPECT_NE(p[0].find("outside the tensor"), std::string::npos);
}

TEST(Coverage, ChunkWithTooFewBytes) {
  auto t = Tensor({4}, {Box{{0}, {4}}});
  t.chunks[0].set_bytes({0, 0, 15});
  auto p = CheckCoverage(t);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_NE(p[0].find("needs 16 bytes"), std::string::npos) << p[0];
}

TEST(Coverage, NoChunksForNonEmptyTensorIsAHole) {
  auto t = Tensor({2, 2}, {});
  EXPECT_EQ(CheckCoverage(t).size(), 1u);
}

TEST(Coverage, ZeroSizeTensorNeedsNoChunks) {
  auto t = Tensor({0, 5}, {});
  EXPECT_TRUE(CheckCoverage(t).empty());
}

TEST(Coverage, ScalarCoveredByOneChunk) {
  auto t = Tensor({}, {Box{}});
  EXPECT_TRUE(CheckCoverage(t).empty());
}

TEST(Coverage, ReplicasAreDroppedNotReportedAsOverlap) {
  auto t = Tensor({4}, {Box{{0}, {4}}, Box{{0}, {4}}});
  EXPECT_EQ(DropReplicas(t), 1u);
  EXPECT_TRUE(CheckCoverage(t).empty());
}

}  // namespace
}  // namespace ckptfs
