// Temporary directories for the unit tests: made under testing::TempDir()
// and removed, with all they hold, when the test process exits, whether its
// test passed or not (an ASSERT that returns early leaves nothing behind).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

namespace ckptfs {

class TempDirs {
 public:
  // A new empty directory named `prefix` plus a unique suffix.
  static std::filesystem::path Make(const std::string& prefix) {
    static TempDirs made;
    std::string path = testing::TempDir() + prefix + "-XXXXXX";
    if (::mkdtemp(path.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << path << ": " << strerror(errno);
    std::lock_guard<std::mutex> lock(made.mu_);
    made.dirs_.push_back(path);
    return path;
  }

  ~TempDirs() {
    if (::getpid() != owner_) return;  // a forked child's exit leaves its parent's directories
    std::error_code ignored;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ignored);
  }

 private:
  const pid_t owner_ = ::getpid();
  std::mutex mu_;  // guards dirs_
  std::vector<std::filesystem::path> dirs_;
};

}  // namespace ckptfs
