#include "indexer/readahead.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace ckptfs {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kFile = 1024 * kMiB;

TEST(ReadStream, FirstRequestReadsNothingAhead) {
  ReadStream s;
  EXPECT_EQ(s.OnRead(0, kMiB, kFile, 8 * kMiB).length, 0u);
}

TEST(ReadStream, SequentialRequestsReadTheNextWindowAhead) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB);
  ReadStream::Window w = s.OnRead(kMiB, kMiB, kFile, 8 * kMiB);
  EXPECT_EQ(w.offset, 2 * kMiB);
  EXPECT_EQ(w.length, 8 * kMiB);
  // The window is ahead already: nothing until a quarter of it is used up.
  EXPECT_EQ(s.OnRead(2 * kMiB, kMiB, kFile, 8 * kMiB).length, 0u);
  w = s.OnRead(3 * kMiB, kMiB, kFile, 8 * kMiB);
  EXPECT_EQ(w.offset, 10 * kMiB);
  EXPECT_EQ(w.length, 2 * kMiB);
}

TEST(ReadStream, OutOfOrderRequestsWithinSlackStaySequential) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB);
  s.OnRead(2 * kMiB, kMiB, kFile, 8 * kMiB);  // the kernel's next read-ahead request first
  auto gen = s.generation()->load();
  s.OnRead(kMiB, kMiB, kFile, 8 * kMiB);
  EXPECT_EQ(s.generation()->load(), gen);
}

TEST(ReadStream, WindowStopsAtEndOfFile) {
  ReadStream s;
  s.OnRead(0, kMiB, 3 * kMiB, 8 * kMiB);
  ReadStream::Window w = s.OnRead(kMiB, kMiB, 3 * kMiB, 8 * kMiB);
  EXPECT_EQ(w.offset, 2 * kMiB);
  EXPECT_EQ(w.length, kMiB);
  EXPECT_EQ(s.OnRead(2 * kMiB, kMiB, 3 * kMiB, 8 * kMiB).length, 0u);
}

TEST(ReadStream, JumpBreaksThePatternAndCancelsQueuedHints) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB);
  EXPECT_GT(s.OnRead(kMiB, kMiB, kFile, 8 * kMiB).length, 0u);
  auto gen = s.generation()->load();
  EXPECT_EQ(s.OnRead(500 * kMiB, kMiB, kFile, 8 * kMiB).length, 0u);
  EXPECT_NE(s.generation()->load(), gen);
  // A new stream from there.
  ReadStream::Window w = s.OnRead(501 * kMiB, kMiB, kFile, 8 * kMiB);
  EXPECT_EQ(w.offset, 502 * kMiB);
  EXPECT_EQ(w.length, 8 * kMiB);
}

TEST(ReadStream, RandomRequestsNeverReadAhead) {
  ReadStream s;
  for (uint64_t at : {700u, 10u, 300u, 900u, 50u, 600u})
    EXPECT_EQ(s.OnRead(at * kMiB, kMiB, kFile, 8 * kMiB).length, 0u) << at;
}

TEST(ReadStream, ZeroWindowIsOff) {
  ReadStream s;
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(s.OnRead(i * kMiB, kMiB, kFile, 0).length, 0u);
}

TEST(ReadStream, DestroyingTheStreamCancelsItsHints) {
  std::shared_ptr<const std::atomic<uint64_t>> gen;
  uint64_t before;
  {
    ReadStream s;
    gen = s.generation();
    before = gen->load();
  }
  EXPECT_NE(gen->load(), before);
}

TEST(HintQueue, BoundedWhileBusy) {
  HintQueue q(2);
  std::atomic<bool> started{false}, release{false};
  std::atomic<int> ran{0};
  ASSERT_TRUE(q.Post([&] {
    started = true;
    while (!release) std::this_thread::yield();
    ++ran;
  }));
  while (!started) std::this_thread::yield();
  EXPECT_TRUE(q.Post([&] { ++ran; }));
  EXPECT_TRUE(q.Post([&] { ++ran; }));
  EXPECT_FALSE(q.Post([&] { ++ran; }));  // full: dropped
  release = true;
  while (ran < 3) std::this_thread::yield();
  q.Stop();
  EXPECT_EQ(ran.load(), 3);
}

TEST(HintQueue, StoppedQueueRefusesJobs) {
  HintQueue q;
  q.Stop();
  EXPECT_FALSE(q.Post([] {}));
}

}  // namespace
}  // namespace ckptfs
