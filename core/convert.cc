#include "core/convert.h"

#include <cmath>
#include <cstring>
#include <limits>

namespace ckptfs {
namespace {

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// A small float with `e` exponent bits (bias `bias`) and `m` mantissa bits.
// `ieee_special`: the all-ones exponent encodes Inf/NaN (F16, F8_E5M2).
// `nan_code`: for F8_E4M3 (fn), S.1111.111 is NaN and there is no Inf.
float DecodeSmall(uint32_t code, int e, int m, int bias, bool ieee_special, bool fn_nan) {
  const uint32_t sign = (code >> (e + m)) & 1;
  const uint32_t exp = (code >> m) & ((1u << e) - 1);
  const uint32_t man = code & ((1u << m) - 1);
  float v;
  if (ieee_special && exp == (1u << e) - 1) {
    v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (fn_nan && exp == (1u << e) - 1 && man == (1u << m) - 1) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(float(man), 1 - bias - m);  // subnormal
  } else {
    v = std::ldexp(float(man | (1u << m)), int(exp) - bias - m);
  }
  return sign ? -v : v;
}

// The "fnuz" 8-bit floats (AMD's): no infinities, no negative zero; the
// code of negative zero, 0x80, is the one NaN.
float DecodeFnuz(uint8_t code, int e, int m, int bias) {
  return code == 0x80 ? std::numeric_limits<float>::quiet_NaN() : DecodeSmall(code, e, m, bias, false, false);
}

uint32_t BitsAt(const uint8_t* src, uint64_t bit, int width) {
  uint32_t v = 0;
  for (int i = 0; i < width; ++i) {
    uint64_t b = bit + i;
    v |= uint32_t((src[b >> 3] >> (b & 7)) & 1) << i;
  }
  return v;
}

}  // namespace

bool NeedsFloat32View(DType t) {
  switch (t) {
    case DType::kBF16: case DType::kF8_E5M2: case DType::kF8_E4M3: case DType::kF8_E8M0:
    case DType::kF8_E4M3FNUZ: case DType::kF8_E5M2FNUZ: case DType::kF4: case DType::kF6_E2M3: case DType::kF6_E3M2:
      return true;
    default:
      return false;
  }
}

bool HasRealValue(DType t) { return t != DType::kC64; }

double DecodeElement(DType t, const uint8_t* src, uint64_t k) {
  auto load = [&](auto zero, size_t size) {
    decltype(zero) v;
    std::memcpy(&v, src + size * k, size);
    return v;
  };
  switch (t) {
    case DType::kBOOL: return src[k] != 0;
    case DType::kU8: return src[k];
    case DType::kI8: return int8_t(src[k]);
    case DType::kI16: return load(int16_t(), 2);
    case DType::kU16: return load(uint16_t(), 2);
    case DType::kI32: return load(int32_t(), 4);
    case DType::kU32: return load(uint32_t(), 4);
    case DType::kI64: return double(load(int64_t(), 8));
    case DType::kU64: return double(load(uint64_t(), 8));
    case DType::kF32: return load(float(), 4);
    case DType::kF64: return load(double(), 8);
    case DType::kF16: return DecodeSmall(load(uint16_t(), 2), 5, 10, 15, true, false);
    case DType::kBF16: return FromBits(uint32_t(load(uint16_t(), 2)) << 16);
    case DType::kF8_E4M3: return DecodeSmall(src[k], 4, 3, 7, false, true);
    case DType::kF8_E5M2: return DecodeSmall(src[k], 5, 2, 15, true, false);
    case DType::kF8_E4M3FNUZ: return DecodeFnuz(src[k], 4, 3, 8);
    case DType::kF8_E5M2FNUZ: return DecodeFnuz(src[k], 5, 2, 16);
    case DType::kF8_E8M0:
      return src[k] == 0xff ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, int(src[k]) - 127);
    case DType::kF4: return DecodeSmall(BitsAt(src, 4 * k, 4), 2, 1, 1, false, false);
    case DType::kF6_E2M3: return DecodeSmall(BitsAt(src, 6 * k, 6), 2, 3, 1, false, false);
    case DType::kF6_E3M2: return DecodeSmall(BitsAt(src, 6 * k, 6), 3, 2, 3, false, false);
    case DType::kC64: break;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

void DecodeToFloat32(DType t, const uint8_t* src, uint64_t first, uint64_t count, float* out) {
  // The dtypes of weights, without a double per element: fp32 as it is,
  // bf16 as the top half of its fp32 (exact, as torch widens it).
  if (t == DType::kF32) {
    std::memcpy(out, src + 4 * first, 4 * count);
    return;
  }
  if (t == DType::kBF16) {
    for (uint64_t i = 0; i < count; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * (first + i), 2);
      const uint32_t bits = uint32_t(h) << 16;
      std::memcpy(out + i, &bits, 4);
    }
    return;
  }
  for (uint64_t i = 0; i < count; ++i) out[i] = float(DecodeElement(t, src, first + i));
}

}  // namespace ckptfs
