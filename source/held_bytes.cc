#include "source/held_bytes.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <new>

namespace ckptfs {

HeldBytes::HeldBytes(std::shared_ptr<char[]> bytes, uint64_t offset, uint64_t length, uint64_t at)
    : bytes_(std::move(bytes)), size_(length) {
  spans_[offset] = {offset + length, at};
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
    std::memcpy(small.get() + at, bytes_.get() + s->second.at + (b - s->first), e - b);
    kept[b] = {e, at};
    at += e - b;
  }
  bytes_ = std::move(small);
  spans_ = std::move(kept);
  size_ = keep;
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
    copies->push_back({bytes_, bytes_.get() + s->second.at + (b - s->first), dst + (b - src), e - b});
    pos = e;
  }
  if (pos < end) missing->emplace_back(pos, end - pos);
}

}  // namespace ckptfs
