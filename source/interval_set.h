// Disjoint half-open intervals of byte offsets: what a source-order plan
// still needs of a range, what a file's readers were served.
#pragma once

#include <cstdint>
#include <map>

namespace ckptfs {

// Disjoint half-open intervals of byte offsets.
class IntervalSet {
 public:
  void Add(uint64_t begin, uint64_t end);
  // Removes [begin, end); returns how many bytes were in the set.
  uint64_t Remove(uint64_t begin, uint64_t end);
  uint64_t Bytes(uint64_t begin, uint64_t end) const;  // in [begin, end)
  bool empty() const { return spans_.empty(); }
  const std::map<uint64_t, uint64_t>& spans() const { return spans_; }  // begin -> end

 private:
  std::map<uint64_t, uint64_t> spans_;
};

}  // namespace ckptfs
