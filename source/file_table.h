// The table of source files an index refers to, with the identity each had
// when indexed (source/source.h). FileId is the position in the table.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

class FileTable {
 public:
  // `source` must outlive the table. `listed`: identities a listing of the
  // same moment told (SourceListing::known), by path; a file there is not
  // asked again.
  explicit FileTable(const Source& source, std::map<std::string, SourceFile> listed = {})
      : source_(source), listed_(std::move(listed)) {}

  // Identifies `rel` (from the listing when it told, else by asking the
  // source) and registers it (once). Fails when it is not a regular file,
  // or not inside the root (a symlink leading out).
  Result<FileId> Add(const std::string& rel);
  // Registers the decoded bytes of [offset, offset + length) of `base`.
  FileId AddDerived(FileId base, uint64_t offset, uint64_t length, const std::string& transform,
                    uint64_t decoded_size);

  const Source& source() const { return source_; }
  const SourceFile& at(FileId id) const { return files_.at(id); }
  // Opens registered file `id` (not a derived one), at the identity it was
  // registered with (Source::OpenIndexed).
  Result<std::unique_ptr<SourceObject>> Open(FileId id) const { return source_.OpenIndexed(files_.at(id)); }
  // All of registered file `id`, read as Open opens it.
  Result<std::string> ReadWhole(FileId id) const { return source_.ReadWholeIndexed(files_.at(id)); }
  std::vector<SourceFile> Take() { return std::move(files_); }

  // Whether readers may place a DCP item's chunk by prediction and leave its
  // framing to be read with its bytes (indexer/dcp_item.h; a mount over
  // object storage asks for it, ScanOptions::predict_items).
  void set_predict_items(bool on) { predict_items_ = on; }
  bool predict_items() const { return predict_items_; }

  // A source of the checkpoint could not be read now (the indexer's
  // IsReadFailure: I/O, a change while indexing, a refusal): the first such
  // failure is kept, and the indexing of the checkpoint fails with it
  // instead of storing it as a problem of the checkpoint's bytes.
  void NoteReadFailure(const Status& st);
  Status read_failure() const;

 private:
  const Source& source_;
  std::map<std::string, SourceFile> listed_;
  std::vector<SourceFile> files_;
  std::map<std::string, FileId> by_path_;
  mutable std::mutex failure_mu_;  // readers read headers side by side
  Status read_failure_;
  bool predict_items_ = false;
};

}  // namespace ckptfs
