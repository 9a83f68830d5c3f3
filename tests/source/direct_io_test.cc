// Direct reads (source/direct_io.h): the alignment arithmetic, the bounded
// buffer pool, the I/O pool and scatter replies against simple oracles, and
// the POSIX backend's direct path on a real disk filesystem (a file half in
// the page cache) and on tmpfs (no O_DIRECT: read buffered), and the
// recycled aligned buffers source-order ranges are read into (ReadOnce).
#include "source/direct_io.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include <new>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "source/io_pool.h"
#include "source/posix_source.h"
#include "tests/source/page_cache_probe.h"
#include "source/range_buffers.h"
#include "source/scatter_reply.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

// --- alignment -------------------------------------------------------------

TEST(AlignSpan, CoversTheRangeWithTheNearestAlignedBoundsByCounting) {
  std::mt19937_64 rng(7);
  for (uint64_t align : {512ull, 4096ull}) {
    for (int i = 0; i < 5000; ++i) {
      const uint64_t offset = i < 50 ? uint64_t(i) * align / 8 : rng() % (1ull << 40);
      const uint64_t length = rng() % (3 * align);
      // Oracle: walk down and up one byte at a time to the nearest multiples.
      uint64_t lo = offset;
      while (lo % align != 0) --lo;
      uint64_t hi = offset + length;
      while (hi % align != 0) ++hi;
      AlignedSpan s = AlignSpan(offset, length, align);
      ASSERT_EQ(s.start, lo) << offset << "+" << length;
      ASSERT_EQ(s.length, hi - lo) << offset << "+" << length;
      ASSERT_EQ(s.skip, offset - lo);
    }
  }
}

// --- BufferPool --------------------------------------------------------------

TEST(BufferPool, BuffersArePageAlignedAndAtLeastTheSizeAsked) {
  BufferPool pool(64 << 20);
  for (uint64_t ask : {1ull, 4096ull, 65537ull, 1ull << 20, (1ull << 20) + 1, 8ull << 20}) {
    auto b = pool.TryTake(ask);
    ASSERT_TRUE(b.has_value()) << ask;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 4096, 0u) << ask;
    EXPECT_GE(b->size(), ask);
    EXPECT_LT(b->size(), std::max<uint64_t>(2 * ask, BufferPool::kMinBuffer + 1));
    EXPECT_TRUE(b->pooled());
    std::memset(b->data(), 0xab, b->size());  // all of it is ours to write
  }
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(BufferPool, ReleasedBufferServesTheNextTakeOfItsSize) {
  BufferPool pool(8 << 20);
  char* first;
  {
    auto b = pool.TryTake(1 << 20);
    ASSERT_TRUE(b);
    first = b->data();
  }
  auto again = pool.TryTake((1 << 20) - 100);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->data(), first);
  EXPECT_EQ(pool.held(), 1u << 20);
}

// Random takes and releases against a model of what the pool may hold: it
// never holds more than its capacity, and refuses a take only when the
// buffers in use leave no room for it.
TEST(BufferPool, NeverHoldsMoreThanItsCapacityAndRefusesOnlyWhenFull) {
  const uint64_t cap = 16 << 20;
  BufferPool pool(cap);
  std::mt19937_64 rng(11);
  std::vector<Buffer> taken;
  uint64_t in_use = 0;  // the model: bytes of the buffers we hold
  for (int step = 0; step < 20000; ++step) {
    if (!taken.empty() && rng() % 2) {
      size_t i = rng() % taken.size();
      in_use -= taken[i].size();
      taken.erase(taken.begin() + i);
    } else {
      const uint64_t ask = 1 + rng() % (6 << 20);
      const uint64_t size = BufferPool::ClassSize(ask);
      auto b = pool.TryTake(ask);
      ASSERT_EQ(b.has_value(), in_use + size <= cap) << "step " << step << " in use " << in_use << " ask " << ask;
      if (b) {
        in_use += b->size();
        taken.push_back(std::move(*b));
      }
    }
    ASSERT_LE(pool.held(), cap);
    ASSERT_EQ(pool.in_use(), in_use);
  }
}

