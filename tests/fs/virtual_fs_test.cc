// VirtualFs without /dev/fuse: the tree, lookups, reads and the errno contract.
#include "fs/virtual_fs.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <thread>

#include "core/safetensors.h"
#include "core/views.h"
#include "fs/source_tree.h"
#include "indexer/scan.h"
#include "source/posix_source.h"
#include "tests/listing_only_source.h"

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

// The tree, the builder and core/views.h's list agree: every directory the
// builder attaches is a view name, a dtype view opens by its name, and a
// near miss is ENOENT (not EIO, not a view).
TEST_F(VirtualFsTest, EveryViewTheBuilderAttachesIsInTheViewList) {
  auto entries = vfs_->ReadDir(vfs_->Resolve("model")->ino);
  ASSERT_TRUE(entries.ok());
  int views = 0;
  for (const auto& e : *entries) {
    if (!e.attr.is_virtual) continue;
    ++views;
    EXPECT_TRUE(ParseViewName(e.name).has_value()) << e.name;
  }
  EXPECT_EQ(views, 3);  // consolidated, mesh, tensors (no bytes/, no merged/ here)
  auto bf16 = vfs_->Resolve("model/consolidated.bf16");
  ASSERT_TRUE(bf16.ok()) << bf16.status().message();
  EXPECT_TRUE(bf16->is_virtual);
  for (const char* miss : {"model/consolidatedx", "model/consolidated.", "model/merged.", "model/mesh.bf16"}) {
    auto a = vfs_->Resolve(miss);
    ASSERT_FALSE(a.ok()) << miss;
    EXPECT_EQ(a.status().err(), ENOENT) << miss << ": " << a.status().message();
  }
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
// threads reading all of them. Every open and read must succeed and return
// that checkpoint's bytes (step s holds 10 * s + 0..7): a file looked up
// before its checkpoint was unloaded opens after it.
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
      if (line.find(": loaded (") != std::string::npos) ++loads_;
    };
    o.log = [this](const std::string& line) {
      std::lock_guard<std::mutex> lock(log_mu_);
      log_.push_back(line);
    };
    const std::string root = dir_.string();
    auto v = VirtualFs::Open(root, dirs, [this, root](const std::string& rel) -> Result<Checkpoint> {
      ++loader_calls_;
      if (broken_.load()) return Status::Corruption("block checksum mismatch in 000012.sst (test)");
      ASSIGN_OR_RETURN(auto ck, ScanCheckpointDir(*PosixSourceAt(root), rel));
      if (!ck) return Status::NotFound(rel);
      return std::move(*ck);
    }, o);
    ASSERT_TRUE(v.ok()) << v.status().message();
    vfs_ = std::move(*v);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The whole of inode `ino`; "" and a failure when the open or read fails.
  std::string ReadIno(uint64_t ino, const std::string& what) {
    auto a = vfs_->GetAttr(ino);
    auto h = vfs_->Open(ino, O_RDONLY);
    if (!a.ok() || !h.ok()) {
      ADD_FAILURE() << what << ": " << (h.ok() ? a.status().message() : h.status().message());
      return "";
    }
    std::string out(a->size, '\0');
    auto n = vfs_->Read(*h, out.data(), out.size(), 0);
    vfs_->Release(*h);
    if (!n.ok() || *n != out.size()) {
      ADD_FAILURE() << what << ": read failed";
      return "";
    }
    return out;
  }
  std::string ReadPath(const std::string& path) {
    auto a = vfs_->Resolve(path);
    if (!a.ok()) {
      ADD_FAILURE() << path << ": " << a.status().message();
      return "";
    }
    return ReadIno(a->ino, path);
  }
  // The tensor bytes of step `s`'s consolidated file.
  std::string TensorBytes(int s) {
    std::string out = ReadPath("step_" + std::to_string(s) + "/consolidated/model.safetensors");
    return out.size() < 8 ? "" : out.substr(out.size() - 8);
  }
  static std::string Want(int s) {
    std::string want;
    for (int i = 0; i < 8; ++i) want.push_back(char(10 * s + i));
    return want;
  }

  fs::path dir_;
  std::unique_ptr<VirtualFs> vfs_;
  std::atomic<int> loads_{0};
  std::atomic<int> loader_calls_{0};
  std::atomic<bool> broken_{false};
  std::mutex log_mu_;
  std::vector<std::string> log_;
};

