// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the per-chunk
// checksum the writer stores with every row it commits (Chunk::crc32c).
//
// Why CRC32C and not xxh3 or zip's CRC-32: x86 has an instruction for it
// (SSE4.2 `crc32`, 8 bytes per instruction, well above disk and memcpy
// speed), ARMv8 has one too, and it is what storage systems already use for
// block checksums (ext4 metadata, iSCSI, RocksDB blocks), so `verify` can be
// written anywhere with a standard library. Its Hamming distance is better
// than zip's CRC-32 at the chunk sizes we write. Unlike a hash, two CRCs of
// adjacent byte ranges combine into the CRC of their concatenation
// (Crc32cCombine), so I/O threads can checksum the pieces of one chunk in any
// order and the writer still reports one value per chunk.
//
// Values are the standard ones: Crc32c(0, "123456789", 9) == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckptfs {

// Continues `crc` (0 to start) over `n` bytes. Uses SSE4.2 when the CPU has
// it (checked once), else slice-by-8 tables.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

// The two implementations, exposed so tests can compare them.
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);
uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t n);  // requires HasCrc32cHardware()
bool HasCrc32cHardware();

// CRC of A||B from crc(A), crc(B) and |B|, in O(log |B|).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace ckptfs