TEST(BufferPool, HeapBufferIsNotPooled) {
  Buffer b = Buffer::Heap(100);
  EXPECT_FALSE(b.pooled());
  EXPECT_EQ(b.size(), 100u);
  Buffer moved = std::move(b);
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(moved.size(), 100u);
}

// --- IoPool ------------------------------------------------------------------

TEST(IoPool, RunsEveryTaskOnceOnSeveralThreads) {
  IoPool io(4);
  const size_t n = 200;
  std::vector<std::atomic<int>> runs(n);
  std::mutex mu;
  std::set<std::thread::id> threads;
  Status st = io.RunAll(n, [&](size_t i) {
    runs[i].fetch_add(1);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::lock_guard<std::mutex> lock(mu);
    threads.insert(std::this_thread::get_id());
    return Status::OK();
  });
  ASSERT_TRUE(st.ok());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(runs[i].load(), 1) << i;
  EXPECT_GT(threads.size(), 1u);
}

TEST(IoPool, ReturnsTheFailureOfTheLowestIndex) {
  IoPool io(3);
  Status st = io.RunAll(50, [&](size_t i) {
    if (i == 41) return Status::IOError("forty-one");
    if (i == 17) return Status::Corruption("seventeen");
    return Status::OK();
  });
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_EQ(st.message(), "seventeen");
  EXPECT_TRUE(io.RunAll(0, [](size_t) { return Status::IOError("never run"); }).ok());
}

