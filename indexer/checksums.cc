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
  const ByteMeta b = t.chunks[c].bytes();
  return t.fqn + " chunk " + std::to_string(c) + " (" + ckpt.files[b.file].path + " bytes [" +
         std::to_string(b.offset) + ", " + std::to_string(b.offset + b.length) + "))";
}

// The CRC32C of a byte range, read in pieces of at most 8 MiB into `buf`.
Result<uint32_t> ChecksumOf(const ByteMeta& range, SourceReader& reader, std::vector<char>& buf,
                            const std::function<void(uint64_t)>& on_piece, uint32_t crc = 0) {
  constexpr uint64_t kPiece = 8 << 20;
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

// File `id`'s bytes outside its chunks against the writer's CRC32C of them.
void VerifyRest(const Checkpoint& ckpt, FileId id, SourceReader& reader, std::vector<char>& buf,
                ChecksumReport& report, const std::function<void(uint64_t)>& on_bytes) {
  const SourceFile& f = ckpt.files[id];
  ++report.files;
  uint32_t crc = 0;
  for (const ByteMeta& range : BytesOutsideChunks(ckpt, id, f.size)) {
    auto got = ChecksumOf(range, reader, buf, [&](uint64_t n) {
      report.bytes += n;
      if (on_bytes) on_bytes(report.bytes);
    }, crc);
    if (!got.ok()) {
      report.problems.push_back(f.path + ": " + got.status().message());
      return;
    }
    crc = *got;
  }
  if (crc != f.rest_crc32c)
    report.problems.push_back(f.path + ": the bytes outside its tensor data (framing, headers, non-tensor items) have "
                              "CRC32C " + Hex(crc) + ", the writer recorded " + Hex(f.rest_crc32c));
}

}  // namespace

ChecksumReport VerifyChunkChecksums(const Checkpoint& ckpt, SourceReader& reader,
                                    const std::function<void(uint64_t)>& on_bytes) {
  ChecksumReport report;
  std::vector<char> buf;
  for (const auto& t : ckpt.tensors)
    for (size_t c = 0; c < t->chunks.size(); ++c) {
      const Chunk& chunk = t->chunks[c];
      if (!chunk.has_crc32c()) continue;
      ++report.chunks;
      if (!chunk.unavailable().empty()) {
        report.problems.push_back(Where(ckpt, *t, c) + ": " + chunk.unavailable());
        continue;
      }
      auto got = ChecksumOf(chunk.bytes(), reader, buf, [&](uint64_t n) {
        report.bytes += n;
        if (on_bytes) on_bytes(report.bytes);
      });
      if (!got.ok()) report.problems.push_back(Where(ckpt, *t, c) + ": " + got.status().message());
      else if (*got != chunk.crc32c())
        report.problems.push_back(Where(ckpt, *t, c) + ": CRC32C " + Hex(*got) + ", the writer recorded " +
                                  Hex(chunk.crc32c()));
    }
  for (FileId id = 0; id < ckpt.files.size(); ++id)
    if (ckpt.files[id].has_rest_crc32c) VerifyRest(ckpt, id, reader, buf, report, on_bytes);
  return report;
}

ChecksumGate::ChecksumGate(const Checkpoint& ckpt) : ckpt_(ckpt) {
  for (const auto& t : ckpt.tensors)
    for (size_t c = 0; c < t->chunks.size(); ++c) {
      const Chunk& chunk = t->chunks[c];
      if (chunk.has_crc32c() && chunk.unavailable().empty())
        entries_.push_back({chunk.offset(), chunk.length(), chunk.crc32c(), t.get(), uint32_t(c)});
    }
  auto file_of = [](const Entry& e) { return e.tensor->chunks[e.chunk].file(); };
  std::sort(entries_.begin(), entries_.end(), [&](const Entry& a, const Entry& b) {
    return std::make_pair(file_of(a), a.offset) < std::make_pair(file_of(b), b.offset);
  });
  file_begin_.assign(ckpt.files.size() + 1, entries_.size());
  for (size_t e = entries_.size(); e-- > 0;) file_begin_[file_of(entries_[e])] = e;
  for (size_t f = ckpt.files.size(); f-- > 0;) file_begin_[f] = std::min(file_begin_[f], file_begin_[f + 1]);
  state_ = std::make_unique<std::atomic<uint8_t>[]>(entries_.size());
  for (size_t e = 0; e < entries_.size(); ++e) state_[e].store(kUnknown, std::memory_order_relaxed);
}

Status ChecksumGate::Check(const std::vector<CopyOp>& copies, const RawRead& read) {
  if (entries_.empty()) return Status::OK();
  for (const CopyOp& c : copies) RETURN_IF_ERROR(CheckRange(c.file, c.src_offset, c.length, read));
  return Status::OK();
}

Status ChecksumGate::CheckRange(FileId file, uint64_t offset, uint64_t length, const RawRead& read) {
  if (file + 1 >= file_begin_.size()) return Status::OK();
  // Chunks of one file do not overlap, so those overlapping the range are
  // consecutive: from the last one starting at or before `offset`.
  auto first = entries_.begin() + file_begin_[file], last = entries_.begin() + file_begin_[file + 1];
  auto it = std::upper_bound(first, last, offset, [](uint64_t o, const Entry& e) { return o < e.offset; });
  if (it != first) --it;
  for (; it != last && it->offset < offset + length; ++it) {
    if (it->offset + it->length <= offset) continue;
    size_t e = size_t(it - entries_.begin());
    uint8_t s = state_[e].load(std::memory_order_acquire);
    if (s == kUnknown) RETURN_IF_ERROR(Verify(e, read));
    else if (s == kBad) {
      std::lock_guard<std::mutex> lock(bad_mu_);
      return Status::Corruption(bad_[e]);
    }
  }
  return Status::OK();
}

Status ChecksumGate::Verify(size_t e, const RawRead& read) {
  const Entry& entry = entries_[e];
  const FileId file = entry.tensor->chunks[entry.chunk].file();
  constexpr uint64_t kPiece = 8 << 20;
  std::vector<char> buf(std::min(kPiece, entry.length));
  uint32_t crc = 0;
  for (uint64_t at = 0; at < entry.length; at += kPiece) {
    const uint64_t n = std::min(kPiece, entry.length - at);
    // A read that fails (a changed source) is the reader's error, not a
    // verdict on the chunk: the next read tries again.
    RETURN_IF_ERROR(read(file, entry.offset + at, n, buf.data()));
    crc = Crc32c(crc, buf.data(), n);
  }
  if (crc == entry.crc32c) {
    state_[e].store(kGood, std::memory_order_release);
    return Status::OK();
  }
  std::string why = Describe(e) + ": CRC32C " + Hex(crc) + ", the writer recorded " + Hex(entry.crc32c) +
                    "; the stored bytes are not the saved ones (`ckptfs verify` lists every such chunk)";
  std::lock_guard<std::mutex> lock(bad_mu_);
  bad_.emplace(e, why);
  state_[e].store(kBad, std::memory_order_release);
  return Status::Corruption(why);
}

std::string ChecksumGate::Describe(size_t e) const {
  return Where(ckpt_, *entries_[e].tensor, entries_[e].chunk);
}

}  // namespace ckptfs
