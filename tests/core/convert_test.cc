// Spot values of the float32 decoders, from the formats' definitions
// (OCP 8-bit floats, OCP MX F4/F6): the end-to-end tests compare every code
// with torch's and ml_dtypes' own conversions.
#include "core/convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace ckptfs {
namespace {

float One(DType t, std::vector<uint8_t> bytes, uint64_t k = 0) {
  float f;
  DecodeToFloat32(t, bytes.data(), k, 1, &f);
  return f;
}

TEST(Convert, BFloat16IsTheHighHalfOfFloat32) {
  EXPECT_EQ(One(DType::kBF16, {0x80, 0x3f}), 1.0f);
  EXPECT_EQ(One(DType::kBF16, {0xc0, 0xc0}), -6.0f);
}

// Every bfloat16 code, decoded in bulk from an odd first element, against
// its value by definition: (-1)^s x 2^(e-127) x 1.m (subnormals 2^-126 x 0.m).
TEST(Convert, EveryBFloat16CodeDecodesToItsValueInBulk) {
  std::vector<uint8_t> src(2 * 65537);
  for (uint32_t h = 0; h < 65536; ++h) {
    src[2 * (h + 1)] = uint8_t(h);
    src[2 * (h + 1) + 1] = uint8_t(h >> 8);
  }
  std::vector<float> out(65536);
  DecodeToFloat32(DType::kBF16, src.data(), 1, 65536, out.data());
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t e = (h >> 7) & 0xFF, m = h & 0x7F;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 0xFF) {
      EXPECT_TRUE(m ? std::isnan(out[h]) : out[h] == float(sign * INFINITY)) << std::hex << h;
      continue;
    }
    const double want = e ? sign * std::ldexp(1.0 + m / 128.0, int(e) - 127) : sign * std::ldexp(m / 128.0, -126);
    ASSERT_EQ(double(out[h]), want) << std::hex << h;
    ASSERT_EQ(std::signbit(out[h]), bool(h & 0x8000)) << std::hex << h;
  }
}

TEST(Convert, Float32DecodesInBulkToItself) {
  const std::vector<float> in = {0.0f, -0.0f, 1.5f, -3.25e-39f, 3.4e38f, INFINITY, -INFINITY, 1e-45f};
  std::vector<uint8_t> src(4 * (in.size() + 2));
  std::memcpy(src.data() + 8, in.data(), 4 * in.size());
  std::vector<float> out(in.size());
  DecodeToFloat32(DType::kF32, src.data(), 2, in.size(), out.data());
  EXPECT_EQ(0, std::memcmp(out.data(), in.data(), 4 * in.size()));
}

TEST(Convert, Float8E4M3FnHasNoInfinity) {
  EXPECT_EQ(One(DType::kF8_E4M3, {0x7e}), 448.0f);              // largest finite
  EXPECT_EQ(One(DType::kF8_E4M3, {0x01}), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(One(DType::kF8_E4M3, {0x7f})));
  EXPECT_EQ(One(DType::kF8_E4M3, {0xb8}), -1.0f);
}

TEST(Convert, Float8E5M2IsIeeeLike) {
  EXPECT_EQ(One(DType::kF8_E5M2, {0x7b}), 57344.0f);
  EXPECT_TRUE(std::isinf(One(DType::kF8_E5M2, {0x7c})));
  EXPECT_TRUE(std::isnan(One(DType::kF8_E5M2, {0x7d})));
  EXPECT_EQ(One(DType::kF8_E5M2, {0x3c}), 1.0f);
}

TEST(Convert, Float8E8M0IsAPowerOfTwo) {
  EXPECT_EQ(One(DType::kF8_E8M0, {127}), 1.0f);
  EXPECT_EQ(One(DType::kF8_E8M0, {130}), 8.0f);
  EXPECT_TRUE(std::isnan(One(DType::kF8_E8M0, {0xff})));
}

TEST(Convert, Float4E2M1ValuesLowNibbleFirst) {
  const float values[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (uint8_t code = 0; code < 16; ++code) {
    float want = (code & 8 ? -1 : 1) * values[code & 7];
    EXPECT_EQ(One(DType::kF4, {uint8_t(code | 0xf0)}, 0), want) << int(code);  // low nibble = element 0
    EXPECT_EQ(One(DType::kF4, {uint8_t(code << 4)}, 1), want) << int(code);    // high nibble = element 1
  }
}

TEST(Convert, Float6PacksFourElementsInThreeBytes) {
  // E2M3: 0b011111 = 7.5 (max); E3M2: 0b011111 = 28 (max). Element 1 sits in
  // bits 6..11 of the little-endian stream.
  EXPECT_EQ(One(DType::kF6_E2M3, {0x1f, 0, 0}), 7.5f);
  EXPECT_EQ(One(DType::kF6_E3M2, {0x1f, 0, 0}), 28.0f);
  EXPECT_EQ(One(DType::kF6_E2M3, {0xc0, 0x07, 0}, 1), 7.5f);
  EXPECT_EQ(One(DType::kF6_E2M3, {0, 0, 0x80}, 3), -0.0f);
  EXPECT_TRUE(std::signbit(One(DType::kF6_E2M3, {0, 0, 0x80}, 3)));
}

TEST(Convert, IntegersForStatistics) {
  std::vector<uint8_t> v = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  EXPECT_EQ(DecodeElement(DType::kI64, v.data(), 0), -1.0);
  EXPECT_EQ(DecodeElement(DType::kU16, v.data(), 1), 65535.0);
  EXPECT_FALSE(HasRealValue(DType::kC64));
}

}  // namespace
}  // namespace ckptfs
