// The stager: bytes land where asked whatever the ring size, checksums equal
// one-pass CRCs of the expected bytes, memory stays the ring, the producer
// blocks when the ring is full, and failures surface.
#include "writer/stager.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "core/crc32c.h"
#include "tests/temp_dirs.h"

namespace ckptfs {
namespace {

std::string TempPath(const std::string& name) {
  return TempDirs::Make("stager_test") / name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string Random(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::string s(n, '\0');
  for (auto& ch : s) ch = char(g());
  return s;
}

Slice Host(const std::string& s, size_t off, size_t n) { return Slice{s.data() + off, n}; }

// A copy engine that counts allocations and can hold the I/O threads.
class GateEngine : public CopyEngine {
 public:
  const char* name() const override { return "gate"; }
  Result<void*> AllocBuffer(uint64_t bytes) override {
    ++allocs;
    return std::malloc(bytes);
  }
  void FreeBuffer(void* p, uint64_t) override { std::free(p); }
  Status Copy(int, void* dst, const Slice& s) override {
    std::memcpy(dst, s.ptr, s.size);
    return Status::OK();
  }
  Status Seal(int) override { return Status::OK(); }
  Status FenceProducer(int, uint64_t) override { return Status::OK(); }
  Status WaitSealed(int) override {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return open; });
    return Status::OK();
  }
  void Open() {
    std::lock_guard<std::mutex> l(mu);
    open = true;
    cv.notify_all();
  }
  std::atomic<int> allocs{0};
  std::mutex mu;
  std::condition_variable cv;
  bool open = true;
};

TEST(Stager, SlicesLandAtTheirOffsetsThroughASmallRing) {
  const std::string a = Random(100000, 1), b = Random(33333, 2);
  StagerOptions o;
  o.buffer_bytes = 4096;
  o.buffers = 3;
  o.io_threads = 2;
  auto st = Stager::Create(o, MakeHostCopyEngine());
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  const std::string path = TempPath("f.bin");
  auto file = (*st)->OpenFile(path);
  ASSERT_TRUE(file.ok());
  // Tag 1: `a` in three uneven slices (copied); tag 2: `b` written directly, after a gap.
  ASSERT_TRUE((*st)->Write(*file, 0, Host(a, 0, 5000), 1, 0, true).ok());
  ASSERT_TRUE((*st)->Write(*file, 5000, Host(a, 5000, 1), 1, 5000, true).ok());
  ASSERT_TRUE((*st)->Write(*file, 5001, Host(a, 5001, a.size() - 5001), 1, 5001, true).ok());
  const uint64_t gap = 17;
  ASSERT_TRUE((*st)->Write(*file, a.size() + gap, Host(b, 0, b.size()), 2, 0, false).ok());
  ASSERT_TRUE((*st)->Drain().ok());
  ASSERT_TRUE((*st)->SyncFile(*file).ok());
  ASSERT_TRUE((*st)->CloseFile(*file).ok());

  std::string want = a + std::string(gap, '\0') + b;
  EXPECT_EQ(ReadAll(path), want);
  auto ca = (*st)->TakeChecksums(1), cb = (*st)->TakeChecksums(2);
  ASSERT_TRUE(ca.ok() && cb.ok());
  EXPECT_EQ(ca->bytes, a.size());
  EXPECT_EQ(ca->crc32c, Crc32cPortable(0, a.data(), a.size()));
  EXPECT_EQ(ca->zip_crc32, uint32_t(crc32(0, reinterpret_cast<const Bytef*>(a.data()), a.size())));
  EXPECT_EQ(cb->crc32c, Crc32cPortable(0, b.data(), b.size()));
  EXPECT_EQ(cb->zip_crc32, uint32_t(crc32(0, reinterpret_cast<const Bytef*>(b.data()), b.size())));
  EXPECT_EQ((*st)->stats().staged_bytes, a.size());
  EXPECT_EQ((*st)->stats().direct_bytes, b.size());
  EXPECT_EQ((*st)->TakeChecksums(1).status().code(), Status::Code::kNotFound);  // taken once
}

TEST(Stager, RandomSlicingOfManyFilesMatches) {
  std::mt19937 g(42);
  StagerOptions o;
  o.buffer_bytes = 1000;
  o.buffers = 2;
  o.io_threads = 3;
  o.direct_piece_bytes = 777;
  auto st = Stager::Create(o, MakeHostCopyEngine());
  ASSERT_TRUE(st.ok());
  std::vector<std::string> paths, data;
  for (int f = 0; f < 3; ++f) {
    paths.push_back(TempPath("r" + std::to_string(f)));
    data.push_back(Random(20000 + 1000 * f, 100 + f));
    ASSERT_TRUE((*st)->OpenFile(paths.back()).ok());
  }
  for (int f = 0; f < 3; ++f)
    for (size_t off = 0; off < data[f].size();) {
      size_t n = std::min<size_t>(data[f].size() - off, g() % 3000 + 1);
      ASSERT_TRUE((*st)->Write(f, off, Host(data[f], off, n), f, off, g() % 2).ok());
      off += n;
    }
  ASSERT_TRUE((*st)->Drain().ok());
  for (int f = 0; f < 3; ++f) {
    ASSERT_TRUE((*st)->CloseFile(f).ok());
    EXPECT_EQ(ReadAll(paths[f]), data[f]) << f;
    auto c = (*st)->TakeChecksums(f);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->crc32c, Crc32cPortable(0, data[f].data(), data[f].size()));
  }
}

