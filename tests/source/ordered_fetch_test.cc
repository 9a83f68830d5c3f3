// Source-order fetch of whole virtual files (source/ordered_fetch.h): every
// source byte fetched once whatever the order of the requests, bytes equal
// to those written to the sources, memory within the bound, a changed source
// read as Stale, and one-tensor files left alone.
#include "source/ordered_fetch.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <mutex>
#include <map>
#include <chrono>

#include "core/layout.h"
#include "source/posix_source.h"
#include "source/source_reader.h"
#include "tests/source/page_cache_probe.h"
#include "tests/source/u8_tensor.h"
#include "tests/temp_dirs.h"

namespace ckptfs {
namespace {

constexpr uint64_t kKiB = 1 << 10;

TEST(IntervalSet, AddMergesAndRemoveCounts) {
  IntervalSet s;
  s.Add(10, 20);
  s.Add(30, 40);
  s.Add(20, 30);  // touching: one span
  EXPECT_EQ(s.spans().size(), 1u);
  EXPECT_EQ(s.Bytes(0, 100), 30u);
  EXPECT_EQ(s.Remove(15, 35), 20u);
  EXPECT_EQ(s.Bytes(0, 100), 10u);
  EXPECT_EQ(s.Remove(15, 35), 0u);  // already gone
  EXPECT_EQ(s.Remove(0, 100), 10u);
  EXPECT_TRUE(s.empty());
}

// `count` u8 tensors of `each` bytes, one file per tensor pair: tensor i in
// file i / 2 at offset (i % 2) * each, laid out in reverse of the files'
// order after a header literal (a consumer order that is not the sources').
struct Files {
  std::filesystem::path dir;
  std::vector<SourceFile> files;
  std::shared_ptr<Layout> layout = std::make_shared<Layout>();
  std::string expected;
};

// Writes source file `name` of `t` with `contents`.
void AddFile(Files& t, const std::string& name, const std::string& contents) {
  std::ofstream(t.dir / name, std::ios::binary) << contents;
  SourceFile sf = *StatSource((t.dir / name).string());
  sf.path = name;
  t.files.push_back(sf);
}

// Lays out u8 tensor `fqn`, bytes [offset, offset + length) of source
// `file`, whose contents are `contents`.
void AddTensor(Files& t, const std::string& fqn, FileId file, uint64_t offset, uint64_t length,
               const std::string& contents) {
  auto tensor = U8Tensor(fqn, file, offset, length);
  EXPECT_TRUE(t.layout->AddTensor(tensor, Box::Whole(tensor->shape)).ok());
  t.expected += contents.substr(offset, length);
}

Files MakeFiles(int count, uint64_t each) {
  Files t;
  t.dir = TempDirs::Make("ckptfs-ordered");
  std::vector<std::string> contents((count + 1) / 2);
  for (int i = 0; i < count; ++i)
    for (uint64_t b = 0; b < each; ++b) contents[i / 2] += char((b * 131 + i * 7) % 251);
  for (size_t f = 0; f < contents.size(); ++f) AddFile(t, "f" + std::to_string(f), contents[f]);
  t.layout->AddLiteral(std::string(100, 'h'));
  t.expected = std::string(100, 'h');
  for (int i = count - 1; i >= 0; --i)
    AddTensor(t, "t" + std::to_string(i), FileId(i / 2), (i % 2) * each, each, contents[i / 2]);
  return t;
}

struct Reader {
  std::shared_ptr<FetchBudget> budget;
  std::unique_ptr<SourceReader> reader;
  Reader(const Files& t, uint64_t bound, uint64_t range, bool direct = false) {
    ReadOptions o;
    o.hold_direct = direct;
    o.readahead_bytes = 0;
    budget = std::make_shared<FetchBudget>(bound, range);
    o.hold = budget;
    o.hold_range_bytes = range;
    o.hold_threads = 3;
    reader = std::make_unique<SourceReader>(t.dir.string(), &t.files, GroupPolicy{}, 1ull << 30, o);
  }
};

// Waits (up to 5 s) until the plan's fetch threads have fetched `bytes` in source order.
void WaitForTheFetch(SourceReader& r, uint64_t bytes) {
  for (int i = 0; i < 500 && r.counters().ordered.load() < bytes; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
}

// Reads [offset, offset + len) as OpenFiles does: the ordinary path until
// the plan started, then through it.
Status ReadVia(SourceReader& r, OrderedFetch& f, const Layout& layout, uint64_t offset, uint64_t len, char* dst) {
  auto plan = Plan(layout, offset, len);
  if (!plan.ok()) return plan.status();
  return f.Noted(offset, plan->length) ? f.Serve(*plan, dst) : r.Execute(*plan, dst);
}

// ReadVia, planned again while it answers PlanAgain (as OpenFiles::Read does).
Status ReadAgainVia(SourceReader& r, OrderedFetch& f, const Layout& layout, uint64_t offset, uint64_t len,
                    char* dst) {
  Status st = ReadVia(r, f, layout, offset, len, dst);
  for (int again = 0; st.code() == Status::Code::kPlanAgain && again < 4; ++again)
    st = ReadVia(r, f, layout, offset, len, dst);
  return st;
}

// The kernel's side of a push: pages handed to the sink are in the page
// cache, so a reader's pass asks the daemon only for the others.
struct PageCache {
  std::mutex mu;
  std::map<uint64_t, std::string> pages;  // offset -> bytes pushed there
  uint64_t from_file = 0, from_memory = 0;  // bytes pushed with a pinned file's descriptor, and without
  PageSink Sink() {
    return [this](uint64_t offset, const PageBytes& b) {
      // A pinned file's bytes are taken from the file, as the mount splices them.
      std::string bytes(b.len, '\0');
      if (b.fd >= 0) EXPECT_EQ(::pread(b.fd, bytes.data(), b.len, off_t(b.fd_offset)), ssize_t(b.len));
      else bytes.assign(b.data, b.len);
      EXPECT_TRUE(std::memcmp(bytes.data(), b.data, b.len) == 0) << "the file's bytes differ from memory's";
      std::lock_guard<std::mutex> lock(mu);
      (b.fd >= 0 ? from_file : from_memory) += b.len;
      pages[offset] = std::move(bytes);
    };
  }
  // Reads the whole file into `got`: cached pages from the cache, the rest
  // through ReadVia in requests of at most 64 KiB.
  Status Pass(SourceReader& r, OrderedFetch& f, const Layout& layout, std::string& got) {
    std::map<uint64_t, std::string> cached;
    {
      std::lock_guard<std::mutex> lock(mu);
      cached = pages;
    }
    uint64_t pos = 0;
    auto ask = [&](uint64_t end) -> Status {
      for (; pos < end;) {
        const uint64_t n = std::min<uint64_t>(64 * kKiB, end - pos);
        RETURN_IF_ERROR(ReadAgainVia(r, f, layout, pos, n, got.data() + pos));
        pos += n;
      }
      return Status::OK();
    };
    for (const auto& [offset, data] : cached) {
      if (offset < pos) continue;
      RETURN_IF_ERROR(ask(offset));
      got.replace(offset, data.size(), data);
      pos = offset + data.size();
    }
    return ask(layout.size());
  }
};

// A pinned range is a mapping of its file, read in on first touch. Its
// pages past the end of the file stand here for pages the disk cannot
// read: touched, they would end the process (SIGBUS). Read in first, they
// are an error, and a Keep over them keeps nothing.
TEST(HeldBytes, AMappingsUnreadablePagesAreAnErrorNotACrash) {
  const auto dir = TempDirs::ForThisTest("held_mapped");
  const long page = ::sysconf(_SC_PAGESIZE);
  const int fd = ::open((dir / "f").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_EQ(::ftruncate(fd, page), 0);  // one page of zeros; the mapping has three
  void* map = ::mmap(nullptr, 3 * page, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  ::close(fd);
  std::shared_ptr<char[]> bytes(static_cast<char*>(map), [page](char* p) { ::munmap(p, 3 * page); });
  HeldBytes held(bytes, 0, 3 * page, 0, /*mapped=*/true);
  std::vector<HeldBytes::Copy> copies;
  std::vector<std::pair<uint64_t, uint64_t>> missing;
  held.Take(100, 2 * page, 0, &copies, &missing);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_TRUE(copies[0].mapped);
  EXPECT_TRUE(HeldBytes::ReadIn(copies[0].from, page - 100).ok());  // the file's page
  EXPECT_EQ(HeldBytes::ReadIn(copies[0].from, copies[0].length).code(), Status::Code::kIOError);
  IntervalSet past_the_end;
  past_the_end.Add(page + 10, page + 20);
  EXPECT_FALSE(held.Keep(past_the_end));
  EXPECT_EQ(held.size(), uint64_t(3 * page));  // all still held
  IntervalSet inside;
  inside.Add(10, 20);
  ASSERT_TRUE(held.Keep(inside));
  copies.clear();
  held.Take(10, 10, 0, &copies, &missing);
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_FALSE(copies[0].mapped);  // kept in memory of its own
}

TEST(HeldBytes, CompactedKeepsItsSpansAndReportsTheRestMissing) {
  std::shared_ptr<char[]> bytes(new char[1000]);
  for (int i = 0; i < 1000; ++i) bytes[i] = char(i % 251);
  HeldBytes held(bytes, 5000, 1000);  // source bytes [5000, 6000)
  IntervalSet keep;
  keep.Add(5010, 5020);
  keep.Add(5900, 5950);
  IntervalSet most;
  most.Add(5000, 5600);
  EXPECT_FALSE(HeldBytes(bytes, 5000, 1000).Compact(most));  // frees less than half
  ASSERT_TRUE(held.Compact(keep));
  EXPECT_EQ(held.size(), 60u);
  bytes.reset();  // the compacted copy owns its bytes
  std::vector<HeldBytes::Copy> copies;
  std::vector<std::pair<uint64_t, uint64_t>> missing;
  held.Take(5005, 940, 100, &copies, &missing);  // [5005, 5945) into dst 100
  ASSERT_EQ(copies.size(), 2u);
  EXPECT_EQ(copies[0].dst, 105u);
  EXPECT_EQ(copies[0].length, 10u);
  EXPECT_EQ(copies[1].dst, 995u);
  EXPECT_EQ(copies[1].length, 45u);
  for (const auto& c : copies)
    for (uint64_t k = 0; k < c.length; ++k) EXPECT_EQ(c.from[k], char((c.dst - 100 + 5 + k) % 251));
  const std::vector<std::pair<uint64_t, uint64_t>> want = {{5005, 5}, {5020, 880}};
  EXPECT_EQ(missing, want);
}

TEST(ServedRecord, ClearedOnlyOnceMuchWasAskedAgain) {
  ServedRecord r;
  EXPECT_EQ(r.Add(0, 8 << 20), 0u);
  EXPECT_EQ(r.Add(4096, 8192), 8192u);  // a page or two asked again: kept
  EXPECT_EQ(r.Get().Bytes(0, 8 << 20), uint64_t(8 << 20));
  for (uint64_t at = 0; at < ServedRecord::kClearAfter; at += 1 << 20) r.Add(at, 1 << 20);
  // The kernel dropped the pages: only what was asked since the clear is left.
  EXPECT_LT(r.Get().Bytes(0, 8 << 20), uint64_t(8 << 20));
}

TEST(ServedRecord, PushedPagesAreNotAskedAgain) {
  // The fetch pushes pages a reader's request served a moment before: the
  // kernel did not ask for them twice, and the record stays whole.
  ServedRecord r;
  r.Add(0, 1 << 20);
  for (int i = 0; i < 8; ++i) r.AddPushed(0, 8 << 20);
  EXPECT_EQ(r.Get().Bytes(0, 8 << 20), uint64_t(8 << 20));
  EXPECT_EQ(r.Add(8 << 20, 4096), 0u);
}

TEST(ServedRecord, RestartKeepsWhatTheRunOfRequestsThatAskedAgainAsked) {
  ServedRecord r;
  r.Add(0, 8 << 20);
  r.Add(4096, 8192);        // a page or two asked again...
  r.Add(9 << 20, 4096);     // ...then new bytes: the run is over
  r.Add(1 << 20, 1 << 20);  // a run: the kernel dropped the pages
  r.AddPushed(12 << 20, 4096);
  r.Add(2 << 20, 1 << 20);
  r.Restart();
  EXPECT_EQ(r.Get().Bytes(0, 32 << 20), uint64_t(2 << 20) + 4096);
  EXPECT_EQ(r.Get().Bytes(1 << 20, 3 << 20), uint64_t(2 << 20));
  EXPECT_EQ(r.Add(0, 16384), 0u);
  r.Restart();  // no run on: nothing forgotten
  EXPECT_EQ(r.Get().Bytes(0, 32 << 20), uint64_t(2 << 20) + 4096 + 16384);
}

TEST(OrderedFetch, ColdPassAfterTheKernelDroppedThePagesIsPlannedAgain) {
  Files t = MakeFiles(8, 300 * kKiB);
  const uint64_t sources = 8 * 300 * kKiB;
  Reader r(t, 64ull << 20, 256 * kKiB);
  auto record = std::make_shared<ServedRecord>();
  std::string got(t.layout->size(), '\0');
  auto pass = [&](OrderedFetch& f) {
    for (uint64_t o = 0; o < t.layout->size(); o += 64 * kKiB)
      ASSERT_TRUE(ReadVia(*r.reader, f, *t.layout, o, 64 * kKiB, got.data() + o).ok());
  };
  auto first = r.reader->MakeOrderedFetch(t.layout, record);
  pass(*first);
  first.reset();
  ASSERT_EQ(r.reader->counters().fetched.load(), sources);
  const uint64_t ordered = r.reader->counters().ordered.load();
  // The same file opened again, every page asked again (the record says
  // all were served): the plan covers the file again, each byte once.
  got.assign(t.layout->size(), '\0');
  auto second = r.reader->MakeOrderedFetch(t.layout, record);
  pass(*second);
  EXPECT_TRUE(second->started());
  EXPECT_TRUE(got == t.expected);
  EXPECT_EQ(r.reader->counters().fetched.load(), 2 * sources);
  EXPECT_GE(r.reader->counters().ordered.load() - ordered, sources / 2);
  EXPECT_GE(second->range_spans().size(), 1u);
}

TEST(OrderedFetch, PlanLeavesOutWhatTheKernelStillHas) {
  // A handle whose first requests include bytes never served: the kernel
  // still has the rest (the record is right), which the plan leaves out.
  Files t = MakeFiles(8, 300 * kKiB);
  Reader r(t, 64ull << 20, 256 * kKiB);
  auto record = std::make_shared<ServedRecord>();
  const uint64_t half = t.layout->size() / 2;
  record->Add(0, half);
  auto f = r.reader->MakeOrderedFetch(t.layout, record);
  std::string got(t.layout->size(), '\0');
  for (uint64_t o = half; o < t.layout->size(); o += 64 * kKiB) {
    const uint64_t n = std::min<uint64_t>(64 * kKiB, t.layout->size() - o);
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, o, n, got.data() + o).ok());
  }
  EXPECT_TRUE(f->started());
  EXPECT_TRUE(got.substr(half) == t.expected.substr(half));
  // Nothing of the first half was fetched: its sources are the kernel's.
  EXPECT_LE(r.reader->counters().fetched.load(), t.layout->size() - half + 2 * 256 * kKiB);
}

TEST(OrderedFetch, EachSourceByteOnceInAnyOrder) {
  for (const char* order : {"forward", "reverse", "random"}) {
    SCOPED_TRACE(order);
    Files t = MakeFiles(8, 300 * kKiB);
    Reader r(t, 64ull << 20, 256 * kKiB);
    auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
    ASSERT_TRUE(f);
    // 64 KiB requests, in the order asked.
    std::vector<uint64_t> at;
    for (uint64_t o = 0; o < t.layout->size(); o += 64 * kKiB) at.push_back(o);
    if (std::string(order) == "reverse") std::reverse(at.begin(), at.end());
    if (std::string(order) == "random") std::shuffle(at.begin(), at.end(), std::mt19937(7));
    std::string got(t.layout->size(), '\0');
    for (uint64_t o : at) ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, o, 64 * kKiB, got.data() + o).ok());
    EXPECT_TRUE(f->started());
    EXPECT_TRUE(got == t.expected);
    const uint64_t sources = 8 * 300 * kKiB;
    EXPECT_EQ(r.reader->counters().fetched.load(), sources);  // every byte once, no more
    EXPECT_EQ(r.reader->counters().refetched.load(), 0u);
    EXPECT_EQ(r.reader->counters().direct.load(), 0u);  // not asked for
    f.reset();
    EXPECT_EQ(r.budget->held(), 0u);
    EXPECT_LE(r.budget->peak(), 64ull << 20);
    EXPECT_LE(r.budget->buffers().idle(), RangeBuffers::kKeepIdle);  // trimmed for the time between loads
  }
}

// Tensors at `spans` (offset, length) of one file of `size` bytes, laid out
// in the spans' order after a header literal.
Files OneFile(uint64_t size, const std::vector<std::pair<uint64_t, uint64_t>>& spans) {
  Files t;
  t.dir = TempDirs::Make("ckptfs-ordered");
  std::string contents;
  for (uint64_t b = 0; b < size; ++b) contents += char((b * 131) % 251);
  AddFile(t, "f0", contents);
  t.layout->AddLiteral(std::string(100, 'h'));
  t.expected = std::string(100, 'h');
  for (size_t i = 0; i < spans.size(); ++i)
    AddTensor(t, "t" + std::to_string(i), FileId(0), spans[i].first, spans[i].second, contents);
  return t;
}

TEST(OrderedFetch, RangesStayInsideTheSourcesPartWindows) {
  // Tensors that start off any window boundary, the second after a gap
  // too large to read across: each range must still lie inside one window
  // of range_bytes of its file (offsets 0, W, 2W ...), where an object
  // store keeps an upload part, so that no part is read for two GETs.
  const uint64_t w = 256 * kKiB;
  const std::pair<uint64_t, uint64_t> a{101400, 600 * kKiB}, b{a.first + a.second + 200 * kKiB, 500 * kKiB};
  Files t = OneFile(2048 * kKiB, {a, b});
  Reader r(t, 64ull << 20, w);
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  ASSERT_TRUE(f);
  std::string got(t.layout->size(), '\0');
  // The last 64 KiB of each tensor start the plan, which leaves them out;
  // then the whole file in order.
  const uint64_t end_b = t.layout->size() - 64 * kKiB, end_a = 100 + a.second - 64 * kKiB;
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, end_b, 64 * kKiB, got.data() + end_b).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, end_a, 64 * kKiB, got.data() + end_a).ok());
  ASSERT_TRUE(f->started());
  for (uint64_t o = 0; o < t.layout->size(); o += 64 * kKiB) {
    const uint64_t n = std::min<uint64_t>(64 * kKiB, t.layout->size() - o);
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, o, n, got.data() + o).ok());
  }
  EXPECT_TRUE(got == t.expected);
  EXPECT_EQ(r.reader->counters().refetched.load(), 0u);
  const auto spans = f->range_spans();
  for (const auto& [offset, length] : spans)
    EXPECT_EQ(offset / w, (offset + length - 1) / w) << "range at " << offset << " of " << length << " bytes";
  // One range per window each tensor touches (the bytes left out do not
  // change which): the first spans windows 0..2, the second 3..5.
  auto windows = [w](std::pair<uint64_t, uint64_t> s) { return (s.first + s.second - 1) / w - s.first / w + 1; };
  EXPECT_EQ(spans.size(), windows(a) + windows(b));
}

