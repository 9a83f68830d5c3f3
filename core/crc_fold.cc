// Shared CRC machinery (what and why: crc_fold.h).
#include "core/crc_fold.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ckptfs::crc {

uint32_t TableUpdate(const Tables& t, uint32_t reg, const uint8_t* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (x86, arm64)
    w ^= reg;
    reg = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
          t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
  }
  while (n--) reg = (reg >> 8) ^ t[0][(reg ^ *p++) & 0xFF];
  return reg;
}

// zlib's multmodp, for any reflected polynomial.
uint32_t MulModP(uint32_t a, uint32_t b, uint32_t poly) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ poly : b >> 1;
  }
  return p;
}

// x^bits mod P by square-and-multiply.
static uint32_t XPowModP(uint64_t bits, uint32_t poly) {
  uint32_t result = 1u << 31, square = 1u << 30;  // x^0, x^1
  for (; bits; bits >>= 1) {
    if (bits & 1) result = MulModP(square, result, poly);
    square = MulModP(square, square, poly);
  }
  return result;
}

uint32_t ShiftBytes(uint64_t n, uint32_t poly) { return XPowModP(8 * n, poly); }

uint32_t Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b, uint32_t poly) {
  // crc(A||B) = crc(A) * x^(8 |B|) + crc(B); the inversions cancel because
  // both CRCs carry them.
  return MulModP(ShiftBytes(len_b, poly), crc_a, poly) ^ crc_b;
}

uint32_t Update(const Tables& t, const FoldKeys& keys, uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t reg = ~crc;
  if (n >= kFoldMin && HasClmul()) {
    uint8_t residue[16];
    size_t done = Fold(keys, reg, p, n, residue);
    reg = TableUpdate(t, 0, residue, 16);
    p += done;
    n -= done;
  }
  return ~TableUpdate(t, reg, p, n);
}

FoldKeys MakeFoldKeys(uint32_t poly) {
  auto key = [poly](uint64_t bits) { return uint64_t(XPowModP(bits, poly)) << 1; };
  return {key(512 + 32), key(512 - 32), key(128 + 32), key(128 - 32)};
}

#if defined(__x86_64__)
bool HasClmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}

namespace {
// x (128 bits) moved 128 bits further on, plus the next 16 bytes: the low
// half is the earlier (higher-degree) one, hence the larger multiplier.
__attribute__((target("pclmul,sse4.1"))) inline __m128i FoldInto(__m128i x, __m128i k, __m128i next) {
  __m128i lo = _mm_clmulepi64_si128(x, k, 0x00), hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(lo, hi), next);
}
__attribute__((target("sse4.1"))) inline __m128i Load(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
}  // namespace

__attribute__((target("pclmul,sse4.1"))) size_t Fold(const FoldKeys& keys, uint32_t reg, const uint8_t* p,
                                                      size_t n, uint8_t residue[16]) {
  __m128i x0 = _mm_xor_si128(Load(p), _mm_cvtsi32_si128(int(reg))), x1 = Load(p + 16), x2 = Load(p + 32),
          x3 = Load(p + 48);
  const __m128i k512 = _mm_set_epi64x(int64_t(keys.k512_hi), int64_t(keys.k512_lo));
  size_t done = 64;
  for (; n - done >= 64; done += 64) {
    x0 = FoldInto(x0, k512, Load(p + done));
    x1 = FoldInto(x1, k512, Load(p + done + 16));
    x2 = FoldInto(x2, k512, Load(p + done + 32));
    x3 = FoldInto(x3, k512, Load(p + done + 48));
  }
  const __m128i k128 = _mm_set_epi64x(int64_t(keys.k128_hi), int64_t(keys.k128_lo));
  x3 = FoldInto(FoldInto(FoldInto(x0, k128, x1), k128, x2), k128, x3);
  for (; n - done >= 16; done += 16) x3 = FoldInto(x3, k128, Load(p + done));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(residue), x3);
  return done;
}
#else
bool HasClmul() { return false; }
size_t Fold(const FoldKeys&, uint32_t, const uint8_t*, size_t, uint8_t*) { return 0; }
#endif

}  // namespace ckptfs::crc
