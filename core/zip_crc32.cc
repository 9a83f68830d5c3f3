// Zip's CRC-32 (what and why: zip_crc32.h; the machinery: crc_fold.h).
#include "core/zip_crc32.h"

#include "core/crc_fold.h"

namespace ckptfs {
namespace {

constexpr uint32_t kPoly = 0xEDB88320;  // reflected 0x04C11DB7
constexpr crc::Tables kTables = crc::MakeTables<kPoly>();

}  // namespace

uint32_t ZipCrc32Portable(uint32_t crc, const void* data, size_t n) {
  return ~crc::TableUpdate(kTables, ~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t ZipCrc32(uint32_t crc, const void* data, size_t n) {
  static const crc::FoldKeys keys = crc::MakeFoldKeys(kPoly);
  return crc::Update(kTables, keys, crc, data, n);
}

uint32_t ZipCrc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return crc::Combine(crc_a, crc_b, len_b, kPoly);
}

}  // namespace ckptfs
