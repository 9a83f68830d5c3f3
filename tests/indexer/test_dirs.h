// What the indexer's tests share: a directory of the running test's own,
// and a fixture with a source root and the path of its store.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>

namespace ckptfs {

// <gtest TempDir>/<prefix>_<pid>_<test name>, removed and made anew: each
// test has its own, and so has each process running it (ctest runs tests
// of one binary side by side).
inline std::filesystem::path FreshTestDir(const std::string& prefix) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) /
      (prefix + "_" + std::to_string(::getpid()) + "_" +
       ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// An empty source root `root_` (dir_/root, canonical) and where its store
// goes, `index_` (dir_/index, not created); dir_ is removed after the test.
class RootAndIndexTest : public ::testing::Test {
 protected:
  explicit RootAndIndexTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    dir_ = FreshTestDir(prefix_);
    std::filesystem::create_directories(dir_ / "root");
    root_ = std::filesystem::canonical(dir_ / "root").string();
    index_ = (dir_ / "index").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::filesystem::path dir_;
  std::string root_, index_;

 private:
  std::string prefix_;
};

}  // namespace ckptfs
