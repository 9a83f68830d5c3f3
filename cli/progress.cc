#include "cli/progress.h"

#include <unistd.h>

#include <cstdio>

namespace ckptfs {

std::string HumanBytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

Progress::Progress(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total),
      enabled_(::isatty(STDERR_FILENO) == 1), start_(std::chrono::steady_clock::now()), last_(start_) {}

Progress::~Progress() {
  if (enabled_) Draw(true);
}

void Progress::Update(uint64_t done) {
  done_ = done;
  if (!enabled_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_ < std::chrono::milliseconds(100)) return;  // ~10 redraws a second
  last_ = now;
  Draw(false);
}

void Progress::Draw(bool final) {
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::string what;
  if (unit_ == "bytes") {
    what = HumanBytes(done_) + (total_ ? " / " + HumanBytes(total_) : "");
    if (secs > 0) what += "  " + HumanBytes(uint64_t(done_ / secs)) + "/s";
  } else {
    what = std::to_string(done_) + (total_ ? "/" + std::to_string(total_) : "") + " " + unit_;
  }
  int pct = total_ ? int(100.0 * double(done_) / double(total_)) : -1;
  if (pct >= 0)
    std::fprintf(stderr, "\r%s: %3d%%  %s   ", label_.c_str(), pct, what.c_str());
  else
    std::fprintf(stderr, "\r%s: %s   ", label_.c_str(), what.c_str());
  if (final) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

}  // namespace ckptfs
