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

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/box.h"
#include "core/dtype.h"
#include "core/status.h"

namespace ckptfs {

// Index of a source file in its checkpoint's file table (Checkpoint::files).
using FileId = uint32_t;

// The tensor's fqn is TensorMeta::fqn, held once for all its chunks.
struct ShardMeta {
  Box box;
};

struct ByteMeta {
  FileId file = 0;
  uint64_t offset = 0;  // absolute byte offset in the source file
  uint64_t length = 0;
  bool operator==(const ByteMeta&) const = default;
};

struct BasicMeta {
  DType dtype = DType::kF32;
  // Element strides of the stored box; empty means row-major (contiguous).
  std::vector<uint64_t> strides;
};

class SourceObject;

// A chunk placed by prediction, not by its item's framing: a DCP item (a
// torch.save archive) of a contiguous tensor holds its bytes where
// torch.save puts them (indexer/dcp_item.h), so a mount over object storage
// plans and fetches them before the framing is read, and reads the framing
// with them (docs/SEMANTICS.md, "Framing read with the bytes"). No byte of
// such a chunk is served before its item's framing was read and said the
// same: the planner marks copies from an unchecked item (CopyOp::speculative),
// and the read path settles the item before it hands any of them out.
//
// Shared by the chunk's copies; settled once (Settle), by whichever reader
// has the framing's bytes first. Thread-safe.
struct ItemCheck {
  enum State : int { kUnchecked = 0, kVerified, kWrong };
  ByteMeta item;       // the whole item
  ByteMeta predicted;  // where the chunk's bytes are, row-major, if the prediction holds
  Shape shape;         // the item's tensor, as the metadata says
  DType dtype = DType::kF32;
  // The bytes of the item the check reads when torch wrote it (file
  // offset, length): at its head and its tail.
  std::vector<std::pair<uint64_t, uint64_t>> windows;
  // Reads the item's framing through `obj` (a read of a window the caller
  // holds is answered from memory) and settles the check; an error
  // (I/O, a source changed) leaves it unchecked. Set by the indexer.
  // `what` names the item in messages.
  using Verify = Status (*)(const SourceObject& obj, ItemCheck& check, const std::string& what);
  Verify verify = nullptr;

  State state() const { return State(state_.load(std::memory_order_acquire)); }
  // kWrong: where the item holds the chunk's bytes and their strides, or
  // why it cannot be served (non-empty `why`). Valid once state() is kWrong.
  const ByteMeta& actual() const { return actual_; }
  const std::vector<uint64_t>& actual_strides() const { return actual_strides_; }
  const std::string& why() const { return why_; }

  // The gate where bytes leave (docs/SEMANTICS.md, "Framing read with the
  // bytes"): bytes planned from chunk placement `k` (null: placed by its
  // framing) may reach a reader, a pushed page or a computed value only
  // when this holds. Every path that hands out planned bytes asks it.
  static bool Servable(const ItemCheck* k) { return !k || k->state() == kVerified; }

  // Records the outcome once; later calls change nothing.
  void Settle(bool as_predicted, ByteMeta actual = {}, std::vector<uint64_t> strides = {}, std::string why = {});
  // The same prediction, unchecked, with file ids `by` higher (a table that
  // holds another checkpoint's files first: core/lora_view.cc).
  std::shared_ptr<ItemCheck> Renumbered(FileId by) const;

 private:
  std::mutex mu_;  // serializes Settle
  std::atomic<int> state_{kUnchecked};
  ByteMeta actual_;
  std::vector<uint64_t> actual_strides_;
  std::string why_;
};

// One row of each: where a box of the tensor is stored and how to read it.
//
// A checkpoint holds one per shard piece (a million for a large MoE
// checkpoint), so the three are packed into 48 bytes with nothing on the heap
// for the usual chunk: rank <= 2 with dims below 2^32, offset and length
// below 2^48, row-major, readable. Anything else (a wider box, strides, an
// unavailable reason) moves to one heap block. Read and written through the
// accessors; the packing is invisible to callers.
class Chunk {
 public:
  Chunk();
  Chunk(const Box& box, const ByteMeta& bytes, DType dtype = DType::kF32);
  Chunk(const Chunk& o);
  Chunk(Chunk&&) noexcept;
  Chunk& operator=(const Chunk& o);
  Chunk& operator=(Chunk&&) noexcept;
  ~Chunk();

