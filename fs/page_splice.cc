#include "fs/page_splice.h"

#include <fcntl.h>
#include <linux/fuse.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ckptfs {
namespace {

// The largest pipe an unprivileged process gets by default
// (/proc/sys/fs/pipe-max-size): a message of up to about 1 MiB.
constexpr int kPipeBytes = 1 << 20;

// The calling thread's pipe, as large as the system lets it be, made anew
// after a failed message (which may have left bytes in it).
class StorePipe {
 public:
  ~StorePipe() { Close(); }
  // Whether it is open; opens it first if needed.
  bool Ready() {
    if (r_ >= 0) return true;
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) return false;
    r_ = p[0];
    w_ = p[1];
    int cap = ::fcntl(w_, F_SETPIPE_SZ, kPipeBytes);
    if (cap < 0) cap = ::fcntl(w_, F_GETPIPE_SZ);
    // A slot per page: the header takes one, bytes not page-aligned in the
    // file one more.
    const long page = ::sysconf(_SC_PAGESIZE);
    room_ = cap > 2 * page ? size_t(cap / page - 2) * size_t(page) : 0;
    if (room_ == 0) Close();
    return room_ > 0;
  }
  void Close() {
    if (r_ >= 0) ::close(r_), ::close(w_);
    r_ = w_ = -1;
  }
  int r() const { return r_; }
  int w() const { return w_; }
  size_t room() const { return room_; }  // bytes of a message's data that fit with its header

 private:
  int r_ = -1, w_ = -1;
  size_t room_ = 0;
};

thread_local StorePipe store_pipe;

// Splices `len` bytes at `at` of `fd` into the pipe's write end `w`.
bool SpliceFrom(int fd, uint64_t at, int w, size_t len) {
  loff_t off = loff_t(at);
  while (len > 0) {
    const ssize_t n = ::splice(fd, &off, w, nullptr, len, SPLICE_F_MORE);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // the end of the file, or an error a read will meet
    len -= size_t(n);
  }
  return true;
}

// One FUSE_NOTIFY_STORE message of `len` bytes (at most the pipe's room).
bool StoreOne(StorePipe& p, int dev, uint64_t ino, uint64_t offset, int fd, uint64_t fd_offset, size_t len) {
  struct {
    fuse_out_header out;
    fuse_notify_store_out store;
  } head;
  std::memset(&head, 0, sizeof head);
  head.out.len = uint32_t(sizeof head + len);
  head.out.error = FUSE_NOTIFY_STORE;  // unique 0: a notification
  head.store = {ino, offset, uint32_t(len), 0};
  if (::write(p.w(), &head, sizeof head) != ssize_t(sizeof head)) return false;
  if (!SpliceFrom(fd, fd_offset, p.w(), len)) return false;
  for (;;) {
    const ssize_t n = ::splice(p.r(), nullptr, dev, nullptr, sizeof head + len, 0);
    if (n < 0 && errno == EINTR) continue;
    return n == ssize_t(sizeof head + len);
  }
}

}  // namespace

size_t SpliceStore(int dev, uint64_t ino, uint64_t offset, int fd, uint64_t fd_offset, size_t len) {
  StorePipe& p = store_pipe;
  size_t done = 0;
  while (done < len && p.Ready()) {
    const size_t n = std::min(len - done, p.room());
    if (!StoreOne(p, dev, ino, offset + done, fd, fd_offset + done, n)) {
      p.Close();
      break;
    }
    done += n;
  }
  return done;
}

}  // namespace ckptfs
