// The identity of source files now, for checks of many files at once (a
// stored index before it is served, loaded checkpoints on a rescan): from
// one listing of each directory where the backend's listings tell
// identities (object storage: a LIST per directory, not a HEAD per object),
// else by asking for each file. A file a listing leaves out is asked for
// too, whose answer says what happened to it. One check's worth: listings
// are kept until this is destroyed. Not thread-safe.
#pragma once

#include <map>
#include <string>

#include "core/meta.h"
#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

class IdentitiesNow {
 public:
  // `source` must outlive this.
  explicit IdentitiesNow(const Source& source) : source_(source) {}

  // The identity of file `rel` now (as Source::Identify).
  Result<SourceFile> Of(const std::string& rel);

 private:
  const Source& source_;
  std::map<std::string, Result<SourceListing>> listings_;  // by directory
};

}  // namespace ckptfs
