#include "source/disk_cache.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "tests/source/fake_bytes.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kBlock = 4096;

// An object of FakeBytes; fetches recorded.
struct FakeObject {
  FakeObject(std::string identity_, uint64_t size_, int version_ = 0)
      : identity(std::move(identity_)), size(size_), version(version_) {}
  std::string identity;
  uint64_t size;
  int version;
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> fetches;  // (offset, len)
  bool fail = false;

  DiskCache::Fetch fetch() {
    return [this](uint64_t at, uint64_t n, char* out) {
      std::lock_guard<std::mutex> lock(mu);
      fetches.emplace_back(at, n);
      if (fail) return Status::IOError("connection reset");
      FillFakeBytes(at, n, version, out);
      return Status::OK();
    };
  }
  std::string Expected(uint64_t at, uint64_t n) const { return FakeBytes(at, n, version); }
  std::string Read(DiskCache& cache, uint64_t at, uint64_t n) {
    std::string got(n, '\0');
    Status st = cache.Read(identity, size, at, n, got.data(), fetch());
    EXPECT_TRUE(st.ok()) << st.message();
    return got;
  }
  size_t Fetches() {
    std::lock_guard<std::mutex> lock(mu);
    return fetches.size();
  }
};

std::string Slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void Spit(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// Bytes of the block files as the filesystem allocates them (4 KiB units),
// counted here from the directory, not by the cache.
uint64_t BlockBytesOnDisk(const fs::path& dir) {
  uint64_t total = 0;
  for (const auto& e : fs::directory_iterator(dir / "blocks"))
    if (e.path().extension() == ".blk") total += (e.file_size() + 4095) / 4096 * 4096;
  return total;
}

void SetMtime(const std::string& path, int64_t seconds_ago) {
  timespec t[2];
  ::clock_gettime(CLOCK_REALTIME, &t[0]);
  t[0].tv_sec -= seconds_ago;
  t[1] = t[0];
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), t, 0), 0) << path;
}

class DiskCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / ("disk_cache_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::shared_ptr<DiskCache> Open(uint64_t max_bytes = 1 << 20) {
    auto c = DiskCache::Open(dir_.string(), max_bytes, kBlock);
    EXPECT_TRUE(c.ok()) << c.status().message();
    return c.ok() ? *c : nullptr;
  }

  fs::path dir_;
};

TEST_F(DiskCacheTest, AMissFetchesWholeBlocksOnceAndAHitFetchesNothing) {
  auto cache = Open();
  FakeObject obj{"obj", 10000};  // blocks of 4096, 4096 and 1808 bytes
  EXPECT_EQ(obj.Read(*cache, 100, 4900), obj.Expected(100, 4900));
  ASSERT_EQ(obj.fetches, (std::vector<std::pair<uint64_t, uint64_t>>{{0, 8192}}));  // one run, two blocks
  EXPECT_EQ(obj.Read(*cache, 0, 10000), obj.Expected(0, 10000));
  ASSERT_EQ(obj.fetches.size(), 2u);
  EXPECT_EQ(obj.fetches[1], (std::pair<uint64_t, uint64_t>{8192, 1808}));  // the short last block only
  for (auto [at, n] : {std::pair<uint64_t, uint64_t>{0, 10000}, {4095, 2}, {9999, 1}, {5000, 0}})
    EXPECT_EQ(obj.Read(*cache, at, n), obj.Expected(at, n)) << at;
  EXPECT_EQ(obj.fetches.size(), 2u);
  EXPECT_EQ(cache->stats().misses.load(), 3u);
  EXPECT_GE(cache->stats().hits.load(), 5u);
  // Another cache on the directory (a later mount) finds the blocks too.
  cache.reset();
  auto again = Open();
  EXPECT_EQ(obj.Read(*again, 0, 10000), obj.Expected(0, 10000));
  EXPECT_EQ(obj.fetches.size(), 2u);
}

