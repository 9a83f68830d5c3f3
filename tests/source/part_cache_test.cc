#include "source/part_cache.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "tests/source/fake_bytes.h"

namespace ckptfs {
namespace {

// An object of FakeBytes; fetches counted.
struct FakeObject {
  uint64_t size;
  int version = 0;
  std::atomic<int> fetches{0};
  std::atomic<bool> fail{false};
  PartCache::Fetch fetch() {
    return [this](const std::string&, uint64_t at, uint64_t n, char* out) {
      ++fetches;
      if (fail) return Status::IOError("reset");
      FillFakeBytes(at, n, version, out);
      return Status::OK();
    };
  }
  std::string Expected(uint64_t at, uint64_t n) const { return FakeBytes(at, n, version); }
};

TEST(PartCache, ServesPrefetchedRangesAcrossPartsAndTheShortLastPart) {
  FakeObject obj{1000};
  PartCache cache(1 << 20, 64, 3);
  cache.Prefetch("k", obj.size, 0, obj.size, obj.fetch());
  for (auto [at, n] : {std::pair<uint64_t, uint64_t>{0, 1}, {60, 10}, {63, 130}, {990, 10}, {0, 1000}}) {
    std::string got(n, '\0');
    ASSERT_TRUE(cache.Copy("k", at, n, got.data())) << at;
    EXPECT_EQ(got, obj.Expected(at, n)) << at;
  }
  EXPECT_EQ(obj.fetches.load(), 16);  // ceil(1000 / 64), each part once
}

// Parts larger than half the capacity: a prefetch queues the first part and
// finds no room for the second. The part it queued is still fetched, and its
// reader gets it (it once waited forever: no worker had been woken).
TEST(PartCache, APrefetchThatRunsOutOfRoomStillFetchesWhatItQueued) {
  FakeObject obj{1000};
  PartCache cache(100, 60, 1);
  // A first part, fetched and read: the worker is started and now waits.
  cache.Prefetch("k", obj.size, 960, 40, obj.fetch());
  std::string last(40, '\0');
  ASSERT_TRUE(cache.Copy("k", 960, 40, last.data()));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  cache.Prefetch("k", obj.size, 0, 120, obj.fetch());
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::string got(60, '\0');
  std::thread reader([&] {
    EXPECT_TRUE(cache.Copy("k", 0, 60, got.data()));
    *done = true;
  });
  for (int i = 0; i < 500 && !*done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!*done) {
    ADD_FAILURE() << "the reader of a queued part still waits after 5 s";
    std::fflush(nullptr);
    std::_Exit(1);  // the waiting reader cannot be woken: end here rather than hang
  }
  reader.join();
  EXPECT_EQ(got, obj.Expected(0, 60));
}

TEST(PartCache, AnotherVersionsKeyNeverMeetsTheseParts) {
  FakeObject obj{256};
  PartCache cache(1 << 20, 64, 2);
  const std::string v1("k\0etag-1", 8), v2("k\0etag-2", 8);
  cache.Prefetch(v1, obj.size, 0, 256, obj.fetch());
  char b[8];
  EXPECT_FALSE(cache.Copy(v2, 0, 8, b));
  EXPECT_TRUE(cache.Copy(v1, 0, 8, b));
}

TEST(PartCache, ARangeNotPrefetchedOrAFailedFetchIsTheReadersToFetch) {
  FakeObject obj{256};
  PartCache cache(1 << 20, 64, 2);
  char b[8];
  EXPECT_FALSE(cache.Copy("k", 0, 8, b));
  obj.fail = true;
  cache.Prefetch("k", obj.size, 0, 64, obj.fetch());
  EXPECT_FALSE(cache.Copy("k", 0, 8, b));  // waits for the fetch, then says no
  EXPECT_EQ(cache.held(), 0u);
  // Half prefetched: not served from the cache at all.
  obj.fail = false;
  cache.Prefetch("k", obj.size, 0, 64, obj.fetch());
  EXPECT_FALSE(cache.Copy("k", 32, 64, b));
}

TEST(PartCache, HoldsAtMostItsCapacityDroppingTheLeastRecentlyUsed) {
  FakeObject obj{100 * 64};
  PartCache cache(4 * 64, 64, 2);
  cache.Prefetch("k", obj.size, 0, 4 * 64, obj.fetch());
  char b[1];
  ASSERT_TRUE(cache.Copy("k", 0, 1, b));          // waits for part 0
  ASSERT_TRUE(cache.Copy("k", 3 * 64, 1, b));     // and part 3
  ASSERT_TRUE(cache.Copy("k", 64, 1, b));
  ASSERT_TRUE(cache.Copy("k", 2 * 64, 1, b));
  ASSERT_TRUE(cache.Copy("k", 0, 1, b));          // part 0 most recently used now
  EXPECT_EQ(cache.held(), 4u * 64);
  cache.Prefetch("k", obj.size, 10 * 64, 64, obj.fetch());  // drops part 3, the least recent
  ASSERT_TRUE(cache.Copy("k", 10 * 64, 1, b));
  EXPECT_LE(cache.held(), 4u * 64);
  EXPECT_TRUE(cache.Copy("k", 0, 1, b));
  EXPECT_FALSE(cache.Copy("k", 3 * 64, 1, b));
}

// Share hands out a range where it lies in its part, without a copy: the
// bytes must be the object's, and stay so after the part leaves the cache.
TEST(PartCache, SharesARangeInsideOnePartAndKeepsItValidAfterEviction) {
  FakeObject obj{1000};
  PartCache cache(2 * 64, 64, 2);
  cache.Prefetch("k", obj.size, 0, 128, obj.fetch());
  auto first = cache.Share("k", 70, 50);  // waits for part 1
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(std::string(first->data, 50), obj.Expected(70, 50));
  EXPECT_FALSE(cache.Share("k", 60, 10).has_value());  // across two parts: the reader copies
  EXPECT_FALSE(cache.Share("k", 200, 8).has_value());  // never fetched
  EXPECT_FALSE(cache.Share("k", 0, 0).has_value());
  auto last = cache.Share("k", 0, 64);
  ASSERT_TRUE(last.has_value());
  // Two other parts take the room: parts 0 and 1 are dropped, not freed.
  cache.Prefetch("k", obj.size, 512, 128, obj.fetch());
  char b[1];
  ASSERT_TRUE(cache.Copy("k", 512, 1, b));
  ASSERT_TRUE(cache.Copy("k", 576, 1, b));
  EXPECT_FALSE(cache.Copy("k", 70, 1, b));
  EXPECT_EQ(std::string(first->data, 50), obj.Expected(70, 50));
  EXPECT_EQ(std::string(last->data, 64), obj.Expected(0, 64));
  // The short last part: a range past the object's end is not shared.
  cache.Prefetch("k", obj.size, 960, 40, obj.fetch());
  ASSERT_TRUE(cache.Share("k", 960, 40).has_value());
  EXPECT_FALSE(cache.Share("k", 990, 20).has_value());
  // A failed fetch is not shared either.
  obj.fail = true;
  cache.Prefetch("k", obj.size, 256, 64, obj.fetch());
  EXPECT_FALSE(cache.Share("k", 256, 8).has_value());
}

TEST(PartCache, ConcurrentReadersOfPartsInFlightGetExactBytes) {
  FakeObject obj{64 * 1024};
  PartCache cache(1 << 20, 1024, 4);
  cache.Prefetch("k", obj.size, 0, obj.size, obj.fetch());
  std::atomic<int> wrong{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 8; ++t)
    readers.emplace_back([&, t] {
      for (uint64_t at = t * 100; at + 3000 < obj.size; at += 2500) {
        std::string got(3000, '\0');
        if (!cache.Copy("k", at, 3000, got.data()) || got != obj.Expected(at, 3000)) ++wrong;
      }
    });
  for (auto& r : readers) r.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(obj.fetches.load(), 64);
}

}  // namespace
}  // namespace ckptfs
