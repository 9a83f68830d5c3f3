// Property tests of the read planner against a naive per-element reference.
//
// Each case makes a random tensor (rank 0-5, zero-size dims, byte-sized
// dtypes), cuts it into chunks (whole, one dimension in uneven parts, 2-d
// blocks, empty chunks), stores each chunk row-major or transposed (strided)
// at random offsets of 1-3 real files with garbage between them, and builds a
// layout: literal bytes, a region of the tensor (whole or a random sub-box),
// literal bytes. Random byte ranges are planned and executed with the real
// SourceReader and compared with bytes gathered element by element.
#include "core/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <tuple>

#include "core/convert.h"
#include "source/posix_source.h"
#include "source/source_reader.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

// Row-major flat index of `idx` in `shape`.
uint64_t Flat(const std::vector<uint64_t>& idx, const Shape& shape) {
  uint64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

// Calls fn(idx) for every index of `box` in row-major order.
template <typename Fn>
void ForEachIndex(const Box& box, Fn fn) {
  if (box.numel() == 0) return;
  std::vector<uint64_t> idx = box.offsets;
  while (true) {
    fn(idx);
    size_t d = box.rank();
    while (d > 0) {
      --d;
      if (++idx[d] < box.offsets[d] + box.lengths[d]) break;
      idx[d] = box.offsets[d];
      if (d == 0) return;
    }
    if (box.rank() == 0) return;
  }
}

// torch.chunk sizes: ceil(n / parts) each, the last ones smaller or empty.
std::vector<uint64_t> ChunkCuts(uint64_t n, uint64_t parts) {
  uint64_t step = parts ? (n + parts - 1) / parts : n;
  std::vector<uint64_t> cuts{0};
  for (uint64_t p = 1; p <= parts; ++p) cuts.push_back(std::min(n, p * std::max<uint64_t>(step, 1)));
  return cuts;
}

std::vector<uint64_t> RandomCuts(uint64_t n, std::mt19937_64& rng) {
  std::vector<uint64_t> cuts{0, n};
  int extra = rng() % 4;
  for (int i = 0; i < extra; ++i) cuts.push_back(n ? rng() % (n + 1) : 0);
  std::sort(cuts.begin(), cuts.end());
  return cuts;  // repeated cuts give empty chunks, as torch writes for short dims
}

std::vector<Box> Tile(const Shape& shape, std::mt19937_64& rng) {
  size_t r = shape.size();
  int mode = r == 0 ? 0 : rng() % 4;
  std::vector<std::vector<uint64_t>> cuts(r);
  for (size_t d = 0; d < r; ++d) cuts[d] = {0, shape[d]};
  if (mode == 1) {  // one dim, torch.chunk
    size_t d = rng() % r;
    cuts[d] = ChunkCuts(shape[d], 1 + rng() % 4);
  } else if (mode == 2) {  // one dim, random cuts
    size_t d = rng() % r;
    cuts[d] = RandomCuts(shape[d], rng);
  } else if (mode == 3) {  // 2-d blocks
    size_t d0 = rng() % r, d1 = rng() % r;
    cuts[d0] = RandomCuts(shape[d0], rng);
    cuts[d1] = ChunkCuts(shape[d1], 1 + rng() % 3);
  }
  std::vector<Box> boxes;
  std::vector<size_t> at(r, 0);
  while (true) {
    Box b;
    for (size_t d = 0; d < r; ++d) {
      b.offsets.push_back(cuts[d][at[d]]);
      b.lengths.push_back(cuts[d][at[d] + 1] - cuts[d][at[d]]);
    }
    boxes.push_back(b);
    size_t d = r;
    bool done = true;
    while (d > 0) {
      --d;
      if (++at[d] + 1 < cuts[d].size()) { done = false; break; }
      at[d] = 0;
    }
    if (done) break;
  }
  return boxes;
}

class PlannerProperty : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("planner_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(PlannerProperty, RandomTensorsShardingsAndRangesMatchPerElementReference) {
  std::mt19937_64 rng(20261121);
  const DType byte_types[] = {DType::kU8,  DType::kBF16, DType::kF16,     DType::kF32,     DType::kI64,
                              DType::kF64, DType::kC64,  DType::kBOOL,    DType::kF8_E4M3, DType::kF8_E5M2};
  int cases = 0, ranges = 0;
  for (int iter = 0; iter < 400; ++iter) {
    DType dtype = byte_types[rng() % std::size(byte_types)];
    const uint64_t isz = DTypeBits(dtype) / 8;
    Shape shape(rng() % 6);
    for (auto& d : shape) d = (rng() % 10 == 0) ? 0 : 1 + rng() % 6;
    const uint64_t numel = Box::Whole(shape).numel();
    std::vector<char> global(numel * isz);
    for (auto& c : global) c = char(rng());

    // Chunks, stored row-major or transposed, in 1-3 files.
    auto tensor = std::make_shared<TensorMeta>();
    tensor->fqn = "t";
    tensor->dtype = dtype;
    tensor->shape = shape;
    int nfiles = 1 + rng() % 3;
    std::vector<std::string> contents(nfiles);
    for (const Box& box : Tile(shape, rng)) {
      Chunk c;
      c.set_box(box);
      c.set_dtype(dtype);
      std::vector<uint64_t> strides = RowMajorStrides(box.lengths);
      if (box.rank() > 1 && rng() % 3 == 0) {  // transposed storage
        std::vector<size_t> perm(box.rank());
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        uint64_t s = 1;
        for (size_t k = perm.size(); k-- > 0;) {
          strides[perm[k]] = s;
          s *= box.lengths[perm[k]];
        }
        c.set_strides(strides);
      }
      int f = rng() % nfiles;
      contents[f].append(rng() % 10, 'g');  // garbage between items
      const uint64_t offset = contents[f].size();
      std::string item(box.numel() * isz, '\0');
      ForEachIndex(box, [&](const std::vector<uint64_t>& idx) {
        uint64_t s = 0;
        for (size_t d = 0; d < box.rank(); ++d) s += (idx[d] - box.offsets[d]) * strides[d];
        std::memcpy(&item[s * isz], &global[Flat(idx, shape) * isz], isz);
      });
      c.set_bytes({FileId(f), offset, item.size()});
      contents[f] += item;
      tensor->chunks.push_back(c);
    }

    std::vector<SourceFile> files;
    for (int f = 0; f < nfiles; ++f) {
      std::string name = "case" + std::to_string(iter) + "_" + std::to_string(f);
      std::ofstream(dir_ / name, std::ios::binary) << contents[f];
      SourceFile sf = *StatSource((dir_ / name).string());
      sf.path = name;
      files.push_back(sf);
    }

    // Target region: whole tensor, or a random sub-box.
    Box target = Box::Whole(shape);
    if (rng() % 3 == 0) {
      for (size_t d = 0; d < shape.size(); ++d) {
        if (shape[d] == 0) continue;
        target.offsets[d] = rng() % shape[d];
        target.lengths[d] = 1 + rng() % (shape[d] - target.offsets[d]);
      }
    }
    std::string head(rng() % 20, 'H'), tail(rng() % 5, 'T');
    Layout layout;
    layout.AddLiteral(head);
    // Types NumPy lacks are sometimes presented as float32 (tensors/*.npy).
    const bool convert = NeedsFloat32View(dtype) && rng() % 2;
    ASSERT_TRUE((convert ? layout.AddTensorAsFloat32(tensor, target) : layout.AddTensor(tensor, target)).ok());
    layout.AddLiteral(tail);

    std::string expected = head;
    ForEachIndex(target, [&](const std::vector<uint64_t>& idx) {
      const char* elem = &global[Flat(idx, shape) * isz];
      if (!convert) return expected.append(elem, isz), void();
      float f;
      DecodeToFloat32(dtype, reinterpret_cast<const uint8_t*>(elem), 0, 1, &f);
      expected.append(reinterpret_cast<const char*>(&f), 4);
    });
    expected += tail;
    ASSERT_EQ(layout.size(), expected.size());

    SourceReader reader(dir_.string(), &files);
    for (int k = 0; k < 25; ++k) {
      uint64_t a = rng() % (expected.size() + 4), len = rng() % (expected.size() + 4);
      if (k == 0) a = 0, len = expected.size();
      auto plan = Plan(layout, a, len);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      uint64_t want = a >= expected.size() ? 0 : std::min<uint64_t>(len, expected.size() - a);
      ASSERT_EQ(plan->length, want);
      std::string got(want, '\0');
      ASSERT_TRUE(reader.Execute(*plan, got.data()).ok());
      ASSERT_EQ(got, expected.substr(std::min<uint64_t>(a, expected.size()), want))
          << "iter " << iter << " dtype " << DTypeName(dtype) << " shape " << ShapeToString(shape)
          << " target " << ToString(target) << " range " << a << "+" << len;
      ++ranges;
    }
    ++cases;
  }
  EXPECT_EQ(cases, 400);
  EXPECT_EQ(ranges, 400 * 25);
}

// One tensor [rows, cols] F32 split on dim 1 over two chunks in one file.
struct ColumnSplit {
  std::shared_ptr<TensorMeta> tensor = std::make_shared<TensorMeta>();
  Layout layout;
};

ColumnSplit MakeColumnSplit(uint64_t rows, uint64_t cols) {
  ColumnSplit s;
  s.tensor->fqn = "w";
  s.tensor->dtype = DType::kF32;
  s.tensor->shape = {rows, cols};
  uint64_t half = cols / 2;
  for (uint64_t k = 0; k < 2; ++k) {
    Chunk c;
    c.set_box(Box{{0, k * half}, {rows, half}});
    c.set_dtype(DType::kF32);
    c.set_bytes({0, k * rows * half * 4, rows * half * 4});
    s.tensor->chunks.push_back(c);
  }
  EXPECT_TRUE(s.layout.AddTensor(s.tensor, Box::Whole(s.tensor->shape)).ok());
  return s;
}

TEST(Planner, ColumnShardedTensorYieldsOneRunPerRowPerShard) {
  auto s = MakeColumnSplit(64, 32);
  auto plan = Plan(s.layout, 0, s.layout.size());
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->copies.size(), 128u);
  // ... which GroupReads serves with one covering read.
  auto reads = GroupReads(plan->copies);
  ASSERT_EQ(reads.size(), 1u);
  EXPECT_EQ(reads[0].gathers.size(), 128u);
  EXPECT_EQ(reads[0].length, 64u * 32 * 4);
}