// A task that throws (bad_alloc under memory pressure), on the caller's
// thread or a pool thread: RunAll waits for every other task, which may
// still use what the caller owns, then rethrows on the caller's thread.
TEST(IoPool, ATaskThatThrowsIsRethrownAfterEveryTaskHasFinished) {
  IoPool io(3);
  for (int round = 0; round < 20; ++round) {
    auto finished = std::make_shared<std::atomic<int>>(0);
    bool threw = false;
    try {
      (void)io.RunAll(40, [&, finished](size_t i) -> Status {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (i % 13 == 5) throw std::bad_alloc();
        finished->fetch_add(1);
        return Status::OK();
      });
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    EXPECT_TRUE(threw);
    EXPECT_EQ(finished->load(), 40 - 3) << "RunAll returned while tasks were still running";
  }
}

// More callers than pool threads, each waiting on its own batch: every batch
// finishes (callers run their own tasks when the threads are busy).
TEST(IoPool, ManyCallersAtOnceAllFinish) {
  IoPool io(2);
  std::atomic<uint64_t> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 12; ++c)
    callers.emplace_back([&] {
      for (int round = 0; round < 50; ++round)
        ASSERT_TRUE(io.RunAll(7, [&](size_t i) {
                        sum.fetch_add(i + 1);
                        return Status::OK();
                      }).ok());
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(sum.load(), 12u * 50u * 28u);
}

// --- ScatterReply ------------------------------------------------------------

struct Piece {
  uint64_t at;
  std::string bytes;
};

// The oracle: each piece written at its offset of one string.
std::string Expected(const std::vector<Piece>& pieces) {
  uint64_t n = 0;
  for (const Piece& p : pieces) n = std::max<uint64_t>(n, p.at + p.bytes.size());
  std::string out(n, '\0');
  for (const Piece& p : pieces) out.replace(p.at, p.bytes.size(), p.bytes);
  return out;
}

// Pieces of random sizes tiling [0, total), added in a shuffled order, each
// in its own string (so no two are adjacent in memory).
std::vector<Piece> RandomPieces(size_t count, std::mt19937_64& rng) {
  std::vector<Piece> pieces;
  uint64_t at = 0;
  for (size_t i = 0; i < count; ++i) {
    std::string b(1 + rng() % 300, '\0');
    for (char& ch : b) ch = char(rng());
    pieces.push_back({at, b});
    at += b.size();
  }
  std::shuffle(pieces.begin(), pieces.end(), rng);
  return pieces;
}

std::string Sent(const ScatterReply& r) {
  std::string out;
  for (const struct iovec& v : r.iov()) out.append(static_cast<const char*>(v.iov_base), v.iov_len);
  return out;
}

TEST(ScatterReply, PiecesInAnyOrderComeOutInFileOrder) {
  std::mt19937_64 rng(3);
  for (size_t count : {size_t(1), size_t(2), size_t(37), ScatterReply::kMaxPieces}) {
    std::vector<Piece> pieces = RandomPieces(count, rng);
    ScatterReply r;
    for (const Piece& p : pieces) r.Add(p.at, p.bytes.data(), p.bytes.size());
    ASSERT_TRUE(r.Finish().ok());
    EXPECT_EQ(r.iov().size(), count);  // not gathered: every piece as it is
    EXPECT_EQ(Sent(r), Expected(pieces));
    EXPECT_EQ(r.length(), Expected(pieces).size());
    std::string copied(r.length(), '\0');
    r.CopyTo(copied.data());
    EXPECT_EQ(copied, Expected(pieces));
  }
}

TEST(ScatterReply, MoreThanIovMaxPiecesAreGatheredDownToIt) {
  std::mt19937_64 rng(5);
  for (size_t count : {ScatterReply::kMaxPieces + 1, size_t(2048), size_t(5000)}) {
    std::vector<Piece> pieces = RandomPieces(count, rng);
    ScatterReply r;
    for (const Piece& p : pieces) r.Add(p.at, p.bytes.data(), p.bytes.size());
    ASSERT_TRUE(r.Finish().ok());
    ASSERT_EQ(r.iov().size(), ScatterReply::kMaxPieces) << count;
    EXPECT_EQ(Sent(r), Expected(pieces)) << count;
  }
  ScatterReply few;  // a limit of 1: everything in one piece
  std::vector<Piece> pieces = RandomPieces(10, rng);
  for (const Piece& p : pieces) few.Add(p.at, p.bytes.data(), p.bytes.size());
  ASSERT_TRUE(few.Finish(1).ok());
  ASSERT_EQ(few.iov().size(), 1u);
  EXPECT_EQ(Sent(few), Expected(pieces));
}

// 1100 pieces of 1000 bytes but for 78 of one byte in a row: bringing them
// to 1023 copies exactly those 78 bytes; every other piece is sent from
// where it was.
TEST(ScatterReply, GathersTheNeighboursWithTheFewestBytes) {
  std::vector<std::string> store;
  std::vector<Piece> pieces;
  uint64_t at = 0;
  for (size_t i = 0; i < 1100; ++i) {
    const size_t n = (i >= 500 && i < 578) ? 1 : 1000;
    pieces.push_back({at, std::string(n, char('a' + i % 26))});
    at += n;
  }
  ScatterReply r;
  for (const Piece& p : pieces) r.Add(p.at, p.bytes.data(), p.bytes.size());
  ASSERT_TRUE(r.Finish().ok());
  ASSERT_EQ(r.iov().size(), ScatterReply::kMaxPieces);
  EXPECT_EQ(Sent(r), Expected(pieces));
  std::set<const void*> originals;
  for (const Piece& p : pieces) originals.insert(p.bytes.data());
  uint64_t copied = 0;
  for (const struct iovec& v : r.iov())
    if (!originals.count(v.iov_base)) copied += v.iov_len;
  EXPECT_EQ(copied, 78u);
}

TEST(ScatterReply, NeighboursInMemoryAreJoinedAndGatherMemoryIsOwned) {
  const std::string backing = "abcdefghij";
  ScatterReply r;
  r.ReserveGather(3);
  r.Add(0, backing.data(), 4);       // "abcd"
  r.Add(4, backing.data() + 4, 3);   // "efg", right after it in memory
  std::memcpy(r.Reserve(7, 3), "XYZ", 3);
  ASSERT_TRUE(r.Finish().ok());
  ASSERT_EQ(r.iov().size(), 2u);
  EXPECT_EQ(r.iov()[0].iov_len, 7u);
  EXPECT_EQ(Sent(r), "abcdefgXYZ");
}

TEST(ScatterReply, AHoleOrAnOverlapIsCorruption) {
  const std::string b = "0123456789";
  ScatterReply hole;
  hole.Add(0, b.data(), 3);
  hole.Add(4, b.data() + 4, 3);
  Status st = hole.Finish();
  EXPECT_EQ(st.code(), Status::Code::kCorruption);
  EXPECT_NE(st.message().find("hole at byte 3"), std::string::npos) << st.message();
  ScatterReply overlap;
  overlap.Add(0, b.data(), 5);
  overlap.Add(3, b.data(), 2);
  EXPECT_EQ(overlap.Finish().code(), Status::Code::kCorruption);
  ScatterReply empty;
  EXPECT_TRUE(empty.Finish().ok());
  EXPECT_EQ(empty.iov().size(), 0u);
}

// --- the POSIX backend's direct path ---------------------------------------

// statx reports direct I/O alignment for regular files only: a probe file.
bool SupportsDirect(const fs::path& dir) {
  const fs::path probe = dir / "probe";
  std::ofstream(probe) << "x";
  struct statx sx;
  const bool ok = ::statx(AT_FDCWD, probe.c_str(), 0, STATX_DIOALIGN, &sx) == 0 &&
                  (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align > 0 &&
                  sx.stx_dio_offset_align <= 4096;
  fs::remove(probe);
  return ok;
}

// A directory on a filesystem with O_DIRECT: the test temp dir, else
// /var/tmp (where /tmp is tmpfs).
fs::path DiskDir(const std::string& name) {
  for (std::string base : {::testing::TempDir(), std::string("/var/tmp")}) {
    fs::path d = fs::path(base) / (name + "_" + std::to_string(::getpid()));
    fs::create_directories(d);
    if (SupportsDirect(d)) return d;
    fs::remove_all(d);
  }
  ADD_FAILURE() << "no directory with O_DIRECT among the test temp dir and /var/tmp";
  return {};
}

std::string RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string s(n, '\0');
  for (char& ch : s) ch = char(rng());
  return s;
}

// Writes `bytes` to `path`, flushed to disk, with the page cache of
// [drop_from, end) dropped.
void WriteFile(const fs::path& path, const std::string& bytes, uint64_t drop_from) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), ssize_t(bytes.size()));
  ASSERT_EQ(::fsync(fd), 0);
  ASSERT_EQ(::posix_fadvise(fd, off_t(drop_from), 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
}

class DirectPosixTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  fs::path dir_;
};

