// What the store's .cc files share, and only they include: index_store.cc
// (the rows API), store_open.cc (where a store lives, its marker, its
// writer lock, opening and rebuilding it) and commit_record_sst.cc (a
// writer's commit record as an SST file: written, read, ingested). These
// are the only files that know RocksDB exists; this header names its types
// without including it.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"

namespace rocksdb {
class Status;
struct Options;
}  // namespace rocksdb

namespace ckptfs::store_internal {

// A RocksDB status as ours: NotFound, Corruption, or IOError, with `what`
// saying which operation on which path.
Status FromRocks(const rocksdb::Status& s, const std::string& what);
// The options of every database, SST writer and SST reader of a store.
rocksdb::Options StoreOptions();

}  // namespace ckptfs::store_internal
