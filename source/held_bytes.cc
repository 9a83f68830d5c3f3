#include "source/held_bytes.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <new>

namespace ckptfs {

HeldBytes::HeldBytes(std::shared_ptr<char[]> bytes, uint64_t offset, uint64_t length, uint64_t at, bool mapped)
    : bytes_(std::move(bytes)), size_(length), mapped_(mapped) {
  spans_[offset] = {offset + length, at};
}

Status HeldBytes::ReadIn(const char* from, uint64_t len) {
  static const uintptr_t page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t b = reinterpret_cast<uintptr_t>(from) / page * page;
  const uintptr_t e = (reinterpret_cast<uintptr_t>(from) + len + page - 1) / page * page;
  if (len == 0 || ::madvise(reinterpret_cast<void*>(b), e - b, MADV_POPULATE_READ) == 0) return Status::OK();
  return Status::IOError(std::string("the pinned source's pages cannot be read: ") + std::strerror(errno));
}

bool HeldBytes::Compact(const IntervalSet& spans) {
  if (spans.Bytes(0, UINT64_MAX) * 2 > size_) return false;  // a copy would free less than it costs
  return Keep(spans);
}

bool HeldBytes::Keep(const IntervalSet& spans) {
  const uint64_t keep = spans.Bytes(0, UINT64_MAX);
  std::shared_ptr<char[]> small;
  try {
    small.reset(new char[std::max<uint64_t>(keep, 1)]);
  } catch (const std::bad_alloc&) {
    return false;
  }
  std::map<uint64_t, Span> kept;
  uint64_t at = 0;
  for (const auto& [b, e] : spans.spans()) {
    auto s = std::prev(spans_.upper_bound(b));  // holds [b, e): the contract
    const char* from = bytes_.get() + s->second.at + (b - s->first);
    if (mapped_ && !ReadIn(from, e - b).ok()) return false;
    std::memcpy(small.get() + at, from, e - b);
    kept[b] = {e, at};
    at += e - b;
  }
  bytes_ = std::move(small);
  spans_ = std::move(kept);
  size_ = keep;
  mapped_ = false;
  return true;
}

void HeldBytes::Take(uint64_t src, uint64_t length, uint64_t dst, std::vector<Copy>* copies,
                     std::vector<std::pair<uint64_t, uint64_t>>* missing) const {
  const uint64_t end = src + length;
  uint64_t pos = src;
  auto s = spans_.upper_bound(pos);
  if (s != spans_.begin()) --s;
  for (; s != spans_.end() && s->first < end; ++s) {
    const uint64_t b = std::max(pos, s->first), e = std::min(end, s->second.end);
    if (b >= e) continue;
    if (pos < b) missing->emplace_back(pos, b - pos);
    copies->push_back({bytes_, bytes_.get() + s->second.at + (b - s->first), dst + (b - src), e - b, mapped_});
    pos = e;
  }
  if (pos < end) missing->emplace_back(pos, end - pos);
}

}  // namespace ckptfs