TEST(OrderedFetch, BoundSmallerThanTheFileStaysExact) {
  Files t = MakeFiles(8, 300 * kKiB);
  Reader r(t, 512 * kKiB, 256 * kKiB);  // two ranges at most
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  std::string got(t.layout->size(), '\0');
  for (uint64_t o = t.layout->size(); o > 0;) {  // reverse: the fetch threads' order is the opposite
    const uint64_t len = std::min<uint64_t>(o, 48 * kKiB);
    o -= len;
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, o, len, got.data() + o).ok());
    ASSERT_LE(r.budget->held(), 512 * kKiB);
  }
  EXPECT_TRUE(got == t.expected);
  EXPECT_LE(r.budget->peak(), 512 * kKiB);
}

TEST(OrderedFetch, ChangedSourceIsStaleNotHeldBytes) {
  Files t = MakeFiles(4, 200 * kKiB);
  Reader r(t, 64ull << 20, 1 << 20);
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  std::string got(t.layout->size(), '\0');
  // Two tensors begun: the plan starts, and its ranges are fetched.
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data()).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 200 * kKiB, 4 * kKiB, got.data()).ok());
  ASSERT_TRUE(f->started());
  // Rewritten in place, size kept, mtime moved on: the held bytes are the old ones.
  std::filesystem::path p = t.dir / "f0";
  {
    std::fstream out(p, std::ios::in | std::ios::out | std::ios::binary);
    out.write(std::string(400 * kKiB, 'X').data(), 400 * kKiB);
  }
  std::filesystem::last_write_time(p, std::filesystem::last_write_time(p) + std::chrono::seconds(5));
  // The last tensor (t0, file f0) is at the end of the virtual file.
  const uint64_t last = t.layout->size() - 200 * kKiB;
  Status st = ReadVia(*r.reader, *f, *t.layout, last, 64 * kKiB, got.data() + last);
  EXPECT_EQ(st.code(), Status::Code::kStale) << st.message();
}

