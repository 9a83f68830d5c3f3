// Small POSIX helpers shared by the readers and the executor: full preads
// that retry on EINTR and short reads, with errors that name the file.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace ckptfs {

// Reads exactly `len` bytes at `offset` of `fd` into `buf`; a short file is
// Corruption ("unexpected end of file"), an OS error IOError.
Status PreadFull(int fd, char* buf, uint64_t len, uint64_t offset, const std::string& what);

// Opens `path` read-only and reads [offset, offset + len).
Result<std::string> ReadFileRange(const std::string& path, uint64_t offset, uint64_t len);

// Reads a whole (small) file.
Result<std::string> ReadWholeFile(const std::string& path);

// The wall clock (CLOCK_REALTIME) in nanoseconds since the epoch: what the
// index, the disk cache and the mount stamp their records with.
int64_t WallClockNs();

// Closes the fd on scope exit.
class ScopedFd {
 public:
  explicit ScopedFd(int fd = -1) : fd_(fd) {}
  ~ScopedFd();
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace ckptfs
