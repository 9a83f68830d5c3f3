// mesh/<spec>/rank-NNNNN/: what one rank of a new parallel layout loads,
// from sharding rules (core/sharding.h). Pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/hf_folder.h"
#include "core/meta.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/views.h"

namespace ckptfs {

// Every rank's folder under `spec`: its slice of each tensor it holds (in
// model.safetensors, or split files + index.json when large), the sidecars,
// and layout.json giving each tensor's global shape and this rank's box
// (or, for a fused tensor, the boxes joined), plus `notes` for the whole
// spec (a tp spec that split nothing says so). InvalidArgument with the
// reason when the spec is impossible for this checkpoint; no file is built
// then.
struct MeshFiles {
  std::vector<std::vector<ViewFile>> ranks;  // by rank
  std::vector<std::string> notes;
};
Result<MeshFiles> MeshView(const Checkpoint& ckpt, const std::vector<SourceFile>& files, const MeshSpec& spec,
                           const ShardingRules& rules, const ConsolidatedOptions& options,
                           const DTypeView* dtype = nullptr);

// The text of mesh/README: the grammar, rank order and rules in use.
std::string MeshReadme(const ShardingRules& rules);

}  // namespace ckptfs
