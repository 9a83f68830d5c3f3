#include "core/safetensors.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

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
        BadCase{"duplicate_metadata", R"({"__metadata__":{},"__metadata__":{}})", "duplicate entry '__metadata__'"},
        BadCase{"duplicate_before_bad_entry", R"({"a":{"dtype":"F128"},"a":{}})", "duplicate entry 'a'"},
        BadCase{"repeated_field", R"({"a":{"dtype":"U8","shape":[1],"dtype":"U8","data_offsets":[0,1]}})", "gives 'dtype' twice"},
        BadCase{"entry_not_object", R"({"a":[1]})", "entry 'a' is not an object"},
        BadCase{"metadata_not_object", R"({"__metadata__":"pt"})", "__metadata__ is not an object"},
        BadCase{"metadata_nested", R"({"__metadata__":{"k":{"x":"y"}}})", "__metadata__['k'] is not a string"},
        BadCase{"dtype_not_string", R"({"a":{"dtype":8,"shape":[1],"data_offsets":[0,1]}})", "has no dtype"},
        BadCase{"no_shape", R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", "has no shape"},
        BadCase{"shape_not_array", R"({"a":{"dtype":"U8","shape":{"0":1},"data_offsets":[0,1]}})", "shape is not an array"},
        BadCase{"nested_shape", R"({"a":{"dtype":"U8","shape":[[1]],"data_offsets":[0,1]}})", "non-negative integer"},
        BadCase{"no_offsets", R"({"a":{"dtype":"U8","shape":[1]}})", "has no data_offsets"},
        BadCase{"three_offsets", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", "must have 2 values"},
        BadCase{"huge_offset", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,18446744073709551616]}})", "non-negative integer"},
        BadCase{"trailing_garbage", R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}x)", "not valid JSON"},
        BadCase{"bad_json_after_bad_entry", R"({"a":{"dtype":"F128"},)", "not valid JSON"},
        BadCase{"invalid_utf8", std::string("{\"a\xff\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}"), "not valid JSON"}),
    [](const auto& info) { return std::string(info.param.name); });

// A large header written by the test, in shuffled text order, with escaped
// names and empty tensors: the parser must return each generated entry,
// sorted by (begin, end, name).
struct Generated {
  std::string text;
  std::vector<SafetensorsEntry> entries;  // in data order
};

Generated GenerateHeader(size_t n, uint32_t seed) {
  struct Kind {
    DType dtype;
    const char* name;
    uint64_t width;
  };
  const Kind kinds[] = {{DType::kBF16, "BF16", 2}, {DType::kF32, "F32", 4}, {DType::kI64, "I64", 8}, {DType::kU8, "U8", 1}};
  std::mt19937 rng(seed);
  Generated g;
  std::vector<std::string> items;
  uint64_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const Kind& k = kinds[rng() % 4];
    std::vector<uint64_t> shape;
    for (size_t r = rng() % 4; r > 0; --r) shape.push_back(rng() % 5);  // rank 0..3, zero dims included
    uint64_t numel = 1;
    for (uint64_t x : shape) numel *= x;
    const uint64_t nbytes = numel * k.width;
    std::string dims;
    for (uint64_t x : shape) dims += (dims.empty() ? "" : ",") + std::to_string(x);
    // The text spells the name with a \u escape; it must come back as UTF-8.
    g.entries.push_back({"layers." + std::to_string(i) + ".w\xc3\xa9", k.dtype, shape, at, at + nbytes});
    items.push_back("\"layers." + std::to_string(i) + ".w\\u00e9\":{\"data_offsets\":[" + std::to_string(at) + "," +
                    std::to_string(at + nbytes) + "],\"dtype\":\"" + k.name + "\",\"shape\":[" + dims + "]}");
    at += nbytes;
  }
  std::shuffle(items.begin(), items.end(), rng);
  g.text = "{";
  for (const std::string& item : items) g.text += (g.text.size() > 1 ? "," : "") + item;
  g.text += ",\"__metadata__\":{\"format\":\"pt\"}}";
  return g;
}

