#include "core/safetensors.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace ckptfs {
namespace {

std::string Prefix(uint64_t n) {
  std::string p(8, '\0');
  for (int i = 0; i < 8; ++i) p[i] = char((n >> (8 * i)) & 0xff);
  return p;
}

Result<SafetensorsHeader> Parse(const std::string& json) { return ParseSafetensorsHeader(json, json.size()); }

TEST(SafetensorsHeader, ParsesEntriesSortedByOffsetAndMetadata) {
  auto h = Parse(R"({"b":{"dtype":"F32","shape":[2],"data_offsets":[2,10]},)"
                 R"("a":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},"__metadata__":{"format":"pt"}})");
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->entries.size(), 2u);
  EXPECT_EQ(h->entries[0].name, "a");
  EXPECT_EQ(h->entries[1].dtype, DType::kF32);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  EXPECT_EQ(h->data_end(), 10u);
}

TEST(SafetensorsHeader, AcceptsScalarsAndEmptyTensors) {
  auto h = Parse(R"({"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]}})");
  ASSERT_TRUE(h.ok()) << h.status().ToString();
}

struct BadCase {
  const char* name;
  std::string json;
  const char* message;
};

class SafetensorsHeaderRejects : public ::testing::TestWithParam<BadCase> {};

TEST_P(SafetensorsHeaderRejects, WithAPreciseMessage) {
  auto h = Parse(GetParam().json);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kCorruption);
  EXPECT_NE(h.status().message().find(GetParam().message), std::string::npos) << h.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SafetensorsHeaderRejects,
    ::testing::Values(
        BadCase{"not_object", R"([1,2])", "does not start with '{'"},
        BadCase{"bad_json", R"({"a":)", "not valid JSON"},
        BadCase{"duplicate", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "duplicate entry 'a'"},
        BadCase{"unknown_dtype", R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}})", "unknown dtype 'F128'"},
        BadCase{"size_mismatch", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "needs 8"},
        BadCase{"gap", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "(gap)"},
        BadCase{"overlap", R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})", "(overlap)"},
        BadCase{"negative", R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "non-negative integer"},
        BadCase{"float_shape", R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "non-negative integer"},
        BadCase{"overflow", R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", "overflows"},
        BadCase{"half_byte", R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}})", "whole number of bytes"},
        BadCase{"end_before_begin", R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[2,1]}})", "end before"},
        BadCase{"metadata_not_string", R"({"__metadata__":{"k":1}})", "is not a string"},
        BadCase{"invalid_utf8", std::string("{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}"), "not valid JSON"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(SafetensorsHeaderLength, RejectsLengthBeyondCapAndFile) {
  EXPECT_FALSE(DecodeHeaderLength(Prefix(100'000'001), 200'000'000).ok());
  auto past = DecodeHeaderLength(Prefix(100), 50);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("runs past the end"), std::string::npos);
  EXPECT_FALSE(DecodeHeaderLength("", 4).ok());
  EXPECT_EQ(*DecodeHeaderLength(Prefix(42), 50), 42u);
}

TEST(SafetensorsHeaderLength, RejectsTheAbuseFixture) {
  std::ifstream f(CKPTFS_SHARED_DIR "/fixtures/third_party/safetensors-cpp/safetensors_abuse_attempt_1.safetensors",
                  std::ios::binary);
  ASSERT_TRUE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  std::string bytes = ss.str();
  EXPECT_FALSE(DecodeHeaderLength(bytes.substr(0, 8), bytes.size()).ok());
}

TEST(SafetensorsFileSize, TellsTruncationFromTrailingBytes) {
  auto h = Parse(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})");
  ASSERT_TRUE(h.ok());
  uint64_t want = 8 + h->header_len + 4;
  EXPECT_TRUE(CheckSafetensorsFileSize(*h, want).ok());
  EXPECT_NE(CheckSafetensorsFileSize(*h, want - 1).message().find("truncated"), std::string::npos);
  EXPECT_NE(CheckSafetensorsFileSize(*h, want + 1).message().find("trailing"), std::string::npos);
}

TEST(SafetensorsEncode, PadsWithSpacesToEightAndRoundTrips) {
  std::vector<SafetensorsEntry> entries = {{"w", DType::kBF16, {3}, 0, 6}, {"b", DType::kU8, {1}, 6, 7}};
  auto enc = EncodeSafetensorsHeader(entries, {{"format", "pt"}});
  ASSERT_TRUE(enc.ok());
  uint64_t n = *DecodeHeaderLength(enc->substr(0, 8), enc->size() + 7);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(8 + n, enc->size());
  std::string json = enc->substr(8);
  EXPECT_EQ(json.substr(json.find_last_not_of(' ') + 1), std::string(json.size() - 1 - json.find_last_not_of(' '), ' '));
  auto h = ParseSafetensorsHeader(json, n);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_EQ(h->entries[0].name, "w");
  EXPECT_EQ(h->metadata.at("format"), "pt");
  // __metadata__ first, then tensors in data order (what readers expect).
  EXPECT_EQ(json.find("{\"__metadata__\""), 0u);
  EXPECT_LT(json.find("\"w\""), json.find("\"b\""));
}

}  // namespace
}  // namespace ckptfs
