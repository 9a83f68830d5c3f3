#include "source/direct_io.h"

#include <sys/mman.h>

#include <cstdio>
#include <new>

namespace ckptfs {
namespace {

// Anonymous mappings are page-aligned, which O_DIRECT needs of its memory.
char* MapBytes(size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
}

std::string Bytes(uint64_t n) {
  char out[32];
  if (n < (1 << 10)) std::snprintf(out, sizeof out, "%llu B", static_cast<unsigned long long>(n));
  else if (n < (1 << 20)) std::snprintf(out, sizeof out, "%.1f KiB", double(n) / (1 << 10));
  else std::snprintf(out, sizeof out, "%.1f MiB", double(n) / (1 << 20));
  return out;
}

}  // namespace

AlignedSpan AlignSpan(uint64_t offset, uint64_t length, uint64_t align) {
  AlignedSpan s;
  s.start = AlignDown(offset, align);
  s.skip = offset - s.start;
  s.length = AlignUp(offset + length, align) - s.start;
  return s;
}

Buffer Buffer::Heap(size_t size) {
  if (size == 0) return Buffer();
  return Buffer(new char[size], size, nullptr);
}

Buffer::Buffer(Buffer&& o) noexcept : data_(o.data_), size_(o.size_), pool_(o.pool_) {
  o.data_ = nullptr;
  o.size_ = 0;
  o.pool_ = nullptr;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(pool_, o.pool_);
  }
  return *this;
}

Buffer::~Buffer() { Reset(); }

void Buffer::Reset() {
  if (!data_) return;
  if (pool_) pool_->Give(data_, size_);
  else delete[] data_;
  data_ = nullptr;
  size_ = 0;
  pool_ = nullptr;
}

BufferPool::~BufferPool() {
  for (auto& [size, list] : free_)
    for (char* p : list) ::munmap(p, size);
}

size_t BufferPool::ClassSize(uint64_t bytes) {
  size_t size = kMinBuffer;
  while (size < bytes) size <<= 1;
  return size;
}

uint64_t BufferPool::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

uint64_t BufferPool::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

void BufferPool::DropFreeLocked(uint64_t need) {
  while (held_ + need > capacity_ && !free_.empty()) {
    auto largest = std::prev(free_.end());
    ::munmap(largest->second.back(), largest->first);
    held_ -= largest->first;
    largest->second.pop_back();
    if (largest->second.empty()) free_.erase(largest);
  }
}

std::optional<Buffer> BufferPool::TryTake(uint64_t bytes) {
  const size_t size = ClassSize(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = free_.find(size); it != free_.end()) {
      char* p = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      in_use_ += size;
      return Buffer(p, size, this);
    }
    DropFreeLocked(size);
    if (held_ + size > capacity_) return std::nullopt;
    // Counted before mapping, so concurrent takers cannot overshoot.
    held_ += size;
    in_use_ += size;
  }
  char* p = MapBytes(size);
  if (p) return Buffer(p, size, this);
  std::lock_guard<std::mutex> lock(mu_);
  held_ -= size;
  in_use_ -= size;
  return std::nullopt;
}

void BufferPool::Give(char* data, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  in_use_ -= size;
  free_[size].push_back(data);
}

std::string DirectStats::Describe() const {
  return "direct reads: " + std::to_string(direct_reads.load()) + " (" + Bytes(direct_bytes.load()) +
         "), cached " + Bytes(cached_bytes.load()) + ", buffered " + Bytes(buffered_bytes.load()) +
         ", files without O_DIRECT " + std::to_string(refused_files.load()) + ", pool full " +
         std::to_string(pool_full.load());
}

}  // namespace ckptfs
