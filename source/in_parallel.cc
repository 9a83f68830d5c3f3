#include "source/in_parallel.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>
#include <vector>

namespace ckptfs {

void ForEachInParallel(size_t n, size_t threads, const std::function<void(size_t)>& work) {
  std::atomic<size_t> next{0};
  auto loop = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) work(i);
  };
  std::vector<std::thread> extra;
  for (size_t t = 1; t < std::min(n, threads); ++t) {
    try {
      extra.emplace_back(loop);
    } catch (const std::system_error&) {
      break;  // fewer side by side: the ones started and this one do every piece
    }
  }
  loop();
  for (std::thread& t : extra) t.join();
}

Status InParallel(size_t n, size_t threads, const std::function<Status(size_t)>& work) {
  std::vector<Status> results(n);
  ForEachInParallel(n, threads, [&](size_t i) { results[i] = work(i); });
  for (const Status& s : results)
    if (!s.ok()) return s;
  return Status::OK();
}

}  // namespace ckptfs
