// Views: the virtual directories the mount adds next to every checkpoint
// (docs/SEMANTICS.md, "Virtual namespace"), and what their files are made
// of. kViewKinds is the one list of view directory names: the tree (which
// names are views), the builder (what it attaches and opens on lookup) and
// `ckptfs verify` read it. Each view's files are made by a pure function
// of its own header: core/hf_folder.h (consolidated/, consolidated.<dtype>/),
// core/mesh_view.h (mesh/), core/item_views.h (tensors/, bytes/),
// core/lora.h (merged/); fs/ puts them in the tree and cli/ reads them
// through the same planner.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "core/layout.h"

namespace ckptfs {

// One file of a view.
struct ViewFile {
  std::string name;  // relative to the view directory
  std::shared_ptr<const Layout> layout;
  // Non-empty when the file cannot be served (the checkpoint is incomplete,
  // or none of the file's tensors can be read): it is still listed so `ls`
  // shows what would be there, but opening it fails (EIO) with this reason.
  std::string problem;
};

enum class ViewKind { kConsolidated, kMerged, kMesh, kTensors, kBytes };

struct ViewKindInfo {
  ViewKind kind;
  const char* name;  // the directory's name next to the checkpoint
  // Also opened by name as `<name>.<dtype>` (consolidated.bf16/,
  // merged.fp16/): the same view cast on read. Such names are never listed;
  // any non-empty suffix is a request for the view (an unknown dtype is
  // refused with the reason in the log).
  bool dtype_family;
  // Read whole by `ckptfs verify`: together these hold every tensor
  // (tensors/) and every Hugging Face file's header (consolidated/).
  bool verified;
};

// Every view kind, in the order the builder attaches them.
inline constexpr ViewKindInfo kViewKinds[] = {
    {ViewKind::kConsolidated, "consolidated", /*dtype_family=*/true, /*verified=*/true},
    {ViewKind::kMerged, "merged", /*dtype_family=*/true, /*verified=*/false},
    {ViewKind::kMesh, "mesh", /*dtype_family=*/false, /*verified=*/false},
    {ViewKind::kTensors, "tensors", /*dtype_family=*/false, /*verified=*/true},
    {ViewKind::kBytes, "bytes", /*dtype_family=*/false, /*verified=*/false},
};

// The directory name of `kind` ("consolidated").
const char* ViewDirName(ViewKind kind);

// A directory entry's name read as a view: its kind, and for a dtype
// family's `<name>.<suffix>` the suffix ("bf16"; "" for the plain name).
struct ViewName {
  ViewKind kind;
  std::string dtype_suffix;
};
// nullopt when `name` names no view: not a kind's name, nor a family's name
// followed by '.' and a non-empty suffix ("consolidatedx", "merged.",
// "mesh.bf16" are not views).
std::optional<ViewName> ParseViewName(std::string_view name);

}  // namespace ckptfs
