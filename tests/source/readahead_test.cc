#include "source/readahead.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/layout.h"
#include "core/planner.h"
#include "source/posix_source.h"
#include "source/source_reader.h"

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

size_t OpenDescriptors() {
  size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;  // opendir's own
}

// A [files x 16384] byte tensor, one row of 64 KiB per source file.
struct ManyFiles {
  std::filesystem::path dir;
  std::vector<SourceFile> files;
  Layout layout;
  std::string expected;
};

ManyFiles MakeManyFiles(uint64_t n, uint64_t row) {
  ManyFiles m;
  char tmpl[] = "/tmp/ckptfs-readahead-XXXXXX";
  m.dir = ::mkdtemp(tmpl);
  auto tensor = std::make_shared<TensorMeta>();
  tensor->fqn = "w";
  tensor->dtype = DType::kU8;
  tensor->shape = {n, row};
  for (uint64_t f = 0; f < n; ++f) {
    std::string bytes(row, char('a' + f % 26));
    bytes[0] = char(f);
    const std::string name = "rank" + std::to_string(f);
    std::ofstream(m.dir / name, std::ios::binary) << bytes;
    SourceFile sf = *StatSource((m.dir / name).string());
    sf.path = name;
    m.files.push_back(sf);
    Chunk c;
    c.set_box(Box{{f, 0}, {1, row}});
    c.set_dtype(DType::kU8);
    c.set_bytes({FileId(f), 0, row});
    tensor->chunks.push_back(c);
    m.expected += bytes;
  }
  EXPECT_TRUE(m.layout.AddTensor(tensor, Box::Whole(tensor->shape)).ok());
  return m;
}

// Read-ahead opens a second descriptor per source it reads ahead; a
// checkpoint of many files must not make it take one per file on top of
// the reads' own (a daemon near its descriptor limit would then fail reads).
TEST(SourceReaderReadAhead, KeepsAtMostKPrefetchFdsDescriptors) {
  constexpr uint64_t kFiles = SourceReader::kPrefetchFds * 3, kRow = 64 << 10;
  ManyFiles m = MakeManyFiles(kFiles, kRow);
  auto layout = std::make_shared<const Layout>(m.layout);
  const size_t before = OpenDescriptors();
  {
    SourceReader reader(m.dir.string(), &m.files);
    ReadStream stream;
    std::string got(m.expected.size(), '\0');
    // Every reading descriptor is opened here, before read-ahead starts:
    // otherwise the read-ahead thread may open one at the same moment as a
    // read and close it on finding the read's, one more for an instant.
    auto whole = Plan(*layout, 0, m.expected.size());
    ASSERT_TRUE(whole.ok());
    ASSERT_TRUE(reader.Execute(*whole, got.data()).ok());
    const uint64_t step = 4 * kRow;
    // Three sequential requests start read-ahead of the rest of the file.
    size_t most = 0;
    for (uint64_t at = 0; at < 3 * step; at += step) {
      auto plan = Plan(*layout, at, step);
      ASSERT_TRUE(plan.ok());
      ASSERT_TRUE(reader.Execute(*plan, got.data() + at).ok());
      reader.ReadAhead(stream, layout, at, plan->length);
    }
    // Limit: one reading descriptor per file and kPrefetchFds read-ahead
    // ones, plus /dev/null while a prefetch runs. Wait until read-ahead has
    // reached the first two (it has then run over more files than it may
    // keep open), checking the limit is never passed.
    const size_t limit = before + kFiles + SourceReader::kPrefetchFds;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (most < limit && std::chrono::steady_clock::now() < deadline) {
      ASSERT_TRUE(reader.Execute(*whole, got.data()).ok());
      most = std::max(most, OpenDescriptors());
      ASSERT_LE(most, limit + 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_GE(most, limit) << "read-ahead never opened its descriptors";
    EXPECT_EQ(got, m.expected);
  }
  EXPECT_EQ(OpenDescriptors(), before) << "descriptors left open after the reader is gone";
  std::filesystem::remove_all(m.dir);
}

TEST(HintQueue, StoppedQueueRefusesJobs) {
  HintQueue q;
  q.Stop();
  EXPECT_FALSE(q.Post([] {}));
}

}  // namespace
}  // namespace ckptfs
