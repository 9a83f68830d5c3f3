// The compute stage of the read path (see docs/ARCHITECTURE.md, read path
// step 3b): tensors whose bytes are computed from source tensors rather than
// copied (dtype casts; LoRA merges).
//
// A Computation describes one output tensor region. Its output is cut into
// blocks of about kComputeBlockBytes, each computed on its own from the
// regions of source tensors it needs (InputsOf): a reader of a few pages
// pays for one block, never for a whole embedding matrix, and a block is the
// unit fs/ caches (fs/compute_cache.h) so readers faulting pages in any order
// compute it once. A block is a box of the output whose bytes are contiguous:
// whole rows (dim 0) when a row fits in kComputeBlockBytes; else one index of
// dim 0 and a range of dim 1 (and so on down the dims), so a [1, 10^9] tensor
// is as bounded as any other. A computation that needs whole rows (a merge
// normalising each row) says so (KeepsRowsWhole) and bounds its rows itself.
// Planning stays pure: the planner emits ComputeOps (core/planner.h) naming
// the block ranges; the executor reads the inputs through the ordinary
// planner and calls Compute().
//
// Computations are immutable and shared between threads. Each has an id
// unique for the life of the process: cache entries are keyed by it, so a
// rebuilt layout (a re-saved checkpoint) never meets the blocks of the one
// it replaced.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/box.h"
#include "core/dtype.h"
#include "core/meta.h"
#include "core/status.h"
#include "core/uninitialized.h"

namespace ckptfs {

// 4 MiB of output per block: 32 FUSE reads of 128 KiB served by one
// computation, and small enough that 16 threads computing at once hold
// ~100 MiB of inputs and outputs (fp32 inputs are at most 2x an fp16 block).
inline constexpr uint64_t kComputeBlockBytes = 4ull << 20;

// The bytes of a block's input or output. Sized without being zero-filled:
// each is written whole by the read or the computation that fills it, and
// zeroing 4 MiB blocks cost 8-9 % of the daemon's CPU on a cast view.
using BlockBytes = UninitializedBytes;

// A region of a source tensor a block needs, read row-major.
struct ComputeInput {
  std::shared_ptr<const TensorMeta> tensor;
  Box box;
};

class Computation {
 public:
  Computation();
  virtual ~Computation() = default;
  Computation(const Computation&) = delete;
  Computation& operator=(const Computation&) = delete;

  uint64_t id() const { return id_; }
  virtual DType dtype() const = 0;
  virtual const Shape& shape() const = 0;
  // What the log and errors call it ("cast of 'w' to BF16").
  virtual std::string what() const = 0;

  uint64_t nbytes() const;
  uint64_t block_count() const;
  // Output bytes [begin, end) of block `b`.
  uint64_t block_begin(uint64_t b) const;
  uint64_t block_end(uint64_t b) const;
  // The block holding output byte `offset` (< nbytes()).
  uint64_t BlockAt(uint64_t offset) const;
  // Block `b` as a box of the output (rank 0: the empty box).
  Box BlockBox(uint64_t b) const;
  // True when blocks must be whole rows of dim 0 (see above).
  virtual bool KeepsRowsWhole() const { return false; }

  // The source regions block `b` needs, in the order Compute() takes them.
  virtual std::vector<ComputeInput> InputsOf(uint64_t b) const = 0;
  // Block `b`'s output bytes from its inputs' row-major bytes.
  virtual Result<BlockBytes> Compute(uint64_t b, const std::vector<BlockBytes>& inputs) const = 0;

 private:
  struct Blocking;
  Blocking blocking() const;

  uint64_t id_;
};

// `box` of `tensor`, each element cast to `to` (core/cast.h). REQUIRES:
// IsCastable(tensor->dtype) and tensor->dtype != to.
std::shared_ptr<const Computation> MakeCast(std::shared_ptr<const TensorMeta> tensor, const Box& box, DType to);

}  // namespace ckptfs
