// Scanned checkpoints through the store, staleness; and the safetensors
// reader on files written here (the store itself: store_test.cc).
#include "indexer/index_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include "core/safetensors.h"
#include "indexer/scan.h"
#include "indexer/source_check.h"
#include "source/posix_source.h"
#include "tests/listing_only_source.h"
#include "tests/indexer/test_dirs.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

class IndexTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempDirs::ForThisTest("index");
    fs::create_directories(dir_ / "ckpt");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes a safetensors file with the given (name, dtype, shape, offsets) entries
  // filled with bytes 0, 1, 2, ...
  void WriteSafetensors(const std::string& name, const std::vector<SafetensorsEntry>& entries,
                        const std::map<std::string, std::string>& metadata = {}) {
    std::string out = *EncodeSafetensorsHeader(entries, metadata);
    uint64_t end = entries.empty() ? 0 : entries.back().end;
    for (uint64_t i = 0; i < end; ++i) out.push_back(char(i));
    std::ofstream(dir_ / "ckpt" / name, std::ios::binary) << out;
  }

  fs::path dir_;
};

// A directory whose objects answer each read after `delay`, counting the
// reads in flight at once (object storage: each header is two round trips).
class SlowSource : public PosixSource {
 public:
  explicit SlowSource(std::string root) : PosixSource(std::move(root)) {}
  Result<std::unique_ptr<SourceObject>> Open(const std::string& rel) const override {
    ASSIGN_OR_RETURN(std::unique_ptr<SourceObject> inner, PosixSource::Open(rel));
    return std::unique_ptr<SourceObject>(new Slow(std::move(inner), this));
  }
  mutable std::atomic<int> in_flight{0}, most{0};

 private:
  class Slow : public SourceObject {
   public:
    Slow(std::unique_ptr<SourceObject> inner, const SlowSource* s) : inner_(std::move(inner)), s_(s) {}
    Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override {
      const int now = ++s_->in_flight;
      for (int m = s_->most; now > m && !s_->most.compare_exchange_weak(m, now);) {}
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      --s_->in_flight;
      return inner_->ReadAt(offset, len, dst);
    }
    Result<SourceFile> Identity() const override { return inner_->Identity(); }

   private:
    std::unique_ptr<SourceObject> inner_;
    const SlowSource* s_;
  };
};

TEST_F(IndexTest, HeadersOfAStepsFilesAreReadSideBySide) {
  constexpr int kFiles = 16;
  for (int r = 0; r < kFiles; ++r) {
    char name[64];
    std::snprintf(name, sizeof name, "shard-%05d-model-00001-of-00001.safetensors", r + 1);
    WriteSafetensors(name, {{"w", DType::kF32, {1, 3}, 0, 12}},
                     {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [)" + std::to_string(r) + R"(, 0]}})"}});
  }
  SlowSource source(fs::canonical(dir_ / "ckpt").string());
  auto catalog = ScanSource(source);
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_EQ(catalog->checkpoints.size(), 1u);
  const Checkpoint& ck = catalog->checkpoints[0];
  EXPECT_TRUE(ck.problems.empty());
  ASSERT_EQ(ck.tensors.size(), 1u);
  EXPECT_EQ(ck.tensors[0]->shape, (Shape{kFiles, 3}));
  EXPECT_EQ(ck.tensors[0]->chunks.size(), size_t(kFiles));
  EXPECT_GE(source.most.load(), 4) << "headers were read one file at a time";
}