TEST(Planner, RowShardedTensorCoalescesIntoOneCopy) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = "w";
  t->dtype = DType::kBF16;
  t->shape = {8, 4};
  for (uint64_t k = 0; k < 2; ++k) {
    Chunk c;
    c.set_box(Box{{k * 4, 0}, {4, 4}});
    c.set_dtype(DType::kBF16);
    c.set_bytes({0, 100 + k * 32, 32});  // adjacent in the file
    t->chunks.push_back(c);
  }
  Layout layout;
  ASSERT_TRUE(layout.AddTensor(t, Box::Whole(t->shape)).ok());
  auto plan = Plan(layout, 0, layout.size());
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->copies.size(), 1u);
  EXPECT_EQ(plan->copies[0].src_offset, 100u);
  EXPECT_EQ(plan->copies[0].length, 64u);
}

TEST(Layout, SegmentAtNamesTheSegmentHoldingAByte) {
  Layout empty;
  EXPECT_EQ(empty.SegmentAt(0), 0u);
  Layout layout;
  layout.AddLiteral("header");            // [0, 6)
  layout.AddLiteral("");                  // no segment
  layout.AddSource(0, 100, 10);           // [6, 16)
  layout.AddLiteral(std::string(3, 'p'));  // [16, 19)
  ASSERT_EQ(layout.segments().size(), 3u);
  const std::vector<std::pair<uint64_t, size_t>> want = {{0, 0},  {5, 0},  {6, 1},  {15, 1},
                                                         {16, 2}, {18, 2}, {19, 2}, {500, 2}};
  for (auto [offset, segment] : want) EXPECT_EQ(layout.SegmentAt(offset), segment) << offset;
}

