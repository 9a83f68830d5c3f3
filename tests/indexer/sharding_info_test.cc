#include "indexer/sharding_info.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

namespace ckptfs {
namespace {

std::vector<uint64_t> Offsets(const ShardingInfo& info, const char* fqn) {
  const Dims* d = info.Find(fqn);
  EXPECT_NE(d, nullptr) << fqn;
  return d ? std::vector<uint64_t>(d->begin(), d->end()) : std::vector<uint64_t>{};
}

std::string Error(const char* text) {
  auto r = ShardingInfo::Parse("DCP_SHARDING_INFO", text);
  EXPECT_FALSE(r.ok()) << text;
  return r.ok() ? "" : r.status().message();
}

TEST(ShardingInfo, ReadsEachFqnsOffsetsOfAnyRank) {
  auto r = ShardingInfo::Parse("DCP_SHARDING_INFO",
                               R"({"b.w": {"saved_offsets": [4, 0]}, "a": {"saved_offsets": [7]},)"
                               R"( "c": {"x": {"y": [1]}, "saved_offsets": [1, 2, 3], "z": "s"},)"
                               R"( "big": {"saved_offsets": [18446744073709551615, 0]}, "s": {"saved_offsets": []}})");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->size(), 5u);
  EXPECT_EQ(Offsets(*r, "b.w"), (std::vector<uint64_t>{4, 0}));
  EXPECT_EQ(Offsets(*r, "a"), (std::vector<uint64_t>{7}));
  EXPECT_EQ(Offsets(*r, "c"), (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(Offsets(*r, "big"), (std::vector<uint64_t>{18446744073709551615ull, 0}));
  EXPECT_EQ(Offsets(*r, "s"), (std::vector<uint64_t>{}));
  EXPECT_EQ(r->Find("b"), nullptr);
  EXPECT_EQ(r->Find("zz"), nullptr);
}

TEST(ShardingInfo, RepeatedFqnOrFieldKeepsTheLast) {
  auto r = ShardingInfo::Parse("k", R"({"w": {"saved_offsets": "no"}, "w": {"saved_offsets": [1, 2], "saved_offsets": [3, 4]}})");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->size(), 1u);
  EXPECT_EQ(Offsets(*r, "w"), (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": [1]}, "w": 3})"), "DCP_SHARDING_INFO['w'] has no saved_offsets list");
}

TEST(ShardingInfo, NotAnObject) {
  EXPECT_EQ(Error("[1, 2]"), "DCP_SHARDING_INFO is not a JSON object");
  EXPECT_EQ(Error("7"), "DCP_SHARDING_INFO is not a JSON object");
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": [0]})"), "DCP_SHARDING_INFO is not a JSON object");  // truncated
  EXPECT_EQ(Error(""), "DCP_SHARDING_INFO is not a JSON object");
}

TEST(ShardingInfo, NoList) {
  EXPECT_EQ(Error(R"({"w": [0, 0]})"), "DCP_SHARDING_INFO['w'] has no saved_offsets list");
  EXPECT_EQ(Error(R"({"w": {"offsets": [0]}})"), "DCP_SHARDING_INFO['w'] has no saved_offsets list");
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": {"0": 1}}})"), "DCP_SHARDING_INFO['w'] has no saved_offsets list");
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": 0}})"), "DCP_SHARDING_INFO['w'] has no saved_offsets list");
}

TEST(ShardingInfo, OffsetsMustBeNonNegativeIntegers) {
  const std::string bad = "DCP_SHARDING_INFO['w'] saved_offsets are not non-negative integers";
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": [0, -1]}})"), bad);
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": [0, 1.5]}})"), bad);
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": ["0"]}})"), bad);
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": [[0]]}})"), bad);
  EXPECT_EQ(Error(R"({"w": {"saved_offsets": [null]}})"), bad);
}

TEST(ShardingInfo, FirstFaultInFqnOrder) {
  EXPECT_EQ(Error(R"({"b": {"saved_offsets": [-1]}, "a": {}})"), "DCP_SHARDING_INFO['a'] has no saved_offsets list");
}

}  // namespace
}  // namespace ckptfs
