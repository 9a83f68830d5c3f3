// Reading the DCP `Metadata` pickle (torch.distributed.checkpoint, and the
// formats built on it: Megatron torch_dist, ByteCheckpoint) from the inert
// value tree of the restricted unpickler. Shared by dcp_reader.cc and
// bytecheckpoint_reader.cc.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "indexer/pickle.h"

namespace ckptfs {

// A dataclass field: the BUILD state is the instance dict, or a
// (dict, slots) pair for classes with __slots__. nullptr when absent.
const PickleValue* Field(const PickleValue* v, std::string_view name);

// The class name of a NewObj/Reduce instance (after BUILD wrappers); the
// module is not checked, so both TensorProperties spellings match.
std::string_view ClassOf(const PickleValue* v);
// The module of that class ("torch.distributed.checkpoint.metadata").
std::string_view ModuleOf(const PickleValue* v);

// The element type of a TensorProperties; torch.float4_e2m1fn_x2 is F4
// (ReadDcpMetadata doubles its last dim). nullopt for a dtype the index
// cannot hold.
std::optional<DType> PropertiesDType(const PickleValue* props);
std::optional<uint64_t> UInt(const PickleValue* v);

// One item of a .distcp file.
struct StorageInfo {
  std::string relative_path;
  uint64_t offset = 0, length = 0;
  std::vector<std::string> transforms;
};

struct ChunkKey {
  std::string fqn;
  std::vector<uint64_t> offsets;
  bool operator<(const ChunkKey& o) const { return std::tie(fqn, offsets) < std::tie(o.fqn, o.offsets); }
};

// Fills, from a Metadata object: `tensors` (fqn, dtype, global shape, key
// path from planner_data; no chunks yet), `declared` (each tensor's chunk
// boxes), `storage` (tensor items) and `byte_storage` (BYTE_IO items),
// `reformulated` (Megatron: fqn -> original global shape). When
// `tensor_meta` is given, ByteCheckpoint's all_tensor_metadata blobs (each
// item's own pickled tensor description) go there.
Status ReadDcpMetadata(const std::string& rel, const PickleValue* root, std::map<std::string, TensorMeta>& tensors,
                       std::map<std::string, std::vector<Box>>& declared, std::map<ChunkKey, StorageInfo>& storage,
                       std::map<std::string, StorageInfo>& byte_storage,
                       std::map<std::string, std::vector<uint64_t>>& reformulated,
                       std::map<ChunkKey, std::string>* tensor_meta);

}  // namespace ckptfs
