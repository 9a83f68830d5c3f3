// Where a checkpoint's bytes live: one interface to list a source root,
// identify its files and read byte ranges of them. The indexer, the read
// path, the checks and the CLI reach source files only through it, so a
// root may be a local directory (source/posix_source.h) or, behind the same
// calls, another kind of store.
//
// Identity. Every file is identified when indexed (SourceFile: size plus
// what the backend can vouch for) and compared again before its bytes are
// served; the backend decides what "the same file" means (DescribeChange),
// because what a filesystem keeps stable differs (docs/SEMANTICS.md).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/direct_io.h"

namespace ckptfs {

// The entries directly inside one directory of a source, names sorted.
struct SourceListing {
  std::vector<std::string> files;  // regular files (for POSIX, links to them too)
  std::vector<std::string> dirs;   // subdirectories, never links to them
  // Links to directories (POSIX only): not walked by the scan, but a model
  // folder's sidecars may live there.
  std::vector<std::string> linked_dirs;
  // The identities of `files` where the listing itself tells them (object
  // stores: size, ETag, Last-Modified), by name; empty for POSIX.
  std::map<std::string, SourceFile> known;
};

// A source range read into memory of its own (SourceObject::ReadFilled).
struct FilledRange {
  Buffer buffer;                              // holds the bytes, unless `shared` does
  std::shared_ptr<const void> shared;  // memory a cache keeps (decoded items, parts)
  const char* data = nullptr;                 // the first byte asked for
};

// Bytes of a source file mapped into memory and kept from changing while
// this lives (SourceObject::Pin). Releasing it unmaps them. The mapping is
// read on first touch, and a page the disk cannot read would end the
// process there (SIGBUS): read the pages in before copying from them
// (HeldBytes::ReadIn), or splice them from fd().
class PinnedRange {
 public:
  virtual ~PinnedRange() = default;
  const char* data() const { return data_; }  // the first byte asked for
  // An open descriptor of the file, valid while this lives, at whose
  // offsets the same bytes lie (for splicing them); -1 if none.
  int fd() const { return fd_; }

 protected:
  const char* data_ = nullptr;
  int fd_ = -1;
};

// One open source file. ReadAt may be called from several threads at once.
class SourceObject {
 public:
  virtual ~SourceObject() = default;

  // Reads exactly `len` bytes at `offset` into `dst`. A file shorter than
  // that is Corruption ("unexpected end of file"); other failures IOError.
  virtual Status ReadAt(uint64_t offset, uint64_t len, char* dst) const = 0;

  // [offset, offset + len) into memory the result owns. With `direct`, a
  // backend that can (POSIX) reads the part not in its cache with O_DIRECT
  // into memory of direct->pool() (source/direct_io.h). Errors as ReadAt.
  // Default: ReadAt into heap memory.
  virtual Result<FilledRange> ReadFilled(uint64_t offset, uint64_t len, DirectIo* direct) const;

  // ReadAt, with the part not in the cache read as ReadFilled reads it.
  virtual Status ReadAtVia(uint64_t offset, uint64_t len, char* dst, DirectIo* direct) const {
    return ReadAt(offset, len, dst);
  }

  // ReadAt, for a range read once and then held by the caller (a
  // source-order range, source/ordered_fetch.h): a backend that can (POSIX,
  // where the filesystem allows) reads the part not in its cache straight
  // into `dst` with O_DIRECT, so the source's pages are not cached beside
  // the copy the caller holds. `dst` must lie offset % kDirectAlign bytes
  // into kDirectAlign-aligned memory that holds AlignSpan(offset, len)
  // whole; bytes of that span outside the range may be overwritten.
  // Returns the bytes read with O_DIRECT. Errors as ReadAt. Default: ReadAt.
  virtual Result<uint64_t> ReadOnce(uint64_t offset, uint64_t len, char* dst) const;

