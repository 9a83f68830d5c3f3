// The index's lifecycle against real stores in a temporary directory: a
// missing store is built, an existing one opened as it is, checkpoints saved
// since are indexed, a damaged store is rebuilt with exactly what the root
// holds, and changed sources are caught before a tree is served.
#include "indexer/index_lifecycle.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "indexer/scan.h"
#include "source/posix_source.h"
#include "tests/indexer/test_dirs.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

class IndexLifecycleTest : public RootAndIndexTest {
 protected:
  IndexLifecycleTest() : RootAndIndexTest("lifecycle") {}
  void SetUp() override {
    RootAndIndexTest::SetUp();
    auto source = PosixSource::OpenRoot(root_);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    source_ = *source;
  }

  // A Hugging Face folder `dir` with one F32 tensor `name` of `n` elements.
  void SaveCheckpoint(const std::string& dir, const std::string& name, size_t n) {
    std::string header = "{\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) +
                         "],\"data_offsets\":[0," + std::to_string(4 * n) + "]}}";
    header.resize((header.size() + 7) / 8 * 8, ' ');
    const uint64_t len = header.size();
    fs::create_directories(fs::path(root_) / dir);
    std::ofstream f(fs::path(root_) / dir / "model.safetensors", std::ios::binary);
    f.write(reinterpret_cast<const char*>(&len), 8);  // little-endian, as the format says
    f << header << std::string(4 * n, '\x01');
  }

  // What `ckptfs index` does: open for update, scan, apply.
  Status Build() {
    ++builds_;
    bool rebuilt = false;
    ASSIGN_OR_RETURN(auto store, OpenForUpdate(index_, root_, Note(), &rebuilt));
    ASSIGN_OR_RETURN(Catalog catalog, ScanSource(*source_));
    return ApplyScan(*store, catalog, rebuilt);
  }

  ReadOpenOptions Options(bool reindex = false) {
    ReadOpenOptions o;
    o.reindex = reindex;
    o.build = [this] { return Build(); };
    o.note = Note();
    return o;
  }
  Notes Note() {
    return [this](const std::string& line) { notes_.push_back(line); };
  }

  static std::set<std::string> Dirs(const Store& store) {
    std::set<std::string> out;
    for (const CheckpointEntry& e : store.List()) out.insert(e.dir);
    return out;
  }
  bool Noted(const std::string& part) const {
    for (const std::string& n : notes_)
      if (n.find(part) != std::string::npos) return true;
    return false;
  }

  std::shared_ptr<PosixSource> source_;
  int builds_ = 0;
  std::vector<std::string> notes_;
};

