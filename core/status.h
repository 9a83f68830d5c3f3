// Status and Result<T>: how every ckptfs library reports failure.
//
// A Status is a value. ok() is cheap; errors come from named factories with a
// precise message ("shard-00002-...: header length 1e18 exceeds file size").
// No exception crosses a library boundary. Each code maps to one errno in
// fs/fs_error.h (FsError::From), and to one exit code in cli/cli.h (see docs/SEMANTICS.md).
#pragma once

#include <cassert>
#include <optional>
#include <string>
#include <utility>

namespace ckptfs {

class Status {
 public:
  enum class Code {
    kOk = 0,
    kNotFound,         // no such tensor / file / view
    kCorruption,       // bytes on disk contradict the format
    kInvalidArgument,  // caller asked for something impossible
    kIOError,          // the OS refused (errno in the message)
    kNotSupported,     // valid input we do not handle
    kStale,            // a source file changed after indexing
    kIncomplete,       // the checkpoint lacks data (hole, missing shard)
    kBusy,             // another process holds it (the index's writer lock)
    kPermissionDenied, // the source refused us (object storage: 403)
    kPlanAgain,        // a read was planned on a prediction found wrong (ItemCheck): plan it again
  };

  Status() = default;
  static Status OK() { return Status(); }
  static Status NotFound(std::string m) { return Status(Code::kNotFound, std::move(m)); }
  static Status Corruption(std::string m) { return Status(Code::kCorruption, std::move(m)); }
  static Status InvalidArgument(std::string m) { return Status(Code::kInvalidArgument, std::move(m)); }
  static Status IOError(std::string m) { return Status(Code::kIOError, std::move(m)); }
  static Status NotSupported(std::string m) { return Status(Code::kNotSupported, std::move(m)); }
  static Status Stale(std::string m) { return Status(Code::kStale, std::move(m)); }
  static Status Incomplete(std::string m) { return Status(Code::kIncomplete, std::move(m)); }
  static Status Busy(std::string m) { return Status(Code::kBusy, std::move(m)); }
  static Status PermissionDenied(std::string m) { return Status(Code::kPermissionDenied, std::move(m)); }
  static Status PlanAgain(std::string m) { return Status(Code::kPlanAgain, std::move(m)); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "Corruption: <message>"
  std::string ToString() const;

  // Returns a copy whose message is prefixed with `context: `.
  Status WithContext(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  Status(Code c, std::string m) : code_(c), message_(std::move(m)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

const char* CodeName(Status::Code code);

// A value or the error that explains why there is none. `E` is Status
// except in fs/, whose errors carry an errno (fs/fs_error.h); a default
// constructed E must be ok().
template <typename T, typename E = Status>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  Result(E status) : status_(std::move(status)) { assert(!status_.ok()); }  // NOLINT
  bool ok() const { return status_.ok(); }
  const E& status() const { return status_; }
  T& value() & { assert(ok()); return *value_; }
  const T& value() const& { assert(ok()); return *value_; }
  T&& value() && { assert(ok()); return std::move(*value_); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  E status_;
  std::optional<T> value_;
};

}  // namespace ckptfs

#define CKPTFS_CONCAT_INNER(a, b) a##b
#define CKPTFS_CONCAT(a, b) CKPTFS_CONCAT_INNER(a, b)

// Returns the Status from the enclosing function if `expr` is not ok.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::ckptfs::Status _st = (expr);             \
    if (!_st.ok()) return _st;                 \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX())`: binds the value or returns the Status.
#define ASSIGN_OR_RETURN(lhs, expr)                                   \
  auto CKPTFS_CONCAT(_res_, __LINE__) = (expr);                       \
  if (!CKPTFS_CONCAT(_res_, __LINE__).ok())                           \
    return CKPTFS_CONCAT(_res_, __LINE__).status();                   \
  lhs = std::move(CKPTFS_CONCAT(_res_, __LINE__)).value()
