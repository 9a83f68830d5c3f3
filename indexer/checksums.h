// Re-reading a checkpoint's chunks against the CRC32C their writer
// recorded (Chunk::crc32c; ckptfs's own writer records one per chunk,
// a scan none): what `ckptfs verify` does on top of reading every view.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/meta.h"
#include "indexer/source_reader.h"

namespace ckptfs {

struct ChecksumReport {
  uint64_t chunks = 0;  // chunks with a recorded checksum, all read
  uint64_t bytes = 0;
  // One line per chunk that differs or cannot be read: tensor, chunk, file,
  // byte range, and the two values.
  std::vector<std::string> problems;
};

// Reads each chunk of `ckpt` that carries a checksum through `reader` (so a
// changed source is an error, not a mismatch) and compares. `on_bytes`, when
// set, is told the bytes read so far.
ChecksumReport VerifyChunkChecksums(const Checkpoint& ckpt, SourceReader& reader,
                                    const std::function<void(uint64_t)>& on_bytes = {});

}  // namespace ckptfs
