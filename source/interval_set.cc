#include "source/interval_set.h"

#include <algorithm>
#include <iterator>

namespace ckptfs {

void IntervalSet::Add(uint64_t begin, uint64_t end) {
  if (begin >= end) return;
  auto it = spans_.upper_bound(begin);
  if (it != spans_.begin() && std::prev(it)->second >= begin) --it;
  while (it != spans_.end() && it->first <= end) {
    begin = std::min(begin, it->first);
    end = std::max(end, it->second);
    it = spans_.erase(it);
  }
  spans_.emplace(begin, end);
}

uint64_t IntervalSet::Remove(uint64_t begin, uint64_t end) {
  if (begin >= end) return 0;
  uint64_t removed = 0;
  auto it = spans_.upper_bound(begin);
  if (it != spans_.begin()) --it;
  while (it != spans_.end() && it->first < end) {
    const uint64_t b = it->first, e = it->second;
    if (e <= begin) {
      ++it;
      continue;
    }
    removed += std::min(e, end) - std::max(b, begin);
    it = spans_.erase(it);
    if (b < begin) spans_.emplace(b, begin);
    if (e > end) it = spans_.emplace(end, e).first;
  }
  return removed;
}

uint64_t IntervalSet::Bytes(uint64_t begin, uint64_t end) const {
  uint64_t n = 0;
  auto it = spans_.upper_bound(begin);
  if (it != spans_.begin()) --it;
  for (; it != spans_.end() && it->first < end; ++it)
    if (it->second > begin) n += std::min(end, it->second) - std::max(begin, it->first);
  return n;
}

}  // namespace ckptfs
