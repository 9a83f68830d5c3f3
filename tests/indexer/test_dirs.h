// What the indexer's tests share: a fixture with a source root and the
// path of its store, in a directory of the running test's own.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <utility>

#include "tests/temp_dirs.h"

namespace ckptfs {

// An empty source root `root_` (dir_/root, canonical) and where its store
// goes, `index_` (dir_/index, not created); dir_ is removed after the test.
class RootAndIndexTest : public ::testing::Test {
 protected:
  explicit RootAndIndexTest(std::string prefix) : prefix_(std::move(prefix)) {}
  void SetUp() override {
    dir_ = TempDirs::ForThisTest(prefix_);
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
