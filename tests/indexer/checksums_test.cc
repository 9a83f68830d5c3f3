// VerifyChunkChecksums against CRC32C values computed here from the bytes
// with a bitwise reference (not the library's table or instruction paths).
#include "indexer/checksums.h"

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "indexer/file_table.h"

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
      c.bytes = {0, off, len};
      c.has_crc32c = true;
      c.crc32c = BitwiseCrc32c(data_.substr(off, len));
      t->chunks.push_back(c);
    }
    Chunk plain;  // no recorded checksum: not read
    plain.bytes = {0, 0, 16};
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
  tensor_->chunks[1].crc32c ^= 0x100;
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

}  // namespace
}  // namespace ckptfs