// A request that found the plan not started, then lost the race to another
// request that started it, is told so by Noted: its bytes are in the plan,
// and read the ordinary way they would be fetched twice.
TEST(OrderedFetch, RequestRacingTheStartIsServedByThePlan) {
  Files t = MakeFiles(4, 200 * kKiB);
  Reader r(t, 64ull << 20, 1 << 20);
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  std::string got(t.layout->size(), '\0');
  const uint64_t size = t.layout->size();
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 0, 100, got.data()).ok());  // the header
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 200 * kKiB, got.data() + 100).ok());  // the first tensor
  // Request C (the third tensor) looked before D (the second) started the plan.
  auto c_plan = Plan(*t.layout, 100 + 400 * kKiB, 200 * kKiB);
  ASSERT_TRUE(c_plan.ok());
  ASSERT_FALSE(f->started());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 200 * kKiB, 200 * kKiB, got.data() + 100 + 200 * kKiB).ok());
  ASSERT_TRUE(f->started());
  ASSERT_TRUE(f->Noted(100 + 400 * kKiB, c_plan->length));
  ASSERT_TRUE(f->Serve(*c_plan, got.data() + 100 + 400 * kKiB).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 600 * kKiB, size - 100 - 600 * kKiB,
                      got.data() + 100 + 600 * kKiB).ok());
  EXPECT_TRUE(got == t.expected);
  EXPECT_EQ(r.reader->counters().fetched.load(), 4 * 200 * kKiB);
}