TEST(Planner, GroupReadsSplitsWhenGapsAreLarge) {
  std::vector<CopyOp> copies = {{0, 0, 0, 10}, {0, 1 << 20, 10, 10}, {1, 0, 20, 10}};
  auto reads = GroupReads(copies);
  EXPECT_EQ(reads.size(), 3u);
  for (const auto& r : reads) EXPECT_TRUE(r.direct());
}

// Random copies over a few files, interleaved and out of order: every copy
// comes back as exactly one gather of a read of its file, reads are ordered
// by file then offset, and a read covers its gathers within the policy.
TEST(Planner, GroupReadsKeepsEveryCopyOnceInFileThenOffsetOrder) {
  std::mt19937_64 rng(20261125);
  const GroupPolicy policy;
  for (int round = 0; round < 200; ++round) {
    const uint64_t files = 1 + rng() % 9, n = rng() % 300;
    std::vector<CopyOp> copies;
    for (uint64_t i = 0, dst = 0; i < n; ++i) {
      const uint64_t length = 1 + rng() % 5000;
      copies.push_back({FileId(rng() % files * 7), rng() % (64 << 20), dst, length, rng() % 5 == 0});
      dst += length;
    }
    using Key = std::tuple<FileId, uint64_t, uint64_t, uint64_t, bool>;
    std::vector<Key> want, got;
    for (const CopyOp& c : copies) want.emplace_back(c.file, c.src_offset, c.dst_offset, c.length, c.to_scratch);
    auto reads = GroupReads(copies, policy);
    for (size_t i = 0; i < reads.size(); ++i) {
      const SourceRead& r = reads[i];
      if (i > 0) {
        const SourceRead& p = reads[i - 1];
        ASSERT_TRUE(p.file < r.file || (p.file == r.file && p.offset <= r.offset)) << "round " << round;
      }
      EXPECT_LE(r.length, std::max<uint64_t>(policy.max_span, r.gathers.front().length));
      for (const auto& g : r.gathers) {
        ASSERT_LE(g.read_offset + g.length, r.length);
        got.emplace_back(r.file, r.offset + g.read_offset, g.dst_offset, g.length, g.to_scratch);
      }
    }
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    ASSERT_EQ(got, want) << "round " << round;
  }
}

