// The checkpoint model every layer shares (vocabulary from ByteCheckpoint).
//
//   ShardMeta (box)               which part of its tensor (the fqn is the tensor's)
//   ByteMeta  (file, offset, len) where that part's bytes are
//   BasicMeta (dtype, strides)    how to read them
//
// A chunk is one row of each. A tensor is its global shape plus chunks that
// tile it exactly once (see core/coverage.h). Readers in indexer/ produce these;
// views in core/ and fs/ consume them and never see a file format.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/box.h"
#include "core/dtype.h"

namespace ckptfs {

// Index of a source file in its checkpoint's file table (Checkpoint::files).
using FileId = uint32_t;

// A value (a string, a vector) that nearly every chunk leaves empty, kept out
// of the chunk: one pointer, null when empty, where the value itself would
// take 24 or 32 bytes in each of a million chunks. Reads as a const T& (an
// empty T when null); assigning an empty T frees it.
template <class T>
class OutOfLine {
 public:
  OutOfLine() = default;
  OutOfLine(T v) { *this = std::move(v); }  // NOLINT: implicit, as a T
  OutOfLine(const OutOfLine& o) : p_(o.p_ ? std::make_unique<T>(*o.p_) : nullptr) {}
  OutOfLine(OutOfLine&&) noexcept = default;
  OutOfLine& operator=(const OutOfLine& o) { return *this = o.get(); }
  OutOfLine& operator=(OutOfLine&&) noexcept = default;
  OutOfLine& operator=(T v) {
    p_ = v.empty() ? nullptr : std::make_unique<T>(std::move(v));
    return *this;
  }
  OutOfLine& operator=(const char* s) requires std::is_same_v<T, std::string> { return *this = T(s); }

  const T& get() const {
    static const T kEmpty;
    return p_ ? *p_ : kEmpty;
  }
  operator const T&() const { return get(); }  // NOLINT: implicit, as a T
  bool empty() const { return !p_; }
  size_t size() const { return get().size(); }
  auto operator[](size_t i) const { return get()[i]; }
  void clear() { p_.reset(); }

  friend bool operator==(const OutOfLine& a, const OutOfLine& b) { return a.get() == b.get(); }
  friend T operator+(T a, const OutOfLine& b) requires std::is_same_v<T, std::string> {
    a += b.get();
    return a;
  }

 private:
  std::unique_ptr<T> p_;
};

// The tensor's fqn is TensorMeta::fqn, held once for all its chunks.
struct ShardMeta {
  Box box;
};

struct ByteMeta {
  FileId file = 0;
  uint64_t offset = 0;  // absolute byte offset in the source file
  uint64_t length = 0;
};

struct BasicMeta {
  DType dtype = DType::kF32;
  // Element strides of the stored box; empty means row-major (contiguous).
  OutOfLine<std::vector<uint64_t>> strides;
};

// 104 bytes, none on the heap for a row-major, readable chunk of rank <= 2
// (Dims, OutOfLine): a million chunks fit in about 100 MiB.
struct Chunk {
  ShardMeta shard;
  ByteMeta bytes;
  BasicMeta basic;
  // Non-empty when the box is known but its bytes cannot be served (the
  // shard file is truncated, say). Reads touching it fail with this reason.
  OutOfLine<std::string> unavailable;
  // CRC32C of the chunk's stored bytes, when its writer recorded one
  // (ckptfs's own writer does; checkpoints indexed by a scan have none).
  bool has_crc32c = false;
  uint32_t crc32c = 0;
};

struct TensorMeta {
  std::string fqn;
  // Where the tensor sat in the saved object: the nested keys
  // ({"model", "layers.0.weight"} for DCP's "model.layers.0.weight"). Empty
  // when the format is flat (safetensors): then the fqn is the only key.
  std::vector<std::string> path;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<Chunk> chunks;
  // Non-empty when the chunks do not tile the tensor (hole, overlap). Reads
  // touching the tensor fail with this reason; nothing is zero-filled.
  std::string problem;

  uint64_t numel() const;
  uint64_t nbytes() const;  // valid shapes only (indexer checks)
};

// A file under the source root, with the identity it had when indexed.
//
// Or a derived source: the decoded bytes of a transformed item (a DCP item
// written through zstd), bytes [base_offset, base_offset + base_length) of
// file `base` decoded with `transform`. Its `size` is the decoded size; its
// identity is the base file's.
struct SourceFile {
  std::string path;  // relative to the source root ("file@offset" when derived)
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  // ctime cannot be set back by a user (utime restores mtime, not ctime), so
  // a rewrite that keeps the size and restores the mtime is still seen.
  int64_t ctime_ns = 0;
  uint64_t inode = 0;
  std::string transform;  // "" for a plain file; "zstd"
  uint32_t base = 0;
  uint64_t base_offset = 0;
  uint64_t base_length = 0;
  bool derived() const { return !transform.empty(); }
};

// One recognised checkpoint: a directory under the source root. It owns
// its file table, so a checkpoint can be indexed, stored, loaded and served
// without touching any other.
struct Checkpoint {
  std::string dir;     // relative to the source root; "" for the root itself
  std::string format;  // "hf-safetensors", "sharded-safetensors", ...
  std::vector<SourceFile> files;  // FileId is the position here
  std::vector<std::shared_ptr<const TensorMeta>> tensors;  // sorted by fqn
  // Files passed through into views (config.json, tokenizer files), keyed
  // by the name they get in the view.
  std::map<std::string, FileId> sidecars;
  // fqn -> 1-based output file index, from fqn_to_file_index_mapping.json.
  std::map<std::string, int> file_index;
  // Non-tensor items (DCP BYTE_IO: each a torch.save blob), by key.
  std::map<std::string, ByteMeta> byte_items;
  // Everything found wrong while indexing, for `ckptfs index` and `check`.
  std::vector<std::string> problems;
  // Non-empty when the tensor list itself cannot be trusted (a shard file
  // whose header cannot be read, a rank's files missing): views of the
  // checkpoint are listed but their reads fail with this reason.
  std::string incomplete;
};

// Everything a scan of a source root found.
struct Catalog {
  std::string root;                  // absolute path of the source root
  std::vector<Checkpoint> checkpoints;
  int64_t indexed_at_ns = 0;
};

}  // namespace ckptfs
