#include "source/source.h"

#include <cstring>

namespace ckptfs {

Result<std::unique_ptr<SourceObject>> SourceObject::Reopen() const {
  return Status::NotSupported("this source object cannot be reopened");
}

Result<FilledRange> SourceObject::ReadFilled(uint64_t offset, uint64_t len, DirectIo*) const {
  FilledRange out;
  out.buffer = Buffer::Heap(len);
  RETURN_IF_ERROR(ReadAt(offset, len, out.buffer.data()));
  out.data = out.buffer.data();
  return out;
}

Result<std::string> SourceObject::ReadString(uint64_t offset, uint64_t len) const {
  std::string out(len, '\0');
  RETURN_IF_ERROR(ReadAt(offset, len, out.data()));
  return out;
}

Status MemoryObject::ReadAt(uint64_t offset, uint64_t len, char* dst) const {
  if (offset > bytes_.size() || len > bytes_.size() - offset)
    return Status::Corruption("unexpected end of file at byte " + std::to_string(std::min<uint64_t>(offset, bytes_.size())) +
                              " of " + std::to_string(bytes_.size()));
  std::memcpy(dst, bytes_.data() + offset, len);
  return Status::OK();
}

Result<SourceFile> MemoryObject::Identity() const {
  SourceFile f;
  f.size = bytes_.size();
  return f;
}

Result<std::string> Source::ReadRange(const std::string& rel, uint64_t offset, uint64_t len) const {
  ASSIGN_OR_RETURN(std::unique_ptr<SourceObject> obj, Open(rel));
  return obj->ReadString(offset, len);
}

Result<std::string> Source::ReadWhole(const std::string& rel) const {
  ASSIGN_OR_RETURN(std::unique_ptr<SourceObject> obj, Open(rel));
  ASSIGN_OR_RETURN(SourceFile id, obj->Identity());
  return obj->ReadString(0, id.size);
}

std::string JoinRel(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

}  // namespace ckptfs
