// Runs n independent pieces of work on a few short-lived threads: the
// indexer's reads of many files' headers or framing, an S3 object's ranges.
// (A mount's read path uses the long-lived IoPool instead: io_pool.h.)
#pragma once

#include <cstddef>
#include <functional>

#include "core/status.h"

namespace ckptfs {

// Runs work(0) .. work(n - 1), each once, on up to `threads` threads, the
// caller's included; returns when all have returned. When no thread can be
// started, fewer (at least the caller's) do every piece.
void ForEachInParallel(size_t n, size_t threads, const std::function<void(size_t)>& work);

// The same for work that can fail: OK, or the failure of the lowest index
// that failed.
Status InParallel(size_t n, size_t threads, const std::function<Status(size_t)>& work);

}  // namespace ckptfs
