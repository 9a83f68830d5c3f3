// FsOptions: what a VirtualFs (fs/virtual_fs.h) and its parts are told at
// mount time, and where checkpoints' rows come from.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>

#include "core/meta.h"
#include "core/hf_folder.h"
#include "source/source_reader.h"

namespace ckptfs {

struct FsOptions {
  ConsolidatedOptions consolidated;
  // Contents of a mesh rules file (`--rules`), or empty for the presets.
  std::string rules_json;
  uid_t uid = 0;
  gid_t gid = 0;
  // Checkpoints kept loaded (rows, plans, views); beyond it the least
  // recently used one with no open file is unloaded and loaded again on its
  // next use. 0 = no limit (the CLI's one-shot commands).
  size_t max_loaded = 0;
  // Receives one line per served error (EIO on a read, say) and per view
  // that could not be built. Must be thread-safe.
  std::function<void(const std::string&)> log;
  // Receives one line per checkpoint loaded or unloaded. May be empty.
  std::function<void(const std::string&)> info;
  // Asks the kernel to drop what it cached of inode `ino` (pages and
  // attributes). Called from a reader thread, never while a lock is held;
  // the mount queues it (invalidating from inside a read of the same inode
  // would deadlock on the page lock). May be empty (no kernel cache: cat,
  // export, tests).
  std::function<void(uint64_t ino)> invalidate;
  // Likewise for the kernel's cached name `name` in directory `parent`
  // (a view of a replaced or removed checkpoint).
  using InvalidateEntry = std::function<void(uint64_t parent, const std::string& name)>;
  InvalidateEntry invalidate_entry;
  // Stores `bytes` at `offset` of inode `ino` in the kernel's page
  // cache: whole tensors read ahead of their readers
  // (ReadOptions::push_tensor_bytes). Called from a push thread; does
  // nothing unless `valid()` holds, checked in the same step as the store
  // against `invalidate` (which the mount orders after it): pages of a
  // checkpoint found stale are never stored. May be empty (no pushes).
  using Store =
      std::function<void(uint64_t ino, uint64_t offset, const PageBytes& bytes, const std::function<bool()>& valid)>;
  Store store;
  // Read-ahead and overlapped source reads (source/source_reader.h).
  ReadOptions read;
  // Tensors a dtype view (consolidated.<dtype>/, mesh/<spec>.<dtype>/)
  // keeps as saved: a regex searched in their names (`--keep-dtype`).
  std::string keep_dtype;
  // Bytes of computed tensor blocks kept for readers (`--compute-cache-mib`,
  // fs/compute_cache.h). 512 MiB: a ~1B-parameter model's largest matrices
  // many times over, 2 % of a 24 GiB machine, which the page cache needs
  // more (it holds the served pages themselves).
  uint64_t compute_cache_bytes = 512ull << 20;
  // Check each chunk's recorded CRC32C on its first read; a mismatch is EIO
  // for the reads touching that chunk (ChecksumGate, source/checksums.h).
  bool verify_checksums = false;

  void Log(const std::string& line) const {
    if (log) log(line);
  }
  void Info(const std::string& line) const {
    if (info) info(line);
  }
};

// Loads the rows of the checkpoint in directory `dir` (relative to the root).
using CheckpointLoader = std::function<Result<Checkpoint>(const std::string& dir)>;

}  // namespace ckptfs
