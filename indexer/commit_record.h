// A writer's commit record: the SST file of store rows it leaves in
// .ckptfs/commit.sst (written, and read as untrusted input, by
// commit_record_sst.cc; ingested by Store::Ingest), and that record checked
// against the files before it is used (commit_record.cc).
//
// A scan reads what a checkpoint's files say (DCP's .metadata items,
// safetensors headers). ckptfs's writer also leaves a commit record
// (.ckptfs/commit.sst, docs/WRITER.md) with what only the writer knows: the
// CRC32C of every chunk it wrote and of each file's other bytes. The record
// never replaces the scan: a checkpoint is always served as its files say,
// with its folder's sidecars (config.json, tokenizer files) as the folder
// holds them now, so a step shows the same views however it was indexed.
// The record adds its checksums, and only when it agrees with the files on
// every tensor (dtype, shape) and every chunk (box, file, offset, length,
// dtype). A record that disagrees anywhere (altered, damaged, or written
// for other files) is refused whole: no checksum of it is used.
#pragma once

#include <string>

#include "core/meta.h"
#include "core/status.h"
#include "source/source.h"

namespace ckptfs {

// Writes a writer's commit record: the rows Commit() would write for `ckpt`
// (source "writer"), sorted, as an SST file at `sst_path`. `ckpt.dir` and
// every file path are relative to `abs_root` (an absolute path, or the
// s3://BUCKET/PREFIX root the writer uploaded under).
Status WriteCommitRecord(const std::string& abs_root, const Checkpoint& ckpt, const std::string& sst_path);

// The checkpoint a writer's commit record (WriteCommitRecord) describes,
// its rows checked as untrusted input (one checkpoint's keys, paths inside
// it, counts and file ids consistent), its paths relative to the root the
// writer had. Nothing here says the files still hold what it describes:
// see ApplyCommitRecord below.
Result<Checkpoint> ReadCommitRecord(const std::string& sst_path);

// Copies `record`'s checksums onto `scanned` when the two describe the same
// tensors stored in the same bytes; else InvalidArgument naming the first
// disagreement, `scanned` unchanged. Paths are compared relative to each
// one's checkpoint directory (a record may have been written under another
// root).
Status ApplyCommitRecord(const Checkpoint& record, Checkpoint& scanned);

// The commit record of `ckpt` (whose directory is relative to `source`'s
// root), read through `source` and applied. OK once applied; NotFound when the
// directory has none; Stale when it is not current: older than the
// directory's .metadata or, without one, than a file it describes or a data
// file of `ckpt` (another save replaced the one it describes); sidecars
// (config.json, tokenizer files, README, any file `ckpt` lists in
// `sidecars`) written after the save do not count. Any other error when it
// cannot be read or disagrees with the files, saying why ("it is older
// than…", "it disagrees with the files: …"). `ckpt` changes only when OK.
Status UseCommitRecord(const Source& source, Checkpoint& ckpt);

}  // namespace ckptfs