// With a sink, each fetched range's whole pages go to it at once, equal to
// the file's bytes there; the requests that follow need only the pages
// across range boundaries, and nothing is fetched twice.
TEST(OrderedFetch, FetchedPagesArePushedAsTheFilesBytes) {
  Files t = MakeFiles(8, 300 * kKiB);  // a 100-byte header: no tensor starts on a page
  Reader r(t, 64ull << 20, 256 * kKiB);
  PageCache cache;
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr, cache.Sink());
  std::string got(t.layout->size(), '\0');
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data() + 100).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 300 * kKiB, 4 * kKiB, got.data() + 100 + 300 * kKiB).ok());
  ASSERT_TRUE(f->started());
  const uint64_t sources = 8 * 300 * kKiB;
  WaitForTheFetch(*r.reader, sources - 8 * kKiB);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the last range's push
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    for (const auto& [offset, data] : cache.pages) {
      EXPECT_EQ(offset % 4096, 0u);
      EXPECT_TRUE(data == t.expected.substr(offset, data.size())) << offset;
      bytes += data.size();
    }
  }
  EXPECT_GE(bytes, sources - 8 * 2 * 4096 - 8 * kKiB);  // all but each tensor's two edge pages and the reads
  // A pass of the consumer asks for the pages not pushed; the kernel keeps
  // the two first requests' 8 KiB too, but this pass asks for them again,
  // and they were never planned: every other byte once.
  ASSERT_TRUE(cache.Pass(*r.reader, *f, *t.layout, got).ok());
  EXPECT_TRUE(got == t.expected);
  EXPECT_EQ(r.reader->counters().fetched.load(), sources + 8 * kKiB);
  EXPECT_EQ(r.reader->counters().refetched.load(), 0u);
}

