// The fetched bytes of one source range, held for the readers that have yet
// to ask for them (source/ordered_fetch.h). Held whole once fetched; after
// the range's whole pages went to the page cache, only the spans still
// needed (the pages it shares with a neighbouring range, a few KiB per
// tensor edge) are kept, in one small buffer, so that a memory bound holds
// what consumers have yet to read rather than whole ranges.
//
// Not thread-safe: its owner guards it. The buffer is shared with the
// copies Take hands out, so a copy stays valid after a Compact or a Reset
// and may be read outside the owner's lock.
//
// The bytes may be a mapping of a source file (a pin, SourceObject::Pin),
// whose pages are read in on first touch: a page that cannot be read would
// end the process (SIGBUS) where a read() fails. So a mapped hold reads
// the pages in (ReadIn) before it copies from them, and its copies say they
// are mapped, for their readers to do the same.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/status.h"
#include "source/interval_set.h"

namespace ckptfs {

class HeldBytes {
 public:
  HeldBytes() = default;
  // Holds source bytes [offset, offset + length), which `bytes` holds whole
  // from byte `at` on; `mapped`: a mapping of a file (see above).
  HeldBytes(std::shared_ptr<char[]> bytes, uint64_t offset, uint64_t length, uint64_t at = 0, bool mapped = false);

  // Reads the pages under [from, from + len) of a file's mapping in, or
  // says why it cannot (the file's read error); then a copy cannot fault.
  static Status ReadIn(const char* from, uint64_t len);

  // Keeps only `spans` (source offsets; every byte of them held now) when
  // that frees at least half of what is held. Returns whether it did; false
  // also when the small buffer cannot be allocated (all stays held).
  bool Compact(const IntervalSet& spans);
  // Keeps only `spans` (every byte of them held now), copied into a buffer
  // of their own, whatever that frees; false (all stays held) when it
  // cannot be allocated, or a mapping's pages cannot be read.
  bool Keep(const IntervalSet& spans);

  // Bytes of a held span copied into a reply at `dst`.
  struct Copy {
    std::shared_ptr<char[]> bytes;  // keeps `from` alive
    const char* from;
    uint64_t dst, length;
    bool mapped;  // read it in (ReadIn) before copying
  };
  // Splits source bytes [src, src + length), bound for reply offset `dst`,
  // into copies from what is held and the source spans that are not
  // (`missing`: (source offset, length)).
  void Take(uint64_t src, uint64_t length, uint64_t dst, std::vector<Copy>* copies,
            std::vector<std::pair<uint64_t, uint64_t>>* missing) const;

  uint64_t size() const { return size_; }  // bytes held
  void Reset() { *this = HeldBytes(); }

 private:
  struct Span {
    uint64_t end, at;  // source bytes [begin, end) are at bytes_ + at
  };
  std::shared_ptr<char[]> bytes_;
  std::map<uint64_t, Span> spans_;  // by source begin
  uint64_t size_ = 0;
  bool mapped_ = false;
};

}  // namespace ckptfs