TEST(Stager, MemoryIsTheRingAndTheProducerBlocksWhenItIsFull) {
  auto engine = std::make_unique<GateEngine>();
  GateEngine* gate = engine.get();
  gate->open = false;  // I/O threads cannot finish a buffer until opened
  StagerOptions o;
  o.buffer_bytes = 1024;
  o.buffers = 2;
  o.io_threads = 1;
  auto st = Stager::Create(o, std::move(engine));
  ASSERT_TRUE(st.ok());
  const std::string path = TempPath("bp.bin");
  ASSERT_TRUE((*st)->OpenFile(path).ok());
  const std::string data = Random(10 * 1024, 9);  // five times the ring
  std::atomic<bool> returned{false};
  std::thread producer([&] {
    EXPECT_TRUE((*st)->Write(0, 0, Host(data, 0, data.size()), 0, 0, true).ok());
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_FALSE(returned.load()) << "Write returned while the ring was full and nothing drained";
  gate->Open();
  producer.join();
  ASSERT_TRUE((*st)->Drain().ok());
  ASSERT_TRUE((*st)->CloseFile(0).ok());
  EXPECT_EQ(ReadAll(path), data);
  EXPECT_EQ(gate->allocs.load(), 2);
  EXPECT_GT((*st)->stats().producer_wait_ns, 100'000'000u);
}

TEST(Stager, WriteErrorsSurfaceAtDrainAndStopLaterWrites) {
  StagerOptions o;
  o.buffer_bytes = 512;
  auto st = Stager::Create(o, MakeHostCopyEngine());
  ASSERT_TRUE(st.ok());
  auto f = (*st)->OpenFile("/dev/full");  // every write fails with ENOSPC
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  const std::string data = Random(4096, 3);
  Status first = (*st)->Write(*f, 0, Host(data, 0, data.size()), 0, 0, true);
  Status drained = (*st)->Drain();
  EXPECT_EQ(drained.code(), Status::Code::kIOError);
  EXPECT_NE(drained.message().find("/dev/full"), std::string::npos) << drained.message();
  EXPECT_FALSE((*st)->Write(*f, 0, Host(data, 0, 10), 0, 0, true).ok());
}

// The threads this process runs named `name` (/proc/self/task/*/comm).
int ThreadsNamed(const std::string& name) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(e.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++n;
  }
  return n;
}

// ThreadsNamed(name) once it equals `want`, or after 2 s. A joined thread
// can still be listed in /proc/self/task for a moment (the kernel reaps it
// after join returns), and a new one names itself once it runs; a thread
// that was never joined stays listed.
int ThreadsNamedSettled(const std::string& name, int want) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int n = ThreadsNamed(name);
  while (n != want && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    n = ThreadsNamed(name);
  }
  return n;
}

