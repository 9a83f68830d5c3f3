// CRC32C: tables, the SSE4.2 instruction, CLMUL folding (what and why:
// crc32c.h; the shared machinery: crc_fold.h).
#include "core/crc32c.h"

#include <cstring>

#include "core/crc_fold.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ckptfs {
namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // reflected 0x1EDC6F41
constexpr crc::Tables kTables = crc::MakeTables<kPoly>();

}  // namespace

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n) {
  return ~crc::TableUpdate(kTables, ~crc, static_cast<const uint8_t*>(data), n);
}

#if defined(__x86_64__)
namespace {
__attribute__((target("sse4.2"))) uint32_t InstructionUpdate(uint32_t reg, const uint8_t* p, size_t n) {
  uint64_t c = reg;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  uint32_t c32 = uint32_t(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
}  // namespace

uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t n) {
  return ~InstructionUpdate(~crc, static_cast<const uint8_t*>(data), n);
}
bool HasCrc32cHardware() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#else
uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t n) { return Crc32cPortable(crc, data, n); }
bool HasCrc32cHardware() { return false; }
#endif

uint32_t Crc32cFolded(uint32_t crc, const void* data, size_t n) {
  static const crc::FoldKeys keys = crc::MakeFoldKeys(kPoly);
  return crc::Update(kTables, keys, crc, data, n);
}

uint32_t Crc32c(uint32_t crc, const void* data, size_t n) {
  if (n >= crc::kFoldMin && crc::HasClmul()) return Crc32cFolded(crc, data, n);
  return HasCrc32cHardware() ? Crc32cHardware(crc, data, n) : Crc32cPortable(crc, data, n);
}

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return crc::Combine(crc_a, crc_b, len_b, kPoly);
}

}  // namespace ckptfs
