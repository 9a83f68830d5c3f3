// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the per-chunk
// checksum the writer stores with every row it commits (Chunk::crc32c).
//
// Why CRC32C and not xxh3 or zip's CRC-32: x86 has an instruction for it
// (SSE4.2 `crc32`, 8 bytes per instruction) and CLMUL folding computes it
// at memory speed (crc_fold.h), ARMv8 has an instruction too, and it is what storage systems already use for
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

// Continues `crc` (0 to start) over `n` bytes. Uses CLMUL folding for long
// inputs and the SSE4.2 instruction for short ones when the CPU has them
// (checked once), else slice-by-8 tables.
uint32_t Crc32c(uint32_t crc, const void* data, size_t n);

// The implementations, exposed so tests can compare them.
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t n);
uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t n);  // requires HasCrc32cHardware()
uint32_t Crc32cFolded(uint32_t crc, const void* data, size_t n);    // folds only where crc::HasClmul()
bool HasCrc32cHardware();

// CRC of A||B from crc(A), crc(B) and |B|, in O(log |B|).
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

}  // namespace ckptfs