TEST_F(DiskCacheTest, ACorruptBlockIsDiscardedAndRefetchedNeverServed) {
  FakeObject obj{"obj", 3 * kBlock};
  const std::string path = Open()->BlockPath(obj.identity, 1);
  // A byte of the header (magic, offset, header CRC, identity "obj") or of
  // the data (the first and the last), which start at 43.
  for (uint64_t at : {0ul, 16ul, 36ul, 40ul, 43ul, 42ul + kBlock}) {
    auto cache = Open();
    ASSERT_EQ(obj.Read(*cache, 0, 3 * kBlock), obj.Expected(0, 3 * kBlock));
    const std::string good = Slurp(path);
    ASSERT_LT(at, good.size());
    std::string bad = good;
    bad[at] ^= 0x01;
    Spit(path, bad);
    const size_t before = obj.Fetches();
    EXPECT_EQ(obj.Read(*cache, 0, 3 * kBlock), obj.Expected(0, 3 * kBlock)) << at;
    ASSERT_EQ(obj.Fetches(), before + 1) << at;
    EXPECT_EQ(obj.fetches.back(), (std::pair<uint64_t, uint64_t>{kBlock, kBlock})) << at;
    EXPECT_EQ(cache->stats().discarded.load(), 1u) << at;
    EXPECT_EQ(Slurp(path), good) << at;  // stored again, whole
  }
}

TEST_F(DiskCacheTest, ATruncatedOrLengthenedBlockIsDiscardedAndRefetched) {
  auto cache = Open();
  FakeObject obj{"obj", 2 * kBlock};
  ASSERT_EQ(obj.Read(*cache, 0, 2 * kBlock), obj.Expected(0, 2 * kBlock));
  const std::string path = cache->BlockPath(obj.identity, 0);
  const std::string good = Slurp(path);
  for (const std::string& bad : {good.substr(0, good.size() - 1), good.substr(0, 40), std::string(), good + "x"}) {
    Spit(path, bad);
    const size_t before = obj.Fetches();
    // A part of the block only: it is still read and checked whole.
    EXPECT_EQ(obj.Read(*cache, 10, 20), obj.Expected(10, 20)) << bad.size();
    EXPECT_EQ(obj.Fetches(), before + 1) << bad.size();
    EXPECT_EQ(Slurp(path), good) << bad.size();
  }
  EXPECT_EQ(cache->stats().discarded.load(), 4u);
}

