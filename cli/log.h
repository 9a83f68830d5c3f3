// The mount daemon's log: timestamped, levelled lines to stderr or a file.
//
// A background mount has no terminal and often no syslog (/dev/log is
// absent in containers), so by default it appends to a file next to its
// index and says where in its first lines.
#pragma once

#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace ckptfs {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

// "error", "warn", "info", "debug".
std::optional<LogLevel> ParseLogLevel(const std::string& s);

class Log {
 public:
  // Appends to `path`, or writes to stderr when `path` is empty.
  static std::optional<Log> Open(const std::string& path, LogLevel level, std::string* error);
  Log(Log&& other) noexcept;
  ~Log();

  // "2026-11-23T12:00:00.123Z WARN  ckptfs[1234]: line". Thread-safe.
  void Write(LogLevel level, const std::string& line);
  const std::string& path() const { return path_; }

 private:
  Log(std::FILE* f, std::string path, LogLevel level) : f_(f), path_(std::move(path)), level_(level) {}
  std::FILE* f_;
  std::string path_;
  LogLevel level_;
  std::unique_ptr<std::mutex> mu_ = std::make_unique<std::mutex>();
};

}  // namespace ckptfs
