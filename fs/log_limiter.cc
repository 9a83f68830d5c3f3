#include "fs/log_limiter.h"

#include <cctype>

namespace ckptfs {

LogLimiter::LogLimiter(std::function<void(const std::string&)> sink)
    : LogLimiter(std::move(sink), Options(), Clock::now) {}

LogLimiter::LogLimiter(std::function<void(const std::string&)> sink, Options options,
                       std::function<Clock::time_point()> now)
    : sink_(std::move(sink)), options_(options), now_(std::move(now)) {}

LogLimiter::~LogLimiter() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, w] : windows_) ReportLocked(w);
}

void LogLimiter::set_sink(std::function<void(const std::string&)> sink) {
  std::lock_guard<std::mutex> lock(mu_);
  sink_ = std::move(sink);
}

void LogLimiter::ReportLocked(Window& w) {
  if (w.suppressed == 0 || !sink_) return;
  const auto secs = std::chrono::duration_cast<std::chrono::seconds>(options_.window).count();
  sink_(w.last + " (and " + std::to_string(w.suppressed - 1) + " more like this in the last " +
        std::to_string(secs) + " s)");
  w.suppressed = 0;
}

void LogLimiter::FlushLocked(Clock::time_point now) {
  for (auto it = windows_.begin(); it != windows_.end();) {
    if (now - it->second.start < options_.window) {
      ++it;
      continue;
    }
    ReportLocked(it->second);
    it = windows_.erase(it);  // a quiet key costs nothing
  }
}

void LogLimiter::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  FlushLocked(now_());
}

void LogLimiter::Log(const std::string& key, const std::string& line) {
  const Clock::time_point now = now_();
  std::lock_guard<std::mutex> lock(mu_);
  FlushLocked(now);
  auto [it, fresh] = windows_.try_emplace(key);
  Window& w = it->second;
  if (fresh) w.start = now;
  if (w.written < options_.burst) {
    ++w.written;
    if (sink_) sink_(line);
    return;
  }
  ++w.suppressed;
  w.last = line;
}

std::string CauseKey(const std::string& message) {
  std::string out;
  out.reserve(message.size());
  for (size_t i = 0; i < message.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(message[i]))) {
      out += message[i];
      continue;
    }
    out += '#';
    while (i + 1 < message.size() && std::isdigit(static_cast<unsigned char>(message[i + 1]))) ++i;
  }
  return out;
}

}  // namespace ckptfs
