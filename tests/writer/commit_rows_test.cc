// Commit rows from written chunks: boxes, file table, CRCs, BYTE_IO items,
// and refusal of chunks that do not tile their tensor. GatherWritten over
// the thread collective.
#include "writer/commit_rows.h"
#include "tests/temp_dirs.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <thread>

namespace ckptfs {
namespace {

std::string MakeRoot() {
  const std::string dir = TempDirs::Make("rows");
  ::mkdir((dir + "/step_1").c_str(), 0755);
  std::ofstream(dir + "/step_1/__0_0.distcp") << std::string(1000, 'a');
  std::ofstream(dir + "/step_1/__1_0.distcp") << std::string(500, 'b');
  return dir;
}

WrittenCheckpoint TwoRankSave() {
  WrittenCheckpoint w;
  w.dir = "step_1";
  w.tensors = {{"model.w", {"model", "w"}, "bfloat16", {5, 4}}, {"step", {}, "int64", {}}};
  // Rows 0-2 on rank 0, rows 3-4 on rank 1 (uneven Shard(0)).
  w.chunks = {{"model.w", {3, 0}, {2, 4}, "__1_0.distcp", 64, 16, 0xBBBB},
              {"model.w", {0, 0}, {3, 4}, "__0_0.distcp", 128, 24, 0xAAAA},
              {"step", {}, {}, "__0_0.distcp", 512, 8, 0xCCCC}};
  w.bytes = {{"optim.param_groups", "__0_0.distcp", 0, 100}};
  return w;
}

TEST(CommitRows, ChunksBecomeRowsWithTheirFilesAndCrcs) {
  const std::string root = MakeRoot();
  auto rows = BuildCommitRows(root, TwoRankSave());
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  const Checkpoint& c = *rows;
  EXPECT_EQ(c.dir, "step_1");
  EXPECT_EQ(c.format, "dcp");
  ASSERT_EQ(c.tensors.size(), 2u);
  const TensorMeta& w = *c.tensors[0];
  EXPECT_EQ(w.fqn, "model.w");
  EXPECT_EQ(w.path, (std::vector<std::string>{"model", "w"}));
  EXPECT_EQ(w.dtype, DType::kBF16);
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[0].box().offsets, (std::vector<uint64_t>{0, 0}));  // sorted by box
  EXPECT_EQ(w.chunks[0].offset(), 128u);
  EXPECT_EQ(c.files[w.chunks[0].file()].path, "step_1/__0_0.distcp");
  EXPECT_EQ(c.files[w.chunks[0].file()].size, 1000u);
  EXPECT_EQ(c.files[w.chunks[1].file()].path, "step_1/__1_0.distcp");
  EXPECT_TRUE(w.chunks[0].has_crc32c() && w.chunks[1].has_crc32c());
  EXPECT_EQ(w.chunks[0].crc32c(), 0xAAAAu);
  EXPECT_EQ(w.chunks[1].crc32c(), 0xBBBBu);
  EXPECT_EQ(c.tensors[1]->fqn, "step");
  EXPECT_EQ(c.tensors[1]->path, (std::vector<std::string>{"step"}));
  EXPECT_EQ(c.tensors[1]->chunks[0].crc32c(), 0xCCCCu);
  EXPECT_EQ(c.files.size(), 2u);
  ASSERT_EQ(c.byte_items.count("optim.param_groups"), 1u);
  EXPECT_EQ(c.byte_items.at("optim.param_groups").length, 100u);
  EXPECT_TRUE(c.problems.empty());
}

TEST(CommitRows, AHoleRefusesTheCommit) {
  WrittenCheckpoint w = TwoRankSave();
  w.chunks.erase(w.chunks.begin());  // rows 3-4 missing
  auto rows = BuildCommitRows(MakeRoot(), w);
  EXPECT_EQ(rows.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(rows.status().message().find("model.w"), std::string::npos) << rows.status().message();
}

TEST(CommitRows, AMissingFileIsNotFound) {
  WrittenCheckpoint w = TwoRankSave();
  w.chunks[0].file = "__7_0.distcp";
  EXPECT_EQ(BuildCommitRows(MakeRoot(), w).status().code(), Status::Code::kNotFound);
}

TEST(CommitRows, UnindexableDTypesAreProblemsNotRows) {
  WrittenCheckpoint w = TwoRankSave();
  w.tensors.push_back({"c", {}, "complex128", {1}});
  w.chunks.push_back({"c", {0}, {1}, "__0_0.distcp", 600, 16, 1});
  auto rows = BuildCommitRows(MakeRoot(), w);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  EXPECT_EQ(rows->tensors.size(), 2u);
  ASSERT_EQ(rows->problems.size(), 1u);
  EXPECT_NE(rows->problems[0].find("complex128"), std::string::npos);
}

TEST(CommitRows, Float4x2IsF4CountedInValuesAsAScanReadsIt) {
  WrittenCheckpoint w = TwoRankSave();
  // 3 x 4 float4_e2m1fn_x2 sharded on its last dim: 3 x 8 F4 values.
  w.tensors.push_back({"q", {}, "float4_e2m1fn_x2", {3, 4}});
  w.chunks.push_back({"q", {0, 0}, {3, 2}, "__0_0.distcp", 600, 6, 1});
  w.chunks.push_back({"q", {0, 2}, {3, 2}, "__1_0.distcp", 300, 6, 2});
  w.tensors.push_back({"s", {}, "float4_e2m1fn_x2", {}});  // 0-d: no F4 shape
  w.chunks.push_back({"s", {}, {}, "__0_0.distcp", 700, 1, 3});
  auto rows = BuildCommitRows(MakeRoot(), w);
  ASSERT_TRUE(rows.ok()) << rows.status().ToString();
  auto q = std::find_if(rows->tensors.begin(), rows->tensors.end(), [](auto& t) { return t->fqn == "q"; });
  ASSERT_NE(q, rows->tensors.end());
  EXPECT_EQ((*q)->dtype, DType::kF4);
  EXPECT_EQ((*q)->shape, (std::vector<uint64_t>{3, 8}));
  ASSERT_EQ((*q)->chunks.size(), 2u);
  EXPECT_EQ((*q)->chunks[1].box().offsets, (std::vector<uint64_t>{0, 4}));
  EXPECT_EQ((*q)->chunks[1].box().lengths, (std::vector<uint64_t>{3, 4}));
  EXPECT_EQ((*q)->chunks[1].length(), 6u);
  ASSERT_EQ(rows->problems.size(), 1u);
  EXPECT_EQ(rows->problems[0].rfind("s: ", 0), 0u) << rows->problems[0];
  EXPECT_NE(rows->problems[0].find("0-d"), std::string::npos) << rows->problems[0];
}

TEST(CommitRows, GatherWrittenCollectsEveryRanksChunksInRankOrder) {
  auto group = MakeThreadGroup(3, std::chrono::seconds(20));
  std::vector<Result<std::vector<WrittenChunk>>> got(3, Status::Incomplete("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      std::vector<WrittenChunk> mine;
      for (int i = 0; i <= r; ++i)
        mine.push_back({"t" + std::to_string(r), {uint64_t(i)}, {1}, "__" + std::to_string(r) + "_0.distcp",
                        uint64_t(64 * i), 4, uint32_t(0xF0000000u + r)});
      got[r] = GatherWritten(*group[r], mine);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(got[r].ok()) << got[r].status().ToString();
    ASSERT_EQ(got[r]->size(), 6u);
    EXPECT_EQ((*got[r])[0].fqn, "t0");
    EXPECT_EQ((*got[r])[5].fqn, "t2");
    EXPECT_EQ((*got[r])[5].offsets, (std::vector<uint64_t>{2}));
    EXPECT_EQ((*got[r])[5].crc32c, 0xF0000002u);
    EXPECT_EQ((*got[r])[3].file, "__2_0.distcp");
  }
}

}  // namespace
}  // namespace ckptfs