TEST(Planner, HoleIsAnErrorNotZeros) {
  auto s = MakeColumnSplit(4, 8);
  s.tensor->chunks.pop_back();  // second half of the columns is gone
  auto plan = Plan(s.layout, 0, s.layout.size());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), Status::Code::kIncomplete);
  // A range inside the surviving chunk still plans.
  EXPECT_TRUE(Plan(s.layout, 0, 16).ok());
}

TEST(Planner, UnavailableChunkFailsOnlyReadsThatTouchIt) {
  auto s = MakeColumnSplit(4, 8);
  s.tensor->chunks[1].set_unavailable("shard-00002 is truncated");
  auto bad = Plan(s.layout, 0, s.layout.size());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("shard-00002 is truncated"), std::string::npos);
  EXPECT_TRUE(Plan(s.layout, 0, 16).ok());  // row 0, columns 0-3: first chunk only
}

// A chunk placed by prediction (ItemCheck, core/meta.h) is planned where
// predicted, its copies marked speculative, until its item is settled: as
// predicted (plain copies, same bytes), or elsewhere (copies from where the
// framing says, with its strides), or unusable (the reason, never bytes).
TEST(Planner, APredictedChunkIsPlannedSpeculativelyUntilItsItemIsSettled) {
  auto s = MakeColumnSplit(4, 8);
  auto predicted = [&] {
    auto k = std::make_shared<ItemCheck>();
    k->item = {0, 64, 200};
    k->predicted = s.tensor->chunks[1].bytes();
    s.tensor->chunks[1].set_item_check(k);
    return k;
  };
  auto plan_of = [&] {
    auto plan = Plan(s.layout, 0, s.layout.size());
    EXPECT_TRUE(plan.ok()) << plan.status().ToString();
    return plan.ok() ? *plan : ReadPlan{};
  };
  const ReadPlan plain = plan_of();
  auto k = predicted();
  const ReadPlan speculative = plan_of();
  ASSERT_EQ(speculative.copies.size(), plain.copies.size());
  for (size_t i = 0; i < plain.copies.size(); ++i) {
    const CopyOp &a = plain.copies[i], &b = speculative.copies[i];
    EXPECT_EQ(a.src_offset, b.src_offset);
    // The second chunk holds the right half of each row: from byte 64*... on.
    EXPECT_EQ(b.speculative, a.src_offset >= s.tensor->chunks[1].offset() ? k.get() : nullptr) << i;
  }
  k->Settle(true);
  for (const CopyOp& c : plan_of().copies) EXPECT_EQ(c.speculative, nullptr);

  // Found elsewhere: 100 bytes further, and column-major (strides {1, 4}).
  k = predicted();
  const uint64_t at = s.tensor->chunks[1].offset() + 100;
  k->Settle(false, {0, at, 64}, {1, 4});
  const ReadPlan moved = plan_of();
  for (const CopyOp& c : moved.copies) {
    EXPECT_EQ(c.speculative, nullptr);
    if (c.dst_offset % 32 >= 16) {  // columns 4-7 of a row: one element each, row r at column-major place
      const uint64_t row = c.dst_offset / 32, col = (c.dst_offset % 32) / 4 - 4;
      EXPECT_EQ(c.src_offset, at + (col * 4 + row) * 4) << c.dst_offset;
    }
  }

  k = predicted();
  k->Settle(false, {}, {}, "item at 64: the item holds 0 tensors, not 1");
  auto bad = Plan(s.layout, 0, s.layout.size());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("holds 0 tensors"), std::string::npos);
  EXPECT_TRUE(Plan(s.layout, 0, 16).ok());  // the first chunk's columns alone
}

