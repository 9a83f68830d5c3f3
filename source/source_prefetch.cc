#include "source/source_prefetch.h"

#include <algorithm>

#include "core/compute.h"
#include "core/layout.h"

namespace ckptfs {
namespace {

// Read-ahead is planned and hinted this much of the virtual file at a time,
// in file order (one FUSE request's worth).
constexpr uint64_t kHintSlice = 1 << 20;

// The source ranges that computing the blocks of `op` starting inside it
// reads (their inputs). A block is hinted from the slice holding its first
// byte only, so the slices of one window hint each block once.
std::vector<CopyOp> InputCopies(const ComputeOp& op) {
  std::vector<CopyOp> out;
  const Computation& c = *op.computed;
  const uint64_t end = op.offset + op.length;
  uint64_t b = c.BlockAt(op.offset);
  for (; b < c.block_count() && c.block_begin(b) < end; ++b) {
    if (c.block_begin(b) < op.offset) continue;
    for (const ComputeInput& in : c.InputsOf(b)) {
      Layout layout;
      if (!layout.AddTensor(in.tensor, in.box).ok()) continue;
      auto plan = Plan(layout, 0, layout.size());
      if (plan.ok()) out.insert(out.end(), plan->copies.begin(), plan->copies.end());
    }
  }
  return out;
}

}  // namespace

SourcePrefetch::SourcePrefetch(const std::vector<SourceFile>* files, GroupPolicy policy, CheckedObject checked)
    : files_(files), policy_(policy), checked_(std::move(checked)) {}

void SourcePrefetch::Post(std::shared_ptr<const Layout> layout, ReadStream::Window w,
                          std::shared_ptr<const std::atomic<uint64_t>> generation, std::function<void()> then) {
  const uint64_t want = generation->load();
  // Planned on the hint thread: the request that got here is answered first.
  hints_.Post([this, layout, w, generation, want, then = std::move(then)] {
    HintWindow(*layout, w, generation.get(), want);
    if (then && generation->load() == want) then();
  });
}

void SourcePrefetch::HintWindow(const Layout& layout, ReadStream::Window w, const std::atomic<uint64_t>* generation,
                                uint64_t want) {
  // A slice at a time, in the virtual file's order. Grouped by source file
  // over the whole window, the hints queued all of one file's pieces before
  // the next file's: the reader's next request, which needs a piece of
  // every file, waited behind most of the window's I/O.
  const uint64_t end = w.offset + w.length;
  for (uint64_t at = w.offset; at < end; at += kHintSlice) {
    if (generation->load(std::memory_order_relaxed) != want) return;
    auto plan = Plan(layout, at, std::min(kHintSlice, end - at));
    if (!plan.ok()) return;  // the read of those bytes will say why
    // A computed tensor's bytes come from its inputs: those are read ahead.
    for (const ComputeOp& op : plan->computes) {
      std::vector<CopyOp> inputs = InputCopies(op);
      plan->copies.insert(plan->copies.end(), inputs.begin(), inputs.end());
    }
    Prefetch(GroupReads(plan->copies, policy_), *generation, want);
  }
}

void SourcePrefetch::Prefetch(const std::vector<SourceRead>& reads, const std::atomic<uint64_t>& generation,
                              uint64_t want) {
  auto go_on = [&] { return generation.load(std::memory_order_relaxed) == want; };
  for (const SourceRead& r : reads) {
    if ((*files_)[r.file].derived()) continue;
    const SourceObject* obj = PrefetchObject(r.file);
    if (!obj) continue;  // only speed is lost; the read reports any problem
    obj->Prefetch(r.offset, r.length, go_on);
  }
}

const SourceObject* SourcePrefetch::PrefetchObject(FileId id) {
  for (const auto& [open_id, obj] : objects_)
    if (open_id == id) return obj.get();
  auto checked = checked_(id);  // the second object must be this one's file
  if (!checked.ok()) return nullptr;
  if (objects_.size() == kMaxObjects)  // closed first: never one more than the bound
    objects_.erase(objects_.begin());
  auto second = (*checked)->Reopen();
  if (!second.ok()) return nullptr;
  objects_.emplace_back(id, std::move(second).value());
  return objects_.back().second.get();
}

}  // namespace ckptfs
