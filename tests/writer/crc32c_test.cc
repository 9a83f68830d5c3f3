// CRC32C against published vectors (RFC 3720 B.4, the "123456789" check
// value) and a bit-at-a-time reference written here; SSE4.2, CLMUL folding
// and tables; combination vs one pass. Zip's CRC-32 against zlib's crc32.
#include "core/crc32c.h"
#include "core/crc_fold.h"
#include "core/zip_crc32.h"

#include <zlib.h>

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace ckptfs {
namespace {

// The definition, one bit at a time: independent of the table and the instruction.
uint32_t Reference(const std::string& s) {
  uint32_t c = 0xFFFFFFFF;
  for (unsigned char b : s) {
    c ^= b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1) ? 0x82F63B78u : 0);
  }
  return ~c;
}

std::string Random(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (auto& ch : s) ch = char(g());
  return s;
}

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c(0, "", 0), 0u);
  // RFC 3720 B.4: 32 bytes of zeros, of 0xFF, and 0x00..0x1F.
  std::string zeros(32, '\0'), ones(32, '\xff'), inc;
  for (int i = 0; i < 32; ++i) inc.push_back(char(i));
  EXPECT_EQ(Crc32c(0, zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(0, ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(Crc32c(0, inc.data(), 32), 0x46DD794Eu);
}

TEST(Crc32c, BothImplementationsMatchTheReferenceAtEveryLengthAndAlignment) {
  const std::string data = Random(300, 7);
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; start + n <= data.size(); n += 13) {
      const std::string s = data.substr(start, n);
      const uint32_t want = Reference(s);
      ASSERT_EQ(Crc32cPortable(0, s.data(), n), want) << start << "+" << n;
      if (HasCrc32cHardware()) {
        ASSERT_EQ(Crc32cHardware(0, s.data(), n), want) << start << "+" << n;
      }
      ASSERT_EQ(Crc32c(0, s.data(), n), want);
    }
  }
}

TEST(Crc32c, ContinuingEqualsOnePass) {
  const std::string s = Random(1000, 3);
  EXPECT_EQ(Crc32c(Crc32c(0, s.data(), 377), s.data() + 377, 623), Reference(s));
}

TEST(Crc32c, CombineEqualsOnePass) {
  const std::string s = Random(5000, 11);
  for (size_t cut : {0ul, 1ul, 7ul, 8ul, 1024ul, 4999ul, 5000ul}) {
    uint32_t a = Crc32c(0, s.data(), cut), b = Crc32c(0, s.data() + cut, s.size() - cut);
    EXPECT_EQ(Crc32cCombine(a, b, s.size() - cut), Reference(s)) << cut;
  }
}

TEST(Crc32c, CombineOfManyPiecesInAnyGrouping) {
  const std::string s = Random(1 << 16, 5);
  uint32_t acc = 0;
  for (size_t off = 0; off < s.size(); off += 4096) acc = Crc32cCombine(acc, Crc32c(0, s.data() + off, 4096), 4096);
  EXPECT_EQ(acc, Crc32c(0, s.data(), s.size()));
}

// Lengths around the folding thresholds (kFoldMin, 64-byte blocks, 16-byte
// residues) at every alignment.
TEST(Crc32c, FoldingMatchesTheReferenceAroundItsThresholds) {
#if defined(__x86_64__)
  ASSERT_TRUE(crc::HasClmul());  // every x86-64 server CPU since 2010
#else
  if (!crc::HasClmul()) return;  // Fold is x86-only; Crc32c uses the tables
#endif
  const std::string data = Random(4096, 17);
  for (size_t start = 0; start < 17; ++start)
    for (size_t n : {256ul, 257ul, 271ul, 272ul, 319ul, 320ul, 383ul, 1000ul, 4000ul}) {
      const std::string s = data.substr(start, n);
      ASSERT_EQ(Crc32cFolded(0, s.data(), n), Reference(s)) << start << "+" << n;
      ASSERT_EQ(Crc32cFolded(0x12345678, s.data(), n), Crc32cPortable(0x12345678, s.data(), n));
    }
}

uint32_t Zlib(uint32_t crc, const std::string& s) {
  return uint32_t(crc32_z(crc, reinterpret_cast<const Bytef*>(s.data()), s.size()));
}

TEST(ZipCrc32, EqualsZlibAtEveryLengthAndAlignment) {
  EXPECT_EQ(ZipCrc32(0, "123456789", 9), 0xCBF43926u);
  const std::string data = Random(5000, 23);
  for (size_t start = 0; start < 17; ++start)
    for (size_t n = 0; start + n <= data.size(); n += 61) {
      const std::string s = data.substr(start, n);
      ASSERT_EQ(ZipCrc32(0, s.data(), n), Zlib(0, s)) << start << "+" << n;
      ASSERT_EQ(ZipCrc32Portable(0, s.data(), n), Zlib(0, s)) << start << "+" << n;
      ASSERT_EQ(ZipCrc32(0xDEADBEEF, s.data(), n), Zlib(0xDEADBEEF, s)) << start << "+" << n;
    }
}

TEST(ZipCrc32, CombineEqualsZlibs) {
  const std::string s = Random(1 << 20, 29);
  for (size_t cut : {0ul, 1ul, 300ul, 65536ul, (1ul << 20) - 1}) {
    uint32_t a = ZipCrc32(0, s.data(), cut), b = ZipCrc32(0, s.data() + cut, s.size() - cut);
    EXPECT_EQ(ZipCrc32Combine(a, b, s.size() - cut), Zlib(0, s)) << cut;
    EXPECT_EQ(ZipCrc32Combine(a, b, s.size() - cut), uint32_t(crc32_combine64(a, b, s.size() - cut)));
  }
}

}  // namespace
}  // namespace ckptfs
