#include "source/source.h"

#include <algorithm>
#include <cstring>

namespace ckptfs {

Result<std::unique_ptr<SourceObject>> SourceObject::Reopen() const {
  return Status::NotSupported("this source object cannot be reopened");
}

Result<FilledRange> SourceObject::ReadFilled(uint64_t offset, uint64_t len, DirectIo*) const {
  FilledRange out;
  out.buffer = Buffer::Heap(len);
  RETURN_IF_ERROR(ReadAt(offset, len, out.buffer.data()));
  out.data = out.buffer.data();
  return out;
}

Result<std::unique_ptr<PinnedRange>> SourceObject::Pin(uint64_t, uint64_t) const {
  return Status::NotSupported("this source cannot pin a range");
}

Result<uint64_t> SourceObject::ReadOnce(uint64_t offset, uint64_t len, char* dst) const {
  RETURN_IF_ERROR(ReadAt(offset, len, dst));
  return uint64_t(0);
}

Result<std::string> SourceObject::ReadString(uint64_t offset, uint64_t len) const {
  std::string out(len, '\0');
  RETURN_IF_ERROR(ReadAt(offset, len, out.data()));
  return out;
}

Status SourceObject::ReadRanges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                                std::vector<std::string>* out) const {
  out->assign(ranges.size(), std::string());
  for (size_t i = 0; i < ranges.size(); ++i) {
    (*out)[i].resize(ranges[i].second);
    RETURN_IF_ERROR(ReadAt(ranges[i].first, ranges[i].second, (*out)[i].data()));
  }
  return Status::OK();
}

Result<std::unique_ptr<WindowedObject>> WindowedObject::Fetch(const SourceObject& inner,
                                                              std::vector<std::pair<uint64_t, uint64_t>> ranges,
                                                              WindowGaps gaps) {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;  // (offset, length)
  for (const auto& [offset, len] : ranges) {
    if (len == 0) continue;
    const uint64_t end = merged.empty() ? 0 : merged.back().first + merged.back().second;
    const uint64_t gap = offset > end ? offset - end : 0;
    const bool bridge = gap > 0 && gap <= gaps.longest && gap <= gaps.budget;
    if (!merged.empty() && (offset <= end || bridge)) {
      if (bridge) gaps.budget -= gap;
      merged.back().second = std::max(merged.back().second, offset + len - merged.back().first);
    } else {
      merged.emplace_back(offset, len);
    }
  }
  std::vector<std::string> bytes;
  RETURN_IF_ERROR(inner.ReadRanges(merged, &bytes));
  std::unique_ptr<WindowedObject> out(new WindowedObject(inner));
  for (size_t i = 0; i < merged.size(); ++i) out->windows_.emplace(merged[i].first, std::move(bytes[i]));
  return out;
}

std::unique_ptr<WindowedObject> WindowedObject::Holding(const SourceObject& inner,
                                                        std::map<uint64_t, std::string> windows) {
  std::unique_ptr<WindowedObject> out(new WindowedObject(inner));
  out->windows_ = std::move(windows);
  return out;
}

Status WindowedObject::ReadAt(uint64_t offset, uint64_t len, char* dst) const {
  auto it = windows_.upper_bound(offset);
  if (it != windows_.begin()) {
    --it;
    const uint64_t at = offset - it->first;
    if (at <= it->second.size() && len <= it->second.size() - at) {
      std::memcpy(dst, it->second.data() + at, len);
      return Status::OK();
    }
  }
  return inner_.ReadAt(offset, len, dst);
}

uint64_t WindowedObject::bytes() const {
  uint64_t n = 0;
  for (const auto& [offset, w] : windows_) n += w.size();
  return n;
}

Status MemoryObject::ReadAt(uint64_t offset, uint64_t len, char* dst) const {
  if (offset > bytes_.size() || len > bytes_.size() - offset)
    return Status::Corruption("unexpected end of file at byte " + std::to_string(std::min<uint64_t>(offset, bytes_.size())) +
                              " of " + std::to_string(bytes_.size()));
  std::memcpy(dst, bytes_.data() + offset, len);
  return Status::OK();
}

Result<SourceFile> MemoryObject::Identity() const {
  SourceFile f;
  f.size = bytes_.size();
  return f;
}

Result<std::string> Source::ReadRange(const std::string& rel, uint64_t offset, uint64_t len) const {
  ASSIGN_OR_RETURN(std::unique_ptr<SourceObject> obj, Open(rel));
  return obj->ReadString(offset, len);
}

Result<std::string> Source::ReadWhole(const std::string& rel) const {
  SourceFile any;  // no identity to open at: the file as it is now
  any.path = rel;
  return ReadWholeIndexed(any);
}

Result<std::string> Source::ReadWholeIndexed(const SourceFile& indexed) const {
  ASSIGN_OR_RETURN(std::unique_ptr<SourceObject> obj, OpenIndexed(indexed));
  ASSIGN_OR_RETURN(SourceFile id, obj->Identity());
  return obj->ReadString(0, id.size);
}

std::string JoinRel(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

}  // namespace ckptfs
