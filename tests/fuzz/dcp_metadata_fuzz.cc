// libFuzzer target: no input may crash, hang or leak the DCP metadata path
// (indexer/dcp_metadata.h): a `.metadata` pickle is unpickled by the
// restricted unpickler and read as torch.distributed.checkpoint's Metadata,
// as DcpReader and the ByteCheckpoint reader do.
//
//   bash tools/fuzz.sh dcp_metadata_fuzz      # builds into build-fuzz/
//
// Seeds (corpus/dcp_metadata_fuzz/) are `.metadata` files written by
// torch.distributed.checkpoint.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include "indexer/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ckptfs::UnpickleLimits limits;
  limits.max_values = 1 << 16;
  limits.max_memo_entries = 1 << 14;
  limits.max_tree_values = 1 << 16;
  limits.max_depth = 200;
  auto doc = ckptfs::Unpickle(bytes, limits);
  if (!doc.ok()) return 0;
  const ckptfs::PickleValue* root = &(*doc)->root();
  (void)ckptfs::ClassOf(root);
  (void)ckptfs::ModuleOf(root);
  std::map<std::string, ckptfs::TensorMeta> tensors;
  std::map<std::string, std::vector<ckptfs::Box>> declared;
  std::map<ckptfs::ChunkKey, ckptfs::StorageInfo> storage;
  std::map<std::string, ckptfs::StorageInfo> byte_storage;
  std::map<std::string, std::vector<uint64_t>> reformulated;
  std::map<ckptfs::ChunkKey, std::string> tensor_meta;
  ckptfs::Status st =
      ckptfs::ReadDcpMetadata("fuzz", root, tensors, declared, storage, byte_storage, reformulated, &tensor_meta);
  if (!st.ok()) return 0;
  // What the readers rely on: every declared chunk has the rank of its tensor.
  for (const auto& [fqn, boxes] : declared)
    for (const ckptfs::Box& b : boxes)
      if (b.offsets.size() != tensors.at(fqn).shape.size() || b.lengths.size() != b.offsets.size()) std::abort();
  // No item names a file outside the checkpoint's directory.
  for (const auto& [key, si] : storage)
    if (si.relative_path.find('/') != std::string::npos || si.relative_path == "..") std::abort();
  return 0;
}