TEST_F(IndexLifecycleTest, AMissingStoreIsBuiltThenOpenedReadOnly) {
  SaveCheckpoint("step_1", "w", 3);
  ASSERT_FALSE(fs::exists(index_));
  auto store = OpenForReading(*source_, index_, root_, Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(builds_, 1);
  EXPECT_EQ(Dirs(**store), std::set<std::string>{"step_1"});
  auto catalog = ReadCatalog(**store);
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_EQ(catalog->checkpoints.size(), 1u);
  ASSERT_EQ(catalog->checkpoints[0].tensors.size(), 1u);
  EXPECT_EQ(catalog->checkpoints[0].tensors[0]->fqn, "w");
  EXPECT_EQ(catalog->checkpoints[0].tensors[0]->shape, (std::vector<uint64_t>{3}));
  EXPECT_GT(catalog->indexed_at_ns, 0);
  // Read-only: a write through it is refused.
  EXPECT_FALSE((*store)->Remove("step_1").ok());
}

TEST_F(IndexLifecycleTest, AStoreThatHoldsEveryCheckpointIsOpenedWithoutBuilding) {
  SaveCheckpoint("step_1", "w", 3);
  ASSERT_TRUE(Build().ok());
  builds_ = 0;
  auto store = OpenForReading(*source_, index_, root_, Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(builds_, 0);
  EXPECT_EQ(Dirs(**store), std::set<std::string>{"step_1"});
  EXPECT_TRUE(notes_.empty());
}

TEST_F(IndexLifecycleTest, ReindexBuildsWhateverTheStoreHolds) {
  SaveCheckpoint("step_1", "w", 3);
  ASSERT_TRUE(Build().ok());
  builds_ = 0;
  auto store = OpenForReading(*source_, index_, root_, Options(/*reindex=*/true));
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(builds_, 1);
}

TEST_F(IndexLifecycleTest, ACheckpointSavedSinceIsIndexedAndOneDeletedSinceIsRemoved) {
  SaveCheckpoint("step_1", "w", 3);
  SaveCheckpoint("step_2", "w", 3);
  ASSERT_TRUE(Build().ok());
  fs::remove_all(fs::path(root_) / "step_1");
  SaveCheckpoint("step_3", "v", 5);
  builds_ = 0;
  auto store = OpenForReading(*source_, index_, root_, Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(builds_, 1);
  EXPECT_TRUE(Noted("since it was indexed")) << ::testing::PrintToString(notes_);
  EXPECT_EQ(Dirs(**store), (std::set<std::string>{"step_2", "step_3"}));
  auto ck = (*store)->Load("step_3");
  ASSERT_TRUE(ck.ok()) << ck.status().ToString();
  ASSERT_EQ(ck->tensors.size(), 1u);
  EXPECT_EQ(ck->tensors[0]->fqn, "v");
}

TEST_F(IndexLifecycleTest, WhileAnotherProcessWritesTheStoreItIsReadAsItIs) {
  SaveCheckpoint("step_1", "w", 3);
  ASSERT_TRUE(Build().ok());
  SaveCheckpoint("step_2", "w", 3);
  auto writer = Store::Open(index_, root_, Store::Access::kReadWrite);  // holds the writer lock
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  auto store = OpenForReading(*source_, index_, root_, Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(builds_, 2);  // the one above, and the one that found the store busy
  EXPECT_TRUE(Noted("not listed until that process is done")) << ::testing::PrintToString(notes_);
  EXPECT_EQ(Dirs(**store), std::set<std::string>{"step_1"});
}

TEST_F(IndexLifecycleTest, ABusyBuildOfAMissingStoreIsTheError) {
  SaveCheckpoint("step_1", "w", 3);
  auto writer = Store::Open(index_, root_, Store::Access::kReadWrite);  // creates it, empty
  ASSERT_TRUE(writer.ok()) << writer.status().ToString();
  auto store = OpenForReading(*source_, index_, root_, Options(/*reindex=*/true));
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), Status::Code::kBusy) << store.status().ToString();
}

TEST_F(IndexLifecycleTest, ADamagedStoreIsRebuiltWithExactlyTheCheckpointsUnderTheRoot) {
  SaveCheckpoint("step_1", "w", 3);
  ASSERT_TRUE(Build().ok());
  {
    // Enough rows for several SST blocks: copies of the scanned checkpoint
    // under directories the root does not have.
    auto store = Store::Open(index_, root_, Store::Access::kReadWrite);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto ck = (*store)->Load("step_1");
    ASSERT_TRUE(ck.ok()) << ck.status().ToString();
    for (int i = 0; i < 300; ++i) {
      Checkpoint copy = *ck;
      copy.dir = "gone_" + std::to_string(i);
      ASSERT_TRUE((*store)->Commit(copy).ok());
    }
    ASSERT_TRUE((*store)->VerifyChecksums().ok());  // flushed into SST files
  }
  fs::path sst;
  for (const auto& e : fs::directory_iterator(index_))
    if (e.path().extension() == ".sst" && (sst.empty() || fs::file_size(e) > fs::file_size(sst))) sst = e.path();
  ASSERT_FALSE(sst.empty());
  ASSERT_GT(fs::file_size(sst), 16u * 1024);
  {
    std::fstream f(sst, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(fs::file_size(sst) / 4);
    f.write(std::string(64, '\xa5').data(), 64);
  }
  bool rebuilt = false;
  auto store = OpenForUpdate(index_, root_, Note(), &rebuilt);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_TRUE(rebuilt);
  EXPECT_TRUE(Noted("indexing every checkpoint again")) << ::testing::PrintToString(notes_);
  EXPECT_TRUE((*store)->List().empty());
  auto catalog = ScanSource(*source_);
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_TRUE(ApplyScan(**store, *catalog, rebuilt).ok());
  EXPECT_EQ(Dirs(**store), std::set<std::string>{"step_1"});
  EXPECT_TRUE((*store)->VerifyChecksums().ok());
}

TEST_F(IndexLifecycleTest, ASoundStoreIsNotRebuilt) {
  SaveCheckpoint("step_1", "w", 3);
  ASSERT_TRUE(Build().ok());
  bool rebuilt = true;
  auto store = OpenForUpdate(index_, root_, Note(), &rebuilt);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_FALSE(rebuilt);
  EXPECT_EQ(Dirs(**store), std::set<std::string>{"step_1"});
}

TEST_F(IndexLifecycleTest, ASourceChangedSinceIndexingIsStale) {
  SaveCheckpoint("step_1", "w", 3);
  SaveCheckpoint("step_2", "w", 3);
  ASSERT_TRUE(Build().ok());
  auto store = OpenForReading(*source_, index_, root_, Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto fresh = FreshCheckpoints(*source_, **store);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(std::set<std::string>(fresh->begin(), fresh->end()), (std::set<std::string>{"step_1", "step_2"}));
  std::ofstream(fs::path(root_) / "step_2" / "model.safetensors", std::ios::binary | std::ios::app) << "x";
  fresh = FreshCheckpoints(*source_, **store);
  ASSERT_FALSE(fresh.ok());
  EXPECT_EQ(fresh.status().code(), Status::Code::kStale) << fresh.status().ToString();
  EXPECT_NE(fresh.status().message().find("step_2/model.safetensors"), std::string::npos)
      << fresh.status().message();
}

// A local root whose listings tell each file's identity, as an object
// store's do, and which counts the files it is asked to identify.
class ListingIdentitiesSource : public PosixSource {
 public:
  using PosixSource::PosixSource;
  Result<SourceListing> List(const std::string& rel) const override {
    ASSIGN_OR_RETURN(SourceListing l, PosixSource::List(rel));
    for (const std::string& name : l.files)
      if (auto f = PosixSource::Identify(JoinRel(rel, name)); f.ok()) l.known[name] = *f;
    return l;
  }
  Result<SourceFile> Identify(const std::string& rel) const override {
    identified.push_back(rel);
    return PosixSource::Identify(rel);
  }
  bool ListingsIdentify() const override { return true; }
  mutable std::vector<std::string> identified;
};

TEST_F(IndexLifecycleTest, WhereListingsTellIdentitiesNoFileIsAskedForItsOwn) {
  SaveCheckpoint("step_1", "w", 3);
  SaveCheckpoint("step_2", "w", 3);
  ListingIdentitiesSource source(fs::canonical(root_).string());
  auto catalog = ScanSource(source);
  ASSERT_TRUE(catalog.ok()) << catalog.status().ToString();
  ASSERT_EQ(catalog->checkpoints.size(), 2u);
  EXPECT_EQ(source.identified, std::vector<std::string>{});
  // The identities are the files' own: the same as asking for each.
  for (const Checkpoint& ck : catalog->checkpoints)
    for (const SourceFile& f : ck.files) {
      auto asked = source.PosixSource::Identify(f.path);
      ASSERT_TRUE(asked.ok()) << f.path;
      EXPECT_EQ(source.DescribeChange(f, *asked), "") << f.path;
    }

  ASSERT_TRUE(Build().ok());
  auto store = OpenForReading(*source_, index_, root_, Options());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  auto fresh = FreshCheckpoints(source, **store);
  ASSERT_TRUE(fresh.ok()) << fresh.status().ToString();
  EXPECT_EQ(fresh->size(), 2u);
  EXPECT_EQ(source.identified, std::vector<std::string>{});
  // A change shows in the listing; a file the listing lacks is asked for,
  // and the answer names it.
  std::ofstream(fs::path(root_) / "step_2" / "model.safetensors", std::ios::binary | std::ios::app) << "x";
  fresh = FreshCheckpoints(source, **store);
  ASSERT_FALSE(fresh.ok());
  EXPECT_NE(fresh.status().message().find("step_2/model.safetensors: size changed"), std::string::npos)
      << fresh.status().message();
  fs::remove(fs::path(root_) / "step_1" / "model.safetensors");
  fresh = FreshCheckpoints(source, **store);
  ASSERT_FALSE(fresh.ok());
  EXPECT_EQ(source.identified, std::vector<std::string>{"step_1/model.safetensors"});
  EXPECT_NE(fresh.status().message().find("step_1/model.safetensors"), std::string::npos) << fresh.status().message();
}

}  // namespace
}  // namespace ckptfs
