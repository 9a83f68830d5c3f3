// One reader per input format behind one interface.
//
// The scanner walks the source tree and offers each directory to every
// reader; the first that recognises it fills a Checkpoint. Readers never
// fail the whole scan for one bad file: they record the problem on the
// Checkpoint (and mark it incomplete when the tensor list cannot be trusted).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/file_table.h"

namespace ckptfs {

// One directory of the source (source/source.h), as the readers see it.
// Readers read its files through the FileTable's source.
struct DirListing {
  const Source* source = nullptr;  // what the listing is of
  std::string rel;                 // relative to the source root; "" for it
  std::vector<std::string> files;  // names of regular files, sorted
  std::vector<std::string> dirs;   // names of subdirectories, sorted
  bool has_file(const std::string& name) const;
};

class FormatReader {
 public:
  virtual ~FormatReader() = default;
  virtual std::string name() const = 0;
  virtual bool Recognise(const DirListing& dir) const = 0;
  // Subdirectories that belong to this checkpoint (ByteCheckpoint's model/
  // and optimizer/): the scanner does not offer them to readers again.
  virtual std::vector<std::string> ClaimedSubdirs(const DirListing& dir) const { return {}; }
  // Fills `out` (dir and format are set by the caller). A non-ok Status means
  // the directory could not be read at all (permission denied, say).
  virtual Status Read(const DirListing& dir, FileTable& files, Checkpoint& out) const = 0;
};

// Every reader, in the order they are tried.
std::vector<std::unique_ptr<FormatReader>> AllReaders();

}  // namespace ckptfs