TEST_F(IndexTest, ScanWriteLoadRoundTrip) {
  WriteSafetensors("shard-00001-model-00001-of-00001.safetensors", {{"w", DType::kF32, {2, 3}, 0, 24}},
                   {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [0, 0]}})"}});
  WriteSafetensors("shard-00002-model-00001-of-00001.safetensors", {{"w", DType::kF32, {2, 3}, 0, 24}},
                   {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [2, 0]}})"}});
  auto catalog = ScanSource((dir_ / "ckpt").string());
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_EQ(catalog->checkpoints.size(), 1u);
  EXPECT_EQ(catalog->checkpoints[0].format, "sharded-safetensors");
  ASSERT_EQ(catalog->checkpoints[0].tensors.size(), 1u);
  EXPECT_EQ(catalog->checkpoints[0].tensors[0]->shape, (Shape{4, 3}));
  EXPECT_TRUE(catalog->checkpoints[0].problems.empty());

  auto store = Store::Open((dir_ / "index").string(), catalog->root, Store::Access::kReadWrite);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->Commit(catalog->checkpoints[0]).ok());
  auto loaded = (*store)->Load(catalog->checkpoints[0].dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const auto& files = loaded->files;
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[1].path, catalog->checkpoints[0].files[1].path);
  EXPECT_EQ(files[1].size, catalog->checkpoints[0].files[1].size);
  EXPECT_EQ(files[1].inode, catalog->checkpoints[0].files[1].inode);
  EXPECT_EQ(files[1].ctime_ns, catalog->checkpoints[0].files[1].ctime_ns);
  const TensorMeta& t = *loaded->tensors[0];
  EXPECT_EQ(t.shape, (Shape{4, 3}));
  ASSERT_EQ(t.chunks.size(), 2u);
  EXPECT_EQ(t.chunks[1].box(), (Box{{2, 0}, {2, 3}}));
  EXPECT_EQ(t.chunks[1].offset(), catalog->checkpoints[0].tensors[0]->chunks[1].offset());
  Catalog reloaded;
  reloaded.root = catalog->root;
  reloaded.checkpoints.push_back(std::move(*loaded));
  EXPECT_TRUE(CheckSources(reloaded).ok());
}

TEST_F(IndexTest, RecommitReplacesTheCheckpointAndLeavesNoTemporary) {
  WriteSafetensors("model.safetensors", {{"a", DType::kU8, {4}, 0, 4}});
  const std::string path = (dir_ / "index").string();
  auto store = Store::Open(path, ScanSource((dir_ / "ckpt").string())->root, Store::Access::kReadWrite);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  ASSERT_TRUE((*store)->Commit(ScanSource((dir_ / "ckpt").string())->checkpoints[0]).ok());
  WriteSafetensors("model.safetensors", {{"a", DType::kU8, {4}, 0, 4}, {"b", DType::kU8, {2}, 4, 6}});
  ASSERT_TRUE((*store)->Commit(ScanSource((dir_ / "ckpt").string())->checkpoints[0]).ok());
  auto loaded = (*store)->Load("");
  ASSERT_TRUE(loaded.ok());
  EXPECT_EQ(loaded->tensors.size(), 2u);
  for (const auto& e : fs::directory_iterator(dir_))  // no temporary left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(IndexTest, ChangedSourceIsStale) {
  WriteSafetensors("model.safetensors", {{"a", DType::kU8, {4}, 0, 4}});
  auto catalog = ScanSource((dir_ / "ckpt").string());
  ASSERT_TRUE(catalog.ok());
  std::ofstream(dir_ / "ckpt" / "model.safetensors", std::ios::binary | std::ios::app) << "x";
  Status st = CheckSources(*catalog);
  EXPECT_EQ(st.code(), Status::Code::kStale);
  EXPECT_NE(st.message().find("model.safetensors: size changed"), std::string::npos) << st.message();
}

TEST_F(IndexTest, OverlappingShardsAreRecordedOnTheTensor) {
  WriteSafetensors("shard-00001-model-00001-of-00001.safetensors", {{"w", DType::kU8, {3}, 0, 3}},
                   {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [0]}})"}});
  WriteSafetensors("shard-00002-model-00001-of-00001.safetensors", {{"w", DType::kU8, {3}, 0, 3}},
                   {{"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [2]}})"}});
  auto catalog = ScanSource((dir_ / "ckpt").string());
  ASSERT_TRUE(catalog.ok());
  const auto& t = catalog->checkpoints[0].tensors[0];
  EXPECT_NE(t->problem.find("overlap in [2:3]"), std::string::npos) << t->problem;
  EXPECT_TRUE(catalog->checkpoints[0].incomplete.empty());
}