  // [offset, offset + len) of this object's file, mapped and unchangeable
  // while the result lives: no one may open the file for writing or
  // truncate it meanwhile (a writer's open waits until the result is
  // released). So bytes checked after Pin (the identity of the file, as
  // after every read) stay the checked ones, and may be copied from the
  // result later (see PinnedRange) without a copy of their own first. Hold it for
  // milliseconds: a writer waits that long. NotSupported where the backend,
  // the filesystem, the file's writers or the caller's rights do not allow
  // it (Source::PinsRanges says whether to try); then read with ReadAt.
  virtual Result<std::unique_ptr<PinnedRange>> Pin(uint64_t offset, uint64_t len) const;

  // The identity of the bytes this object reads now (for POSIX: fstat of
  // the descriptor). Path left empty.
  virtual Result<SourceFile> Identity() const = 0;

  // Starts fetching [offset, offset + len) without waiting for it; a hint,
  // only speed depends on it.
  virtual void WillNeed(uint64_t offset, uint64_t len) const {}

  // Brings [offset, offset + len) into the cache that ReadAt reads through
  // (for POSIX, the page cache, waiting for it while `go_on()` is true; for
  // object storage, fetches queued and not waited for).
  // Read-ahead calls it on an object of its own (Reopen), so the reader's
  // objects keep their own state. Only speed depends on it.
  virtual void Prefetch(uint64_t offset, uint64_t len, const std::function<bool()>& go_on) const {}

  // Another object over the same bytes, or an error when the path no longer
  // names them.
  virtual Result<std::unique_ptr<SourceObject>> Reopen() const;

  // [offset, offset + len) as a string, for callers that parse it.
  Result<std::string> ReadString(uint64_t offset, uint64_t len) const;

  // Each of `ranges` (offset, length) into (*out)[i]; the first failure is
  // the answer. Default: one after the other. A backend with round trips to
  // hide (object storage) reads several at once.
  virtual Status ReadRanges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                            std::vector<std::string>* out) const;
};

// Gaps between ranges read rather than split into another read
// (WindowedObject::Fetch): each at most `longest` bytes, all together at
// most `budget` (memory held).
struct WindowGaps {
  uint64_t longest = 0;
  uint64_t budget = 0;
};

// Some ranges of an object read ahead at once (ReadRanges), and the object:
// a read inside the ranges is answered from memory, any other goes to the
// object. For parsers that know beforehand which small pieces they will
// read (the framing of every DCP item of a file): over object storage, a
// few GETs in parallel instead of one round trip per piece. The bytes are
// those the object read; it must outlive this.
class WindowedObject : public SourceObject {
 public:
  // Reads `ranges` of `inner`; overlapping or touching ones are read as
  // one, and so are ones `gaps` allows bridging.
  static Result<std::unique_ptr<WindowedObject>> Fetch(const SourceObject& inner,
                                                       std::vector<std::pair<uint64_t, uint64_t>> ranges,
                                                       WindowGaps gaps = {});
  // Bytes held already: `windows` (offset -> bytes; disjoint, not touching).
  static std::unique_ptr<WindowedObject> Holding(const SourceObject& inner, std::map<uint64_t, std::string> windows);
  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override;
  Result<SourceFile> Identity() const override { return inner_.Identity(); }
  Result<std::unique_ptr<SourceObject>> Reopen() const override { return inner_.Reopen(); }
  uint64_t bytes() const;  // held in memory

 private:
  explicit WindowedObject(const SourceObject& inner) : inner_(inner) {}
  const SourceObject& inner_;
  std::map<uint64_t, std::string> windows_;  // offset -> bytes; disjoint, not touching
};

// An object over bytes already in memory (decoded items, tests). Its
// identity is its size.
class MemoryObject : public SourceObject {
 public:
  explicit MemoryObject(std::string bytes) : bytes_(std::move(bytes)) {}
  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override;
  Result<SourceFile> Identity() const override;

 private:
  std::string bytes_;
};

class Source {
 public:
  virtual ~Source() = default;

  // The root as the user names it, canonical: an absolute path without
  // symlinks. Keys the store and names the root in messages.
  virtual const std::string& root() const = 0;

  // The entries of directory `rel` ("" is the root).
  virtual Result<SourceListing> List(const std::string& rel) const = 0;

  // The identity of regular file `rel` now (path left empty).
  // InvalidArgument when it is not a regular file.
  virtual Result<SourceFile> Identify(const std::string& rel) const = 0;

