// The rows a writer commits: what the ranks wrote (chunks: ShardMeta →
// ByteMeta + CRC32C; BYTE_IO items) turned into the ckptfs model
// (core/meta.h) that a commit record (an SST the store ingests, see
// docs/WRITER.md) carries. No file is read: the writer knows every offset,
// so the store never parses a pickle to learn them.
//
// For trainers outside Python, GatherWritten collects every rank's chunks
// at the coordinator over a Collective.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/meta.h"
#include "core/status.h"
#include "source/s3_client.h"
#include "source/source.h"
#include "writer/collective.h"

namespace ckptfs {

struct WrittenChunk {
  std::string fqn;
  std::vector<uint64_t> offsets, sizes;  // the box in the global tensor, in torch elements
  std::string file;                      // relative to the checkpoint directory
  uint64_t offset = 0, length = 0;       // the raw row-major bytes in `file`
  uint32_t crc32c = 0;
};

struct WrittenTensor {
  std::string fqn;
  std::vector<std::string> path;  // nested keys (DCP planner_data); empty: {fqn}
  std::string dtype;              // torch's name
  std::vector<uint64_t> shape;    // torch's (float4_e2m1fn_x2: in torch elements)
};

struct WrittenBytes {
  std::string key;
  std::string file;
  uint64_t offset = 0, length = 0;
};

struct WrittenCheckpoint {
  std::string dir;  // relative to the root the rows are for ("" = the root)
  std::string format = "dcp";
  std::vector<WrittenTensor> tensors;
  std::vector<WrittenChunk> chunks;
  std::vector<WrittenBytes> bytes;
};

// The checkpoint with its own file table (Checkpoint::files, paths relative
// to abs_root) and a CRC32C on every chunk. Stats every file under
// abs_root/dir (after the writer fsynced them), and
// checks that each tensor's chunks tile it exactly once (a hole or an
// overlap is InvalidArgument naming the tensor: the save is refused, not
// committed with a problem). The rows are what a scan of the files reads: a
// torch.float4_e2m1fn_x2 tensor is F4, its shape's and boxes' last dim
// counted in values (twice torch's); tensors whose dtype the index cannot
// hold (complex128, complex32, a 0-d float4_e2m1fn_x2) are listed in
// ckpt.problems and left out.
Result<Checkpoint> BuildCommitRows(const std::string& abs_root, const WrittenCheckpoint& w);
// The same over any source: an object store's root (source/s3_source.h),
// whose objects are identified (size, ETag) and read back with ranged GETs.
Result<Checkpoint> BuildCommitRows(const Source& source, const WrittenCheckpoint& w);

// Writes `ckpt`'s commit record (the store's WriteCommitRecord, an SST of
// its rows) as abs_root/ckpt.dir/.ckptfs/commit.sst: into a temporary
// file, fsynced, renamed into place, the directory fsynced. Call it last,
// after every shard and .metadata are durable: the record's presence is
// what makes the checkpoint committed for `ckptfs index` and live mounts.
Status WriteCommitRecordFile(const std::string& abs_root, const Checkpoint& ckpt);

// Writes `ckpt`'s commit record as the object `.ckptfs/commit.sst` of its
// directory under `client`'s root (PutObject: it appears whole or not at
// all; RocksDB writes the SST into a temporary local file first). Call it
// last, after every rank file and .metadata are uploaded.
Status PutCommitRecord(const S3Client& client, const Checkpoint& ckpt);

// Every rank's chunks, in rank order, at every rank (AllGather of JSON).
Result<std::vector<WrittenChunk>> GatherWritten(Collective& c, const std::vector<WrittenChunk>& mine);

}  // namespace ckptfs
