// VirtualFs without /dev/fuse: the tree, lookups, reads and the errno contract.
#include "fs/virtual_fs.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "indexer/scan.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

class VirtualFsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("vfs_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "step" / "model");
    // Two ranks of a [4, 2] U8 tensor split on dim 0; bytes 0..7 overall.
    for (int r = 0; r < 2; ++r) {
      std::string meta = R"({"w": {"saved_offsets": [)" + std::to_string(2 * r) + R"(, 0]}})";
      std::string out = *EncodeSafetensorsHeader({{"w", DType::kU8, {2, 2}, 0, 4}}, {{"DCP_SHARDING_INFO", meta}});
      for (int i = 0; i < 4; ++i) out.push_back(char(4 * r + i));
      std::ofstream(dir_ / "step" / "model" / ("shard-0000" + std::to_string(r + 1) + "-model-00001-of-00001.safetensors"),
                    std::ios::binary)
          << out;
    }
    std::ofstream(dir_ / "step" / "model" / "config.json") << R"({"model_type": "llama"})";
    auto catalog = ScanSource((dir_ / "step").string());
    ASSERT_TRUE(catalog.ok());
    FsOptions o;
    o.log = [this](const std::string& line) { log_.push_back(line); };
    auto v = VirtualFs::Create(std::move(*catalog), o);
    ASSERT_TRUE(v.ok());
    vfs_ = std::move(*v);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string ReadAll(const std::string& path) {
    auto a = vfs_->Resolve(path);
    EXPECT_TRUE(a.ok()) << path;
    auto h = vfs_->Open(a->ino, O_RDONLY);
    EXPECT_TRUE(h.ok());
    std::string out(a->size, '\0');
    auto n = vfs_->Read(*h, out.data(), out.size(), 0);
    vfs_->Release(*h);
    EXPECT_TRUE(n.ok()) << n.status().message();
    out.resize(n.ok() ? *n : 0);
    return out;
  }

  fs::path dir_;
  std::unique_ptr<VirtualFs> vfs_;
  std::vector<std::string> log_;
};

TEST_F(VirtualFsTest, ConsolidatedSitsNextToTheCheckpoint) {
  auto entries = vfs_->ReadDir(vfs_->Resolve("model")->ino);
  ASSERT_TRUE(entries.ok());
  std::vector<std::string> names;
  for (const auto& e : *entries) names.push_back(e.name);
  EXPECT_EQ(names, (std::vector<std::string>{"config.json", "consolidated", "mesh",
                                             "shard-00001-model-00001-of-00001.safetensors",
                                             "shard-00002-model-00001-of-00001.safetensors", "tensors"}));
  auto view = vfs_->ReadDir(vfs_->Resolve("model/consolidated")->ino);
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->size(), 2u);
  EXPECT_EQ((*view)[0].name, "config.json");
  EXPECT_EQ((*view)[1].name, "model.safetensors");
  EXPECT_EQ((*view)[1].attr.mode, S_IFREG | 0444u);
}

TEST_F(VirtualFsTest, ConsolidatedBytesAreTheWholeTensorInOrder) {
  std::string bytes = ReadAll("model/consolidated/model.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = *DecodeHeaderLength(bytes.substr(0, 8), bytes.size());
  auto h = ParseSafetensorsHeader(bytes.substr(8, n), n);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->entries[0].shape, (std::vector<uint64_t>{4, 2}));
  EXPECT_EQ(bytes.substr(8 + n), std::string("\0\1\2\3\4\5\6\7", 8));
  EXPECT_EQ(ReadAll("model/consolidated/config.json"), R"({"model_type": "llama"})");
}

TEST_F(VirtualFsTest, SourceFilesAreMirroredReadOnly) {
  auto a = vfs_->Resolve("model/config.json");
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(a->is_virtual);
  EXPECT_EQ(a->mode & 0222, 0u);
  EXPECT_EQ(ReadAll("model/config.json"), R"({"model_type": "llama"})");
}

TEST_F(VirtualFsTest, WriteOpensAreEROFS) {
  for (const char* p : {"model/config.json", "model/consolidated/model.safetensors"}) {
    uint64_t ino = vfs_->Resolve(p)->ino;
    for (int flags : {O_WRONLY, O_RDWR, O_RDONLY | O_TRUNC, O_WRONLY | O_APPEND}) {
      auto h = vfs_->Open(ino, flags);
      ASSERT_FALSE(h.ok());
      EXPECT_EQ(h.status().err(), EROFS) << p << " flags " << flags;
    }
  }
}

TEST_F(VirtualFsTest, ErrnoForMissingAndDirectories) {
  EXPECT_EQ(vfs_->Resolve("model/nope").status().err(), ENOENT);
  EXPECT_EQ(vfs_->Resolve("model/config.json/x").status().err(), ENOTDIR);
  EXPECT_EQ(vfs_->Open(vfs_->Resolve("model/consolidated")->ino, O_RDONLY).status().err(), EISDIR);
  EXPECT_EQ(vfs_->GetAttr(999999).status().err(), ENOENT);
}

TEST_F(VirtualFsTest, RealEntryShadowsVirtualOne) {
  fs::create_directories(dir_ / "step" / "model" / "consolidated");
  std::ofstream(dir_ / "step" / "model" / "consolidated" / "mine.txt") << "real";
  auto view = vfs_->ReadDir(vfs_->Resolve("model/consolidated")->ino);
  ASSERT_TRUE(view.ok());
  ASSERT_EQ(view->size(), 1u);
  EXPECT_EQ((*view)[0].name, "mine.txt");
}

TEST_F(VirtualFsTest, SourceModifiedAfterIndexingReadsAsEIO) {
  auto a = vfs_->Resolve("model/consolidated/model.safetensors");
  auto h = vfs_->Open(a->ino, O_RDONLY);
  ASSERT_TRUE(h.ok());
  {
    std::fstream f(dir_ / "step" / "model" / "shard-00002-model-00001-of-00001.safetensors",
                   std::ios::binary | std::ios::in | std::ios::out | std::ios::ate);
    f << "tail";  // grows the file: size and mtime change
  }
  std::string buf(a->size, '\0');
  auto n = vfs_->Read(*h, buf.data(), buf.size(), 0);
  vfs_->Release(*h);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().err(), EIO);
  EXPECT_NE(n.status().message().find("run `ckptfs index` again"), std::string::npos);
  ASSERT_FALSE(log_.empty());
  EXPECT_NE(log_.back().find("model/consolidated/model.safetensors"), std::string::npos) << log_.back();
}

}  // namespace
}  // namespace ckptfs
