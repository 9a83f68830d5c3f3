// One reader per input format behind one interface.
//
// The scanner walks the source tree and offers each directory to every
// reader; the first that recognises it fills a Checkpoint. Readers never
// fail the whole scan for one bad file: they record the problem on the
// Checkpoint (and mark it incomplete when the tensor list cannot be trusted).
#pragma once

#include <map>
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
  std::vector<std::string> linked_dirs;  // links to directories (POSIX), not walked
  // Identities of `files` the listing told (object stores), by name.
  std::map<std::string, SourceFile> known;
  bool has_file(const std::string& name) const;
  // A subdirectory or a link to one.
  bool has_dir(const std::string& name) const;
};

class FormatReader {
 public:
  virtual ~FormatReader() = default;
  // The registry's name for the format (kFormats below): unique, stable,
  // shown by `ckptfs inspect` and the live mount's log.
  virtual std::string name() const = 0;
  // True when `dir` is a checkpoint of this format. Called on every
  // directory of the root, by the scan, by `inspect` and by a live mount's
  // every rescan, so it must be cheap and without effects:
  // - it decides from `dir`'s names (files and dirs) first, and reads bytes
  //   only where the names cannot tell (a name many formats share): at most
  //   the first 512 bytes of a few files named by `dir`, or of a
  //   subdirectory's file it names (ByteCheckpoint's model/.metadata), or,
  //   where a range cannot be read, that one small file whole;
  // - it reads only through dir.source, never lists further, never writes,
  //   caches nothing, keeps no state (one reader serves many threads);
  // - a file it cannot read means "not this format", never an error: Read
  //   reports what is wrong.
  virtual bool Recognise(const DirListing& dir) const = 0;
  // Subdirectories that belong to this checkpoint (ByteCheckpoint's model/
  // and optimizer/): the scanner does not offer them to readers again.
  virtual std::vector<std::string> ClaimedSubdirs(const DirListing& dir) const { return {}; }
  // Fills `out` (dir and format are set by the caller). A non-ok Status means
  // the directory could not be read at all (permission denied, say).
  virtual Status Read(const DirListing& dir, FileTable& files, Checkpoint& out) const = 0;
};

// The registry: one row per format, in the order they are tried (the first
// reader that recognises a directory reads it). Adding a format is its
// reader's .cc (indexer/<format>_reader.cc, defining its factory), one row
// in kFormats (indexer/formats.cc), CMakeLists.txt and docs/FORMATS.md.
struct FormatEntry {
  const char* name;        // == the reader's name()
  const char* recognises;  // what Recognise looks for, in words, for messages
  std::unique_ptr<FormatReader> (*make)();
};

// Every registered format, in the order tried.
const std::vector<FormatEntry>& Formats();

// A reader of every registered format, in the order tried.
std::vector<std::unique_ptr<FormatReader>> AllReaders();

// What the readers look for, every row's `recognises` in order, joined with
// "; " (for "no checkpoint recognised" messages).
std::string DescribeRecognised();

}  // namespace ckptfs