// A file of odd size, its second half out of the page cache: random ranges
// (unaligned, across the boundary, up to the last byte) read through
// ReadFilled and ReadAtVia equal the bytes written, and both paths ran.
TEST_F(DirectPosixTest, HalfCachedFileReadsExactBytesThroughBothPaths) {
  dir_ = DiskDir("direct_half");
  ASSERT_FALSE(dir_.empty());
  const size_t size = (6 << 20) + 1234;
  const std::string bytes = RandomBytes(size, 1);
  WriteFile(dir_ / "f", bytes, size / 2);
  auto src = PosixSource::OpenRoot(dir_.string());
  ASSERT_TRUE(src.ok());
  auto obj = (*src)->Open("f");
  ASSERT_TRUE(obj.ok());
  DirectIo direct(32 << 20);
  std::mt19937_64 rng(2);
  for (int i = 0; i < 400; ++i) {
    uint64_t len = 1 + rng() % (1 << 20);
    uint64_t off = i == 0 ? size - len : rng() % (size - len + 1);
    if (i % 2 == 0) {
      auto got = (*obj)->ReadFilled(off, len, &direct);
      ASSERT_TRUE(got.ok()) << got.status().message();
      ASSERT_EQ(std::memcmp(got->data, bytes.data() + off, len), 0) << off << "+" << len;
    } else {
      std::string out(len, '\0');
      ASSERT_TRUE((*obj)->ReadAtVia(off, len, out.data(), &direct).ok());
      ASSERT_EQ(out, bytes.substr(off, len)) << off << "+" << len;
    }
  }
  const DirectStats& st = direct.stats();
  EXPECT_GT(st.direct_reads.load(), 0u) << st.Describe();
  EXPECT_GT(st.direct_bytes.load(), 0u) << st.Describe();
  EXPECT_GT(st.cached_bytes.load(), 0u) << st.Describe();
  EXPECT_EQ(st.refused_files.load(), 0u) << st.Describe();
  EXPECT_EQ(direct.pool().in_use(), 0u);
}

