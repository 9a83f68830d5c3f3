// Pushes of whole tensors ahead of their readers (ReadOptions::
// push_tensor_bytes, SourceReader::ReadAhead with a sink): what a sink gets
// is checked against the bytes written to the source files.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "core/layout.h"
#include "source/posix_source.h"
#include "source/source_reader.h"
#include "tests/source/u8_tensor.h"
#include "tests/temp_dirs.h"

namespace ckptfs {
namespace {

constexpr uint64_t kKiB = 1 << 10;
constexpr uint64_t kMiB = 1 << 20;

// Three u8 tensors laid out one after another, a header literal first:
// "a" and "b" of 1 MiB + 100 bytes (not a multiple of the push alignment),
// "big" of 3 MiB; each in a file of its own.
struct Tensors {
  std::filesystem::path dir;
  std::vector<SourceFile> files;
  std::shared_ptr<Layout> layout = std::make_shared<Layout>();
  std::string expected;  // the virtual file's bytes
  std::map<std::string, std::pair<uint64_t, uint64_t>> at;  // name -> [begin, end) in the virtual file
};

Tensors MakeTensors() {
  Tensors t;
  t.dir = TempDirs::Make("ckptfs-push");
  t.layout->AddLiteral(std::string(1000, 'h'));
  t.expected = std::string(1000, 'h');
  const std::pair<const char*, uint64_t> specs[] = {{"a", kMiB + 100}, {"b", kMiB + 100}, {"big", 3 * kMiB}};
  for (const auto& [name, n] : specs) {
    std::string bytes(n, '\0');
    for (uint64_t i = 0; i < n; ++i) bytes[i] = char((i * 131 + name[0]) % 251);
    std::ofstream(t.dir / name, std::ios::binary) << bytes;
    SourceFile sf = *StatSource((t.dir / name).string());
    sf.path = name;
    auto tensor = U8Tensor(name, FileId(t.files.size()), 0, n);
    t.files.push_back(sf);
    t.at[name] = {t.layout->size(), t.layout->size() + n};
    EXPECT_TRUE(t.layout->AddTensor(tensor, Box::Whole(tensor->shape)).ok());
    t.expected += bytes;
  }
  return t;
}

// What a sink was given: bytes by virtual offset, and how many times.
struct Pushed {
  std::mutex mu;
  std::map<uint64_t, std::string> pieces;
  std::map<uint64_t, int> calls;
  PageSink Sink() {
    return [this](uint64_t offset, const PageBytes& b) {
      std::lock_guard<std::mutex> lock(mu);
      pieces[offset] = std::string(b.data, b.len);
      ++calls[offset];
    };
  }
  // Bytes of [begin, end) covered by pushed pieces (pieces may overlap).
  uint64_t Covered(uint64_t begin, uint64_t end) {
    std::lock_guard<std::mutex> lock(mu);
    uint64_t n = 0, at = begin;  // pieces are in offset order
    for (const auto& [off, bytes] : pieces) {
      const uint64_t a = std::max(at, off), b = std::min(end, off + bytes.size());
      if (a < b) n += b - a;
      at = std::max(at, b);
    }
    return n;
  }
  // Waits until [begin, end) is covered or 10 s pass.
  uint64_t WaitCovered(uint64_t begin, uint64_t end) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    uint64_t n = 0;
    while ((n = Covered(begin, end)) < end - begin && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return n;
  }
};

ReadOptions PushUpTo(uint64_t bytes) {
  ReadOptions ro;
  ro.push_tensor_bytes = bytes;
  return ro;
}

TEST(TensorPush, ATouchPushesItsWholeTensorExactlyAndOnce) {
  Tensors t = MakeTensors();
  SourceReader reader(t.dir.string(), &t.files, {}, 0, PushUpTo(2 * kMiB));
  ReadStream stream;
  Pushed pushed;
  const auto [a0, a1] = t.at["a"];
  // The loader's touch: 4 KiB in the middle of "a".
  reader.ReadAhead(stream, t.layout, a0 + 512 * kKiB, 4 * kKiB, pushed.Sink());
  EXPECT_EQ(pushed.WaitCovered(a0, a1), a1 - a0) << "all of a";
  // In whole 64 KiB pieces of the file: a page of the header before "a"
  // and of "b" after it come along, nothing more.
  {
    std::lock_guard<std::mutex> lock(pushed.mu);
    for (const auto& [off, bytes] : pushed.pieces) {
      EXPECT_EQ(bytes, t.expected.substr(off, bytes.size())) << off;
      EXPECT_EQ(off % (64 * kKiB), 0u) << off;
      EXPECT_LE(off + bytes.size(), (a1 + 64 * kKiB - 1) / (64 * kKiB) * (64 * kKiB)) << off;
    }
  }
  // A second touch of "a" in this stream pushes nothing more; another
  // stream's first touch of "b" pushes "b".
  reader.ReadAhead(stream, t.layout, a1 - 4 * kKiB, 4 * kKiB, pushed.Sink());
  ReadStream other;
  const auto [b0, b1] = t.at["b"];
  reader.ReadAhead(other, t.layout, b0 + 256 * kKiB, 4 * kKiB, pushed.Sink());
  EXPECT_EQ(pushed.WaitCovered(b0, b1), b1 - b0) << "b is pushed on its first touch";
  std::lock_guard<std::mutex> lock(pushed.mu);
  for (const auto& [off, n] : pushed.calls) EXPECT_EQ(n, 1) << "pushed again: " << off;
}

TEST(TensorPush, NothingIsPushedForALargeTensorAStreamGoingOnOrNoSink) {
  Tensors t = MakeTensors();
  Pushed pushed;
  {
    SourceReader reader(t.dir.string(), &t.files, {}, 0, PushUpTo(2 * kMiB));
    ReadStream big, stream, no_sink;
    const auto [g0, g1] = t.at["big"];
    reader.ReadAhead(big, t.layout, g0, 4 * kKiB, pushed.Sink());  // 3 MiB > 2 MiB
    // A stream reading "a" front to back goes on into "b": its first
    // request in "b" continues the stream and pushes nothing.
    const auto [a0, a1] = t.at["a"];
    for (uint64_t at = a0; at < a1 + 8 * kKiB; at += 4 * kKiB)
      reader.ReadAhead(stream, t.layout, at, 4 * kKiB, at < a0 + 4 * kKiB ? PageSink{} : pushed.Sink());
    reader.ReadAhead(no_sink, t.layout, t.at["b"].first + kMiB, 4 * kKiB);
  }  // the reader waits for its push threads before it goes
  std::lock_guard<std::mutex> lock(pushed.mu);
  EXPECT_TRUE(pushed.pieces.empty()) << pushed.pieces.size() << " pieces pushed";
}

TEST(TensorPush, OffWhenPushTensorBytesIsZero) {
  Tensors t = MakeTensors();
  Pushed pushed;
  {
    SourceReader reader(t.dir.string(), &t.files, {}, 0, PushUpTo(0));
    ReadStream stream;
    reader.ReadAhead(stream, t.layout, t.at["a"].first, 4 * kKiB, pushed.Sink());
  }
  EXPECT_TRUE(pushed.pieces.empty());
}

}  // namespace
}  // namespace ckptfs
