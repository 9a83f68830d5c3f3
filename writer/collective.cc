// The in-process thread group and the default Broadcast/Barrier (what and
// why: collective.h).
#include "writer/collective.h"

#include <condition_variable>
#include <mutex>

namespace ckptfs {

Status Collective::Broadcast(std::string* data, int root) {
  if (root < 0 || root >= size()) return Status::InvalidArgument("broadcast root " + std::to_string(root) + " out of range");
  ASSIGN_OR_RETURN(auto all, AllGather(rank() == root ? *data : std::string()));
  *data = std::move(all[root]);
  return Status::OK();
}

Status Collective::Barrier() { return AllGather(std::string()).status(); }

namespace {

// Rounds are numbered; a round completes when the last rank arrives, which
// publishes the slots and wakes the others. A rank cannot enter the next
// round's publish before every rank has copied this one's result, because
// the next round needs every rank to arrive again.
struct ThreadGroupState {
  explicit ThreadGroupState(int n, std::chrono::milliseconds t) : size(n), timeout(t), slots(n) {}
  const int size;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t round = 0;  // GUARDED_BY(mu)
  int arrived = 0;     // GUARDED_BY(mu)
  std::vector<std::string> slots, result;  // GUARDED_BY(mu)
};

class ThreadCollective : public Collective {
 public:
  ThreadCollective(std::shared_ptr<ThreadGroupState> g, int rank) : g_(std::move(g)), rank_(rank) {}
  const char* name() const override { return "threads"; }
  int rank() const override { return rank_; }
  int size() const override { return g_->size; }

  Result<std::vector<std::string>> AllGather(const std::string& mine) override {
    std::unique_lock<std::mutex> lock(g_->mu);
    const uint64_t my_round = g_->round;
    g_->slots[rank_] = mine;
    if (++g_->arrived == g_->size) {
      g_->result = g_->slots;
      g_->arrived = 0;
      ++g_->round;
      g_->cv.notify_all();
      return g_->result;
    }
    if (!g_->cv.wait_for(lock, g_->timeout, [&] { return g_->round != my_round; }))
      return Status::IOError("thread collective: rank " + std::to_string(rank_) + " waited " +
                             std::to_string(g_->timeout.count()) + " ms for " +
                             std::to_string(g_->size - g_->arrived) + " other rank(s)");
    return g_->result;
  }

 private:
  std::shared_ptr<ThreadGroupState> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Collective>> MakeThreadGroup(int size, std::chrono::milliseconds timeout) {
  auto g = std::make_shared<ThreadGroupState>(size, timeout);
  std::vector<std::unique_ptr<Collective>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<ThreadCollective>(g, r));
  return out;
}

#ifndef CKPTFS_HAVE_CUDA
int VisibleCudaDevices() { return 0; }
#endif

}  // namespace ckptfs
