// The virtual-file model: a Layout is an ordered list of segments whose bytes
// are known without reading any data.
//
//   literal   bytes held in memory (a safetensors header, a JSON file)
//   tensor    the row-major bytes of a box of a tensor, gathered from chunks
//   source    a byte range of one source file, passed through (sidecars)
//   computed  the bytes of a tensor computed from source tensors (a dtype
//             cast, a LoRA merge: core/compute.h)
//
// Sizes are fixed when the layout is built, so stat and readdir never read
// shard data. Layouts are immutable and shared between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/compute.h"
#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

struct Segment {
  enum class Kind { kLiteral, kTensor, kSource, kComputed };
  Kind kind = Kind::kLiteral;
  uint64_t offset = 0;  // in the virtual file
  uint64_t length = 0;

  std::shared_ptr<const std::string> literal;  // kLiteral
  std::shared_ptr<const TensorMeta> tensor;    // kTensor
  Box box;                                     // kTensor: the region, global coords
  bool convert = false;                        // kTensor: bytes are `as`, decoded on read
  DType as = DType::kF32;
  FileId file = 0;                             // kSource
  uint64_t file_offset = 0;                    // kSource
  std::shared_ptr<const Computation> computed;  // kComputed: all its output bytes
};

class Layout {
 public:
  void AddLiteral(std::string bytes);
  // The bytes of `box` of `tensor`, row-major. Fails when the box is outside
  // the tensor or its size is not whole bytes.
  Status AddTensor(std::shared_ptr<const TensorMeta> tensor, const Box& box);
  // The same elements converted to float32 on read (core/convert.h).
  Status AddTensorAsFloat32(std::shared_ptr<const TensorMeta> tensor, const Box& box);
  void AddSource(FileId file, uint64_t file_offset, uint64_t length);
  void AddComputed(std::shared_ptr<const Computation> c);
  // Room for `n` segments: a layout lives as long as its checkpoint is loaded,
  // and growth by doubling would leave up to half its segments unused.
  void Reserve(size_t n) { segments_.reserve(n); }

  uint64_t size() const { return size_; }
  const std::vector<Segment>& segments() const { return segments_; }
  // The index of the segment holding byte `offset`: the last segment when
  // offset is at or past the end, 0 for an empty layout.
  size_t SegmentAt(uint64_t offset) const;

 private:
  std::vector<Segment> segments_;
  uint64_t size_ = 0;
};

// A box of a tensor, stored in a file under `name` (the fqn when empty).
// Or, for one rank's share of a fused tensor (Phi-3 qkv_proj: its q, k and v
// rows), several boxes joined along `join_dim`: then `joined` holds them in
// order and `box` is unused.
//
// `cast`, when set, serves the elements cast to that dtype (a dtype view);
// dtype() is then the stored entry's dtype. `computed`, when set, serves
// that computation's output instead (a LoRA merge: core/lora.h); `tensor`
// then names the base tensor it replaces, `cast` the computation's dtype.
struct TensorSlice {
  std::shared_ptr<const TensorMeta> tensor;
  Box box;
  std::string name;
  std::vector<Box> joined;
  int join_dim = 0;
  std::optional<DType> cast;
  std::shared_ptr<const Computation> computed;
  const std::string& entry_name() const { return name.empty() ? tensor->fqn : name; }
  DType dtype() const { return cast ? *cast : tensor->dtype; }
  // The stored entry's shape: box.lengths, or the joined boxes' sum.
  Shape shape() const;
  uint64_t nbytes() const;
  // Boxes whose row-major bytes, one after another, are the entry's
  // row-major bytes (joining along dim d > 0 interleaves the parts once per
  // index of the dims before d).
  std::vector<Box> ByteOrder() const;
  static TensorSlice Whole(std::shared_ptr<const TensorMeta> t) {
    Box b = Box::Whole(t->shape);
    return {std::move(t), std::move(b), "", {}, 0, std::nullopt, nullptr};
  }
};
using SliceList = std::vector<TensorSlice>;

// The Hugging Face tensor order in a safetensors file: larger dtypes first
// (keeps payloads aligned), then by name.
void SortForSafetensors(SliceList& slices);

// Virtual safetensors files start their data on a page boundary: the header
// page then never shares a page with tensor bytes, so when one tensor cannot
// be served (EIO), the kernel's per-page retry still reads the header and the
// other tensors. Readers accept any padding; it stays a multiple of 8.
inline constexpr uint64_t kVirtualDataAlignment = 4096;

// A safetensors file holding `slices` in the given order, with `metadata` as
// __metadata__. Each entry's shape is its box's lengths.
Result<Layout> SafetensorsFileLayout(const SliceList& slices, const std::map<std::string, std::string>& metadata);

// Bytes the safetensors header for `slices` takes (prefix included), for
// planning file splits without building the layout.
uint64_t SafetensorsHeaderSize(const SliceList& slices, const std::map<std::string, std::string>& metadata);

}  // namespace ckptfs
