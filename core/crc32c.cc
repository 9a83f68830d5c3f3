// CRC32C: slice-by-8 tables, SSE4.2, and combination (what and why: crc32c.h).
#include "core/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ckptfs {
namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // reflected 0x1EDC6F41

// kTables[k][b]: CRC of byte b followed by k zero bytes (slice-by-8).
using Tables = std::array<std::array<uint32_t, 256>, 8>;
constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xFF];
  return t;
}
constexpr Tables kTables = MakeTables();

// Multiplication modulo the polynomial in the reflected domain (zlib's
// multmodp), used by Crc32cCombine.
uint32_t MulModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod P for k = 0..63: x2n[k] shifts a CRC by 2^k bits.
std::array<uint32_t, 64> MakeX2n() {
  std::array<uint32_t, 64> x2n{};
  uint32_t p = 1u << 30;  // x^1
  for (auto& v : x2n) {
    v = p;
    p = MulModP(p, p);
  }
  return x2n;
}

}  // namespace

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (x86, arm64)
    w ^= c;
    c = kTables[7][w & 0xFF] ^ kTables[6][(w >> 8) & 0xFF] ^ kTables[5][(w >> 16) & 0xFF] ^
        kTables[4][(w >> 24) & 0xFF] ^ kTables[3][(w >> 32) & 0xFF] ^ kTables[2][(w >> 40) & 0xFF] ^
        kTables[1][(w >> 48) & 0xFF] ^ kTables[0][w >> 56];
  }
  while (n--) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xFF];
  return ~c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  uint32_t c32 = uint32_t(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
bool HasCrc32cHardware() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#else
uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t n) { return Crc32cPortable(crc, data, n); }
bool HasCrc32cHardware() { return false; }
#endif

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  return HasCrc32cHardware() ? Crc32cHardware(crc, data, n) : Crc32cPortable(crc, data, n);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  static const std::array<uint32_t, 64> x2n = MakeX2n();
  // crc(A||B) = crc(A) * x^(8 |B|) + crc(B), with the pre/post inversions
  // cancelling because both CRCs carry them.
  uint32_t shift = 1u << 31;  // x^0
  uint64_t bits = len_b;
  for (int k = 3; bits; bits >>= 1, ++k)
    if (bits & 1) shift = MulModP(x2n[k & 63], shift);
  return MulModP(shift, crc_a) ^ crc_b;
}

}  // namespace ckptfs