TEST_F(IndexTest, AlternativeMetadataSpellingIsAccepted) {
  WriteSafetensors("shard-00001-model-00001-of-00001.safetensors", {{"w", DType::kU8, {3}, 0, 3}},
                   {{"dcp_custom_metadata", R"({"w": {"saved_offsets": [0]}})"}});
  WriteSafetensors("shard-00002-model-00001-of-00001.safetensors", {{"w", DType::kU8, {3}, 0, 3}},
                   {{"dcp_custom_metadata", R"({"w": {"saved_offsets": [3]}})"}});
  auto catalog = ScanSource((dir_ / "ckpt").string());
  ASSERT_TRUE(catalog.ok());
  EXPECT_EQ(catalog->checkpoints[0].tensors[0]->shape, (Shape{6}));
  EXPECT_TRUE(catalog->checkpoints[0].tensors[0]->problem.empty());
}

TEST_F(IndexTest, UnreadableHeaderMakesTheCheckpointIncomplete) {
  WriteSafetensors("model-00001-of-00002.safetensors", {{"a", DType::kU8, {4}, 0, 4}});
  std::ofstream(dir_ / "ckpt" / "model-00002-of-00002.safetensors", std::ios::binary)
      << std::string("\x05\0\0\0\0\0\0\0{bad}", 13);
  auto catalog = ScanSource((dir_ / "ckpt").string());
  ASSERT_TRUE(catalog.ok());
  const Checkpoint& ck = catalog->checkpoints[0];
  EXPECT_NE(ck.incomplete.find("model-00002-of-00002.safetensors"), std::string::npos) << ck.incomplete;
  EXPECT_EQ(ck.tensors.size(), 1u);
}

TEST_F(IndexTest, TruncatedShardMarksOnlyItsChunksUnavailable) {
  WriteSafetensors("model.safetensors", {{"a", DType::kU8, {4}, 0, 4}, {"b", DType::kU8, {4}, 4, 8}});
  fs::resize_file(dir_ / "ckpt" / "model.safetensors", fs::file_size(dir_ / "ckpt" / "model.safetensors") - 2);
  auto catalog = ScanSource((dir_ / "ckpt").string());
  ASSERT_TRUE(catalog.ok());
  const Checkpoint& ck = catalog->checkpoints[0];
  EXPECT_TRUE(ck.tensors[0]->chunks[0].unavailable().empty());
  EXPECT_NE(ck.tensors[1]->chunks[0].unavailable().find("truncated"), std::string::npos);
  ASSERT_FALSE(ck.problems.empty());
  EXPECT_NE(ck.problems[0].find("truncated"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

// A directory that holds itself (a bind mount of a root under the root):
// every path lists one subdirectory, `loop`, and names the same directory.
// After 100 listings it answers NotFound, so that a walk without a guard
// ends (and fails the test) instead of running forever.
class LoopingSource : public ListingOnlySource {
 public:
  const std::string& root() const override { return root_; }
  Result<SourceListing> List(const std::string& rel) const override {
    if (++lists > 100) return Status::NotFound(rel);
    SourceListing l;
    l.dirs = {"loop"};
    l.files = {"notes.txt"};
    return l;
  }
  std::string DirKey(const std::string&) const override { return "the one directory"; }

  mutable int lists = 0;

 private:
  std::string root_ = "loop://root";
};

TEST(WalkLoops, ADirectoryThatHoldsItselfIsWalkedOnce) {
  LoopingSource by_names;
  EXPECT_TRUE(FindCheckpointDirs(by_names).empty());
  EXPECT_LE(by_names.lists, 2) << "FindCheckpointDirs walked into the loop";
  LoopingSource scanned;
  auto catalog = ScanSource(scanned);
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  EXPECT_TRUE(catalog->checkpoints.empty());
  EXPECT_LE(scanned.lists, 2) << "ScanSource walked into the loop";
}

}  // namespace
}  // namespace ckptfs