// A cold range is read into our buffer only: the page cache of the source
// stays empty (probing with preadv2(RWF_NOWAIT) started the kernel's
// read-ahead of it, reading it twice).
TEST_F(DirectPosixTest, ColdRangeDoesNotEnterThePageCache) {
  dir_ = DiskDir("direct_cold");
  ASSERT_FALSE(dir_.empty());
  const std::string bytes = RandomBytes(8 << 20, 8);
  WriteFile(dir_ / "f", bytes, 0);
  ASSERT_EQ(ResidentPages(dir_ / "f", 0, bytes.size()), 0u);
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  DirectIo direct(16 << 20);
  for (uint64_t off = 0; off < (4 << 20); off += 1 << 20) {
    auto got = (*obj)->ReadFilled(off + 1, (1 << 20) - 1, &direct);
    ASSERT_TRUE(got.ok());
    ASSERT_EQ(std::memcmp(got->data, bytes.data() + off + 1, (1 << 20) - 1), 0);
  }
  EXPECT_EQ(ResidentPages(dir_ / "f", 0, bytes.size()), 0u) << direct.stats().Describe();
  EXPECT_EQ(direct.stats().direct_bytes.load(), 4u * ((1 << 20) - 1));
}

TEST_F(DirectPosixTest, ReadPastTheEndIsCorruption) {
  dir_ = DiskDir("direct_eof");
  ASSERT_FALSE(dir_.empty());
  const std::string bytes = RandomBytes(10000, 4);
  WriteFile(dir_ / "f", bytes, 0);
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  ASSERT_TRUE(obj.ok());
  DirectIo direct(8 << 20);
  auto got = (*obj)->ReadFilled(9000, 2000, &direct);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), Status::Code::kCorruption);
  EXPECT_NE(got.status().message().find("unexpected end of file at byte 10000"), std::string::npos)
      << got.status().message();
  auto tail = (*obj)->ReadFilled(9000, 1000, &direct);  // up to the last byte: fine
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(std::string(tail->data, 1000), bytes.substr(9000));
}

TEST_F(DirectPosixTest, FullPoolReadsThroughThePageCache) {
  dir_ = DiskDir("direct_full");
  ASSERT_FALSE(dir_.empty());
  const std::string bytes = RandomBytes(1 << 20, 5);
  WriteFile(dir_ / "f", bytes, 0);
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  DirectIo direct(0);  // no room for any buffer
  auto got = (*obj)->ReadFilled(100, 500000, &direct);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(std::string(got->data, 500000), bytes.substr(100, 500000));
  EXPECT_EQ(direct.stats().pool_full.load(), 1u);
  EXPECT_EQ(direct.stats().buffered_bytes.load(), 500000u);
  EXPECT_EQ(direct.stats().direct_bytes.load(), 0u);
}

// tmpfs has no O_DIRECT alignment to offer (statx): its files are read
// buffered, detected once per file.
TEST_F(DirectPosixTest, TmpfsFileIsReadBuffered) {
  struct statfs sfs;
  ASSERT_EQ(::statfs("/dev/shm", &sfs), 0);
  ASSERT_EQ(sfs.f_type, TMPFS_MAGIC) << "/dev/shm is not tmpfs here";
  dir_ = fs::path("/dev/shm") / ("direct_tmpfs_" + std::to_string(::getpid()));
  fs::create_directories(dir_);
  const std::string bytes = RandomBytes(300000, 6);
  std::ofstream(dir_ / "f", std::ios::binary) << bytes;
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  DirectIo direct(8 << 20);
  for (uint64_t off : {0ull, 4097ull, 200000ull}) {
    auto got = (*obj)->ReadFilled(off, 99999, &direct);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(std::string(got->data, 99999), bytes.substr(off, 99999));
  }
  EXPECT_EQ(direct.stats().refused_files.load(), 1u);
  EXPECT_EQ(direct.stats().direct_bytes.load(), 0u);
  EXPECT_EQ(direct.stats().buffered_bytes.load(), 3u * 99999u);
}

// --- ReadOnce: a range read once into the caller's aligned memory -----------

