#include "source/identities_now.h"

namespace ckptfs {

Result<SourceFile> IdentitiesNow::Of(const std::string& rel) {
  if (source_.ListingsIdentify()) {
    const size_t slash = rel.rfind('/');
    const std::string dir = slash == std::string::npos ? "" : rel.substr(0, slash);
    auto it = listings_.find(dir);
    if (it == listings_.end()) it = listings_.emplace(dir, source_.List(dir)).first;
    if (it->second.ok()) {
      const auto& known = it->second->known;
      if (auto f = known.find(rel.substr(slash + 1)); f != known.end()) return f->second;
    }
  }
  return source_.Identify(rel);
}

}  // namespace ckptfs
