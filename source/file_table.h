// The table of source files an index refers to, with the identity each had
// when indexed (source/source.h). FileId is the position in the table.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

class FileTable {
 public:
  // `source` must outlive the table.
  explicit FileTable(const Source& source) : source_(source) {}

  // Identifies `rel` and registers it (once). Fails when it is not a
  // regular file, or not inside the root (a symlink leading out).
  Result<FileId> Add(const std::string& rel);
  // Registers the decoded bytes of [offset, offset + length) of `base`.
  FileId AddDerived(FileId base, uint64_t offset, uint64_t length, const std::string& transform,
                    uint64_t decoded_size);

  const Source& source() const { return source_; }
  const SourceFile& at(FileId id) const { return files_.at(id); }
  // Opens registered file `id` (not a derived one).
  Result<std::unique_ptr<SourceObject>> Open(FileId id) const { return source_.Open(files_.at(id).path); }
  std::vector<SourceFile> Take() { return std::move(files_); }

 private:
  const Source& source_;
  std::vector<SourceFile> files_;
  std::map<std::string, FileId> by_path_;
};

}  // namespace ckptfs
