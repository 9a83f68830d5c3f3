// SourceWatcher: notices changes to the sources of a mounted tree.
//
// A background thread waits on inotify for events in the watched
// directories (writes, attribute changes, renames, deletions) and, a short
// debounce later, calls `on_change`; it also calls it every `rescan` period,
// for filesystems where inotify sees nothing (NFS, Lustre, changes made on
// another host). The callback decides what changed (it re-stats sources),
// so a missed or merged event costs at most one period, never correctness.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"

namespace ckptfs {

class SourceWatcher {
 public:
  struct Options {
    std::chrono::milliseconds debounce{50};
    std::chrono::milliseconds rescan{2000};  // 0 disables the periodic call
  };
  SourceWatcher(std::function<void()> on_change, Options options);
  ~SourceWatcher();  // stops the thread
  SourceWatcher(const SourceWatcher&) = delete;
  SourceWatcher& operator=(const SourceWatcher&) = delete;

  // Starts the thread. Must be called after any fork (daemonizing).
  Status Start();
  // Adds an inotify watch on directory `abs` (idempotent). A failure (no
  // inotify watches left, a filesystem without inotify) is returned so the
  // caller can log it; the periodic rescan still covers the directory.
  Status Watch(const std::string& abs);

 private:
  void Run();

  std::function<void()> on_change_;
  Options options_;
  int inotify_fd_ = -1;
  int stop_fd_ = -1;  // eventfd that wakes the thread to stop
  std::mutex mu_;     // guards watched_
  std::vector<std::string> watched_;
  std::thread thread_;
};

}  // namespace ckptfs
