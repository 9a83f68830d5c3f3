// LogLimiter with a clock the test moves: a few lines per key and window,
// then one line with the count of the rest.
#include "fs/log_limiter.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace ckptfs {
namespace {

class LogLimiterTest : public ::testing::Test {
 protected:
  LogLimiter::Clock::time_point now_{};
  std::vector<std::string> lines_;
  LogLimiter limiter_{[this](const std::string& l) { lines_.push_back(l); }, LogLimiter::Options{},
                      [this] { return now_; }};
};

TEST_F(LogLimiterTest, WritesABurstPerKeyThenCountsTheRestAtTheWindowsEnd) {
  for (int i = 0; i < 1000; ++i) limiter_.Log("a", "a " + std::to_string(i));
  for (int i = 0; i < 3; ++i) limiter_.Log("b", "b " + std::to_string(i));
  EXPECT_EQ(lines_, (std::vector<std::string>{"a 0", "a 1", "a 2", "a 3", "a 4", "b 0", "b 1", "b 2"}));
  now_ += std::chrono::seconds(9);
  limiter_.Flush();
  EXPECT_EQ(lines_.size(), 8u) << "reported before the window ended";
  now_ += std::chrono::seconds(1);
  limiter_.Flush();
  ASSERT_EQ(lines_.size(), 9u);
  // 995 suppressed: the last one shown, 994 more.
  EXPECT_EQ(lines_.back(), "a 999 (and 994 more like this in the last 10 s)");
  limiter_.Log("a", "a again");  // a new window writes again
  EXPECT_EQ(lines_.back(), "a again");
}

TEST_F(LogLimiterTest, ReportsWhatItStillCountsWhenDestroyed) {
  std::vector<std::string> out;
  {
    LogLimiter l([&](const std::string& s) { out.push_back(s); }, LogLimiter::Options{}, [this] { return now_; });
    for (int i = 0; i < 7; ++i) l.Log("k", "x");
  }
  ASSERT_EQ(out.size(), 6u);
  EXPECT_EQ(out.back(), "x (and 1 more like this in the last 10 s)");
}

TEST(CauseKeyTest, OffsetsAndSizesDoNotSplitACause) {
  EXPECT_EQ(CauseKey("f.bin: read of 4096 bytes at 123 failed"), CauseKey("f.bin: read of 8 bytes at 99999 failed"));
  EXPECT_NE(CauseKey("f.bin: gone"), CauseKey("g.bin: gone"));
  EXPECT_EQ(CauseKey("shard-00002"), "shard-#");
}

}  // namespace
}  // namespace ckptfs
