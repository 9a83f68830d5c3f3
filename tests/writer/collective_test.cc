// One conformance suite for every Collective this build and machine can
// run: the thread group always; NCCL when built with it and GPUs are
// visible (tools/gpu_test.sh), with world sizes up to the GPU count.
#include "writer/collective.h"

#include <gtest/gtest.h>

#include <functional>
#include <thread>

namespace ckptfs {
namespace {

struct Impl {
  std::string name;
  int world;
  std::function<Result<std::vector<std::unique_ptr<Collective>>>(int)> make;
};

std::vector<Impl> Available() {
  std::vector<Impl> out;
  for (int w : {1, 2, 3, 5})
    out.push_back({"threads", w, [](int n) -> Result<std::vector<std::unique_ptr<Collective>>> {
                     return MakeThreadGroup(n, std::chrono::seconds(20));
                   }});
  if (BuiltWithNccl())
    for (int w = 1; w <= VisibleCudaDevices(); ++w) out.push_back({"nccl", w, MakeLocalNcclGroup});
  return out;
}

class CollectiveConformance : public testing::TestWithParam<Impl> {
 protected:
  // Runs body(rank's collective) on one thread per rank.
  void RunRanks(const std::function<void(Collective&)>& body) {
    auto group = GetParam().make(GetParam().world);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    ASSERT_EQ(int(group->size()), GetParam().world);
    std::vector<std::thread> threads;
    for (auto& c : *group) threads.emplace_back([&body, &c] { body(*c); });
    for (auto& t : threads) t.join();
  }
};

TEST_P(CollectiveConformance, RanksAndSizes) {
  RunRanks([&](Collective& c) {
    EXPECT_EQ(c.size(), GetParam().world);
    EXPECT_GE(c.rank(), 0);
    EXPECT_LT(c.rank(), c.size());
  });
}

TEST_P(CollectiveConformance, AllGatherOfDifferentLengthsInRankOrder) {
  RunRanks([&](Collective& c) {
    // Rank r sends r*37 copies of 'a'+r (rank 0 sends nothing), with a NUL inside.
    std::string mine(c.rank() * 37, char('a' + c.rank()));
    if (!mine.empty()) mine[0] = '\0';
    auto all = c.AllGather(mine);
    ASSERT_TRUE(all.ok()) << all.status().ToString();
    ASSERT_EQ(int(all->size()), c.size());
    for (int r = 0; r < c.size(); ++r) {
      std::string want(r * 37, char('a' + r));
      if (!want.empty()) want[0] = '\0';
      EXPECT_EQ((*all)[r], want) << "rank " << c.rank() << " slot " << r;
    }
  });
}

TEST_P(CollectiveConformance, RepeatedRoundsDoNotMix) {
  RunRanks([&](Collective& c) {
    for (int round = 0; round < 50; ++round) {
      auto all = c.AllGather(std::to_string(round * 100 + c.rank()));
      ASSERT_TRUE(all.ok());
      for (int r = 0; r < c.size(); ++r) ASSERT_EQ((*all)[r], std::to_string(round * 100 + r));
    }
  });
}

TEST_P(CollectiveConformance, BroadcastFromEveryRoot) {
  RunRanks([&](Collective& c) {
    for (int root = 0; root < c.size(); ++root) {
      std::string data = c.rank() == root ? "from " + std::to_string(root) : "junk";
      ASSERT_TRUE(c.Broadcast(&data, root).ok());
      EXPECT_EQ(data, "from " + std::to_string(root));
    }
    std::string d;
    EXPECT_EQ(c.Broadcast(&d, c.size()).code(), Status::Code::kInvalidArgument);
  });
}

TEST_P(CollectiveConformance, BarrierWaitsForEveryRank) {
  std::atomic<int> before{0};
  RunRanks([&](Collective& c) {
    if (c.rank() == c.size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ++before;
    ASSERT_TRUE(c.Barrier().ok());
    EXPECT_EQ(before.load(), c.size());
  });
}

INSTANTIATE_TEST_SUITE_P(All, CollectiveConformance, testing::ValuesIn(Available()),
                         [](const testing::TestParamInfo<Impl>& i) {
                           return i.param.name + "_world" + std::to_string(i.param.world);
                         });

TEST(ThreadCollective, AMissingRankTimesOutInsteadOfHanging) {
  auto g = MakeThreadGroup(2, std::chrono::milliseconds(100));
  auto r = g[0]->AllGather("x");
  EXPECT_EQ(r.status().code(), Status::Code::kIOError);
  EXPECT_NE(r.status().message().find("1 other rank"), std::string::npos) << r.status().message();
}

}  // namespace
}  // namespace ckptfs
