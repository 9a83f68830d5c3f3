#include "source/range_buffers.h"

#include "source/direct_io.h"

#include <sys/mman.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace ckptfs {

struct RangeBuffers::Shelf {
  Shelf(uint64_t s, size_t k) : size(s), keep(k) {}
  ~Shelf() {
    for (char* p : kept) ::munmap(p, size);
  }
  const uint64_t size;  // of every kept buffer
  const size_t keep;    // at most this many kept
  std::mutex mu;        // guards `kept`
  std::vector<char*> kept;
};

namespace {

// A range is written once, front to back (a GET's body, a read), into a
// fresh mapping: faulted in 4 KiB at a time, that was 7% of the daemon's CPU
// over S3. Huge pages fault 2 MiB at once. Only advice: where transparent
// huge pages are off (or "never"), the mapping faults as before.
constexpr uint64_t kHugePage = 2ull << 20;
void AskForHugePages(char* p, uint64_t bytes) {
  if (bytes >= kHugePage) ::madvise(p, bytes, MADV_HUGEPAGE);
}

}  // namespace

RangeBuffers::RangeBuffers(uint64_t usual, size_t keep_idle)
    : usual_(usual), shelf_(std::make_shared<Shelf>(usual, std::max(keep_idle, kKeepIdle))) {}

std::shared_ptr<char[]> RangeBuffers::Take(uint64_t bytes) {
  // More than half the usual size: a buffer of the usual size (a range that
  // fills most of its window, source/ordered_fetch.h, reuses the shelf's).
  // Less: a mapping of its own size. A recycled buffer was touched whole,
  // and a fresh one of 2 MiB or more is backed by huge pages, so a small
  // range (a few KiB between other items' bytes) held in a buffer of the
  // usual size costs that size: 400 such ranges held at --part-size 64MiB
  // took 23 GiB while the fetch bound counted their bytes, 1 MiB.
  if (bytes > usual_ / 2 && bytes <= usual_) bytes = usual_;
  if (bytes < usual_) bytes = std::max<uint64_t>(AlignUp(bytes, kDirectAlign), kDirectAlign);
  char* p = nullptr;
  if (bytes == usual_) {
    std::lock_guard<std::mutex> lock(shelf_->mu);
    if (!shelf_->kept.empty()) {
      p = shelf_->kept.back();
      shelf_->kept.pop_back();
    }
  }
  if (!p) {
    // Anonymous mappings are page-aligned, which O_DIRECT needs of its memory.
    void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return nullptr;
    p = static_cast<char*>(m);
    AskForHugePages(p, bytes);
  }
  std::weak_ptr<Shelf> shelf = shelf_;
  return std::shared_ptr<char[]>(p, [shelf, bytes](char* q) {
    if (auto s = shelf.lock(); s && bytes == s->size) {
      std::lock_guard<std::mutex> lock(s->mu);
      if (s->kept.size() < s->keep) {
        s->kept.push_back(q);
        return;
      }
    }
    ::munmap(q, bytes);
  });
}

void RangeBuffers::Trim() {
  std::vector<char*> extra;
  {
    std::lock_guard<std::mutex> lock(shelf_->mu);
    while (shelf_->kept.size() > kKeepIdle) {
      extra.push_back(shelf_->kept.back());
      shelf_->kept.pop_back();
    }
  }
  for (char* p : extra) ::munmap(p, usual_);
}

size_t RangeBuffers::idle() const {
  std::lock_guard<std::mutex> lock(shelf_->mu);
  return shelf_->kept.size();
}

}  // namespace ckptfs
