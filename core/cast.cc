#include "core/cast.h"

#include <cstring>

#include "core/convert.h"

namespace ckptfs {
namespace {

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Rounds `v` right by `shift` bits to nearest, ties to even.
uint32_t ShiftRoundEven(uint32_t v, int shift) {
  const uint32_t kept = v >> shift, rest = v & ((1u << shift) - 1), half = 1u << (shift - 1);
  return kept + (rest > half || (rest == half && (kept & 1)));
}

// Element `k` of `src` as float32 bits, as torch widens it.
uint32_t LoadAsF32(DType from, const uint8_t* src, uint64_t k) {
  switch (from) {
    case DType::kF32: {
      uint32_t u;
      std::memcpy(&u, src + 4 * k, 4);
      return u;
    }
    case DType::kF64: {
      double d;
      std::memcpy(&d, src + 8 * k, 8);
      return BitsOf(static_cast<float>(d));
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, src + 2 * k, 2);
      return uint32_t(h) << 16;
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, src + 2 * k, 2);
      return F16ToF32Bits(h);
    }
    case DType::kF8_E4M3:  // NaN (S.1111.111): the mantissa moves up, as torch widens it
      if ((src[k] & 0x7F) == 0x7F) return (uint32_t(src[k] & 0x80) << 24) | 0x7FF00000u;
      break;
    case DType::kF8_E5M2:
      if ((src[k] & 0x7C) == 0x7C && (src[k] & 0x3))
        return (uint32_t(src[k] & 0x80) << 24) | 0x7F800000u | (uint32_t(src[k] & 0x3) << 21);
      break;
    default:
      break;
  }
  float f;  // every other F8 value is exact in float32
  DecodeToFloat32(from, src, k, 1, &f);
  return BitsOf(f);
}

bool IsNaN(uint32_t f) { return (f & 0x7FFFFFFFu) > 0x7F800000u; }

}  // namespace

bool IsCastable(DType t) {
  switch (t) {
    case DType::kF16: case DType::kBF16: case DType::kF32: case DType::kF64:
    case DType::kF8_E5M2: case DType::kF8_E4M3: case DType::kF8_E8M0:
      return true;
    default:
      return false;
  }
}

std::optional<DType> ParseViewDType(std::string_view suffix) {
  if (suffix == "bf16") return DType::kBF16;
  if (suffix == "fp16") return DType::kF16;
  if (suffix == "fp32") return DType::kF32;
  return std::nullopt;
}

std::string_view ViewDTypeSuffix(DType t) {
  return t == DType::kBF16 ? "bf16" : t == DType::kF16 ? "fp16" : "fp32";
}

std::string_view TorchDTypeName(DType t) {
  return t == DType::kBF16 ? "bfloat16" : t == DType::kF16 ? "float16" : "float32";
}

uint16_t F32ToBF16Bits(uint32_t f) {
  if (IsNaN(f)) return 0xFFFF;  // every NaN, as torch's float -> bfloat16 kernel writes it
  return uint16_t((f + 0x7FFFu + ((f >> 16) & 1)) >> 16);  // overflow carries into inf
}

uint16_t F32ToF16Bits(uint32_t f) {
  const uint16_t sign = uint16_t((f >> 16) & 0x8000);
  const uint32_t a = f & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00 | uint16_t((a >> 13) & 0x3FF);  // NaN: quiet, payload's top
  if (a >= 0x47800000u) return sign | 0x7C00;  // >= 65536 (inf included)
  const int e = int(a >> 23);
  if (e < 102) return sign;  // below 2^-25: rounds to zero
  if (e < 113) {  // a half subnormal: units of 2^-24
    const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
    return sign | uint16_t(ShiftRoundEven(m, 126 - e));  // may round up into the first normal
  }
  const uint32_t h = (uint32_t(e - 112) << 10) | ((a & 0x7FFFFFu) >> 13);
  const uint32_t rest = a & 0x1FFFu;
  // A carry out of the mantissa bumps the exponent; out of 30 it is inf.
  return sign | uint16_t(h + (rest > 0x1000u || (rest == 0x1000u && (h & 1))));
}

uint32_t F16ToF32Bits(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
  if (e == 0x1F) return sign | 0x7F800000u | (m << 13);  // inf, NaN with its payload
  if (e != 0) return sign | ((e + 112) << 23) | (m << 13);
  if (m == 0) return sign;
  int shift = 0;  // subnormal: normalise
  uint32_t mm = m;
  while (!(mm & 0x400)) {
    mm <<= 1;
    ++shift;
  }
  return sign | (uint32_t(113 - shift) << 23) | ((mm & 0x3FF) << 13);
}

namespace {

// fp32 -> bf16, the cast of fp32 masters: a loop the compiler vectorizes.
void F32ToBF16(const uint8_t* __restrict src, uint64_t count, uint8_t* __restrict dst) {
  for (uint64_t k = 0; k < count; ++k) {
    uint32_t f;
    std::memcpy(&f, src + 4 * k, 4);
    const uint16_t rounded = uint16_t((f + 0x7FFFu + ((f >> 16) & 1)) >> 16);
    const uint16_t h = IsNaN(f) ? uint16_t(0xFFFF) : rounded;  // as F32ToBF16Bits
    std::memcpy(dst + 2 * k, &h, 2);
  }
}

}  // namespace

void CastElements(DType from, DType to, const uint8_t* src, uint64_t count, uint8_t* dst) {
  if (from == DType::kF32 && to == DType::kBF16) return F32ToBF16(src, count, dst);
  for (uint64_t k = 0; k < count; ++k) {
    const uint32_t f = LoadAsF32(from, src, k);
    if (to == DType::kF32) {
      std::memcpy(dst + 4 * k, &f, 4);
      continue;
    }
    uint16_t h = to == DType::kBF16 ? F32ToBF16Bits(f) : F32ToF16Bits(f);
    // torch writes one NaN for bfloat16 from anything but float: 0x7FC0.
    if (to == DType::kBF16 && from != DType::kF32 && IsNaN(f)) h = 0x7FC0;
    std::memcpy(dst + 2 * k, &h, 2);
  }
}

}  // namespace ckptfs
