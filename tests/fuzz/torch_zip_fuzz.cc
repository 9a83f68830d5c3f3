// libFuzzer target: no input may crash, hang or leak the torch.save archive
// reader (indexer/torch_zip.h): the zip directory, the restricted unpickler
// behind it and the tensor matching. Every tensor it reports must lie inside
// the input.
//
//   bash tools/fuzz.sh torch_zip_fuzz      # builds into build-fuzz/
//
// Seeds (corpus/torch_zip_fuzz/) are real torch.save files. The input is
// offered whole and, as DCP embeds archives in .distcp files, after a prefix.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "indexer/torch_zip.h"

namespace {

void ReadAt(int fd, uint64_t base, uint64_t length, uint64_t file_size) {
  ckptfs::TorchZipLimits limits;
  // Lowered so that a slow input shows up as a timeout, not as a
  // legitimately large archive.
  limits.max_central_directory_bytes = 1 << 20;
  limits.max_entries = 1 << 14;
  limits.pickle.max_values = 1 << 16;
  limits.pickle.max_memo_entries = 1 << 14;
  limits.pickle.max_tree_values = 1 << 16;
  limits.pickle.max_depth = 200;
  auto dir = ckptfs::ReadZipDirectory(fd, base, length, "fuzz", limits);
  if (dir.ok())
    for (const auto& e : dir->entries)
      if (e.data_offset < base || e.data_offset + e.size > base + length) std::abort();
  auto ar = ckptfs::ReadTorchArchive(fd, base, length, "fuzz", limits);
  if (!ar.ok()) return;
  for (const auto& t : ar->tensors) {
    if (t.data_offset > file_size || t.storage_bytes_available > file_size - t.data_offset) std::abort();
    (void)ar->zip.Find(t.storage_key);
  }
  (void)ar->pickle->root().DebugString(1024);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fd = ::memfd_create("torch_zip_fuzz", MFD_CLOEXEC);
  if (fd < 0) return 0;
  if (::write(fd, data, size) == static_cast<ssize_t>(size)) {
    ReadAt(fd, 0, size, size);
    if (size > 16) ReadAt(fd, 16, size - 16, size);
  }
  ::close(fd);
  return 0;
}
