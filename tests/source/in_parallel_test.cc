#include "source/in_parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace ckptfs {
namespace {

TEST(InParallel, EachPieceRunsOnceOnAtMostTheThreadsAsked) {
  std::vector<std::atomic<int>> runs(100);
  std::mutex mu;
  std::set<std::thread::id> threads;
  ForEachInParallel(runs.size(), 4, [&](size_t i) {
    runs[i]++;
    std::lock_guard<std::mutex> lock(mu);
    threads.insert(std::this_thread::get_id());
  });
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << "piece " << i;
  EXPECT_LE(threads.size(), 4u);
  ForEachInParallel(0, 4, [](size_t) { ADD_FAILURE() << "no piece to run"; });
}

TEST(InParallel, TheLowestFailureIsTheAnswerAndEveryPieceStillRuns) {
  std::atomic<int> ran{0};
  Status st = InParallel(50, 3, [&](size_t i) {
    ran++;
    if (i == 7 || i == 31) return Status::IOError("piece " + std::to_string(i));
    return Status::OK();
  });
  EXPECT_EQ(ran.load(), 50);
  EXPECT_FALSE(st.ok());
  EXPECT_EQ(st.message(), "piece 7");
  EXPECT_TRUE(InParallel(5, 8, [](size_t) { return Status::OK(); }).ok());
}

}  // namespace
}  // namespace ckptfs