// Local sources are pinned (SourceObject::Pin), and their pages pushed
// straight from the pin: no range is read into a buffer of the daemon's,
// by a fetch thread or by a reader. A source someone holds open for
// writing cannot be pinned: its ranges are read as before, and exact.
TEST(OrderedFetch, LocalRangesArePushedFromPinnedPagesUnlessAWriterHoldsTheFile) {
  for (bool writer : {false, true}) {
    SCOPED_TRACE(writer ? "f3 open for writing" : "no writer");
    Files t = MakeFiles(8, 300 * kKiB);
    const int held = writer ? ::open((t.dir / "f3").c_str(), O_WRONLY) : -1;
    Reader r(t, 64ull << 20, 256 * kKiB);
    PageCache cache;
    auto f = r.reader->MakeOrderedFetch(t.layout, nullptr, cache.Sink());
    std::string got(t.layout->size(), '\0');
    // f3 holds the first two tensors of the layout (its reverse): they start the plan.
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data() + 100).ok());
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 300 * kKiB, 4 * kKiB, got.data() + 100 + 300 * kKiB).ok());
    const uint64_t sources = 8 * 300 * kKiB;
    WaitForTheFetch(*r.reader, sources - 8 * kKiB);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the last range's push
    const uint64_t pinned = r.reader->counters().pinned.load(), ordered = r.reader->counters().ordered.load();
    uint64_t from_file, from_memory;
    {
      std::lock_guard<std::mutex> lock(cache.mu);
      from_file = cache.from_file;
      from_memory = cache.from_memory;
      for (const auto& [offset, data] : cache.pages)
        EXPECT_TRUE(data == t.expected.substr(offset, data.size())) << offset;
    }
    if (writer) {
      EXPECT_EQ(pinned, ordered - (2 * 300 * kKiB - 8 * kKiB));  // all but f3's, less the two reads
      EXPECT_GT(r.budget->buffers().idle(), 0u);                 // f3's ranges were read into buffers
      EXPECT_GT(from_memory, 0u);                                // and pushed from them
    } else {
      EXPECT_EQ(pinned, ordered);
      EXPECT_EQ(r.budget->buffers().idle(), 0u);  // no range buffer was ever taken
      EXPECT_EQ(from_memory, 0u);                 // every page pushed names its pinned file
    }
    EXPECT_GE(from_file, pinned - 8 * 2 * 2 * 4096);  // all but the pages shared at tensor edges
    ASSERT_TRUE(cache.Pass(*r.reader, *f, *t.layout, got).ok());
    EXPECT_TRUE(got == t.expected);
    EXPECT_EQ(r.reader->counters().fetched.load(), sources + 8 * kKiB);
    if (held >= 0) ::close(held);
  }
}

