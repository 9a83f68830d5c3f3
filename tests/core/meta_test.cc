#include "core/meta.h"

#include <gtest/gtest.h>

namespace ckptfs {
namespace {

// The figure meta.h gives: what a million chunks cost.
TEST(Chunk, IsFortyEightBytes) { EXPECT_EQ(sizeof(Chunk), 48u); }

TEST(Chunk, DefaultIsAnEmptyReadableRowMajorChunk) {
  Chunk c;
  EXPECT_EQ(c.box(), Box{});
  EXPECT_EQ(c.rank(), 0u);
  EXPECT_EQ(c.bytes(), (ByteMeta{0, 0, 0}));
  EXPECT_TRUE(c.strides().empty());
  EXPECT_TRUE(c.unavailable().empty());
  EXPECT_FALSE(c.has_crc32c());
}

TEST(Chunk, PackedFieldsReadBackExactly) {
  Chunk c(Box{{4096, 7}, {4096, 4294967295u}}, {3, (uint64_t{1} << 48) - 1, 123456789012}, DType::kBF16);
  EXPECT_EQ(c.box(), (Box{{4096, 7}, {4096, 4294967295u}}));
  EXPECT_EQ(c.rank(), 2u);
  EXPECT_EQ(c.file(), 3u);
  EXPECT_EQ(c.offset(), (uint64_t{1} << 48) - 1);
  EXPECT_EQ(c.length(), 123456789012u);
  EXPECT_EQ(c.dtype(), DType::kBF16);
}

// Rank 3, a dim of 2^32, an offset past 2^48: kept exactly, out of line.
TEST(Chunk, WideValuesReadBackExactly) {
  const Box rank3{{1, 2, 3}, {4, 5, 6}};
  const Box big{{uint64_t{1} << 32}, {1}};
  const ByteMeta far{7, uint64_t{1} << 50, uint64_t{1} << 49};
  Chunk c(rank3, far, DType::kF32);
  EXPECT_EQ(c.box(), rank3);
  EXPECT_EQ(c.rank(), 3u);
  EXPECT_EQ(c.bytes(), far);
  c.set_box(big);
  EXPECT_EQ(c.box(), big);
  c.set_bytes({1, 2, 3});
  c.set_box(Box{{0}, {8}});
  EXPECT_EQ(c.box(), (Box{{0}, {8}}));
  EXPECT_EQ(c.bytes(), (ByteMeta{1, 2, 3}));
}

TEST(Chunk, StridesUnavailableAndCrcSetAndCleared) {
  Chunk c(Box{{0, 0}, {2, 3}}, {0, 64, 24}, DType::kF32);
  c.set_strides({1, 2});
  c.set_unavailable("shard.safetensors is truncated");
  c.set_crc32c(0xdeadbeef);
  EXPECT_EQ(c.strides(), (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(c.unavailable(), "shard.safetensors is truncated");
  EXPECT_TRUE(c.has_crc32c());
  EXPECT_EQ(c.crc32c(), 0xdeadbeefu);
  c.set_strides({});
  EXPECT_TRUE(c.strides().empty());
  EXPECT_EQ(c.unavailable(), "shard.safetensors is truncated");
  c.set_unavailable("");
  EXPECT_TRUE(c.unavailable().empty());
  EXPECT_EQ(c.box(), (Box{{0, 0}, {2, 3}}));
  EXPECT_EQ(c.bytes(), (ByteMeta{0, 64, 24}));
}

TEST(Chunk, CopiesAreIndependent) {
  Chunk a(Box{{0, 0, 0}, {1, 2, 3}}, {0, 0, 24}, DType::kF32);
  a.set_unavailable("gone");
  Chunk b = a;
  a.set_unavailable("");
  a.set_box(Box{{1}, {1}});
  EXPECT_EQ(b.unavailable(), "gone");
  EXPECT_EQ(b.box(), (Box{{0, 0, 0}, {1, 2, 3}}));
  b = a;
  EXPECT_TRUE(b.unavailable().empty());
  EXPECT_EQ(b.box(), (Box{{1}, {1}}));
  Chunk moved = std::move(b);
  EXPECT_EQ(moved.box(), (Box{{1}, {1}}));
}

}  // namespace
}  // namespace ckptfs
