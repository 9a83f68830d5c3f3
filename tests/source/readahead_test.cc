#include "source/readahead.h"
#include "tests/source/page_cache_probe.h"

#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/compute.h"
#include "core/layout.h"
#include "core/planner.h"
#include "source/posix_source.h"
#include "source/source_reader.h"
#include "tests/temp_dirs.h"

namespace ckptfs {
namespace {

constexpr uint64_t kMiB = 1 << 20;
constexpr uint64_t kFile = 1024 * kMiB;

TEST(ReadStream, FirstRequestReadsNothingAhead) {
  ReadStream s;
  EXPECT_EQ(s.OnRead(0, kMiB, kFile, 8 * kMiB, 0, 0).length, 0u);
}

TEST(ReadStream, SequentialRequestsReadTheNextWindowAhead) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB, 0, 0);
  ReadStream::Window w = s.OnRead(kMiB, kMiB, kFile, 8 * kMiB, 0, 0);
  EXPECT_EQ(w.offset, 2 * kMiB);
  EXPECT_EQ(w.length, 8 * kMiB);
  // The window is ahead already: nothing until a quarter of it is used up.
  EXPECT_EQ(s.OnRead(2 * kMiB, kMiB, kFile, 8 * kMiB, 0, 0).length, 0u);
  w = s.OnRead(3 * kMiB, kMiB, kFile, 8 * kMiB, 0, 0);
  EXPECT_EQ(w.offset, 10 * kMiB);
  EXPECT_EQ(w.length, 2 * kMiB);
}

// transformers' load touches the first and the last MiB of each tensor;
// the last MiB of one and the first of the next are in a row, in either
// order. Units 1, 2, 3: three tensors of 21 MiB.
TEST(ReadStream, TouchesOfNeighbouringUnitsNeverReadAhead) {
  ReadStream s;
  for (auto [at, unit] : {std::pair<uint64_t, uint64_t>{20, 1}, {21, 2}, {42, 3}, {41, 2}, {62, 3}, {63, 4}})
    EXPECT_EQ(s.OnRead(at * kMiB, kMiB, kFile, 8 * kMiB, unit, unit).length, 0u) << at;
}

TEST(ReadStream, ASecondRequestInOneUnitStartsReadingAheadAfterATouch) {
  ReadStream s;
  s.OnRead(20 * kMiB, kMiB, kFile, 8 * kMiB, 1, 1);
  EXPECT_EQ(s.OnRead(21 * kMiB, kMiB, kFile, 8 * kMiB, 2, 2).length, 0u);
  ReadStream::Window w = s.OnRead(22 * kMiB, kMiB, kFile, 8 * kMiB, 2, 2);
  EXPECT_EQ(w.offset, 23 * kMiB);
  EXPECT_EQ(w.length, 8 * kMiB);
}

// A header (unit 0) read with the start of the first tensor (unit 1), then
// the tensor: the second request begins where the first ended.
TEST(ReadStream, AReaderGoingOnFromAHeaderIntoATensorReadsAhead) {
  ReadStream s;
  s.OnRead(0, 256 * 1024, kFile, 8 * kMiB, 0, 1);
  EXPECT_GT(s.OnRead(256 * 1024, 256 * 1024, kFile, 8 * kMiB, 1, 1).length, 0u);
}

TEST(ReadStream, AStreamReadingAheadGoesOnAcrossUnits) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB, 0, 0);
  EXPECT_GT(s.OnRead(kMiB, kMiB, kFile, 8 * kMiB, 0, 0).length, 0u);
  auto gen = s.generation()->load();
  uint64_t ahead = 0;
  for (uint64_t i = 2; i < 12; ++i) ahead += s.OnRead(i * kMiB, kMiB, kFile, 8 * kMiB, i, i).length;
  EXPECT_EQ(s.generation()->load(), gen);
  EXPECT_EQ(ahead, 10 * kMiB);  // on from 10 MiB to 20 MiB: 8 MiB beyond the last request's end
}

TEST(ReadStream, OutOfOrderRequestsWithinSlackStaySequential) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB, 0, 0);
  s.OnRead(2 * kMiB, kMiB, kFile, 8 * kMiB, 0, 0);  // the kernel's next read-ahead request first
  auto gen = s.generation()->load();
  s.OnRead(kMiB, kMiB, kFile, 8 * kMiB, 0, 0);
  EXPECT_EQ(s.generation()->load(), gen);
}

TEST(ReadStream, WindowStopsAtEndOfFile) {
  ReadStream s;
  s.OnRead(0, kMiB, 3 * kMiB, 8 * kMiB, 0, 0);
  ReadStream::Window w = s.OnRead(kMiB, kMiB, 3 * kMiB, 8 * kMiB, 0, 0);
  EXPECT_EQ(w.offset, 2 * kMiB);
  EXPECT_EQ(w.length, kMiB);
  EXPECT_EQ(s.OnRead(2 * kMiB, kMiB, 3 * kMiB, 8 * kMiB, 0, 0).length, 0u);
}