TEST(OrderedFetch, PushedRangesKeepOnlyThePagesTheyShare) {
  // No tensor starts on a page, and 256 KiB ranges cut tensors off page
  // boundaries: nearly every range shares a page with another. Held whole
  // until the consumer asks for those pages, four ranges would fill the
  // 1 MiB bound and stop the fetch; kept as their shared pages, the whole
  // file is fetched and pushed while the consumer has read two requests.
  Files t = MakeFiles(8, 300 * kKiB);
  Reader r(t, 1 << 20, 256 * kKiB);
  PageCache cache;
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr, cache.Sink());
  std::string got(t.layout->size(), '\0');
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data() + 100).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 300 * kKiB, 4 * kKiB, got.data() + 100 + 300 * kKiB).ok());
  const uint64_t sources = 8 * 300 * kKiB;
  WaitForTheFetch(*r.reader, sources - 8 * kKiB);
  EXPECT_GE(r.reader->counters().ordered.load(), sources - 8 * kKiB);
  // At most two pages per range and per tensor edge are kept.
  const uint64_t ranges = f->range_spans().size();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the last range's push
  EXPECT_LE(r.budget->held(), (ranges + 16) * 2 * 4096) << ranges << " ranges";
  ASSERT_TRUE(cache.Pass(*r.reader, *f, *t.layout, got).ok());
  EXPECT_TRUE(got == t.expected);
  EXPECT_EQ(r.reader->counters().fetched.load(), sources + 8 * kKiB);
  EXPECT_EQ(r.reader->counters().refetched.load(), 0u);
  EXPECT_EQ(r.budget->held(), 0u);  // every kept byte was served
}

