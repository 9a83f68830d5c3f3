#include "source/file_table.h"

namespace ckptfs {

Result<FileId> FileTable::Add(const std::string& rel) {
  if (auto it = by_path_.find(rel); it != by_path_.end()) return it->second;
  // A symlink may point anywhere; only files inside the root are sources,
  // so a mount never serves bytes from outside what it was given.
  if (!source_.Contains(rel))
    return Status::InvalidArgument(rel + ": resolves outside the source root (a symlink?); not used");
  SourceFile f;
  if (auto listed = listed_.find(rel); listed != listed_.end()) {
    f = listed->second;
  } else {
    ASSIGN_OR_RETURN(f, source_.Identify(rel));
  }
  f.path = rel;
  FileId id = files_.size();
  files_.push_back(std::move(f));
  by_path_[rel] = id;
  return id;
}

FileId FileTable::AddDerived(FileId base, uint64_t offset, uint64_t length, const std::string& transform,
                             uint64_t decoded_size) {
  SourceFile f = files_.at(base);
  f.path += "@" + std::to_string(offset);
  f.size = decoded_size;
  f.transform = transform;
  f.base = base;
  f.base_offset = offset;
  f.base_length = length;
  FileId id = files_.size();
  files_.push_back(std::move(f));
  return id;
}

void FileTable::NoteReadFailure(const Status& st) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (read_failure_.ok()) read_failure_ = st;
}

Status FileTable::read_failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return read_failure_;
}

}  // namespace ckptfs