TEST_F(EvictionTest, ConcurrentReadersAlwaysGetTheirCheckpointsBytes) {
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 300; ++k) {
        const int s = (t + k) % kSteps;
        if (TensorBytes(s) != Want(s)) ++wrong;
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

// The kernel keeps the inodes it looked up (for an hour here) and opens them
// without a new lookup: an unload in between must not make them ESTALE.
// Each kind of view file: consolidated/, tensors/ (layout made on open),
// mesh/ (made on lookup of its spec) and consolidated.<dtype>/ (likewise).
TEST_F(EvictionTest, FilesLookedUpBeforeAnUnloadOpenAfterIt) {
  const std::vector<std::string> files = {"step_0/consolidated/model.safetensors", "step_0/tensors/w.npy",
                                          "step_0/mesh/tp2/rank-00001/model.safetensors",
                                          "step_0/consolidated.bf16/model.safetensors"};
  std::vector<uint64_t> inos;
  std::vector<std::string> before;
  for (const std::string& f : files) {
    auto a = vfs_->Resolve(f);
    ASSERT_TRUE(a.ok()) << f << ": " << a.status().message();
    inos.push_back(a->ino);
    before.push_back(ReadIno(a->ino, f));
  }
  // The tensor w = rows 0..3 of [0..7] as [4, 2] U8; tp2 rank 1 holds some of it.
  EXPECT_EQ(before[0].substr(before[0].size() - 8), Want(0));
  EXPECT_EQ(before[1].substr(before[1].size() - 8), Want(0));
  for (int round = 0; round < 3; ++round) {
    ASSERT_EQ(TensorBytes(1 + round % 3), Want(1 + round % 3));  // step_0 unloaded
    for (size_t k = 0; k < files.size(); ++k) EXPECT_EQ(ReadIno(inos[k], files[k]), before[k]) << files[k];
  }
  EXPECT_GE(loads_.load(), 3 + 4);
}

// Every unload and reload must give back what it took: after a warm-up that
// made every view (tensors/ listed, a mesh spec built), churning the four
// checkpoints through one slot adds no nodes and no checkpoint entries.
TEST_F(EvictionTest, ChurnKeepsTheNodeTableBounded) {
  auto touch_all = [&](int s) {
    const std::string step = "step_" + std::to_string(s);
    ASSERT_TRUE(vfs_->ReadDir(vfs_->Resolve(step + "/tensors")->ino).ok());
    EXPECT_EQ(TensorBytes(s), Want(s));
    const std::string npy = ReadPath(step + "/tensors/w.npy");
    EXPECT_EQ(npy.substr(npy.size() - 8), Want(s));
    EXPECT_FALSE(ReadPath(step + "/mesh/tp2/rank-00000/model.safetensors").empty());
    EXPECT_NE(ReadPath(step + "/mesh/README").find("rank"), std::string::npos);
  };
  for (int s = 0; s < kSteps; ++s) touch_all(s);
  const size_t nodes = vfs_->NodeCount(), served = vfs_->ServedCount();
  const int loads = loads_.load();
  for (int k = 0; k < 200; ++k) touch_all(k % kSteps);
  EXPECT_GE(loads_.load() - loads, 200) << "the churn did not unload and reload";
  EXPECT_EQ(vfs_->NodeCount(), nodes) << "reloads added nodes";
  EXPECT_EQ(vfs_->ServedCount(), served);
}

// A checkpoint saved again into its directory (live mounts) replaces the
// one served: the old one's nodes leave the tree at once and the table once
// the kernel forgets the inodes it looked up, so a mount whose steps come
// and go for days does not grow. The kernel's old inodes answer ESTALE (it
// looks the path up again), never the old or the new bytes.
TEST_F(EvictionTest, NodesOfAReplacedCheckpointLeaveOnceTheKernelForgetsThem) {
  struct Held {
    uint64_t view, file;
  };
  auto kernel_lookups = [&]() -> Held {
    auto step = vfs_->Lookup(VirtualFs::kRootIno, "step_1", /*for_kernel=*/true);
    auto view = vfs_->Lookup(step->ino, "consolidated", true);
    auto file = vfs_->Lookup(view->ino, "model.safetensors", true);
    auto npy = vfs_->ReadDir(vfs_->Resolve("step_1/tensors")->ino);  // nodes no lookup holds
    EXPECT_TRUE(file.ok() && npy.ok() && npy->size() == 1u);
    return {view->ino, file->ino};
  };
  auto replace_and_forget = [&](const Held& held) {
    vfs_->AddCheckpoint("step_1");
    auto h = vfs_->Open(held.file, O_RDONLY);
    EXPECT_FALSE(h.ok());
    EXPECT_EQ(h.status().err(), ESTALE) << h.status().message();
    vfs_->Forget(held.file, 1);
    vfs_->Forget(held.view, 1);
  };
  replace_and_forget(kernel_lookups());
  EXPECT_EQ(TensorBytes(1), Want(1));
  const size_t nodes = vfs_->NodeCount();
  for (int round = 0; round < 50; ++round) {
    replace_and_forget(kernel_lookups());
    EXPECT_EQ(TensorBytes(1), Want(1));
  }
  EXPECT_EQ(vfs_->NodeCount(), nodes) << "replaced checkpoints' nodes stayed";
}

// A checkpoint whose load fails (a damaged store) answers EIO for its views,
// not ENOENT, and is loaded once the store is repaired, without a remount.
// Within the backoff the loader is not asked again.
TEST_F(EvictionTest, AFailedLoadAnswersEIOAndIsRetriedAfterARepair) {
  broken_ = true;
  auto a = vfs_->Resolve("step_2/consolidated");
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().err(), EIO) << a.status().message();
  EXPECT_NE(a.status().message().find("block checksum mismatch"), std::string::npos) << a.status().message();
  EXPECT_EQ(vfs_->Resolve("step_2/tensors/w.npy").status().err(), EIO);
  EXPECT_EQ(vfs_->Resolve("step_2/nope").status().err(), ENOENT);
  const int calls = loader_calls_.load();
  EXPECT_EQ(vfs_->Resolve("step_2/mesh").status().err(), EIO);
  EXPECT_EQ(loader_calls_.load(), calls) << "retried within the backoff";
  broken_ = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  FsResult<Attr> now = FsError(EIO, "");
  while (std::chrono::steady_clock::now() < deadline && !(now = vfs_->Resolve("step_2/consolidated")).ok())
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(now.ok()) << "never loaded after the repair: " << now.status().message();
  EXPECT_EQ(TensorBytes(2), Want(2));
  std::lock_guard<std::mutex> lock(log_mu_);
  ASSERT_FALSE(log_.empty());
  EXPECT_NE(log_.front().find("step_2/: cannot load the checkpoint"), std::string::npos) << log_.front();
}