// Planned ranges of cold sources are read with O_DIRECT into the range's
// own buffer (SourceObject::ReadOnce): exact bytes, and the sources' pages
// stay out of the page cache. The two requests that start the plan read
// the last file (f3: the layout is in reverse) the ordinary way, with the
// kernel's read-ahead; files f0 to f2 are read by the plan alone. Buffers
// of the usual size are recycled.
TEST(OrderedFetch, ColdSourcesAreReadDirectAndStayOutOfThePageCache) {
  Files t = MakeFiles(8, 300 * kKiB);
  for (const SourceFile& sf : t.files) {
    int fd = ::open((t.dir / sf.path).c_str(), O_RDONLY);
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    ::close(fd);
    ASSERT_EQ(ResidentBytes(t.dir / sf.path), 0u) << "eviction failed: the checks below would mean nothing";
  }
  Reader r(t, 64ull << 20, 256 * kKiB, /*direct=*/true);
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  std::string got(t.layout->size(), '\0');
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data() + 100).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100 + 300 * kKiB, 4 * kKiB, got.data() + 100 + 300 * kKiB).ok());
  ASSERT_TRUE(f->started());
  for (uint64_t o = 0; o < t.layout->size(); o += 64 * kKiB)
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, o, 64 * kKiB, got.data() + o).ok());
  EXPECT_TRUE(got == t.expected);
  const FetchCounters& c = r.reader->counters();
  EXPECT_GE(c.direct.load(), 3 * 600 * kKiB) << c.Describe();
  EXPECT_LE(c.direct.load(), c.ordered.load()) << c.Describe();
  for (const char* name : {"f0", "f1", "f2"})
    EXPECT_EQ(ResidentBytes(t.dir / name), 0u) << name << ": planned ranges went through the page cache";
  f.reset();
  EXPECT_GE(r.budget->buffers().idle(), 1u) << "no range buffer was kept for reuse";
}

// A predicted item (ItemCheck) larger than several ranges: every range
// holding any of its bytes, not only those holding its framing's windows,
// waits for it to settle, and no byte of it is pushed or served from where
// it was predicted when its framing says elsewhere (the bytes there are
// the item's framing and its neighbours', not the tensor's).
constexpr uint64_t kMovedBy = 8 * kKiB;  // where FramingSaysMoved puts the tensor, past the prediction
Status FramingSaysMoved(const SourceObject&, ItemCheck& k, const std::string&) {
  k.Settle(false, {k.item.file, k.predicted.offset + kMovedBy, k.predicted.length});
  return Status::OK();
}
Status FramingSaysPredicted(const SourceObject&, ItemCheck& k, const std::string&) {
  k.Settle(true);
  return Status::OK();
}

// One 1 MiB source "f0" of random bytes (seeded), a 100-byte header and
// u8 tensor "a" (its first 64 KiB); `contents` gets the source's bytes.
Files HeaderAndTensorA(const std::string& dir_name, unsigned seed, std::string& contents) {
  Files t;
  t.dir = TempDirs::Make(dir_name);
  contents.assign(1 << 20, '\0');
  std::mt19937 rng(seed);
  for (char& c : contents) c = char(rng());
  AddFile(t, "f0", contents);
  t.layout->AddLiteral(std::string(100, 'h'));
  t.expected = std::string(100, 'h');
  AddTensor(t, "a", 0, 0, 64 * kKiB, contents);
  return t;
}

// A header, u8 tensor "a" (64 KiB, placed by its framing) and u8 tensor
// "big" (512 KiB, item at 128 KiB, predicted 1 KiB into it) of one 1 MiB
// source whose bytes all differ from their neighbours'.
Files PredictedBigItem(ItemCheck::Verify verify, std::shared_ptr<ItemCheck>& k) {
  std::string contents;
  Files t = HeaderAndTensorA("ckptfs-ordered-predicted", 5, contents);
  k = std::make_shared<ItemCheck>();
  k->item = {0, 128 * kKiB, 600 * kKiB};
  k->predicted = {0, 128 * kKiB + kKiB, 512 * kKiB};
  k->shape = {512 * kKiB};
  k->dtype = DType::kU8;
  k->windows = {{k->item.offset, 2 * kKiB}, {k->item.offset + k->item.length - 2 * kKiB, 2 * kKiB}};
  k->verify = verify;
  auto big = U8Tensor("big", 0, k->predicted.offset, k->predicted.length);
  big->chunks[0].set_item_check(k);
  EXPECT_TRUE(t.layout->AddTensor(big, Box::Whole(big->shape)).ok());
  const uint64_t at = verify == &FramingSaysMoved ? k->predicted.offset + kMovedBy : k->predicted.offset;
  t.expected += contents.substr(at, k->predicted.length);
  return t;
}

