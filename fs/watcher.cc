#include "fs/watcher.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace ckptfs {
namespace {

// Everything that can change what a source holds or which file a name is.
constexpr uint32_t kEvents = IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE |
                             IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF;

void Drain(int fd) {
  char buf[16 * 1024];
  while (::read(fd, buf, sizeof buf) > 0) {
  }
}

}  // namespace

SourceWatcher::SourceWatcher(std::function<void()> on_change, Options options)
    : on_change_(std::move(on_change)), options_(options) {}

SourceWatcher::~SourceWatcher() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    if (::write(stop_fd_, &one, sizeof one) != sizeof one) std::abort();  // cannot stop the thread otherwise
    thread_.join();
  }
  if (inotify_fd_ >= 0) ::close(inotify_fd_);
  if (stop_fd_ >= 0) ::close(stop_fd_);
}

Status SourceWatcher::Start() {
  inotify_fd_ = ::inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  stop_fd_ = ::eventfd(0, EFD_CLOEXEC);
  if (stop_fd_ < 0) return Status::IOError(std::string("eventfd: ") + std::strerror(errno));
  thread_ = std::thread([this] { Run(); });
  if (inotify_fd_ < 0) return Status::IOError(std::string("inotify unavailable: ") + std::strerror(errno));
  return Status::OK();
}

Status SourceWatcher::Watch(const std::string& abs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (std::find(watched_.begin(), watched_.end(), abs) != watched_.end()) return Status::OK();
  if (inotify_fd_ < 0) return Status::IOError("inotify unavailable; changes are seen by the periodic rescan");
  if (::inotify_add_watch(inotify_fd_, abs.c_str(), kEvents) < 0)
    return Status::IOError("inotify watch on " + abs + ": " + std::strerror(errno) +
                           "; changes there are seen by the periodic rescan");
  watched_.push_back(abs);
  return Status::OK();
}

void SourceWatcher::Run() {
  using Clock = std::chrono::steady_clock;
  auto next_rescan = Clock::now() + options_.rescan;
  bool pending = false;  // events seen, debounce running: a rewrite is many events
  Clock::time_point pending_since;
  for (;;) {
    int timeout = -1;
    if (pending) timeout = int(options_.debounce.count());
    else if (options_.rescan.count() > 0)
      timeout = int(std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::milliseconds>(next_rescan - Clock::now()).count()));
    struct pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {inotify_fd_, POLLIN, 0}};
    int n = ::poll(fds, inotify_fd_ >= 0 ? 2 : 1, timeout);
    if (n < 0 && errno != EINTR) return;
    if (n > 0 && fds[0].revents) return;
    if (n > 0 && (fds[1].revents & POLLIN)) {
      Drain(inotify_fd_);
      if (!pending) pending_since = Clock::now();
      pending = true;
      // A steady stream of events (a save in progress) must not postpone
      // the call for ever: at most 5 debounce periods.
      if (Clock::now() - pending_since < 5 * options_.debounce) continue;
    }
    if (pending || Clock::now() >= next_rescan) {
      pending = false;
      next_rescan = Clock::now() + options_.rescan;
      on_change_();
    }
  }
}

}  // namespace ckptfs
