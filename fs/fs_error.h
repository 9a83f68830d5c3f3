// The filesystem's error: an errno for the kernel plus a message for the log.
// The whole errno contract lives here and in docs/SEMANTICS.md.
#pragma once

#include <cerrno>
#include <string>

#include "core/status.h"

namespace ckptfs {

class FsError {
 public:
  FsError() = default;
  FsError(int err, std::string message) : err_(err), message_(std::move(message)) {}

  // Library Status -> errno:
  //   NotFound -> ENOENT; InvalidArgument -> EINVAL;
  //   Corruption, IOError, NotSupported, Stale, Incomplete -> EIO
  //   (the data cannot be served; the message says why).
  static FsError From(const Status& s);

  bool ok() const { return err_ == 0; }
  int err() const { return err_; }
  const std::string& message() const { return message_; }

 private:
  int err_ = 0;
  std::string message_;
};

template <typename T>
using FsResult = Result<T, FsError>;

}  // namespace ckptfs
