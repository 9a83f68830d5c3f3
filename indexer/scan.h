// Builds a Catalog by walking a source tree and offering each directory to
// the format readers (indexer/format_reader.h).
#pragma once

#include <functional>
#include <string>

#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

struct ScanOptions {
  // Called after each directory with (directories done, checkpoints found).
  std::function<void(size_t, size_t)> progress;
  // Overrides every checkpoint's fqn -> file index mapping (JSON file).
  std::string file_index_mapping;
};

// Fails only when `root` cannot be read at all; problems inside checkpoints
// are recorded on them.
Result<Catalog> ScanSource(const std::string& root, const ScanOptions& options = {});

}  // namespace ckptfs