TEST(OrderedFetch, APredictedItemFoundElsewhereHasNoPageOfItPushed) {
  for (const auto verify : {&FramingSaysMoved, &FramingSaysPredicted}) {
    const bool moved = verify == &FramingSaysMoved;
    SCOPED_TRACE(moved ? "found elsewhere" : "found as predicted");
    std::shared_ptr<ItemCheck> k;
    Files t = PredictedBigItem(verify, k);
    Reader r(t, 64ull << 20, 64 * kKiB);  // the item spans ten ranges
    PageCache cache;
    auto f = r.reader->MakeOrderedFetch(t.layout, nullptr, cache.Sink());
    std::string got(t.layout->size(), '\0');
    ASSERT_TRUE(ReadAgainVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data() + 100).ok());
    const uint64_t in_big = 100 + 64 * kKiB + 200 * kKiB;  // a page in the item's middle starts the plan
    ASSERT_TRUE(ReadAgainVia(*r.reader, *f, *t.layout, in_big, 4 * kKiB, got.data() + in_big).ok());
    ASSERT_TRUE(f->started());
    WaitForTheFetch(*r.reader, 500 * kKiB);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the last range's push
    EXPECT_NE(k->state(), ItemCheck::kUnchecked);
    uint64_t pushed_in_big = 0;
    {
      std::lock_guard<std::mutex> lock(cache.mu);
      for (const auto& [offset, data] : cache.pages) {
        EXPECT_TRUE(data == t.expected.substr(offset, data.size())) << "wrong page pushed at " << offset;
        if (offset >= 100 + 64 * kKiB) pushed_in_big += data.size();
      }
    }
    // Found as predicted, the gate lets its pages through: it costs no speed.
    if (!moved) EXPECT_GE(pushed_in_big, 400 * kKiB);
    ASSERT_TRUE(cache.Pass(*r.reader, *f, *t.layout, got).ok());
    const auto diff = std::mismatch(got.begin(), got.end(), t.expected.begin());
    EXPECT_TRUE(diff.first == got.end()) << "first wrong byte at " << (diff.first - got.begin());
  }
}

// A strided tensor (a transposed view, saved as it is) served in part
// before the plan started: the bytes served lie every few hundred bytes of
// its source, and the plan fetches across them rather than a range (a GET)
// between each two.
TEST(OrderedFetch, AStridedTensorServedInPartIsFetchedInFewRanges) {
  std::string contents;
  Files t = HeaderAndTensorA("ckptfs-ordered-strided", 9, contents);
  // u8 [512, 1024] stored column-major (strides {1, 512}) at 128 KiB.
  auto tr = std::make_shared<TensorMeta>();
  tr->fqn = "t";
  tr->dtype = DType::kU8;
  tr->shape = {512, 1024};
  Chunk c;
  c.set_box(Box::Whole(tr->shape));
  c.set_dtype(DType::kU8);
  c.set_bytes({0, 128 * kKiB, 512 * kKiB});
  c.set_strides({1, 512});
  tr->chunks.push_back(c);
  ASSERT_TRUE(t.layout->AddTensor(tr, Box::Whole(tr->shape)).ok());
  Reader r(t, 64ull << 20, 8ull << 20);
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  std::string got(t.layout->size(), '\0');
  // The first 64 rows of the view, then a byte of "a": the plan starts.
  const uint64_t at = 100 + 64 * kKiB;
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, at, 64 * kKiB, got.data() + at).ok());
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 100, 4 * kKiB, got.data() + 100).ok());
  ASSERT_TRUE(f->started());
  EXPECT_LE(f->range_spans().size(), 4u) << "a range between each two bytes served";
  for (uint64_t pos = at; pos < t.layout->size(); pos += 64 * kKiB)
    ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, pos, 64 * kKiB, got.data() + pos).ok());
  for (uint64_t row = 0; row < 512; ++row)  // element (row, col) lies at row + 512 * col
    for (uint64_t col = 0; col < 1024; ++col)
      ASSERT_EQ(got[at + row * 1024 + col], contents[128 * kKiB + row + 512 * col]) << row << "," << col;
}

TEST(OrderedFetch, OneTensorFileIsNotPlanned) {
  Files t = MakeFiles(1, 100 * kKiB);
  Reader r(t, 64ull << 20, 1 << 20);
  EXPECT_FALSE(r.reader->MakeOrderedFetch(t.layout, nullptr));
}

TEST(OrderedFetch, HeaderOnlyReaderStartsNothing) {
  Files t = MakeFiles(4, 200 * kKiB);
  Reader r(t, 64ull << 20, 1 << 20);
  auto f = r.reader->MakeOrderedFetch(t.layout, nullptr);
  std::string got(t.layout->size(), '\0');
  // A request at 0 spanning the header and three tensors (the kernel's read-around).
  ASSERT_TRUE(ReadVia(*r.reader, *f, *t.layout, 0, 500 * kKiB, got.data()).ok());
  EXPECT_FALSE(f->started());
  EXPECT_EQ(r.reader->counters().fetched.load(), 500 * kKiB - 100);
}

}  // namespace
}  // namespace ckptfs