// A fault that fails every read: the log keeps a few lines per checkpoint
// and cause, and says how many it left out.
TEST_F(VirtualFsTest, EveryReadFailingLogsAFewLinesAndACount) {
  auto a = vfs_->Resolve("model/consolidated/model.safetensors");
  auto h = vfs_->Open(a->ino, O_RDONLY);
  ASSERT_TRUE(h.ok());
  {
    std::fstream f(dir_ / "step" / "model" / "shard-00002-model-00001-of-00001.safetensors",
                   std::ios::binary | std::ios::in | std::ios::out | std::ios::ate);
    f << "tail";
  }
  const size_t before = log_.size();
  constexpr int kReads = 10000;
  std::string buf(8, '\0');
  for (int k = 0; k < kReads; ++k) {
    auto n = vfs_->Read(*h, buf.data(), buf.size(), a->size - 8 - (k % 4));
    ASSERT_FALSE(n.ok());
    ASSERT_EQ(n.status().err(), EIO);
  }
  vfs_->Release(*h);
  EXPECT_LE(log_.size() - before, 10u) << "one line per failed read";
  vfs_.reset();  // reports what it still counts
  ASSERT_FALSE(log_.empty());
  const std::string& last = log_.back();
  EXPECT_NE(last.find("more like this in the last 10 s"), std::string::npos) << last;
  EXPECT_NE(last.find("model/consolidated/model.safetensors"), std::string::npos) << last;
  // Every failed read is accounted for: the lines written plus the count.
  size_t written = 0;
  for (size_t k = before; k + 1 < log_.size(); ++k)
    written += log_[k].find("model/consolidated/model.safetensors: read of") != std::string::npos;
  const size_t at = last.find("(and ") + 5;
  EXPECT_EQ(written + 1 + std::stoul(last.substr(at)), size_t(kReads)) << last;
}

