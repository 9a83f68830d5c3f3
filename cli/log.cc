#include "cli/log.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <memory>

namespace ckptfs {

std::optional<LogLevel> ParseLogLevel(const std::string& s) {
  if (s == "error") return LogLevel::kError;
  if (s == "warn" || s == "warning") return LogLevel::kWarn;
  if (s == "info") return LogLevel::kInfo;
  if (s == "debug") return LogLevel::kDebug;
  return std::nullopt;
}

std::optional<Log> Log::Open(const std::string& path, LogLevel level, std::string* error) {
  if (path.empty()) return Log(stderr, "", level);
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f) {
    *error = path + ": " + std::strerror(errno);
    return std::nullopt;
  }
  return Log(f, path, level);
}

Log::Log(Log&& other) noexcept
    : f_(other.f_), path_(std::move(other.path_)), level_(other.level_), mu_(std::move(other.mu_)) {
  other.f_ = nullptr;
}

Log::~Log() {
  if (f_ && f_ != stderr) std::fclose(f_);
}

void Log::Write(LogLevel level, const std::string& line) {
  if (level > level_ || !f_) return;
  static const char* const kNames[] = {"ERROR", "WARN ", "INFO ", "DEBUG"};
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  int ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  struct tm tm;
  gmtime_r(&secs, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%S", &tm);
  std::lock_guard<std::mutex> lock(*mu_);
  std::fprintf(f_, "%s.%03dZ %s ckptfs[%d]: %s\n", stamp, ms, kNames[int(level)], int(::getpid()), line.c_str());
  std::fflush(f_);
}

}  // namespace ckptfs
