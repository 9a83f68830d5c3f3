#include "indexer/checksums.h"

#include <algorithm>
#include <cstdio>

#include "core/crc32c.h"
#include "core/planner.h"

namespace ckptfs {
namespace {

std::string Hex(uint32_t v) {
  char s[11];
  std::snprintf(s, sizeof s, "0x%08x", v);
  return s;
}

std::string Where(const Checkpoint& ckpt, const TensorMeta& t, size_t c) {
  const ByteMeta& b = t.chunks[c].bytes;
  return t.fqn + " chunk " + std::to_string(c) + " (" + ckpt.files[b.file].path + " bytes [" +
         std::to_string(b.offset) + ", " + std::to_string(b.offset + b.length) + "))";
}

// The CRC32C of a byte range, read in pieces of at most 8 MiB into `buf`.
Result<uint32_t> ChecksumOf(const ByteMeta& range, SourceReader& reader, std::vector<char>& buf,
                            const std::function<void(uint64_t)>& on_piece) {
  constexpr uint64_t kPiece = 8 << 20;
  uint32_t crc = 0;
  for (uint64_t at = 0; at < range.length; at += kPiece) {
    ReadPlan plan;
    plan.length = std::min(kPiece, range.length - at);
    plan.copies.push_back({range.file, range.offset + at, 0, plan.length});
    buf.resize(plan.length);
    RETURN_IF_ERROR(reader.Execute(plan, buf.data()));
    crc = Crc32c(crc, buf.data(), plan.length);
    on_piece(plan.length);
  }
  return crc;
}

}  // namespace

ChecksumReport VerifyChunkChecksums(const Checkpoint& ckpt, SourceReader& reader,
                                    const std::function<void(uint64_t)>& on_bytes) {
  ChecksumReport report;
  std::vector<char> buf;
  for (const auto& t : ckpt.tensors)
    for (size_t c = 0; c < t->chunks.size(); ++c) {
      const Chunk& chunk = t->chunks[c];
      if (!chunk.has_crc32c) continue;
      ++report.chunks;
      if (!chunk.unavailable.empty()) {
        report.problems.push_back(Where(ckpt, *t, c) + ": " + chunk.unavailable);
        continue;
      }
      auto got = ChecksumOf(chunk.bytes, reader, buf, [&](uint64_t n) {
        report.bytes += n;
        if (on_bytes) on_bytes(report.bytes);
      });
      if (!got.ok()) report.problems.push_back(Where(ckpt, *t, c) + ": " + got.status().message());
      else if (*got != chunk.crc32c)
        report.problems.push_back(Where(ckpt, *t, c) + ": CRC32C " + Hex(*got) + ", the writer recorded " +
                                  Hex(chunk.crc32c));
    }
  return report;
}

}  // namespace ckptfs
