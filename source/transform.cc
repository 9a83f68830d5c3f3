#include "source/transform.h"

#include <zstd.h>

#include <memory>
#include <vector>

namespace ckptfs {

std::string TransformName(const std::string& descriptor) {
  // torch writes "stream.zstd/1"; the version is the ZStandard extension's.
  if (descriptor == "stream.zstd/1" || descriptor == "stream.zstd") return "zstd";
  return "";
}

Result<std::string> DecodeItem(const std::string& transform, const SourceObject& src, uint64_t offset, uint64_t length,
                               uint64_t max_bytes, const std::string& what) {
  if (transform != "zstd") return Status::NotSupported(what + ": unknown transform '" + transform + "'");
  std::string in(length, '\0');
  if (Status s = src.ReadAt(offset, length, in.data()); !s.ok()) return s.WithContext(what);
  std::unique_ptr<ZSTD_DStream, size_t (*)(ZSTD_DStream*)> ds(ZSTD_createDStream(), ZSTD_freeDStream);
  if (!ds) return Status::IOError(what + ": out of memory for the zstd decoder");
  ZSTD_initDStream(ds.get());
  std::string out;
  std::vector<char> buf(ZSTD_DStreamOutSize());
  ZSTD_inBuffer input{in.data(), in.size(), 0};
  size_t last = 0;
  bool full = false;
  // Until the input is consumed, and then while a call fills the whole
  // output buffer (the decoder may still hold bytes).
  while (input.pos < input.size || full) {
    ZSTD_outBuffer output{buf.data(), buf.size(), 0};
    last = ZSTD_decompressStream(ds.get(), &output, &input);
    if (ZSTD_isError(last)) return Status::Corruption(what + ": zstd: " + ZSTD_getErrorName(last));
    if (out.size() + output.pos > max_bytes)
      return Status::Corruption(what + ": decodes to more than " + std::to_string(max_bytes) + " bytes");
    out.append(buf.data(), output.pos);
    full = output.pos == output.size;
  }
  if (last != 0) return Status::Corruption(what + ": truncated zstd stream");
  return out;
}

std::shared_ptr<const std::string> DecodedCache::Find(FileId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cache_.find(id);
  if (it == cache_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second.second);
  return it->second.first;
}

void DecodedCache::Add(FileId id, std::shared_ptr<const std::string> value) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cache_.count(id)) return;
  lru_.push_front(id);
  cached_bytes_ += value->size();
  cache_[id] = {std::move(value), lru_.begin()};
  // Evict least recently used items, keeping at least the one just added.
  while (cached_bytes_ > budget_ && lru_.size() > 1) {
    FileId victim = lru_.back();
    lru_.pop_back();
    cached_bytes_ -= cache_[victim].first->size();
    cache_.erase(victim);
  }
}

}  // namespace ckptfs
