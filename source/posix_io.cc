#include "source/posix_io.h"

#include <ctime>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ckptfs {

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

Status PreadFull(int fd, char* buf, uint64_t len, uint64_t offset, const std::string& what) {
  uint64_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, buf + done, len - done, offset + done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IOError(what + ": read at " + std::to_string(offset + done) + ": " +
                             std::strerror(errno));
    }
    if (n == 0)
      return Status::Corruption(what + ": unexpected end of file at byte " +
                                std::to_string(offset + done));
    done += n;
  }
  return Status::OK();
}

Result<std::string> ReadFileRange(const std::string& path, uint64_t offset, uint64_t len) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Status::IOError(path + ": " + std::strerror(errno));
  std::string out(len, '\0');
  RETURN_IF_ERROR(PreadFull(fd.get(), out.data(), len, offset, path));
  return out;
}

Result<std::string> ReadWholeFile(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Status::IOError(path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return Status::IOError(path + ": " + std::strerror(errno));
  std::string out(st.st_size, '\0');
  RETURN_IF_ERROR(PreadFull(fd.get(), out.data(), out.size(), 0, path));
  return out;
}

int64_t WallClockNs() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace ckptfs
