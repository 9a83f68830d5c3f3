// What CRC32C (crc32c.h) and zip's CRC-32 (zip_crc32.h) share: both are
// reflected 32-bit CRCs, differing only in their polynomial, so the tables,
// the arithmetic modulo the polynomial (for combining) and the carry-less
// multiply folding (for speed) are written once here, parametrised by it.
//
// Folding (x86 PCLMULQDQ; Gopal et al., "Fast CRC Computation for Generic
// Polynomials Using PCLMULQDQ Instruction", Intel 2009): the CRC of a
// message depends only on the message as a polynomial modulo P, so 64 bytes
// at a time are folded into four 128-bit lanes with multiplications by
// x^k mod P, which keeps that remainder. What is left (16 bytes) is then
// finished byte-wise; no Barrett reduction is needed. 8 multiplies per 64
// bytes run at memory speed, several times the single `crc32` instruction
// chain or the tables.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace ckptfs::crc {

// Slice-by-8 tables of a reflected polynomial: t[k][b] is the CRC of byte b
// followed by k zero bytes.
using Tables = std::array<std::array<uint32_t, 256>, 8>;

template <uint32_t kPoly>
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

// The CRC register (no pre/post inversion) continued over n bytes by the tables.
uint32_t TableUpdate(const Tables& t, uint32_t reg, const uint8_t* p, size_t n);

// x^(8 n) mod P (reflected): multiplying a register by it appends n zero bytes.
uint32_t ShiftBytes(uint64_t n, uint32_t poly);
// a * b mod P, both reflected.
uint32_t MulModP(uint32_t a, uint32_t b, uint32_t poly);

// CRC of A||B from the CRCs of A and B (with the usual inversions) and |B|.
uint32_t Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b, uint32_t poly);

// Folding multipliers of one polynomial (x^(d±32) mod P, shifted into 33
// bits, for fold distances d of 512 and 128 bits).
struct FoldKeys {
  uint64_t k512_lo, k512_hi, k128_lo, k128_hi;
};
FoldKeys MakeFoldKeys(uint32_t poly);

bool HasClmul();  // the CPU has PCLMULQDQ (checked once)

// Inputs shorter than this go to the tables or the instruction directly.
constexpr size_t kFoldMin = 256;

// Folds the longest prefix of p[0, n) that is a multiple of 16 bytes (n >=
// kFoldMin; requires HasClmul()) starting from register `reg`, and writes
// the 16 bytes whose CRC from register 0 is the register after that prefix.
// Returns the prefix length.
size_t Fold(const FoldKeys& keys, uint32_t reg, const uint8_t* p, size_t n, uint8_t residue[16]);

// The CRC (with the usual inversions) of p[0, n) continued from `crc`:
// folded when n >= kFoldMin and the CPU has CLMUL, the rest by the tables.
uint32_t Update(const Tables& t, const FoldKeys& keys, uint32_t crc, const void* data, size_t n);

}  // namespace ckptfs::crc