TEST(SafetensorsHeader, ParsesFiftyThousandShuffledEntriesAsGenerated) {
  Generated g = GenerateHeader(50'000, 7);
  auto h = Parse(g.text);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  std::vector<SafetensorsEntry> want = g.entries;
  std::sort(want.begin(), want.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  ASSERT_EQ(h->entries.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const SafetensorsEntry& got = h->entries[i];
    ASSERT_EQ(got.name, want[i].name) << i;
    ASSERT_EQ(got.dtype, want[i].dtype) << got.name;
    ASSERT_EQ(got.shape, want[i].shape) << got.name;
    ASSERT_EQ(got.begin, want[i].begin) << got.name;
    ASSERT_EQ(got.end, want[i].end) << got.name;
  }
  EXPECT_EQ(h->metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
}

TEST(SafetensorsHeader, RejectsADuplicateFarFromItsFirstOccurrence) {
  Generated g = GenerateHeader(50'000, 11);
  // Give the last tensor item of the text the first one's name.
  const size_t first_end = g.text.find("\":{");
  const std::string first_name = g.text.substr(2, first_end - 2);
  const size_t last = g.text.rfind(",\"layers.");
  const size_t last_end = g.text.find("\":{", last);
  g.text.replace(last + 2, last_end - last - 2, first_name);
  auto h = Parse(g.text);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), Status::Code::kCorruption);
  EXPECT_NE(h.status().message().find("duplicate entry 'layers."), std::string::npos) << h.status().message();
}

TEST(SafetensorsHeaderLength, RejectsLengthBeyondCapAndFile) {
  EXPECT_FALSE(DecodeHeaderLength(Prefix(100'000'001), 200'000'000).ok());
  auto past = DecodeHeaderLength(Prefix(100), 50);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("runs past the end"), std::string::npos);
  EXPECT_FALSE(DecodeHeaderLength("", 4).ok());
  EXPECT_EQ(*DecodeHeaderLength(Prefix(42), 50), 42u);
}

TEST(SafetensorsHeaderLength, RejectsTheAbuseFixture) {
  std::ifstream f(CKPTFS_FIXTURES_DIR "/third_party/safetensors-cpp/safetensors_abuse_attempt_1.safetensors",
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

// Checked with nlohmann's DOM parser rather than with ours; the order of the
// text (data order) by scanning it for each entry's data_offsets.
TEST(SafetensorsEncode, WritesFiftyThousandEntriesInOrderWithEscapes) {
  std::vector<SafetensorsEntry> entries;
  for (uint64_t i = 0; i < 50'000; ++i)
    entries.push_back({"t" + std::to_string(i) + (i % 7 == 0 ? "\"q\\\n" : ""), DType::kF32, {i % 3, 2},
                       24 * i, 24 * i + 8 * (i % 3)});
  auto enc = EncodeSafetensorsHeader(entries, {{"k\"", "v\t"}, {"a", "b"}});
  ASSERT_TRUE(enc.ok()) << enc.status().ToString();
  const std::string text = enc->substr(8);
  auto j = nlohmann::json::parse(text);
  ASSERT_EQ(j.size(), entries.size() + 1);
  EXPECT_EQ(j.at("__metadata__"), (nlohmann::json{{"a", "b"}, {"k\"", "v\t"}}));
  EXPECT_EQ(text.find("{\"__metadata__\""), 0u);
  size_t at = 0;
  for (const SafetensorsEntry& e : entries) {
    const nlohmann::json& v = j.at(e.name);
    ASSERT_EQ(v.size(), 3u) << e.name;
    ASSERT_EQ(v.at("dtype"), "F32") << e.name;
    ASSERT_EQ(v.at("shape").get<std::vector<uint64_t>>(), e.shape) << e.name;
    ASSERT_EQ(v.at("data_offsets").get<std::vector<uint64_t>>(), (std::vector<uint64_t>{e.begin, e.end}));
    const std::string offsets = "\"data_offsets\":[" + std::to_string(e.begin) + "," + std::to_string(e.end) + "]";
    size_t next = text.find(offsets, at);
    ASSERT_NE(next, std::string::npos) << e.name << " is out of data order";
    at = next + offsets.size();
  }
}

TEST(SafetensorsEncode, RefusesDuplicateReservedAndNonUtf8Names) {
  EXPECT_EQ(EncodeSafetensorsHeader({{"w", DType::kU8, {1}, 0, 1}, {"w", DType::kU8, {1}, 1, 2}}, {}).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(EncodeSafetensorsHeader({{"__metadata__", DType::kU8, {1}, 0, 1}}, {}).status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_EQ(EncodeSafetensorsHeader({{"bad\xff", DType::kU8, {1}, 0, 1}}, {}).status().code(),
            Status::Code::kInvalidArgument);
}

}  // namespace
}  // namespace ckptfs