  // Opens regular file `rel` for reading.
  virtual Result<std::unique_ptr<SourceObject>> Open(const std::string& rel) const = 0;

  // Opens file `indexed.path`, indexed as `indexed`, for reading those
  // bytes. A backend whose reads are pinned to a version (ReadsArePinned)
  // may pin them to `indexed.version` without asking the store: a file
  // changed since then fails its reads with Stale, not its open. Default
  // (and for a derived file or one without a version): Open(indexed.path).
  virtual Result<std::unique_ptr<SourceObject>> OpenIndexed(const SourceFile& indexed) const {
    return Open(indexed.path);
  }

  // "" when `now` is the file that was indexed as `indexed`, else what
  // changed, in words ("size changed from 10 to 12").
  virtual std::string DescribeChange(const SourceFile& indexed, const SourceFile& now) const = 0;

  // False when `rel` may not be served as part of this root (for POSIX: it
  // resolves, through symlinks, outside the root).
  virtual bool Contains(const std::string& rel) const = 0;

  // When entry `rel` (a file or directory, links not followed) last
  // changed (POSIX ctime), in ns since the epoch; nullopt when it does not exist. Orders
  // a checkpoint's commit point against its other files
  // (indexer/scan.h, CommitPointIsNewest).
  virtual std::optional<int64_t> ChangeTimeNs(const std::string& rel) const = 0;
  // When entry `rel` was last written (POSIX mtime), likewise.
  virtual std::optional<int64_t> ModifyTimeNs(const std::string& rel) const = 0;

  // True when an open object's reads fail by themselves once the file
  // changes (object storage: every GET carries If-Match), so a reader
  // need not identify the path again after each read.
  virtual bool ReadsArePinned() const { return false; }

  // True when List tells each file's identity (SourceListing::known) as
  // Identify would: one listing of a directory then answers for all its
  // files (object storage: a LIST instead of a HEAD per object).
  virtual bool ListingsIdentify() const { return false; }

  // True when its objects' Pin may succeed (POSIX files): a source-order
  // fetch then pushes pages from pinned source bytes (source/ordered_fetch.h).
  virtual bool PinsRanges() const { return false; }

  // True when bytes read once are kept for the next read without asking
  // (a POSIX file's page cache); false for object storage, whose ranges are
  // fetched again each time they are read.
  virtual bool CachesReads() const { return true; }

  // A key equal for two directory paths that name the same directory (for
  // POSIX: device and inode), so a walk never enters one twice.
  virtual std::string DirKey(const std::string& rel) const { return rel; }

  // Capabilities. Callers outside source/ ask these, never the backend's
  // type, so a new backend is one class here and nothing elsewhere.

  // The path of entry `rel` on this host's filesystem, for what only a real
  // file will do (RocksDB opens an SST by path; inotify watches a path; a
  // tree opened beneath a root descriptor); "" when the backend's files are
  // not files here (object storage), and callers then go through Open().
  virtual std::string LocalPath(const std::string& rel) const { return ""; }

  // How a whole file is best fetched in order, for a backend with round
  // trips to hide: ranges of `range_bytes`, `threads` of them in flight.
  struct FetchShape {
    uint64_t range_bytes = 0;
    unsigned threads = 0;
  };
  // nullopt: no preference (the reader's defaults hold).
  virtual std::optional<FetchShape> PreferredFetch() const { return std::nullopt; }

  // What reading this source has cost so far, one log line each (object
  // storage: requests and bytes fetched, the disk cache's hits); none for a
  // backend whose reads cost nothing worth reporting. Safe from any thread.
  virtual std::vector<std::string> DescribeTraffic() const { return {}; }

  // Convenience: [offset, offset + len) of file `rel`, and all of it.
  Result<std::string> ReadRange(const std::string& rel, uint64_t offset, uint64_t len) const;
  Result<std::string> ReadWhole(const std::string& rel) const;
  // All of file `indexed.path`, opened as OpenIndexed opens it (over object
  // storage: the indexed version, without asking for it again).
  Result<std::string> ReadWholeIndexed(const SourceFile& indexed) const;
};

// "dir/name", or "name" when dir is the root ("").
std::string JoinRel(const std::string& dir, const std::string& name);

}  // namespace ckptfs
