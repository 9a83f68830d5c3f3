// Element casts (core/cast.h) against references computed another way: the
// compiler's IEEE _Float16 conversions, and round-to-nearest-even decided in
// double arithmetic for bfloat16. torch itself is the oracle of the e2e tests
// (tests/e2e/test_derived.py).
#include "core/cast.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace ckptfs {
namespace {

float F(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t U(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// bfloat16 by comparing the two neighbours in exact double arithmetic.
uint16_t ReferenceBF16(uint32_t u) {
  const float f = F(u);
  if (std::isnan(f)) return 0;  // not compared here
  const uint16_t lo = uint16_t(u >> 16);
  if ((u & 0xFFFF) == 0) return lo;
  const uint16_t hi = uint16_t(lo + 1);  // away from zero, same sign
  const double dlo = std::fabs(double(F(uint32_t(lo) << 16)) - f);
  // The neighbour above the largest finite value is inf: rounding goes there
  // at or beyond half an ulp past it, as IEEE says.
  const double dhi = (hi & 0x7FFF) == 0x7F80 ? std::fabs(std::ldexp(1.0, 128) - std::fabs(double(f)))
                                             : std::fabs(double(F(uint32_t(hi) << 16)) - f);
  if (dlo != dhi) return dlo < dhi ? lo : hi;
  return (lo & 1) ? hi : lo;
}

std::vector<uint32_t> SampleFloats() {
  std::vector<uint32_t> out;
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 65537) out.push_back(uint32_t(u));
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) out.push_back(rng());
  // Ties, neighbours of ties, range edges, subnormals of both formats.
  for (uint32_t base : {0x3F808000u, 0x3F818000u, 0x477FE000u, 0x477FF000u, 0x7F7F8000u, 0x7F7FFFFFu,
                        0x33000000u, 0x33000001u, 0x387FC000u, 0x38800000u, 0x00000001u, 0x00800000u,
                        0x7F800000u, 0x7FC00000u, 0x7F800001u, 0x3F800000u})
    for (int d = -3; d <= 3; ++d)
      for (uint32_t sign : {0u, 0x80000000u}) out.push_back((base + d) ^ sign);
  return out;
}

TEST(Cast, F32ToF16MatchesIeeeConversion) {
  for (uint32_t u : SampleFloats()) {
    const _Float16 h = static_cast<_Float16>(F(u));
    uint16_t want;
    std::memcpy(&want, &h, 2);
    const uint16_t got = F32ToF16Bits(u);
    if (std::isnan(F(u))) {
      EXPECT_EQ(got, ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)) << std::hex << u;  // torch's NaN
    } else {
      ASSERT_EQ(got, want) << std::hex << u << " " << F(u);
    }
  }
}

TEST(Cast, F32ToBF16RoundsToNearestEven) {
  for (uint32_t u : SampleFloats()) {
    if (std::isnan(F(u))) {
      EXPECT_EQ(F32ToBF16Bits(u), 0xFFFF) << std::hex << u;  // torch's NaN
      continue;
    }
    ASSERT_EQ(F32ToBF16Bits(u), ReferenceBF16(u)) << std::hex << u << " " << F(u);
  }
}

// The bulk fp32 -> bf16 loop (vectorized) against the same reference, with
// lengths and source alignments that leave vector remainders.
TEST(Cast, CastElementsF32ToBF16MatchesTheReferenceAtEveryLengthAndAlignment) {
  const std::vector<uint32_t> in = SampleFloats();
  std::vector<uint8_t> src(in.size() * 4 + 3);
  for (size_t shift : {0, 1, 3}) {
    std::memcpy(src.data() + shift, in.data(), in.size() * 4);
    for (size_t count : {size_t(0), size_t(1), size_t(7), size_t(33), in.size()}) {
      std::vector<uint16_t> out(count + 1, 0xABCD);
      CastElements(DType::kF32, DType::kBF16, src.data() + shift, count, reinterpret_cast<uint8_t*>(out.data()));
      for (size_t k = 0; k < count; ++k) {
        const uint16_t want = std::isnan(F(in[k])) ? 0xFFFF : ReferenceBF16(in[k]);
        ASSERT_EQ(out[k], want) << "element " << k << " of " << count << ", shift " << shift;
      }
      EXPECT_EQ(out[count], 0xABCD) << "wrote past the end";
    }
  }
}

TEST(Cast, F16ToF32IsExactForEveryValue) {
  for (uint32_t b = 0; b < 65536; ++b) {
    _Float16 h;
    const uint16_t bits = uint16_t(b);
    std::memcpy(&h, &bits, 2);
    const float want = static_cast<float>(h);
    const uint32_t got = F16ToF32Bits(bits);
    if (std::isnan(want)) {
      EXPECT_EQ(got, bits & 0x8000 ? (uint32_t(bits & 0x3FF) << 13) | 0xFF800000u
                                   : (uint32_t(bits & 0x3FF) << 13) | 0x7F800000u) << b;  // payload kept
    } else {
      ASSERT_EQ(got, U(want)) << b;
    }
  }
}

TEST(Cast, CastElementsWidensBF16AndNarrowsF64ThroughF32) {
  const uint16_t bf[] = {0x3F80, 0xC049, 0x0001, 0x7F80};
  float out[4];
  CastElements(DType::kBF16, DType::kF32, reinterpret_cast<const uint8_t*>(bf), 4, reinterpret_cast<uint8_t*>(out));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(U(out[i]), uint32_t(bf[i]) << 16);
  // 1 + 2^-8 + 2^-30: to float32 it is 1 + 2^-8 (a bf16 tie), which rounds to
  // even (1.0); rounded once from double it would round up.
  const double d = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  uint16_t h;
  CastElements(DType::kF64, DType::kBF16, reinterpret_cast<const uint8_t*>(&d), 1, reinterpret_cast<uint8_t*>(&h));
  EXPECT_EQ(h, 0x3F80);
}

TEST(Cast, ViewDTypeNames) {
  EXPECT_EQ(ParseViewDType("bf16"), DType::kBF16);
  EXPECT_EQ(ParseViewDType("fp16"), DType::kF16);
  EXPECT_EQ(ParseViewDType("fp32"), DType::kF32);
  EXPECT_EQ(ParseViewDType("bfloat16"), std::nullopt);
  EXPECT_FALSE(IsCastable(DType::kI64));
  EXPECT_FALSE(IsCastable(DType::kF4));
  EXPECT_TRUE(IsCastable(DType::kF8_E4M3));
}

}  // namespace
}  // namespace ckptfs
