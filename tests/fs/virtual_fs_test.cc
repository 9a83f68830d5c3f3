// VirtualFs without /dev/fuse: the tree, lookups, reads and the errno contract.
#include "fs/virtual_fs.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/safetensors.h"
#include "indexer/scan.h"
#include "source/posix_source.h"

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

// tensors/ is filled on first use: a lookup of one file, with no listing
// before it, must find it (NumPy's format: magic, header padded so the data
// starts at a multiple of 64, then the C-order bytes).
TEST_F(VirtualFsTest, TensorsFileFoundByLookupBeforeAnyListing) {
  std::string npy = ReadAll("model/tensors/w.npy");
  ASSERT_EQ(npy.size() % 64, 8u);
  EXPECT_EQ(npy.substr(0, 6), "\x93NUMPY");
  const std::string header = npy.substr(10, npy.size() - 8 - 10);
  EXPECT_NE(header.find("'descr': '|u1'"), std::string::npos) << header;
  EXPECT_NE(header.find("'shape': (4, 2)"), std::string::npos) << header;
  EXPECT_EQ(npy.substr(npy.size() - 8), std::string("\0\1\2\3\4\5\6\7", 8));
}

TEST_F(VirtualFsTest, TensorsListingAndLookupShowTheSameFile) {
  auto listed = vfs_->ReadDir(vfs_->Resolve("model/tensors")->ino);
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].name, "w.npy");
  auto again = vfs_->ReadDir(vfs_->Resolve("model/tensors")->ino);
  ASSERT_TRUE(again.ok());
  ASSERT_EQ(again->size(), 1u);
  auto looked_up = vfs_->Resolve("model/tensors/w.npy");
  ASSERT_TRUE(looked_up.ok());
  EXPECT_EQ(looked_up->ino, (*listed)[0].attr.ino);
  EXPECT_EQ(looked_up->size, (*listed)[0].attr.size);
  EXPECT_EQ(vfs_->Resolve("model/tensors/nope.npy").status().err(), ENOENT);
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

// A re-save can rewrite one rank's file and leave another's as it was: once
// any source of a checkpoint changed, bytes from its untouched files are
// not served either (they may belong to the save that was replaced).
TEST_F(VirtualFsTest, RegressionUntouchedFileOfAChangedCheckpointReadsAsEIO) {
  const std::string whole = ReadAll("model/consolidated/model.safetensors");
  uint64_t header = 0;
  std::memcpy(&header, whole.data(), 8);
  const uint64_t rank0_data = 8 + header;  // rows 0..1 of w: shard-00001's 4 bytes
  ASSERT_EQ(whole.substr(rank0_data, 4), std::string("\0\1\2\3", 4));
  {
    std::fstream f(dir_ / "step" / "model" / "shard-00002-model-00001-of-00001.safetensors",
                   std::ios::binary | std::ios::in | std::ios::out | std::ios::ate);
    f << "tail";
  }
  EXPECT_EQ(vfs_->RecheckSources(), 1u);  // what the watcher does on a change
  auto a = vfs_->Resolve("model/consolidated/model.safetensors");
  auto h = vfs_->Open(a->ino, O_RDONLY);
  ASSERT_TRUE(h.ok());
  std::string buf(4, '\0');
  auto n = vfs_->Read(*h, buf.data(), buf.size(), rank0_data);
  vfs_->Release(*h);
  ASSERT_FALSE(n.ok()) << "served " << buf.size() << " bytes of a checkpoint whose other file changed";
  EXPECT_EQ(n.status().err(), EIO);
}

