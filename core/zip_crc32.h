// Zip's CRC-32 (ISO 3309 / ITU-T V.42, reflected polynomial 0xEDB88320;
// zlib's crc32): what a torch.save archive records for each entry, so the
// writer computes it over every tensor's bytes. CLMUL folding when the CPU
// has it (crc_fold.h), about 4x zlib 1.2's braided tables here; slice-by-8
// tables otherwise. Values equal zlib's: ZipCrc32(0, "123456789", 9) ==
// 0xCBF43926.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckptfs {

// Continues `crc` (0 to start) over `n` bytes.
uint32_t ZipCrc32(uint32_t crc, const void* data, size_t n);
uint32_t ZipCrc32Portable(uint32_t crc, const void* data, size_t n);  // tables only, for tests

// CRC of A||B from crc(A), crc(B) and |B|.
uint32_t ZipCrc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace ckptfs