// [off, off + len) through ReadOnce into a buffer of RangeBuffers, as
// OrderedFetch lays it out (the range at its offset into an aligned span).
struct OnceRead {
  std::shared_ptr<char[]> buffer;
  const char* data = nullptr;
  Result<uint64_t> direct = uint64_t(0);
};
OnceRead ReadOnceInto(RangeBuffers& buffers, const SourceObject& obj, uint64_t off, uint64_t len) {
  const AlignedSpan span = AlignSpan(off, len);
  OnceRead r;
  r.buffer = buffers.Take(span.length);
  EXPECT_NE(r.buffer, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r.buffer.get()) % kDirectAlign, 0u);
  r.data = r.buffer.get() + span.skip;
  r.direct = obj.ReadOnce(off, len, r.buffer.get() + span.skip);
  return r;
}

// A cold file of odd size. Random ranges, up to the last byte, are read
// with O_DIRECT whole, as ReadOnce reports, and leave none of their pages
// in the page cache. Then, its first half cached, random ranges anywhere
// (across the boundary: the cached prefix through the page cache) equal
// the bytes written.
TEST_F(DirectPosixTest, ReadOnceReadsExactBytesAndLeavesColdPagesOutOfTheCache) {
  dir_ = DiskDir("direct_once");
  ASSERT_FALSE(dir_.empty());
  const size_t size = (6 << 20) + 1234;
  const std::string bytes = RandomBytes(size, 11);
  WriteFile(dir_ / "f", bytes, 0);
  ASSERT_EQ(ResidentPages(dir_ / "f", 0, size), 0u) << "eviction failed";
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  ASSERT_TRUE(obj.ok());
  RangeBuffers buffers(1 << 20);
  std::mt19937_64 rng(12);
  auto check = [&](uint64_t off, uint64_t len) -> uint64_t {
    OnceRead r = ReadOnceInto(buffers, **obj, off, len);
    EXPECT_TRUE(r.direct.ok()) << r.direct.status().message();
    if (!r.direct.ok()) return 0;
    EXPECT_EQ(std::memcmp(r.data, bytes.data() + off, len), 0) << off << "+" << len;
    EXPECT_LE(*r.direct, len);
    return *r.direct;
  };
  for (int i = 0; i < 100; ++i) {
    const uint64_t len = 1 + rng() % (1 << 20);
    const uint64_t off = i == 0 ? size - len : rng() % (size - len + 1);
    ASSERT_EQ(check(off, len), len) << "a cold range read through the page cache: " << off;
  }
  EXPECT_EQ(ResidentPages(dir_ / "f", 0, size), 0u);
  std::string half(size / 2, '\0');
  ASSERT_TRUE((*obj)->ReadAt(0, half.size(), half.data()).ok());
  // The kernel's read-ahead may have brought in part of the second half
  // too, as much as it likes: drop it, so that the second half is cold.
  const int fd = ::open((dir_ / "f").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::posix_fadvise(fd, off_t(half.size() + 4096), 0, POSIX_FADV_DONTNEED), 0);
  ::close(fd);
  uint64_t direct = 0;
  for (int i = 0; i < 200; ++i) {
    const uint64_t len = 1 + rng() % (1 << 20);
    direct += check(rng() % (size - len + 1), len);
  }
  EXPECT_GT(direct, 0u);
}

// Once a file's ranges are read with O_DIRECT, the kernel reads no more of
// it ahead: a buffered read of its first 64 KiB caches those pages only,
// where the same read of a file not yet read so caches more (the kernel's
// initial read-ahead at offset 0; checked here, or this test could not
// tell). Read-ahead racing the direct reads would cache ranges the fetch
// holds in memory already (docs/BENCHMARKS.md, "A racing read-ahead").
TEST_F(DirectPosixTest, ReadOnceTurnsOffTheKernelsReadAheadOfTheFile) {
  dir_ = DiskDir("direct_once_ra");
  ASSERT_FALSE(dir_.empty());
  const size_t size = 16 << 20, head = 64 << 10;
  const uint64_t head_pages = head / uint64_t(::sysconf(_SC_PAGESIZE));
  const std::string bytes = RandomBytes(size, 15);
  WriteFile(dir_ / "plain", bytes, 0);
  WriteFile(dir_ / "once", bytes, 0);
  ASSERT_EQ(ResidentPages(dir_ / "plain", 0, size) + ResidentPages(dir_ / "once", 0, size), 0u) << "eviction failed";
  auto source = *PosixSource::OpenRoot(dir_.string());
  auto plain = source->Open("plain");
  auto once = source->Open("once");
  ASSERT_TRUE(plain.ok() && once.ok());
  std::string got(head, '\0');
  ASSERT_TRUE((*plain)->ReadAt(0, head, got.data()).ok());
  ASSERT_GT(ResidentPages(dir_ / "plain", 0, size), head_pages) << "the kernel read nothing ahead here";
  RangeBuffers buffers(1 << 20);
  OnceRead r = ReadOnceInto(buffers, **once, 8 << 20, 1 << 20);
  ASSERT_TRUE(r.direct.ok()) << r.direct.status().message();
  ASSERT_EQ(*r.direct, uint64_t(1 << 20));
  ASSERT_TRUE((*once)->ReadAt(0, head, got.data()).ok());
  EXPECT_EQ(got, bytes.substr(0, head));
  EXPECT_EQ(ResidentPages(dir_ / "once", 0, size), head_pages);
}