// --max-loaded under concurrency: four checkpoints, one kept loaded, eight
// threads reading all of them. Every read must return that checkpoint's
// bytes (step s holds 10 * s + 0..7); an open may meet an unloaded
// generation (ESTALE, which the kernel retries with a fresh lookup), a read
// of an open file never fails.
class EvictionTest : public ::testing::Test {
 protected:
  static constexpr int kSteps = 4;
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("vfs_evict_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    std::vector<std::string> dirs;
    for (int s = 0; s < kSteps; ++s) {
      const std::string rel = "step_" + std::to_string(s);
      fs::create_directories(dir_ / rel);
      for (int r = 0; r < 2; ++r) {
        std::string meta = R"({"w": {"saved_offsets": [)" + std::to_string(2 * r) + R"(, 0]}})";
        std::string out = *EncodeSafetensorsHeader({{"w", DType::kU8, {2, 2}, 0, 4}}, {{"DCP_SHARDING_INFO", meta}});
        for (int i = 0; i < 4; ++i) out.push_back(char(10 * s + 4 * r + i));
        std::ofstream(dir_ / rel / ("shard-0000" + std::to_string(r + 1) + "-model-00001-of-00001.safetensors"),
                      std::ios::binary)
            << out;
      }
      dirs.push_back(rel);
    }
    FsOptions o;
    o.max_loaded = 1;
    o.info = [this](const std::string& line) {
      if (line.find(": loaded") != std::string::npos) ++loads_;
    };
    const std::string root = dir_.string();
    auto v = VirtualFs::Open(root, dirs, [root](const std::string& rel) -> Result<Checkpoint> {
      ASSIGN_OR_RETURN(auto ck, ScanCheckpointDir(*PosixSourceAt(root), rel));
      if (!ck) return Status::NotFound(rel);
      return std::move(*ck);
    }, o);
    ASSERT_TRUE(v.ok()) << v.status().message();
    vfs_ = std::move(*v);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The tensor bytes of step `s`'s consolidated file, retrying an open that
  // met an unloaded generation; "" and a failure when anything else fails.
  std::string TensorBytes(int s) {
    const std::string path = "step_" + std::to_string(s) + "/consolidated/model.safetensors";
    for (int attempt = 0; attempt < 100; ++attempt) {
      auto a = vfs_->Resolve(path);
      if (!a.ok()) {
        ADD_FAILURE() << path << ": " << a.status().message();
        return "";
      }
      auto h = vfs_->Open(a->ino, O_RDONLY);
      if (!h.ok() && h.status().err() == ESTALE) continue;
      if (!h.ok()) {
        ADD_FAILURE() << path << ": " << h.status().message();
        return "";
      }
      std::string out(a->size, '\0');
      auto n = vfs_->Read(*h, out.data(), out.size(), 0);
      vfs_->Release(*h);
      if (!n.ok() || *n != out.size()) {
        ADD_FAILURE() << path << ": read failed";
        return "";
      }
      return out.substr(out.size() - 8);
    }
    ADD_FAILURE() << path << ": ESTALE 100 times in a row";
    return "";
  }

  fs::path dir_;
  std::unique_ptr<VirtualFs> vfs_;
  std::atomic<int> loads_{0};
};

TEST_F(EvictionTest, ConcurrentReadersAlwaysGetTheirCheckpointsBytes) {
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 300; ++k) {
        const int s = (t + k) % kSteps;
        std::string want;
        for (int i = 0; i < 8; ++i) want.push_back(char(10 * s + i));
        if (TensorBytes(s) != want) ++wrong;
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GT(loads_.load(), kSteps) << "checkpoints were never unloaded and loaded again";
}

TEST_F(EvictionTest, AnOpenFileKeepsItsCheckpointLoaded) {
  auto a = vfs_->Resolve("step_0/consolidated/model.safetensors");
  ASSERT_TRUE(a.ok());
  auto h = vfs_->Open(a->ino, O_RDONLY);
  ASSERT_TRUE(h.ok());
  for (int s = 1; s < kSteps; ++s) EXPECT_EQ(TensorBytes(s).size(), 8u);
  std::string out(a->size, '\0');
  auto n = vfs_->Read(*h, out.data(), out.size(), 0);  // its rows were not freed
  ASSERT_TRUE(n.ok()) << n.status().message();
  EXPECT_EQ(out.substr(out.size() - 8), std::string("\0\1\2\3\4\5\6\7", 8));
  vfs_->Release(*h);
  const int before = loads_.load();
  EXPECT_EQ(TensorBytes(0), std::string("\0\1\2\3\4\5\6\7", 8));
  EXPECT_EQ(loads_.load(), before) << "step_0 was unloaded while its file was open";
}

}  // namespace
}  // namespace ckptfs
