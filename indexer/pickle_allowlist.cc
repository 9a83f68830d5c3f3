// The globals a checkpoint's pickle may name (IsAllowedGlobal, pickle.h):
// what torch.save and DCP's .metadata write, and nothing that runs code
// when Python unpickles it. A global not listed still unpickles here (as
// an inert Global node); the allowlist tells callers which to refuse.
#include <string_view>

#include "indexer/pickle.h"

namespace ckptfs {

namespace {

struct GlobalName {
  std::string_view module;
  std::string_view name;
};

// Exact (module, name) pairs on the allowlist. Why each is there: the
// tensor rebuild functions, storage classes and dtypes are what torch.save
// writes; the layout/memory-format names, torch.Size and the DCP classes are
// what `.metadata` writes; the builtins are how protocol 0-2 spell sets,
// bytes and OrderedDicts; pathlib is StorageMeta.checkpoint_id; numpy scalars
// appear in optimizer and trainer state.
constexpr GlobalName kAllowed[] = {
    {"torch._utils", "_rebuild_tensor"},
    {"torch._utils", "_rebuild_tensor_v2"},
    {"torch._utils", "_rebuild_tensor_v3"},
    {"torch._utils", "_rebuild_parameter"},
    {"torch._utils", "_rebuild_parameter_with_state"},
    {"torch._tensor", "_rebuild_from_type_v2"},
    {"torch.nn.parameter", "Parameter"},
    {"torch.storage", "UntypedStorage"},
    {"torch.storage", "TypedStorage"},
    {"torch", "UntypedStorage"},
    {"torch", "TypedStorage"},
    {"torch", "Size"},
    {"torch", "device"},
    {"torch.serialization", "_get_layout"},
    {"torch.distributed.checkpoint.filesystem", "_StorageInfo"},
    {"collections", "OrderedDict"},
    {"builtins", "set"},
    {"builtins", "frozenset"},
    {"builtins", "bytes"},
    {"builtins", "bytearray"},
    {"_codecs", "encode"},
    {"pathlib", "Path"},
    {"pathlib", "PosixPath"},
    {"pathlib", "PurePosixPath"},
    {"pathlib", "WindowsPath"},
    {"pathlib", "PureWindowsPath"},
    {"pathlib._local", "Path"},  // Python 3.13 moved the classes here
    {"pathlib._local", "PosixPath"},
    {"pathlib._local", "PurePosixPath"},
    {"pathlib._local", "WindowsPath"},
    {"pathlib._local", "PureWindowsPath"},
    {"numpy", "dtype"},
    {"numpy.core.multiarray", "scalar"},
    {"numpy._core.multiarray", "scalar"},  // numpy >= 2
};

// Modules all of whose names are allowed: DCP metadata classes (torch <= 2.2
// spells TensorProperties' module the _shard way).
constexpr std::string_view kAllowedModules[] = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed._shard.sharded_tensor.metadata",
};

// Names under module `torch`: storages, dtypes, layouts, memory formats.
constexpr std::string_view kTorchNames[] = {
    "DoubleStorage", "FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage",
    "IntStorage", "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage",
    "ComplexFloatStorage", "ComplexDoubleStorage",
    "float32", "float", "float64", "double", "float16", "half", "bfloat16", "int64", "long",
    "int32", "int", "int16", "short", "int8", "uint8", "bool", "uint16", "uint32", "uint64",
    "complex32", "chalf", "complex64", "cfloat", "complex128", "cdouble", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc",
    "contiguous_format", "preserve_format", "channels_last", "channels_last_3d",
};

}  // namespace

bool IsAllowedGlobal(std::string_view module, std::string_view name) {
  for (const auto& g : kAllowed)
    if (g.module == module && g.name == name) return true;
  for (auto m : kAllowedModules)
    if (m == module) return true;
  if (module == "torch")
    for (auto n : kTorchNames)
      if (n == name) return true;
  return false;
}

}  // namespace ckptfs