TEST(ReadStream, JumpBreaksThePatternAndCancelsQueuedHints) {
  ReadStream s;
  s.OnRead(0, kMiB, kFile, 8 * kMiB, 0, 0);
  EXPECT_GT(s.OnRead(kMiB, kMiB, kFile, 8 * kMiB, 0, 0).length, 0u);
  auto gen = s.generation()->load();
  EXPECT_EQ(s.OnRead(500 * kMiB, kMiB, kFile, 8 * kMiB, 0, 0).length, 0u);
  EXPECT_NE(s.generation()->load(), gen);
  // A new stream from there.
  ReadStream::Window w = s.OnRead(501 * kMiB, kMiB, kFile, 8 * kMiB, 0, 0);
  EXPECT_EQ(w.offset, 502 * kMiB);
  EXPECT_EQ(w.length, 8 * kMiB);
}

TEST(ReadStream, RandomRequestsNeverReadAhead) {
  ReadStream s;
  for (uint64_t at : {700u, 10u, 300u, 900u, 50u, 600u})
    EXPECT_EQ(s.OnRead(at * kMiB, kMiB, kFile, 8 * kMiB, 0, 0).length, 0u) << at;
}

TEST(ReadStream, ZeroWindowIsOff) {
  ReadStream s;
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(s.OnRead(i * kMiB, kMiB, kFile, 0, 0, 0).length, 0u);
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
  m.dir = TempDirs::Make("ckptfs-readahead");
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
  constexpr uint64_t kFiles = SourcePrefetch::kMaxObjects * 3, kRow = 64 << 10;
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
    // Limit: one reading descriptor per file and SourcePrefetch::kMaxObjects read-ahead
    // ones, plus /dev/null while a prefetch runs. Wait until read-ahead has
    // reached the first two (it has then run over more files than it may
    // keep open), checking the limit is never passed.
    const size_t limit = before + kFiles + SourcePrefetch::kMaxObjects;
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
}

// A sequential reader of a computed tensor (here a bf16 cast of an fp32
// one) reads ahead the inputs of the blocks it is about to be served: the
// source ranges behind them reach the page cache before they are asked for.
TEST(SourceReaderReadAhead, ReadsAheadTheInputsOfComputedTensors) {
  constexpr uint64_t kRows = 64, kCols = 64 << 10;  // 16 MiB of fp32, 8 MiB once cast
  const std::filesystem::path dir = TempDirs::Make("ckptfs-readahead");
  {
    std::ofstream out(dir / "w.bin", std::ios::binary);
    std::vector<float> row(kCols, 1.5f);
    for (uint64_t r = 0; r < kRows; ++r) out.write(reinterpret_cast<const char*>(row.data()), kCols * 4);
  }
  std::vector<SourceFile> files{*StatSource((dir / "w.bin").string())};
  files[0].path = "w.bin";
  auto tensor = std::make_shared<TensorMeta>();
  tensor->fqn = "w";
  tensor->dtype = DType::kF32;
  tensor->shape = {kRows, kCols};
  Chunk c;
  c.set_box(Box::Whole(tensor->shape));
  c.set_dtype(DType::kF32);
  c.set_bytes({FileId(0), 0, kRows * kCols * 4});
  tensor->chunks.push_back(c);
  auto layout = std::make_shared<Layout>();
  layout->AddComputed(MakeCast(tensor, Box::Whole(tensor->shape), DType::kBF16));
  {
    const int fd = ::open((dir / "w.bin").c_str(), O_RDONLY);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
  ReadOptions ro;
  ro.readahead_bytes = 4 * kMiB;
  SourceReader reader(dir.string(), &files, {}, 0, ro);
  ReadStream stream;
  // Two sequential 1 MiB requests at the start of the cast tensor.
  for (uint64_t at = 0; at < 2 * kMiB; at += kMiB) reader.ReadAhead(stream, layout, at, kMiB);
  // The window ahead, [2, 6) MiB of bf16, holds the start of the second
  // block (4 MiB of output: rows 32 to 63), whose input is fp32 bytes
  // [8, 16) MiB of the source.
  const uint64_t want = 8 * kMiB / ::sysconf(_SC_PAGESIZE);
  uint64_t got = 0;
  for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       got < want && std::chrono::steady_clock::now() < deadline;
       std::this_thread::sleep_for(std::chrono::milliseconds(10)))
    got = ResidentPages(dir / "w.bin", 8 * kMiB, 8 * kMiB);
  EXPECT_EQ(got, want) << "the inputs of the next blocks were not read ahead";
}

TEST(HintQueue, StoppedQueueRefusesJobs) {
  HintQueue q;
  q.Stop();
  EXPECT_FALSE(q.Post([] {}));
}

}  // namespace
}  // namespace ckptfs
