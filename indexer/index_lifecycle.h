// The lifecycle of a root's index (its Store): built from a scan of the
// root and repaired first when damaged; opened for reading, built first when
// there is none, when asked, or when checkpoints were saved under the root
// since; checked against the sources before a tree is served from it.
//
// Every command that reads an index goes through here (the CLI's index,
// mount, ls, cat, export, inspect, check, verify); what to print and which
// exit code a Status becomes is theirs. What the user should hear of (a
// store rebuilt, checkpoints indexed since) is said through `Notes`, one
// line each.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "indexer/index_store.h"
#include "source/source.h"

namespace ckptfs {

using Notes = std::function<void(const std::string&)>;

// Opens the store of `abs_root` at `index_path` read-write (Busy, naming the
// holder, when another process writes it; created when absent), says what
// opening did, then checks every block of it: a damaged block (a flipped bit
// in an SST) is found by no open and by no commit, only by the reads that
// hit it. A damaged store is rebuilt empty and *rebuilt set: the caller then
// commits every checkpoint again (ApplyScan).
Result<std::unique_ptr<Store>> OpenForUpdate(const std::string& index_path, const std::string& abs_root,
                                             const Notes& note, bool* rebuilt);

// Makes `store` hold exactly the checkpoints of `catalog` (a scan of the
// root): each committed in its own batch, those the scan no longer found
// removed. After a rebuild the store is read back in full before it is
// trusted: damage that a rebuild does not cure is the disk's (Corruption
// saying so).
Status ApplyScan(Store& store, const Catalog& catalog, bool rebuilt);

// Every committed checkpoint of the store, loaded; indexed_at_ns is the
// latest commit's.
Result<Catalog> ReadCatalog(const Store& store);

// True when the store lacks a checkpoint that is now under the root (one
// saved since the index was built, say while a live mount served it).
bool MissesCheckpoints(const Store& store, const Source& source);

// The directories of the store's checkpoints, each checked against its
// sources (their file rows only: no tensor is read). Stale when a source
// changed or cannot be read (the message says which); the store's own error
// when the rows cannot be read (re-indexing rewrites them).
Result<std::vector<std::string>> FreshCheckpoints(const Source& source, const Store& store);

struct ReadOpenOptions {
  bool reindex = false;  // build before opening, whatever the store holds
  // Builds the index (OpenForUpdate, a scan, ApplyScan; the caller reports
  // what it found). Called when there is no store, when `reindex`, or when
  // the store misses checkpoints now under the root.
  std::function<Status()> build;
  Notes note;
};

// Opens the store read-only, building it first as ReadOpenOptions says. A
// failed build is returned as `build` returned it, except Busy while adding
// checkpoints saved since: another process is indexing, so the store is used
// as it is (noted). NotFound when there is still no store.
Result<std::unique_ptr<Store>> OpenForReading(const Source& source, const std::string& index_path,
                                              const std::string& abs_root, const ReadOpenOptions& options);

}  // namespace ckptfs
