#include "source/tensor_push.h"

#include <algorithm>

#include "core/uninitialized.h"

namespace ckptfs {
namespace {

// A push reads and hands over this much at a time (its buffer), from and to
// multiples of kPushAlign where the file allows, so that the kernel gets
// whole pages.
constexpr uint64_t kPushPiece = 8 << 20;
constexpr uint64_t kPushAlign = 64 << 10;

}  // namespace

void TensorPusher::Push(ReadStream& stream, const std::shared_ptr<const Layout>& layout, size_t unit,
                        uint64_t offset, const PageSink& sink) {
  if (unit >= layout->segments().size()) return;
  const Segment& seg = layout->segments()[unit];
  if (seg.kind != Segment::Kind::kTensor || seg.length > max_bytes_) return;
  auto down = [](uint64_t x) { return x / kPushAlign * kPushAlign; };
  auto up = [&](uint64_t x) { return std::min(layout->size(), (x + kPushAlign - 1) / kPushAlign * kPushAlign); };
  // The whole tensor, the request's own pages too (the reply may fill
  // fewer than a piece): from the request on first (a reader going on
  // from there needs those next), then what lies before.
  const uint64_t lo = down(seg.offset), hi = up(seg.offset + seg.length), at = std::max(lo, down(offset));
  std::vector<ReadStream::Window> ws{{at, hi - at}};
  if (lo < at) ws.push_back({lo, at - lo});
  if (!stream.ClaimUnit(unit)) return;
  std::shared_ptr<const std::atomic<uint64_t>> life = stream.lifetime();
  const uint64_t want = life->load();
  // The sources are prefetched by the prefetch thread, as a stream's are:
  // parts are then allocated by one thread, from one malloc arena (from
  // four push threads, glibc kept twice the part cache in their arenas).
  // The push is queued once they are.
  for (size_t i = 0; i < ws.size(); ++i) {
    std::function<void()> then;
    if (i + 1 == ws.size())
      then = [this, layout, ws, life, want, sink] {
        auto job = [this, layout, ws, life, want, sink] { Run(*layout, ws, *life, want, sink); };
        queues_[next_++ % kPushers].Post(std::move(job));
      };
    prefetch_->Post(layout, ws[i], life, std::move(then));
  }
}

void TensorPusher::Run(const Layout& layout, const std::vector<ReadStream::Window>& ws,
                       const std::atomic<uint64_t>& life, uint64_t want, const PageSink& sink) {
  auto go_on = [&] { return life.load(std::memory_order_relaxed) == want; };
  UninitializedBytes buf;  // written whole by execute_
  for (const ReadStream::Window& w : ws) {
    for (uint64_t at = w.offset; at < w.offset + w.length && go_on(); at += kPushPiece) {
      auto plan = Plan(layout, at, std::min(kPushPiece, w.offset + w.length - at));
      if (!plan.ok() || !plan->computes.empty()) return;
      buf.resize(plan->length);
      if (!execute_(*plan, buf.data()).ok()) return;
      if (go_on()) sink(at, PageBytes{buf.data(), plan->length});
    }
  }
}

void TensorPusher::Stop() {
  for (HintQueue& q : queues_) q.Stop();
}

}  // namespace ckptfs