// ReadScatter (the mount's reply) gives, for every range of every view file
// of the fixture, the bytes the copying Read gives, with direct reads on
// and the sources out of the page cache; the consolidated tensor data is
// also checked against the bytes the fixture wrote (0..7).
TEST_F(VirtualFsTest, ScatterRepliesEqualCopiedReadsForEveryRange) {
  auto catalog = ScanSource((dir_ / "step").string());
  ASSERT_TRUE(catalog.ok());
  FsOptions o;
  o.read.direct = std::make_shared<DirectIo>(8 << 20);
  auto v = VirtualFs::Create(std::move(*catalog), o);
  ASSERT_TRUE(v.ok());
  for (const char* shard : {"shard-00001-model-00001-of-00001.safetensors",
                            "shard-00002-model-00001-of-00001.safetensors"}) {
    int fd = ::open((dir_ / "step" / "model" / shard).c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::fsync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  for (const char* path : {"model/consolidated/model.safetensors", "model/tensors/w.npy",
                           "model/consolidated/config.json"}) {
    const std::string whole = ReadAll(path);
    ASSERT_FALSE(whole.empty()) << path;
    if (std::string(path).find("config") == std::string::npos) {
      EXPECT_EQ(whole.substr(whole.size() - 8), std::string("\0\1\2\3\4\5\6\7", 8)) << path;
    }
    auto a = (*v)->Resolve(path);
    ASSERT_TRUE(a.ok());
    auto h = (*v)->Open(a->ino, O_RDONLY);
    ASSERT_TRUE(h.ok());
    for (uint64_t off = 0; off <= whole.size(); ++off) {
      for (uint64_t len = 0; off + len <= whole.size() + 2; ++len) {
        auto r = (*v)->ReadScatter(*h, len, off);
        ASSERT_TRUE(r.ok()) << path << " @" << off << "+" << len << ": " << r.status().message();
        std::string got(r->length(), '\0');
        r->CopyTo(got.data());
        ASSERT_EQ(got, whole.substr(off, len)) << path << " @" << off << "+" << len;
      }
    }
    (*v)->Release(*h);
  }
}

TEST_F(VirtualFsTest, ScatterReplyOfAChangedSourceIsEIO) {
  auto a = vfs_->Resolve("model/consolidated/model.safetensors");
  auto h = vfs_->Open(a->ino, O_RDONLY);
  ASSERT_TRUE(h.ok());
  {
    std::fstream f(dir_ / "step" / "model" / "shard-00002-model-00001-of-00001.safetensors",
                   std::ios::binary | std::ios::in | std::ios::out | std::ios::ate);
    f << "tail";
  }
  auto r = vfs_->ReadScatter(*h, a->size, 0);
  vfs_->Release(*h);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().err(), EIO);
  EXPECT_NE(r.status().message().find("run `ckptfs index` again"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

// A source whose listing takes longer than the tree keeps listings (as one
// of 10^5 keys does over 100 ListObjectsV2 pages), counting its listings.
class SlowListing : public ListingOnlySource {
 public:
  explicit SlowListing(size_t files) {
    for (size_t i = 0; i < files; ++i) {
      const std::string name = "f" + std::to_string(i);
      listing_.files.push_back(name);
      SourceFile f;
      f.size = i;
      listing_.known[name] = f;
    }
    std::sort(listing_.files.begin(), listing_.files.end());
  }
  const std::string& root() const override { return root_; }
  Result<SourceListing> List(const std::string&) const override {
    ++lists;
    std::this_thread::sleep_for(std::chrono::milliseconds(1200));
    return listing_;
  }

  mutable std::atomic<int> lists{0};

 private:
  std::string root_ = "slow://listing";
  SourceListing listing_;
};

TEST(ListedTree, ALookupAfterASlowListingUsesIt) {
  auto source = std::make_shared<SlowListing>(50);
  auto tree = SourceTree::Open(source);
  ASSERT_TRUE(tree.ok());
  auto names = (*tree)->List("");
  ASSERT_TRUE(names.ok());
  ASSERT_EQ(names->size(), 50u);
  for (const std::string& name : *names) {
    auto st = (*tree)->Lstat(name);
    ASSERT_TRUE(st.ok()) << name;
    EXPECT_EQ(uint64_t(st->st_size), std::stoull(name.substr(1))) << name;
  }
  EXPECT_EQ(source->lists.load(), 1) << "the listing was made again for the lookups of its entries";
}

}  // namespace
}  // namespace ckptfs