TEST_F(DiskCacheTest, AnotherVersionsBlocksAreNeverServed) {
  auto cache = Open();
  FakeObject v1{"key etag-1", 2 * kBlock, 0}, v2{"key etag-2", 2 * kBlock, 1};
  ASSERT_EQ(v1.Read(*cache, 0, 2 * kBlock), v1.Expected(0, 2 * kBlock));
  EXPECT_EQ(v2.Read(*cache, 0, 2 * kBlock), v2.Expected(0, 2 * kBlock));
  EXPECT_EQ(v2.Fetches(), 1u);
  // A block file of v1 under v2's name (as a hash collision would put it):
  // its header names v1, so it is discarded and v2's bytes fetched.
  fs::copy_file(cache->BlockPath(v1.identity, 0), cache->BlockPath(v2.identity, 0),
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(v2.Read(*cache, 0, kBlock), v2.Expected(0, kBlock));
  EXPECT_EQ(v2.Fetches(), 2u);
  EXPECT_EQ(cache->stats().discarded.load(), 1u);
  // Block 1 of v1 at block 0's name: same identity, wrong offset.
  fs::copy_file(cache->BlockPath(v1.identity, 1), cache->BlockPath(v1.identity, 0),
                fs::copy_options::overwrite_existing);
  EXPECT_EQ(v1.Read(*cache, 0, kBlock), v1.Expected(0, kBlock));
  EXPECT_EQ(v1.Fetches(), 2u);
}

TEST_F(DiskCacheTest, StaysWithinItsBoundEvictingTheLeastRecentlyUsedFirst) {
  // A 4096-byte block with its header takes 8 KiB: 8 blocks fill 64 KiB.
  const uint64_t max = 64 << 10;
  auto cache = Open(max);
  FakeObject a{"a", 8 * kBlock}, b{"b", kBlock};
  ASSERT_EQ(a.Read(*cache, 0, 8 * kBlock), a.Expected(0, 8 * kBlock));
  ASSERT_EQ(BlockBytesOnDisk(dir_), max);
  for (uint64_t i = 0; i < 8; ++i) SetMtime(cache->BlockPath(a.identity, i), 100 - int64_t(i));  // 0 oldest
  ASSERT_EQ(a.Read(*cache, 0, 1), a.Expected(0, 1));  // block 0: now the most recently used
  ASSERT_EQ(b.Read(*cache, 0, kBlock), b.Expected(0, kBlock));
  // Evicted down to 7/8 of the bound to make room: blocks 1 and 2, the least recently used.
  EXPECT_TRUE(fs::exists(cache->BlockPath(a.identity, 0)));
  EXPECT_FALSE(fs::exists(cache->BlockPath(a.identity, 1)));
  EXPECT_FALSE(fs::exists(cache->BlockPath(a.identity, 2)));
  for (uint64_t i = 3; i < 8; ++i) EXPECT_TRUE(fs::exists(cache->BlockPath(a.identity, i))) << i;
  EXPECT_TRUE(fs::exists(cache->BlockPath(b.identity, 0)));
  EXPECT_EQ(cache->stats().evicted.load(), 2u);
  // Random reads of an object 16 times the bound never take it over.
  FakeObject big{"big", 128 * kBlock};
  std::mt19937_64 rng(7);
  for (int r = 0; r < 200; ++r) {
    const uint64_t at = rng() % big.size, n = std::min<uint64_t>(big.size - at, 1 + rng() % (3 * kBlock));
    ASSERT_EQ(big.Read(*cache, at, n), big.Expected(at, n)) << at;
    ASSERT_LE(BlockBytesOnDisk(dir_), max) << r;
  }
  EXPECT_LE(cache->Recount(), max);
  EXPECT_EQ(cache->Recount(), BlockBytesOnDisk(dir_));
}

TEST_F(DiskCacheTest, AReopenedCacheWithASmallerBoundShrinksToIt) {
  FakeObject a{"a", 16 * kBlock};
  ASSERT_EQ(a.Read(*Open(), 0, a.size), a.Expected(0, a.size));
  ASSERT_EQ(BlockBytesOnDisk(dir_), 16u * 8192);
  auto small = Open(64 << 10);
  EXPECT_LE(BlockBytesOnDisk(dir_), 64u << 10);
}

TEST_F(DiskCacheTest, ABlockDeletedUnderTheCacheIsFetchedAgain) {
  auto cache = Open();
  FakeObject obj{"obj", 4 * kBlock};
  ASSERT_EQ(obj.Read(*cache, 0, obj.size), obj.Expected(0, obj.size));
  for (const auto& e : fs::directory_iterator(dir_ / "blocks")) fs::remove(e.path());  // another process evicted them
  EXPECT_EQ(obj.Read(*cache, 0, obj.size), obj.Expected(0, obj.size));
  EXPECT_EQ(obj.Fetches(), 2u);
  EXPECT_EQ(cache->stats().discarded.load(), 0u);
}

TEST_F(DiskCacheTest, AFailedFetchFailsTheReadAndStoresNothing) {
  auto cache = Open();
  FakeObject obj{"obj", 2 * kBlock};
  obj.fail = true;
  std::string got(obj.size, '\0');
  Status st = cache->Read(obj.identity, obj.size, 0, obj.size, got.data(), obj.fetch());
  EXPECT_EQ(st.code(), Status::Code::kIOError);
  EXPECT_EQ(st.message(), "connection reset");
  EXPECT_EQ(BlockBytesOnDisk(dir_), 0u);
}

TEST_F(DiskCacheTest, RefusesADirectoryWithOtherFilesAndNeverDeletesThem) {
  fs::create_directories(dir_);
  Spit(dir_ / "notes.txt", "mine");
  auto c = DiskCache::Open(dir_.string(), 1 << 20, kBlock);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("notes.txt"), std::string::npos) << c.status().message();
  EXPECT_EQ(Slurp(dir_ / "notes.txt"), "mine");
  EXPECT_FALSE(fs::exists(dir_ / "blocks"));
  fs::remove(dir_ / "notes.txt");
  Spit(dir_ / "CACHEDIR.TAG", "Signature: 8a477f597d28d172789f06886806bc55\n# another tool's cache\n");
  c = DiskCache::Open(dir_.string(), 1 << 20, kBlock);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("another program"), std::string::npos) << c.status().message();
  c = DiskCache::Open((dir_ / "new").string(), 4 * kBlock - 1, kBlock);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("at least 16384 bytes"), std::string::npos) << c.status().message();
}

