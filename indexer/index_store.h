// The on-disk index: a RocksDB database holding one Catalog
// (schema: docs/INDEX.md). This file and index_store.cc are the only places
// that know RocksDB exists.
//
// Writes are atomic: the database is built in a sibling temporary directory,
// a completion record is written last, and the directory is then renamed
// into place (swapped atomically with an older index, which is removed).
// Readers open it read-only, so many mounts can share one index.
#pragma once

#include <string>

#include "core/meta.h"
#include "core/status.h"

namespace ckptfs {

// The schema version written into and required from every index.
inline constexpr int kIndexSchemaVersion = 1;

// Where an index for `root` lives unless --index says otherwise:
// $CKPTFS_INDEX_DIR, else $XDG_CACHE_HOME/ckptfs, else ~/.cache/ckptfs,
// then "<basename>-<hash of the absolute path>".
std::string DefaultIndexPath(const std::string& abs_root);

Status WriteIndex(const Catalog& catalog, const std::string& index_path);

// NotFound when there is no index, Corruption when it is incomplete or of
// another schema version.
Result<Catalog> LoadIndex(const std::string& index_path);

// Stats every source file and compares it with the indexed identity; Stale
// naming the first few changed files, or OK.
Status CheckSources(const Catalog& catalog);

}  // namespace ckptfs
