// Temporary directories for the unit tests, all made under
// testing::TempDir() and removed, with all they hold, when the test process
// exits, whether its test passed or not (an ASSERT that returns early
// leaves nothing behind).
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
    std::string path = testing::TempDir() + prefix + "-XXXXXX";
    if (::mkdtemp(path.data()) == nullptr) ADD_FAILURE() << "mkdtemp " << path << ": " << strerror(errno);
    return Remember(path);
  }

  // <TempDir>/<prefix>_<pid>_<test name>, removed and made anew: each test
  // has its own, and so has each process running it (ctest runs tests of
  // one binary side by side).
  static std::filesystem::path ForThisTest(const std::string& prefix) {
    const std::filesystem::path dir =
        std::filesystem::path(::testing::TempDir()) /
        (prefix + "_" + std::to_string(::getpid()) + "_" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    return Remember(dir);
  }

  ~TempDirs() {
    if (::getpid() != owner_) return;  // a forked child's exit leaves its parent's directories
    std::error_code ignored;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ignored);
  }

 private:
  static std::filesystem::path Remember(const std::filesystem::path& dir) {
    static TempDirs made;
    std::lock_guard<std::mutex> lock(made.mu_);
    made.dirs_.push_back(dir);
    return dir;
  }

  const pid_t owner_ = ::getpid();
  std::mutex mu_;  // guards dirs_
  std::vector<std::filesystem::path> dirs_;
};

}  // namespace ckptfs
