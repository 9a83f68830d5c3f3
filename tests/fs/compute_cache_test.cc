// The compute stage's cache (fs/compute_cache.h): a block is computed once
// however its pages are asked for, memory stays within the budget, and a
// source changed after a block was computed is an error, never old bytes.
#include "fs/compute_cache.h"

#include <gtest/gtest.h>

#include <new>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "core/safetensors.h"
#include "indexer/scan.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

// A cast that counts its computations.
class Counting : public Computation {
 public:
  explicit Counting(std::shared_ptr<const Computation> inner) : inner_(std::move(inner)) {}
  DType dtype() const override { return inner_->dtype(); }
  const Shape& shape() const override { return inner_->shape(); }
  std::string what() const override { return inner_->what(); }
  std::vector<ComputeInput> InputsOf(uint64_t b) const override { return inner_->InputsOf(b); }
  Result<BlockBytes> Compute(uint64_t b, const std::vector<BlockBytes>& in) const override {
    ++calls;
    if (throws > 0) {
      --throws;
      throw std::bad_alloc();
    }
    return inner_->Compute(b, in);
  }
  mutable std::atomic<int> calls{0};
  mutable std::atomic<int> throws{0};  // the next this many computations throw

 private:
  std::shared_ptr<const Computation> inner_;
};

class ComputeCacheTest : public ::testing::Test {
 protected:
  // A [rows, 1024] F32 tensor w = i * 0.37 - 5 (row-major index i).
  static constexpr uint64_t kCols = 1024;
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("cc_" + std::to_string(::getpid()) + "_" +
                                             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    // 5000 rows: bf16 blocks are 2048 rows (4 MiB), so 3 blocks, the last short.
    rows_ = 5000;
    values_.resize(rows_ * kCols);
    for (uint64_t i = 0; i < values_.size(); ++i) values_[i] = float(i) * 0.37f - 5.0f;
    const uint64_t n = values_.size() * 4;
    std::string out = *EncodeSafetensorsHeader({{"w", DType::kF32, {rows_, kCols}, 0, n}}, {});
    out.append(reinterpret_cast<const char*>(values_.data()), n);
    std::ofstream(dir_ / "model.safetensors", std::ios::binary) << out;
    auto catalog = ScanSource(dir_.string());
    ASSERT_TRUE(catalog.ok());
    ASSERT_EQ(catalog->checkpoints.size(), 1u);
    ckpt_ = std::move(catalog->checkpoints[0]);
    reader_ = std::make_unique<SourceReader>(dir_.string(), &ckpt_.files);
    const auto& t = ckpt_.tensors.at(0);
    cast_ = std::make_shared<Counting>(MakeCast(t, Box::Whole(t->shape), DType::kBF16));
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The expected bf16 bytes: of the two bf16 neighbours of each (finite)
  // value, the nearer in double arithmetic, ties to the even one.
  std::string Expected() const {
    std::string out(values_.size() * 2, '\0');
    for (uint64_t i = 0; i < values_.size(); ++i) {
      uint32_t u;
      std::memcpy(&u, &values_[i], 4);
      uint16_t lo = uint16_t(u >> 16), hi = uint16_t(lo + 1), h = lo;
      if (u & 0xFFFF) {
        auto value = [](uint16_t b) {
          uint32_t w = uint32_t(b) << 16;
          float f;
          std::memcpy(&f, &w, 4);
          return double(f);
        };
        const double dlo = std::abs(value(lo) - values_[i]), dhi = std::abs(value(hi) - values_[i]);
        h = dlo < dhi || (dlo == dhi && !(lo & 1)) ? lo : hi;
      }
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
    return out;
  }

  Status ReadPage(ComputeCache& cache, uint64_t offset, uint64_t length, char* dst) {
    return cache.Fill({{cast_.get(), offset, 0, length}}, dst, *reader_, 0);
  }

  fs::path dir_;
  uint64_t rows_ = 0;
  std::vector<float> values_;
  Checkpoint ckpt_;
  std::unique_ptr<SourceReader> reader_;
  std::shared_ptr<Counting> cast_;
};

TEST_F(ComputeCacheTest, PagesInRandomOrderFromManyThreadsComputeEachBlockOnce) {
  ComputeCache cache(64ull << 20);
  const uint64_t size = cast_->nbytes(), page = 4096;
  std::vector<uint64_t> pages;
  for (uint64_t at = 0; at < size; at += page) pages.push_back(at);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(3));
  std::string got(size, '\0');
  std::atomic<size_t> next{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&] {
      for (size_t k; (k = next++) < pages.size();) {
        const uint64_t at = pages[k];
        if (!ReadPage(cache, at, std::min(page, size - at), got.data() + at).ok()) ++failures;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(cast_->block_count(), 3u);
  EXPECT_EQ(cast_->calls, 3);
  EXPECT_TRUE(got == Expected());
  EXPECT_EQ(cache.stats().bytes, size);
}

TEST_F(ComputeCacheTest, KeptBytesStayWithinTheBudget) {
  ComputeCache cache(5ull << 20);  // room for one 4 MiB block
  const uint64_t size = cast_->nbytes();
  std::string got(size, '\0');
  for (int pass = 0; pass < 2; ++pass)
    for (uint64_t at = 0; at < size; at += 128 << 10) {
      ASSERT_TRUE(ReadPage(cache, at, std::min<uint64_t>(128 << 10, size - at), got.data() + at).ok());
      EXPECT_LE(cache.stats().bytes, 5ull << 20);
    }
  EXPECT_TRUE(got == Expected());
  EXPECT_EQ(cast_->calls, 6);  // each pass computes each block once
}

TEST_F(ComputeCacheTest, SourceChangedAfterComputeIsStaleNotOldBytes) {
  ComputeCache cache(64ull << 20);
  std::string page(4096, '\0');
  ASSERT_TRUE(ReadPage(cache, 0, page.size(), page.data()).ok());
  {
    std::fstream f(dir_ / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    f.write("\0\0\0\0", 4);
  }
  fs::last_write_time(dir_ / "model.safetensors", fs::file_time_type::clock::now() + std::chrono::seconds(5));
  Status st = ReadPage(cache, 0, page.size(), page.data());
  EXPECT_EQ(st.code(), Status::Code::kStale) << st.ToString();
}

// A computation that throws (bad_alloc) reaches its reader as the exception
// (the mount answers ENOMEM) and leaves no slot behind: the next read
// computes the block and gets its bytes.
TEST_F(ComputeCacheTest, AComputationThatThrowsIsComputedAgainByTheNextRead) {
  ComputeCache cache(64ull << 20);
  std::string page(4096, '\0');
  cast_->throws = 1;
  EXPECT_THROW((void)ReadPage(cache, 0, page.size(), page.data()), std::bad_alloc);
  ASSERT_TRUE(ReadPage(cache, 0, page.size(), page.data()).ok());
  EXPECT_EQ(page, Expected().substr(0, page.size()));
  EXPECT_EQ(cast_->calls, 2);
}

TEST_F(ComputeCacheTest, DropForgetsTheOwnersBlocks) {
  ComputeCache cache(64ull << 20);
  std::string page(4096, '\0');
  ASSERT_TRUE(ReadPage(cache, 0, page.size(), page.data()).ok());
  cache.Drop(0);
  EXPECT_EQ(cache.stats().bytes, 0u);
  ASSERT_TRUE(ReadPage(cache, 0, page.size(), page.data()).ok());
  EXPECT_EQ(cast_->calls, 2);
}

}  // namespace
}  // namespace ckptfs
