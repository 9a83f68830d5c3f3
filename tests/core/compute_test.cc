// How computations are cut into blocks (core/compute.h): every block is a
// box of the output whose bytes are contiguous, at most kComputeBlockBytes
// whatever the shape, and the blocks tile the output in order. The checks
// derive each block's place from its box (row-major strides), not from the
// blocking code.
#include "core/compute.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace ckptfs {
namespace {

std::shared_ptr<TensorMeta> Tensor(DType dtype, Shape shape) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = "w";
  t->dtype = dtype;
  t->shape = std::move(shape);
  return t;
}

// Byte offset of `box`'s first element in the row-major output of `shape`.
uint64_t FirstByte(const Shape& shape, const Box& box, DType dtype) {
  const std::vector<uint64_t> strides = RowMajorStrides(std::vector<uint64_t>(shape.begin(), shape.end()));
  uint64_t element = 0;
  for (size_t d = 0; d < shape.size(); ++d) element += box.offsets[d] * strides[d];
  return *ByteSize(dtype, element);
}

// True when the box's row-major bytes are contiguous in the output: after
// the first dim whose length is over 1, every dim is whole.
bool Contiguous(const Shape& shape, const Box& box) {
  size_t d = 0;
  while (d < shape.size() && box.lengths[d] == 1) ++d;
  for (++d; d < shape.size(); ++d)
    if (box.offsets[d] != 0 || box.lengths[d] != shape[d]) return false;
  return true;
}

void ExpectBlocksTile(const Computation& c) {
  const Shape& shape = c.shape();
  uint64_t at = 0;
  for (uint64_t b = 0; b < c.block_count(); ++b) {
    SCOPED_TRACE("block " + std::to_string(b) + " of " + c.what());
    const Box box = c.BlockBox(b);
    ASSERT_TRUE(InBounds(box, shape));
    EXPECT_TRUE(Contiguous(shape, box));
    ASSERT_EQ(c.block_begin(b), at);
    EXPECT_EQ(FirstByte(shape, box, c.dtype()), at);
    EXPECT_EQ(c.block_end(b) - c.block_begin(b), *ByteSize(c.dtype(), box.numel()));
    EXPECT_LE(c.block_end(b) - c.block_begin(b), kComputeBlockBytes);
    EXPECT_EQ(c.BlockAt(c.block_begin(b)), b);
    EXPECT_EQ(c.BlockAt(c.block_end(b) - 1), b);
    at = c.block_end(b);
  }
  EXPECT_EQ(at, c.nbytes());
}

TEST(ComputeBlocks, EveryShapeIsCutIntoBoundedContiguousBlocks) {
  const uint64_t wide = 3 * (kComputeBlockBytes / 2) + 5;  // elements of a row wider than a block
  const Shape shapes[] = {{1, wide}, {3, wide}, {wide}, {2, 3, wide / 3}, {5, 7}, {4096, 1024}, {3, 5, 7, 11},
                          {2, 1, wide}, {1}, {1, 1, 1}};
  for (const Shape& s : shapes)
    for (DType to : {DType::kBF16, DType::kF32}) {
      const DType from = to == DType::kF32 ? DType::kBF16 : DType::kF32;
      auto cast = MakeCast(Tensor(from, s), Box::Whole(s), to);
      ExpectBlocksTile(*cast);
    }
}

TEST(ComputeBlocks, RowsThatFitABlockStayWhole) {
  auto cast = MakeCast(Tensor(DType::kF32, {4096, 1024}), Box::Whole({4096, 1024}), DType::kBF16);
  ASSERT_EQ(cast->block_count(), 2u);  // 2 KiB rows of bf16: 2048 rows per 4 MiB
  EXPECT_EQ(cast->BlockBox(1), (Box{{2048, 0}, {2048, 1024}}));
}

TEST(ComputeBlocks, EmptyAndScalarOutputsAreOneBlock) {
  for (const Shape& s : {Shape{}, Shape{0, 4}, Shape{4, 0}}) {
    auto cast = MakeCast(Tensor(DType::kF32, s), Box::Whole(s), DType::kBF16);
    EXPECT_EQ(cast->block_count(), 1u);
    EXPECT_EQ(cast->block_begin(0), 0u);
    EXPECT_EQ(cast->block_end(0), cast->nbytes());
    EXPECT_EQ(cast->BlockBox(0), Box::Whole(s));
  }
}

// A [1, n] row wider than a block, cast bf16 -> f32 (exact: the bits move up
// 16), as a box of a bigger tensor: each block reads its own columns of the
// box and computes them.
TEST(ComputeBlocks, AWideRowIsCastBlockByBlockFromItsOwnColumns) {
  const uint64_t n = kComputeBlockBytes / 4 * 2 + 1000;  // f32 output: 2 blocks and a bit
  auto t = Tensor(DType::kBF16, {3, n + 7});
  const Box box{{1, 5}, {1, n}};
  auto cast = MakeCast(t, box, DType::kF32);
  ASSERT_EQ(cast->block_count(), 3u);
  std::mt19937 rng(5);
  std::vector<uint16_t> row(n);
  for (auto& v : row) v = uint16_t(rng());
  for (uint64_t b = 0; b < cast->block_count(); ++b) {
    const std::vector<ComputeInput> in = cast->InputsOf(b);
    ASSERT_EQ(in.size(), 1u);
    const uint64_t first = cast->block_begin(b) / 4, count = (cast->block_end(b) - cast->block_begin(b)) / 4;
    EXPECT_EQ(in[0].box, (Box{{1, 5 + first}, {1, count}})) << b;
    BlockBytes bytes(count * 2);
    std::memcpy(bytes.data(), row.data() + first, count * 2);
    auto out = cast->Compute(b, {bytes});
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    ASSERT_EQ(out->size(), count * 4);
    for (uint64_t i = 0; i < count; ++i) {
      uint32_t got;
      std::memcpy(&got, out->data() + 4 * i, 4);
      ASSERT_EQ(got, uint32_t(row[first + i]) << 16) << "element " << first + i;
    }
  }
}

}  // namespace
}  // namespace ckptfs
