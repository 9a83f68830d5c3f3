// A one-line progress display for long CLI work. Draws on stderr only when
// stderr is a terminal; otherwise (logs, CI, pipes) it stays quiet.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace ckptfs {

class Progress {
 public:
  // `unit` is "bytes" (shown as MiB with a rate) or a noun like "dirs".
  Progress(std::string label, uint64_t total, std::string unit);
  ~Progress();  // finishes the line
  void Update(uint64_t done);
  bool enabled() const { return enabled_; }

 private:
  void Draw(bool final);
  std::string label_, unit_;
  uint64_t total_ = 0, done_ = 0;
  bool enabled_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

// "1.5 GiB", "512 B"
std::string HumanBytes(uint64_t n);

}  // namespace ckptfs
