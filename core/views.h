// Views: the virtual files made from a checkpoint (see DESIGN.md, "Virtual
// namespace"). Pure functions from the catalog to named Layouts; fs/ puts
// them in the tree and tools/ reads them through the same planner.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

struct ViewFile {
  std::string name;  // relative to the view directory
  std::shared_ptr<const Layout> layout;
  // Non-empty when the file cannot be served (the checkpoint is incomplete);
  // it is still listed so `ls` shows what would be there.
  std::string problem;
};

struct ConsolidatedOptions {
  // Hugging Face's default max_shard_size ("5GB" = 5 * 10^9 bytes).
  uint64_t max_file_bytes = 5'000'000'000;
};

// The Hugging Face folder for `ckpt`: model.safetensors, or
// model-0000i-of-0000N.safetensors + model.safetensors.index.json (split by
// ckpt.file_index when present, else by max_file_bytes and the header cap),
// plus the sidecar files. `files` is the catalog's file table.
Result<std::vector<ViewFile>> ConsolidatedView(const Checkpoint& ckpt,
                                               const std::vector<SourceFile>& files,
                                               const ConsolidatedOptions& options);

}  // namespace ckptfs
