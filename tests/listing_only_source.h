// A Source for unit tests that only lists: every file is missing, nothing
// changes. A test derives from it and overrides List (and DirKey, root)
// to shape the tree a walk or a listing sees.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "source/source.h"

namespace ckptfs {

class ListingOnlySource : public Source {
 public:
  Result<SourceFile> Identify(const std::string& rel) const override { return Status::NotFound(rel); }
  Result<std::unique_ptr<SourceObject>> Open(const std::string& rel) const override { return Status::NotFound(rel); }
  std::string DescribeChange(const SourceFile&, const SourceFile&) const override { return ""; }
  bool Contains(const std::string&) const override { return true; }
  std::optional<int64_t> ChangeTimeNs(const std::string&) const override { return 0; }
  std::optional<int64_t> ModifyTimeNs(const std::string&) const override { return 0; }
};

}  // namespace ckptfs
