// Which pages of a file are in the page cache, for the tests of reads that
// must (read-ahead) or must not (O_DIRECT) bring them in.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <vector>

namespace ckptfs {

// Pages of [offset, offset + len) of `path` in the page cache (mincore on a
// mapping of our own: the test runs as the files' owner). `offset` is
// page-aligned.
inline uint64_t ResidentPages(const std::filesystem::path& path, uint64_t offset, uint64_t len) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  void* m = ::mmap(nullptr, len, PROT_READ, MAP_SHARED, fd, off_t(offset));
  ::close(fd);
  EXPECT_NE(m, MAP_FAILED);
  if (m == MAP_FAILED) return 0;
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((len + page - 1) / page);
  EXPECT_EQ(::mincore(m, len, vec.data()), 0);
  ::munmap(m, len);
  uint64_t n = 0;
  for (unsigned char v : vec) n += v & 1;
  return n;
}

// Bytes of the whole of `path` in the page cache, by the page.
inline uint64_t ResidentBytes(const std::filesystem::path& path) {
  return ResidentPages(path, 0, std::filesystem::file_size(path)) * uint64_t(::sysconf(_SC_PAGESIZE));
}

}  // namespace ckptfs