TEST_F(DirectPosixTest, ReadOncePastTheEndIsCorruption) {
  dir_ = DiskDir("direct_once_eof");
  ASSERT_FALSE(dir_.empty());
  const std::string bytes = RandomBytes(10000, 13);
  WriteFile(dir_ / "f", bytes, 0);
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  RangeBuffers buffers(8192);
  OnceRead past = ReadOnceInto(buffers, **obj, 9000, 2000);
  ASSERT_FALSE(past.direct.ok());
  EXPECT_EQ(past.direct.status().code(), Status::Code::kCorruption);
  EXPECT_NE(past.direct.status().message().find("unexpected end of file"), std::string::npos)
      << past.direct.status().message();
  OnceRead tail = ReadOnceInto(buffers, **obj, 9000, 1000);  // up to the last byte: fine
  ASSERT_TRUE(tail.direct.ok());
  EXPECT_EQ(std::string(tail.data, 1000), bytes.substr(9000));
}

TEST_F(DirectPosixTest, ReadOnceOfATmpfsFileIsBuffered) {
  dir_ = fs::path("/dev/shm") / ("direct_once_tmpfs_" + std::to_string(::getpid()));
  fs::create_directories(dir_);
  const std::string bytes = RandomBytes(300000, 14);
  std::ofstream(dir_ / "f", std::ios::binary) << bytes;
  auto obj = (*PosixSource::OpenRoot(dir_.string()))->Open("f");
  RangeBuffers buffers(1 << 20);
  OnceRead r = ReadOnceInto(buffers, **obj, 4097, 250000);
  ASSERT_TRUE(r.direct.ok());
  EXPECT_EQ(*r.direct, 0u);
  EXPECT_EQ(std::string(r.data, 250000), bytes.substr(4097, 250000));
}

// --- RangeBuffers ---------------------------------------------------------------

// A freed buffer of the usual size serves the next take (no new mapping, no
// page faults); a take of more than half the usual size gets one of the
// usual size, a small or a larger one its own, not kept; at most kKeepIdle
// wait.
TEST(RangeBuffers, UsualSizeIsRecycledUpToTheIdleBound) {
  RangeBuffers buffers(64 << 10);
  char* first;
  {
    auto a = buffers.Take(64 << 10);
    ASSERT_NE(a, nullptr);
    first = a.get();
    std::memset(a.get(), 7, 64 << 10);
  }
  EXPECT_EQ(buffers.idle(), 1u);
  auto b = buffers.Take(64 << 10);
  EXPECT_EQ(b.get(), first);
  EXPECT_EQ(buffers.idle(), 0u);
  { auto larger = buffers.Take(128 << 10); ASSERT_NE(larger, nullptr); }
  EXPECT_EQ(buffers.idle(), 0u) << "a buffer of another size was kept";
  char* part;
  {
    auto most = buffers.Take(40 << 10);  // a range filling most of its window
    ASSERT_NE(most, nullptr);
    part = most.get();
    std::memset(most.get(), 7, 64 << 10);  // all of the usual size is there
  }
  EXPECT_EQ(buffers.idle(), 1u) << "a range of most of the usual size had its buffer not kept";
  EXPECT_EQ(buffers.Take(64 << 10).get(), part);
  ASSERT_EQ(buffers.idle(), 1u);
  {
    // A small range (a few KiB between other items) gets a mapping of its
    // own size, not a recycled buffer touched whole: held, it costs its size.
    auto small = buffers.Take(12288);
    ASSERT_NE(small, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(small.get()) % kDirectAlign, 0u);
    std::memset(small.get(), 7, 12288);
  }
  EXPECT_EQ(buffers.idle(), 1u) << "a small range's own mapping was kept as one of the usual size";
  std::vector<std::shared_ptr<char[]>> many;
  for (size_t i = 0; i < RangeBuffers::kKeepIdle + 3; ++i) many.push_back(buffers.Take(64 << 10));
  std::set<char*> distinct;
  for (auto& m : many) {
    ASSERT_NE(m, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(m.get()) % kDirectAlign, 0u);
    distinct.insert(m.get());
  }
  EXPECT_EQ(distinct.size(), many.size()) << "one buffer handed out twice";
  many.clear();
  EXPECT_EQ(buffers.idle(), RangeBuffers::kKeepIdle);
}

