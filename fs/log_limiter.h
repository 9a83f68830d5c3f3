// LogLimiter: keeps a fault that fails every read from flooding the log.
//
// Lines are grouped by a key (the mount uses checkpoint + cause). In each
// window (10 s) the first `burst` lines of a key are written as they come;
// the rest are counted, and when the window is over one line reports them:
// "<the last one> (and N more like this in the last 10 s)". Without a limit
// a mount under a failing disk wrote 517 MB of identical lines in 93 s.
//
// Thread-safe. The sink is called with the limiter's lock held, so lines
// of one key keep their order; it must not call back into the limiter.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>

namespace ckptfs {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  struct Options {
    Clock::duration window = std::chrono::seconds(10);
    // Five lines show the pattern (a changed source, the ranges it hits);
    // more add nothing but bytes.
    uint64_t burst = 5;
  };
  explicit LogLimiter(std::function<void(const std::string&)> sink);
  LogLimiter(std::function<void(const std::string&)> sink, Options options,
             std::function<Clock::time_point()> now);
  // Reports what is still counted.
  ~LogLimiter();

  void Log(const std::string& key, const std::string& line);
  // Reports every window that is over and held suppressed lines; Log()
  // does this too, the watcher's periodic call covers a fault that stopped.
  void Flush();
  void set_sink(std::function<void(const std::string&)> sink);

 private:
  struct Window {
    Clock::time_point start;
    uint64_t written = 0;
    uint64_t suppressed = 0;
    std::string last;  // the last suppressed line
  };
  // REQUIRES: mu_ held.
  void ReportLocked(Window& w);
  void FlushLocked(Clock::time_point now);

  std::function<void(const std::string&)> sink_;
  const Options options_;
  const std::function<Clock::time_point()> now_;
  std::mutex mu_;  // guards windows_, sink_
  std::unordered_map<std::string, Window> windows_;
};

// `message` with every run of digits replaced by '#': offsets and sizes
// differ between the reads one fault fails, the cause does not.
std::string CauseKey(const std::string& message);

}  // namespace ckptfs