  // ShardMeta: the box in the global tensor.
  Box box() const;
  size_t rank() const;
  void set_box(const Box& box);

  // ByteMeta: where the box's bytes are.
  ByteMeta bytes() const;
  FileId file() const { return file_; }
  uint64_t offset() const;
  uint64_t length() const;
  void set_bytes(const ByteMeta& bytes);

  // BasicMeta: the stored dtype and element strides (empty: row-major).
  DType dtype() const { return dtype_; }
  void set_dtype(DType dtype) { dtype_ = dtype; }
  const std::vector<uint64_t>& strides() const;
  void set_strides(std::vector<uint64_t> strides);

  // Non-empty when the box is known but its bytes cannot be served (the
  // shard file is truncated, say). Reads touching it fail with this reason.
  const std::string& unavailable() const;
  void set_unavailable(std::string why);

  // Non-null when the chunk's ByteMeta and strides are a prediction still
  // to be checked against its item's framing (ItemCheck).
  const std::shared_ptr<ItemCheck>& item_check() const;
  void set_item_check(std::shared_ptr<ItemCheck> check);

  // CRC32C of the chunk's stored bytes, when its writer recorded one
  // (ckptfs's own writer does; checkpoints indexed by a scan have none).
  bool has_crc32c() const { return flags_ & kHasCrc; }
  uint32_t crc32c() const { return crc32c_; }
  void set_crc32c(uint32_t crc) {
    crc32c_ = crc;
    flags_ |= kHasCrc;
  }

 private:
  struct Extra;
  enum : uint8_t { kHasCrc = 1, kWideBox = 2, kWideBytes = 4 };
  Extra& extra();
  void DropEmptyExtra();

  uint32_t offsets_[2] = {0, 0};  // the box, when not kWideBox
  uint32_t lengths_[2] = {0, 0};
  uint32_t offset_lo_ = 0;  // the bytes' offset and length (48 bits
  uint32_t length_lo_ = 0;  // each), when not kWideBytes
  uint16_t offset_hi_ = 0;
  uint16_t length_hi_ = 0;
  FileId file_ = 0;
  uint32_t crc32c_ = 0;
  DType dtype_ = DType::kF32;
  uint8_t rank_ = 0;
  uint8_t flags_ = 0;
  std::unique_ptr<Extra> extra_;
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
  // What pins a read to exactly these bytes, where the backend has such a
  // thing (object storage: the ETag, whose hash is `inode`); "" otherwise.
  // Source::OpenIndexed opens by it without asking the store again.
  std::string version;
  std::string transform;  // "" for a plain file; "zstd"
  // CRC32C of the bytes no tensor chunk covers (BytesOutsideChunks), when
  // the writer recorded one: zip framing, headers, BYTE_IO items.
  bool has_rest_crc32c = false;
  uint32_t rest_crc32c = 0;
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

// The byte ranges of file `file` (of `size` bytes) that no tensor chunk of
// `ckpt` covers, in file order: what a writer wrote besides tensor data.
std::vector<ByteMeta> BytesOutsideChunks(const Checkpoint& ckpt, FileId file, uint64_t size);

// Everything a scan of a source root found.
struct Catalog {
  std::string root;                  // absolute path of the source root
  std::vector<Checkpoint> checkpoints;
  // Checkpoints left out because their files could not be read now (an
  // outage, a server failing past its retries), each saying which and why:
  // not stored, so the next scan reads them again.
  std::vector<std::string> unread;
  int64_t indexed_at_ns = 0;
};

}  // namespace ckptfs
