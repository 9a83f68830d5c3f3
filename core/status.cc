#include "core/status.h"

namespace ckptfs {

const char* CodeName(Status::Code code) {
  switch (code) {
    case Status::Code::kOk: return "OK";
    case Status::Code::kNotFound: return "NotFound";
    case Status::Code::kCorruption: return "Corruption";
    case Status::Code::kInvalidArgument: return "InvalidArgument";
    case Status::Code::kIOError: return "IOError";
    case Status::Code::kNotSupported: return "NotSupported";
    case Status::Code::kStale: return "Stale";
    case Status::Code::kIncomplete: return "Incomplete";
    case Status::Code::kBusy: return "Busy";
    case Status::Code::kPermissionDenied: return "PermissionDenied";
    case Status::Code::kPlanAgain: return "PlanAgain";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return std::string(CodeName(code_)) + ": " + message_;
}

}  // namespace ckptfs