TEST(Planner, TensorWithCoverageProblemFails) {
  auto s = MakeColumnSplit(4, 8);
  s.tensor->problem = "tensor 'w': chunks overlap";
  auto plan = Plan(s.layout, 0, 4);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("overlap"), std::string::npos);
}

TEST(Planner, RangePastEndIsEmpty) {
  auto s = MakeColumnSplit(2, 2);
  auto plan = Plan(s.layout, s.layout.size() + 10, 5);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->length, 0u);
}

// Packed sub-byte dtypes: F4 (2 per byte) and F6 (4 per 3 bytes).
TEST(Planner, PackedF4SplitOnByteBoundariesOfTheInnerDim) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = "q";
  t->dtype = DType::kF4;
  t->shape = {2, 8};  // 8 bytes; each row 4 bytes
  // Column split at element 4 (byte 2 of each row): chunk bytes are rows of 2.
  for (uint64_t k = 0; k < 2; ++k) {
    Chunk c;
    c.set_box(Box{{0, k * 4}, {2, 4}});
    c.set_dtype(DType::kF4);
    c.set_bytes({0, k * 4, 4});
    t->chunks.push_back(c);
  }
  Layout layout;
  ASSERT_TRUE(layout.AddTensor(t, Box::Whole(t->shape)).ok());
  auto plan = Plan(layout, 0, layout.size());
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  // File: [A0 A1 | A2 A3 | B0 B1 | B2 B3] -> rows: A0 A1 B0 B1, A2 A3 B2 B3
  std::vector<std::pair<uint64_t, uint64_t>> got;  // (src, dst) per byte
  for (const auto& c : plan->copies)
    for (uint64_t i = 0; i < c.length; ++i) got.push_back({c.src_offset + i, c.dst_offset + i});
  std::vector<std::pair<uint64_t, uint64_t>> want = {{0, 0}, {1, 1}, {4, 2}, {5, 3},
                                                     {2, 4}, {3, 5}, {6, 6}, {7, 7}};
  std::sort(got.begin(), got.end(), [](auto a, auto b) { return a.second < b.second; });
  EXPECT_EQ(got, want);
}

TEST(Planner, PackedF6RowSlabsFlattenToBytes) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = "q";
  t->dtype = DType::kF6_E2M3;
  t->shape = {4, 2};  // rows of 2 elements = 1.5 bytes: only 2-row slabs are whole bytes
  for (uint64_t k = 0; k < 2; ++k) {
    Chunk c;
    c.set_box(Box{{k * 2, 0}, {2, 2}});
    c.set_dtype(t->dtype);
    c.set_bytes({0, 10 + k * 3 + k * 5, 3});
    t->chunks.push_back(c);
  }
  Layout layout;
  ASSERT_TRUE(layout.AddTensor(t, Box::Whole(t->shape)).ok());
  ASSERT_EQ(layout.size(), 6u);
  auto plan = Plan(layout, 0, 6);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  ASSERT_EQ(plan->copies.size(), 2u);
  EXPECT_EQ(plan->copies[0].src_offset, 10u);
  EXPECT_EQ(plan->copies[1].src_offset, 18u);
  EXPECT_EQ(plan->copies[1].dst_offset, 3u);
}

TEST(Planner, PackedSplitOffByteBoundaryIsNotSupported) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = "q";
  t->dtype = DType::kF4;
  t->shape = {2, 6};
  for (uint64_t k = 0; k < 2; ++k) {  // columns 0-2 and 3-5: 1.5 bytes per row
    Chunk c;
    c.set_box(Box{{0, k * 3}, {2, 3}});
    c.set_dtype(t->dtype);
    c.set_bytes({0, k * 3, 3});
    t->chunks.push_back(c);
  }
  Layout layout;
  ASSERT_TRUE(layout.AddTensor(t, Box::Whole(t->shape)).ok());
  auto plan = Plan(layout, 0, layout.size());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), Status::Code::kNotSupported);
}

}  // namespace
}  // namespace ckptfs
