#include "fs/compute_cache.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "core/layout.h"

namespace ckptfs {

Status ComputeCache::Fill(const std::vector<ComputeOp>& ops, char* dst, SourceReader& reader, int owner) {
  for (const ComputeOp& op : ops) {
    const Computation& c = *op.computed;
    uint64_t b = c.BlockAt(op.offset);
    for (uint64_t done = 0; done < op.length; ++b) {
      const uint64_t at = op.offset + done;
      const uint64_t begin = c.block_begin(b), end = c.block_end(b);
      if (at < begin || at >= end)
        return Status::Corruption(c.what() + ": byte " + std::to_string(at) + " is in no block");
      ASSIGN_OR_RETURN(Block block, Get(c, b, reader, owner));
      const uint64_t n = std::min(end - at, op.length - done);
      std::memcpy(dst + op.dst_offset + done, block.bytes->data() + (at - begin), n);
      done += n;
    }
  }
  return Status::OK();
}

Result<ComputeCache::Block> ComputeCache::Get(const Computation& c, uint64_t b, SourceReader& reader, int owner) {
  const Key key{c.id(), b};
  std::promise<Result<Block>> promise;
  std::shared_future<Result<Block>> ready;
  bool mine = false;
  uint64_t serial = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(key);
    if (it != slots_.end()) {
      ++hits_;
      if (it->second.kept) lru_.splice(lru_.begin(), lru_, it->second.lru);
      ready = it->second.ready;
    } else {
      ready = promise.get_future().share();
      serial = ++serial_;
      slots_.emplace(key, Slot{ready, owner, serial, 0, false, {}});
      mine = true;
    }
  }
  if (!mine) {
    Result<Block> block = ready.get();
    if (!block.ok()) return block.status();
    RETURN_IF_ERROR(reader.CheckSources(block->files));
    return block;
  }
  std::optional<Result<Block>> computed;
  try {
    computed.emplace(ComputeBlock(c, b, reader));
  } catch (...) {
    // bad_alloc: the waiters get it too, and the slot goes, so that a read
    // after memory is free again computes the block anew.
    promise.set_exception(std::current_exception());
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(key);
    if (it != slots_.end() && it->second.serial == serial) EraseLocked(it);
    throw;
  }
  Result<Block> block = std::move(*computed);
  promise.set_value(block);
  std::lock_guard<std::mutex> lock(mu_);
  ++computed_;
  auto it = slots_.find(key);
  if (it == slots_.end() || it->second.serial != serial) return block;  // dropped meanwhile
  if (!block.ok()) {
    EraseLocked(it);  // the next read tries again
    return block;
  }
  KeepLocked(key, block->bytes->size());
  return block;
}

Result<ComputeCache::Block> ComputeCache::ComputeBlock(const Computation& c, uint64_t b, SourceReader& reader) {
  Block block;
  std::vector<BlockBytes> inputs;
  for (const ComputeInput& in : c.InputsOf(b)) {
    Layout layout;
    RETURN_IF_ERROR(layout.AddTensor(in.tensor, in.box));
    BlockBytes bytes(layout.size());
    auto plan = reader.ReadLaidOut(layout, 0, layout.size(), bytes.data());
    if (!plan.ok()) return plan.status().WithContext(c.what());
    for (const CopyOp& op : plan->copies) block.files.push_back(op.file);
    inputs.push_back(std::move(bytes));
  }
  std::sort(block.files.begin(), block.files.end());
  block.files.erase(std::unique(block.files.begin(), block.files.end()), block.files.end());
  ASSIGN_OR_RETURN(BlockBytes out, c.Compute(b, inputs));
  block.bytes = std::make_shared<const BlockBytes>(std::move(out));
  return block;
}

void ComputeCache::KeepLocked(const Key& key, uint64_t size) {
  auto it = slots_.find(key);
  if (size > budget_) {
    EraseLocked(it);
    return;
  }
  while (kept_bytes_ + size > budget_ && !lru_.empty()) EraseLocked(slots_.find(lru_.back()));
  lru_.push_front(key);
  it->second.kept = true;
  it->second.size = size;
  it->second.lru = lru_.begin();
  kept_bytes_ += size;
}

void ComputeCache::EraseLocked(std::map<Key, Slot>::iterator it) {
  if (it->second.kept) {
    kept_bytes_ -= it->second.size;
    lru_.erase(it->second.lru);
  }
  slots_.erase(it);
}

void ComputeCache::Drop(int owner) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = slots_.begin(); it != slots_.end();) {
    auto next = std::next(it);
    if (it->second.owner == owner) EraseLocked(it);
    it = next;
  }
}

ComputeCache::Stats ComputeCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {computed_, hits_, kept_bytes_};
}

}  // namespace ckptfs
