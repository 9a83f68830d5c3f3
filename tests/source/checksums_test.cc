// VerifyChunkChecksums and ChecksumGate against CRC32C values computed here
// from the bytes with a bitwise reference (not the library's table or
// instruction paths).
#include "source/checksums.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "source/posix_source.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

uint32_t BitwiseCrc32c(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char b : bytes) {
    crc ^= b;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

class ChecksumsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("checksums_" + std::to_string(::getpid()));
    fs::create_directories(root_);
    // 20 MiB: the second chunk spans several of the 8 MiB pieces it is read in.
    data_.resize(20 << 20);
    for (size_t i = 0; i < data_.size(); ++i) data_[i] = char((i * 2654435761u) >> 13);
    std::ofstream(root_ / "rank0.bin", std::ios::binary).write(data_.data(), data_.size());
    auto file = StatSource((root_ / "rank0.bin").string());
    ASSERT_TRUE(file.ok()) << file.status().message();
    file->path = "rank0.bin";
    ckpt_.files.push_back(*file);
    auto t = tensor_ = std::make_shared<TensorMeta>();
    t->fqn = "w";
    for (auto [off, len] : {std::pair<uint64_t, uint64_t>{0, 1000}, {1000, data_.size() - 1000}}) {
      Chunk c;
      c.set_bytes({0, off, len});
      c.set_crc32c(BitwiseCrc32c(data_.substr(off, len)));
      t->chunks.push_back(c);
    }
    Chunk plain;  // no recorded checksum: not read
    plain.set_bytes({0, 0, 16});
    t->chunks.push_back(plain);
    ckpt_.tensors.push_back(t);
  }
  void TearDown() override { fs::remove_all(root_); }

  ChecksumReport Verify() {
    SourceReader reader(root_.string(), &ckpt_.files);
    return VerifyChunkChecksums(ckpt_, reader);
  }

  fs::path root_;
  std::string data_;
  Checkpoint ckpt_;
  std::shared_ptr<TensorMeta> tensor_;  // ckpt_'s only tensor, mutable here
};

TEST_F(ChecksumsTest, MatchingChunksAreCountedAndReadInFull) {
  ChecksumReport r = Verify();
  EXPECT_TRUE(r.problems.empty()) << r.problems.front();
  EXPECT_EQ(r.chunks, 2u);
  EXPECT_EQ(r.bytes, data_.size());
}

TEST_F(ChecksumsTest, AWrongRecordedValueIsNamedWithItsRange) {
  tensor_->chunks[1].set_crc32c(tensor_->chunks[1].crc32c() ^ 0x100);
  ChecksumReport r = Verify();
  ASSERT_EQ(r.problems.size(), 1u);
  const std::string& p = r.problems[0];
  EXPECT_NE(p.find("w chunk 1"), std::string::npos) << p;
  EXPECT_NE(p.find("rank0.bin bytes [1000, " + std::to_string(data_.size()) + ")"), std::string::npos) << p;
  EXPECT_NE(p.find("the writer recorded"), std::string::npos) << p;
}

TEST_F(ChecksumsTest, AChangedSourceIsAnErrorNotAMismatch) {
  ::usleep(50'000);  // past the filesystem's timestamp granularity
  {
    std::fstream f(root_ / "rank0.bin", std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(5);
    f.put('\x7f');
  }
  ChecksumReport r = Verify();
  ASSERT_EQ(r.problems.size(), 2u);
  for (const std::string& p : r.problems) EXPECT_EQ(p.find("CRC32C"), std::string::npos) << p;
}


// A reader whose every Execute passes through a gate over ckpt_.
class GateTest : public ChecksumsTest {
 protected:
  std::unique_ptr<SourceReader> GatedReader() {
    auto reader = std::make_unique<SourceReader>(root_.string(), &ckpt_.files);
    reader->SetChecksumGate(std::make_unique<ChecksumGate>(ckpt_));
    return reader;
  }
  // Bytes [offset, offset + length) of rank0.bin through `reader`.
  Result<std::string> Read(SourceReader& reader, uint64_t offset, uint64_t length) {
    ReadPlan plan;
    plan.length = length;
    plan.copies.push_back({0, offset, 0, length});
    std::string out(length, '\0');
    RETURN_IF_ERROR(reader.Execute(plan, out.data()));
    return out;
  }
};

TEST_F(GateTest, GoodChunksServeTheirBytesAndAreVerifiedOnce) {
  auto reader = GatedReader();
  auto a = Read(*reader, 5000, 10);  // inside chunk 1: all of it is read first
  ASSERT_TRUE(a.ok()) << a.status().message();
  EXPECT_EQ(*a, data_.substr(5000, 10));
  const uint64_t after_first = reader->counters().fetched.load();
  EXPECT_GE(after_first, data_.size() - 1000);
  auto b = Read(*reader, 9000, 10);  // the verdict is kept: only these bytes
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_EQ(*b, data_.substr(9000, 10));
  EXPECT_EQ(reader->counters().fetched.load(), after_first + 10);
}

TEST_F(GateTest, ABadChunkFailsEveryReadTouchingItAndOnlyThose) {
  tensor_->chunks[1].set_crc32c(tensor_->chunks[1].crc32c() ^ 0x100);
  auto reader = GatedReader();
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto bad = Read(*reader, 20000, 100);
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().code(), Status::Code::kCorruption);
    EXPECT_NE(bad.status().message().find("w chunk 1"), std::string::npos) << bad.status().message();
  }
  auto across = Read(*reader, 990, 20);  // chunk 0's last bytes and chunk 1's first
  EXPECT_FALSE(across.ok());
  auto good = Read(*reader, 0, 1000);  // chunk 0 alone
  ASSERT_TRUE(good.ok()) << good.status().message();
  EXPECT_EQ(*good, data_.substr(0, 1000));
}

TEST_F(GateTest, BytesOutsideEveryChecksummedChunkPassUnchecked) {
  tensor_->chunks[0].set_crc32c(tensor_->chunks[0].crc32c() ^ 1);
  tensor_->chunks[0].set_bytes({0, 100, 900});  // bytes [0, 100) belong to no checksummed chunk
  auto reader = GatedReader();
  auto head = Read(*reader, 0, 100);
  ASSERT_TRUE(head.ok()) << head.status().message();
  EXPECT_EQ(*head, data_.substr(0, 100));
  EXPECT_FALSE(Read(*reader, 50, 100).ok());  // reaches into the bad chunk
}

}  // namespace
}  // namespace ckptfs