// A std::thread destroyed while joinable calls std::terminate: the stager
// must join its I/O threads whatever state a failure left it in, here with
// the ring full of jobs that fail, a partly filled buffer, and no Drain.
TEST(Stager, DestroyedMidFailureJoinsItsThreads) {
  const int before = ThreadsNamed("ckptfs-io");
  for (int round = 0; round < 20; ++round) {
    StagerOptions o;
    o.buffer_bytes = 512;
    o.io_threads = 3;
    auto st = Stager::Create(o, MakeHostCopyEngine());
    ASSERT_TRUE(st.ok());
    EXPECT_EQ(ThreadsNamedSettled("ckptfs-io", before + 3), before + 3);
    auto full = (*st)->OpenFile("/dev/full");  // every write fails with ENOSPC
    ASSERT_TRUE(full.ok()) << full.status().ToString();
    const std::string data = Random(64 * 1024 + 100, round);
    // Staged and direct writes racing the first failure; their results are
    // whatever the race gives: the point is what destruction does next.
    (void)(*st)->Write(*full, 0, Host(data, 0, data.size()), 0, 0, true);
    (void)(*st)->Write(*full, 0, Host(data, 0, data.size()), 1, 0, false);
    (void)(*st)->Write(*full, 0, Host(data, 0, 100), 2, 0, true);
    st->reset();  // must return, threads joined
    EXPECT_EQ(ThreadsNamedSettled("ckptfs-io", before), before);
  }
}

TEST(Stager, CloseJoinsOnceAndRefusesLaterWrites) {
  auto st = Stager::Create(StagerOptions{.buffer_bytes = 4096, .io_threads = 2}, MakeHostCopyEngine());
  ASSERT_TRUE(st.ok());
  const std::string path = TempPath("closed.bin");
  auto f = (*st)->OpenFile(path);
  ASSERT_TRUE(f.ok());
  const std::string data = Random(10000, 7);
  ASSERT_TRUE((*st)->Write(*f, 0, Host(data, 0, data.size()), 0, 0, true).ok());
  const int running = ThreadsNamed("ckptfs-io");
  EXPECT_TRUE((*st)->Close().ok());  // drains first: the bytes are written
  EXPECT_EQ(ThreadsNamedSettled("ckptfs-io", running - 2), running - 2);
  EXPECT_TRUE((*st)->Close().ok());
  Status late = (*st)->Write(*f, 0, Host(data, 0, 10), 1, 0, true);
  EXPECT_EQ(late.code(), Status::Code::kInvalidArgument);
  EXPECT_NE(late.message().find("closed"), std::string::npos) << late.message();
  std::ifstream in(path, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), data);
}

TEST(Stager, DeviceSlicesNeedTheCudaEngine) {
  auto st = Stager::Create(StagerOptions{.buffer_bytes = 4096}, MakeHostCopyEngine());
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE((*st)->OpenFile(TempPath("d.bin")).ok());
  int x = 0;
  Status s = (*st)->Write(0, 0, Slice{&x, 4, /*device=*/0, /*stream=*/0}, 0, 0, true);
  EXPECT_EQ(s.code(), Status::Code::kNotSupported);
}

TEST(Stager, OverlappingPiecesOfATagAreRefused) {
  auto st = Stager::Create(StagerOptions{.buffer_bytes = 4096}, MakeHostCopyEngine());
  ASSERT_TRUE(st.ok());
  ASSERT_TRUE((*st)->OpenFile(TempPath("o.bin")).ok());
  const std::string d = Random(100, 1);
  ASSERT_TRUE((*st)->Write(0, 0, Host(d, 0, 60), 5, 0, true).ok());
  ASSERT_TRUE((*st)->Write(0, 50, Host(d, 50, 50), 5, 50, true).ok());
  ASSERT_TRUE((*st)->Drain().ok());
  auto c = (*st)->TakeChecksums(5);
  EXPECT_EQ(c.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(c.status().message().find("overlapping"), std::string::npos);
}

TEST(Stager, SyncDirFailsOnAMissingDirectory) {
  EXPECT_TRUE(SyncDir(testing::TempDir()).ok());
  EXPECT_EQ(SyncDir("/nonexistent/ckptfs").code(), Status::Code::kIOError);
}

}  // namespace
}  // namespace ckptfs
