// libFuzzer target: no input may crash, hang or leak the restricted
// unpickler or the torch.save reader (indexer/pickle.h, indexer/torch_zip.h).
//
//   bash tools/fuzz.sh pickle_fuzz      # builds into build-fuzz/
//
// Seeds (corpus/pickle_fuzz/): data.pkl files and DCP .metadata pickles.
//
// Each input is unpickled, the result is walked through every accessor, and
// the same bytes are offered to the zip reader through a memfd. Limits are
// lowered so that a slow input shows up as a timeout, not as a legitimately
// large pickle.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "indexer/pickle.h"
#include "indexer/torch_zip.h"

namespace {

using ckptfs::PickleValue;

size_t Touch(const PickleValue& v, int depth) {
  size_t n = 1;
  (void)v.AsBool();
  (void)v.AsInt();
  (void)v.AsFloat();
  (void)v.AsStr();
  (void)v.global_module();
  (void)v.IsGlobal("torch", "Size");
  (void)v.DictGet("key");
  (void)v.DictGetInt(0);
  (void)v.At(0);
  (void)v.Unwrapped();
  (void)v.CallArgs("torch._utils", "_rebuild_tensor_v2");
  (void)ckptfs::AsShape(v);
  (void)ckptfs::MatchTorchTensor(v);
  if (depth > 64) return n;
  if (const auto* items = v.AsSequence())
    for (const PickleValue* c : *items) n += Touch(*c, depth + 1);
  if (const auto* items = v.AsSet())
    for (const PickleValue* c : *items) n += Touch(*c, depth + 1);
  if (const auto* entries = v.AsDict())
    for (const auto& e : *entries) n += Touch(*e.key, depth + 1) + Touch(*e.value, depth + 1);
  for (const PickleValue* c : {v.callable(), v.args(), v.kwargs(), v.built_object(), v.build_state(), v.pid()})
    if (c) n += Touch(*c, depth + 1);
  for (const PickleValue* c : v.object_list_items()) n += Touch(*c, depth + 1);
  for (const auto& e : v.object_dict_items()) n += Touch(*e.key, depth + 1) + Touch(*e.value, depth + 1);
  return n;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ckptfs::UnpickleLimits limits;
  limits.max_values = 1 << 16;
  limits.max_memo_entries = 1 << 14;
  limits.max_tree_values = 1 << 16;
  limits.max_depth = 200;
  auto doc = ckptfs::Unpickle(bytes, limits);
  if (doc.ok()) {
    (void)(*doc)->root().DebugString(1024);
    (void)Touch((*doc)->root(), 0);
  }

  int fd = ::memfd_create("pickle_fuzz", MFD_CLOEXEC);
  if (fd >= 0) {
    if (::write(fd, data, size) == static_cast<ssize_t>(size)) {
      ckptfs::TorchZipLimits zl;
      zl.pickle = limits;
      auto ar = ckptfs::ReadTorchArchive(fd, 0, size, "fuzz", zl);
      // Also as an item embedded after a prefix, as in a .distcp file.
      if (size > 8) (void)ckptfs::ReadTorchArchive(fd, 8, size - 8, "fuzz@8", zl);
    }
    ::close(fd);
  }
  return 0;
}