// A shelf for many fetch threads keeps more while they run; Trim leaves
// kKeepIdle for the time between loads, and no shelf keeps fewer.
TEST(RangeBuffers, ALargerShelfIsTrimmedWhenTheFetchEnds) {
  const size_t keep = RangeBuffers::kKeepIdle * 2 + 3;
  RangeBuffers buffers(64 << 10, keep);
  std::vector<std::shared_ptr<char[]>> many;
  for (size_t i = 0; i < keep + 4; ++i) many.push_back(buffers.Take(64 << 10));
  std::set<char*> first;
  for (auto& m : many) first.insert(m.get());
  many.clear();
  EXPECT_EQ(buffers.idle(), keep);
  // The next takes are the kept buffers, not new mappings.
  for (size_t i = 0; i < keep; ++i) many.push_back(buffers.Take(64 << 10));
  for (auto& m : many) EXPECT_TRUE(first.count(m.get())) << "a kept buffer was not reused";
  many.clear();
  buffers.Trim();
  EXPECT_EQ(buffers.idle(), RangeBuffers::kKeepIdle);
  RangeBuffers small(64 << 10, 2);
  for (size_t i = 0; i < RangeBuffers::kKeepIdle + 2; ++i) many.push_back(small.Take(64 << 10));
  many.clear();
  EXPECT_EQ(small.idle(), RangeBuffers::kKeepIdle);
}

// The VmFlags line of /proc/self/smaps for the mapping holding `p`.
std::string VmFlagsOf(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo, hi;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find('-'))
      inside = lo <= at && at < hi;
    else if (inside && line.rfind("VmFlags:", 0) == 0)
      return line;
  }
  return "";
}

// A range buffer of 2 MiB or more asks for transparent huge pages ("hg" in
// its VmFlags), so that a fresh one faults 2 MiB at a time; a small one
// (a mount's ranges of less than 2 MiB) does not.
TEST(RangeBuffers, LargeBuffersAskForHugePages) {
  RangeBuffers buffers(8 << 20), smaller(64 << 10);
  auto large = buffers.Take(8 << 20);
  auto small = smaller.Take(64 << 10);
  ASSERT_NE(large, nullptr);
  ASSERT_NE(small, nullptr);
  const std::string large_flags = VmFlagsOf(large.get()), small_flags = VmFlagsOf(small.get());
  ASSERT_FALSE(large_flags.empty()) << "no mapping in /proc/self/smaps holds the buffer";
  EXPECT_NE(large_flags.find(" hg"), std::string::npos) << large_flags;
  EXPECT_EQ(small_flags.find(" hg"), std::string::npos) << small_flags;
}

// The copies a reader holds may outlive the mount's buffers.
TEST(RangeBuffers, ABufferMayOutliveItsRangeBuffers) {
  std::shared_ptr<char[]> kept;
  {
    RangeBuffers buffers(8192);
    kept = buffers.Take(8192);
    ASSERT_NE(kept, nullptr);
  }
  std::memset(kept.get(), 1, 8192);
  EXPECT_EQ(kept[8191], 1);
  kept.reset();  // unmapped, not put back on a shelf that is gone
}

}  // namespace
}  // namespace ckptfs