TEST_F(DiskCacheTest, FilesNotNamedByTheCacheAreNeitherCountedNorEvicted) {
  const uint64_t max = 64 << 10;
  auto cache = Open(max);
  const std::string foreign(100 << 10, 'f');
  Spit(dir_ / "README", "left by the user");
  Spit(dir_ / "blocks" / "notes.blk", foreign);
  Spit(dir_ / "blocks" / "0123.blk", foreign);
  Spit(dir_ / "blocks" / ".tmp", foreign);
  FakeObject big{"big", 64 * kBlock};
  ASSERT_EQ(big.Read(*cache, 0, big.size), big.Expected(0, big.size));
  EXPECT_EQ(Slurp(dir_ / "README"), "left by the user");
  for (const char* name : {"notes.blk", "0123.blk", ".tmp"}) EXPECT_EQ(Slurp(dir_ / "blocks" / name), foreign) << name;
  // The bound counts only the cache's own blocks: 7/8 of 64 KiB after the last eviction, at most 64 KiB.
  EXPECT_GT(cache->stats().evicted.load(), 0u);
  EXPECT_LE(cache->Recount(), max);
  EXPECT_GT(cache->Recount(), 0u);
}

TEST_F(DiskCacheTest, ATempFileOfADeadWriterIsRemovedAFreshOneKept) {
  auto cache = Open();
  const std::string name = fs::path(cache->BlockPath("obj", 0)).filename().string();
  const fs::path stale = dir_ / "blocks" / ("." + name + ".999999.0.tmp");
  const fs::path fresh = dir_ / "blocks" / ("." + name + ".999999.1.tmp");
  Spit(stale, "half a block");
  Spit(fresh, "half a block");
  SetMtime(stale.string(), 2 * 3600);
  cache->Recount();
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(fresh));
}

// Random ranges of four objects through `cache`; false on a wrong byte.
bool ReadRandomly(DiskCache& cache, std::vector<std::unique_ptr<FakeObject>>& objects, uint64_t seed, int reads) {
  std::mt19937_64 rng(seed);
  for (int r = 0; r < reads; ++r) {
    FakeObject& obj = *objects[rng() % objects.size()];
    const uint64_t at = rng() % obj.size, n = std::min<uint64_t>(obj.size - at, 1 + rng() % (4 * kBlock));
    std::string got(n, '\0');
    if (!cache.Read(obj.identity, obj.size, at, n, got.data(), obj.fetch()).ok() || got != obj.Expected(at, n))
      return false;
  }
  return true;
}

std::vector<std::unique_ptr<FakeObject>> FourObjects() {
  std::vector<std::unique_ptr<FakeObject>> objects;
  for (int v = 0; v < 4; ++v)
    objects.push_back(std::unique_ptr<FakeObject>(new FakeObject("obj-" + std::to_string(v), 20 * kBlock + 123, v)));
  return objects;
}

TEST_F(DiskCacheTest, TwoCachesOnOneDirectoryShareBlocksAndTheBound) {
  const uint64_t max = 128 << 10;  // 16 blocks: far fewer than the 84 read
  auto one = Open(max), two = Open(max);
  auto objects = FourObjects();
  FakeObject& first = *objects[0];
  ASSERT_EQ(first.Read(*one, 0, 4 * kBlock), first.Expected(0, 4 * kBlock));
  ASSERT_EQ(first.Read(*two, 0, 4 * kBlock), first.Expected(0, 4 * kBlock));
  EXPECT_EQ(first.Fetches(), 1u);  // the second cache found the first's blocks
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] { wrong += !ReadRandomly(t % 2 ? *one : *two, objects, t, 300); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(BlockBytesOnDisk(dir_), max);
  EXPECT_LE(one->Recount(), max);
}

TEST_F(DiskCacheTest, TwoProcessesShareADirectoryWithinTheBound) {
  const uint64_t max = 128 << 10;
  Open(max);  // creates the directory before the processes race
  std::vector<pid_t> children;
  for (int p = 0; p < 2; ++p) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto c = DiskCache::Open(dir_.string(), max, kBlock);
      auto objects = FourObjects();
      bool ok = c.ok() && ReadRandomly(**c, objects, 100 + p, 400);
      ::_exit(ok ? 0 : 1);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  EXPECT_LE(BlockBytesOnDisk(dir_), max);
  auto objects = FourObjects();
  EXPECT_TRUE(ReadRandomly(*Open(max), objects, 5, 100));
}

}  // namespace
}  // namespace ckptfs
