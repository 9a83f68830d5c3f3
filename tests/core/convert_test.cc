// Spot values of the float32 decoders, from the formats' definitions
// (OCP 8-bit floats, OCP MX F4/F6): the end-to-end tests compare every code
// with torch's and ml_dtypes' own conversions.
#include "core/convert.h"

#include <gtest/gtest.h>

#include <cmath>

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
