// Whether the files a checkpoint was indexed from still hold what they held
// then: each is identified again (a local file: size, mtime, ctime, inode;
// an object: ETag and size) and compared with the identity its rows record.
#pragma once

#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

class Source;

// Stats every source file and compares it with the indexed identity; Stale
// naming the first few changed files, or OK.
Status CheckSources(const Catalog& catalog);
// The same for files of one root (`files` as Store::LoadFiles returns them).
Status CheckSources(const std::string& root, const std::vector<SourceFile>& files);
Status CheckSources(const Source& source, const std::vector<SourceFile>& files);

}  // namespace ckptfs
