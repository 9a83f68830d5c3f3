#include "core/views.h"

namespace ckptfs {

const char* ViewDirName(ViewKind kind) {
  for (const ViewKindInfo& k : kViewKinds)
    if (k.kind == kind) return k.name;
  return "";  // unreachable: every kind has a row
}

std::optional<ViewName> ParseViewName(std::string_view name) {
  for (const ViewKindInfo& k : kViewKinds) {
    const std::string_view base = k.name;
    if (name == base) return ViewName{k.kind, ""};
    if (k.dtype_family && name.size() > base.size() + 1 && name.starts_with(base) && name[base.size()] == '.')
      return ViewName{k.kind, std::string(name.substr(base.size() + 1))};
  }
  return std::nullopt;
}

}  // namespace ckptfs
