// Executes read plans against the source files of one checkpoint: the one
// place where the read path touches the sources (source/source.h), shared by
// the mount and the CLI.
//
// Files are opened lazily on first use; at open their identity (for POSIX:
// size, mtime, ctime, inode where stable) must match what was indexed. Every
// request checks it again AFTER its reads, on the open object and on the
// path: a writer updates mtime/ctime before its data becomes visible, so
// bytes read before an unchanged identity was seen are the indexed bytes. A source changed,
// truncated, rewritten with its mtime set back, renamed over or deleted
// after indexing is answered with Stale, never with stale, mixed or zeroed
// bytes (a short read is Corruption). Once a file is seen changed, every
// later read of it fails at once.
//
// Speed (docs/BENCHMARKS.md): with ReadOptions::direct, the reads of one
// request run side by side on an I/O pool and read what is not in the page
// cache with O_DIRECT into pooled buffers (source/direct_io.h), which
// ExecuteScatter hands to the reply without copying; without it, they are
// hinted to the kernel together before they are read one by one, so their
// disk I/O overlaps. ReadAhead() brings the sources of what a sequential
// reader will ask for next into the page cache (source/source_prefetch.h). None
// of this replaces the checked reads.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/meta.h"
#include "core/planner.h"
#include "core/status.h"
#include "source/direct_io.h"
#include "source/ordered_fetch.h"
#include "source/readahead.h"
#include "source/scatter_reply.h"
#include "source/source.h"
#include "source/source_objects.h"
#include "source/source_prefetch.h"
#include "source/tensor_push.h"
#include "source/transform.h"

namespace ckptfs {

struct ReadOptions {
  // Source bytes read ahead of a sequential reader of one open file
  // (`ckptfs mount --readahead-mib`); 0 turns read-ahead off. 32 MiB keeps
  // a disk of ~2 GB/s busy for the ~15 ms a 2-core machine may take to
  // come back to a stream under load, and is small next to a page cache.
  uint64_t readahead_bytes = 32ull << 20;
  // Hint all reads of a request before the first pread (overlapped I/O;
  // without `direct` only: with it the reads run side by side).
  bool overlap = true;
  // A tensor of at most this many bytes of a virtual file is pushed whole
  // into the kernel's page cache the first time a request that continues
  // no stream touches it (ReadAhead with a sink; source/tensor_push.h).
  // 0: off (local roots, whose page cache keeps what was read).
  uint64_t push_tensor_bytes = 0;
  // Direct reads of cold source ranges into a bounded pool, the reads of a
  // request run side by side (source/direct_io.h); shared by the readers of
  // one mount. Null: every read goes through the page cache, one after the
  // other (the CLI's one-shot commands).
  std::shared_ptr<DirectIo> direct;
  // Source-order fetch of whole virtual files (source/ordered_fetch.h):
  // the memory bound its held ranges share (`ckptfs mount
  // --fetch-hold-mib`), shared by the readers of one mount. Null: off (the
  // CLI's one-shot commands, `--fetch-hold-mib 0`).
  std::shared_ptr<FetchBudget> hold;
  // Its largest fetch and how many are in flight per open file (S3:
  // --part-size and --max-threads, sized for the server).
  uint64_t hold_range_bytes = 8ull << 20;
  unsigned hold_threads = 4;
  // Held ranges of cold sources read with O_DIRECT where the filesystem
  // allows (SourceObject::ReadOnce; `ckptfs mount --fetch-direct`): about
  // 40% less of the daemon's CPU, and the sources' pages are not cached
  // beside the virtual file's; but slower where the device needs the
  // kernel's read-ahead to reach its speed (docs/BENCHMARKS.md).
  bool hold_direct = false;
};

class ChecksumGate;

// Derived sources (decoded transformed items) are decoded on first read and
// kept in an LRU cache bounded by `decoded_cache_bytes` (DecodedCache).

class SourceReader {
 public:
  // `files` (a checkpoint's file table) must outlive the reader.
  SourceReader(std::shared_ptr<const Source> source, const std::vector<SourceFile>* files, GroupPolicy policy = {},
               uint64_t decoded_cache_bytes = 1ull << 30, ReadOptions read = {});
  // Over the POSIX directory `root` (absolute, resolved).
  SourceReader(const std::string& root, const std::vector<SourceFile>* files, GroupPolicy policy = {},
               uint64_t decoded_cache_bytes = 1ull << 30, ReadOptions read = {});
  ~SourceReader();
  SourceReader(const SourceReader&) = delete;
  SourceReader& operator=(const SourceReader&) = delete;

  // Fills dst[0, plan.length) as the plan says. Thread-safe.
  Status Execute(const ReadPlan& plan, char* dst);
  // Plans [offset, offset + length) of `layout` and Executes it, planned
  // again while a prediction is found wrong (PlanAgain: each time settles
  // every item of the plan, so once is the rule); returns the plan that
  // filled dst (its ComputeOps are left to the caller).
  Result<ReadPlan> ReadLaidOut(const Layout& layout, uint64_t offset, uint64_t length, char* dst);

  // The plan's bytes as a scatter list over the buffers its reads filled
  // (source/scatter_reply.h): no byte read is copied to put it in place.
  // Literals and converted values go to the reply's gather memory, which is
  // reserved for the plan's ComputeOps too: the caller fills those with
  // reply->Reserve, then calls reply->Finish. Same checks as Execute: the
  // sources' identity after every read, before anything is handed out.
  Status ExecuteScatter(const ReadPlan& plan, ScatterReply* reply);

  // From now on every Execute first passes its source ranges through
  // `gate` (verify-on-first-read of recorded checksums; source/checksums.h).
  // Call before the reader is shared between threads.
  void SetChecksumGate(std::unique_ptr<ChecksumGate> gate);

  // Call after serving [offset, offset + length) of the virtual file laid
  // out by `layout` to the reader whose requests `stream` follows: when they
  // are sequential, queues read-ahead of the source ranges of the next
  // bytes (done by a background thread). With `sink` and
  // push_tensor_bytes, a request that continues no stream also has its
  // whole tensor read and handed to `sink`, once per stream and tensor, by
  // a background thread (TensorPusher). Never blocks on I/O.
  void ReadAhead(ReadStream& stream, const std::shared_ptr<const Layout>& layout, uint64_t offset,
                 uint64_t length, const PageSink& sink = {});

  // What this reader fetched and served, counted into `counters` from now
  // on (a checkpoint's, kept across unloads). Call before the reader is
  // shared between threads.
  void ShareCounters(std::shared_ptr<FetchCounters> counters) { counters_ = std::move(counters); }
  FetchCounters& counters() { return *counters_; }

  // A source-order fetch of the virtual file laid out by `layout`, for one
  // open handle (source/ordered_fetch.h), or null when it is off or the
  // file is not worth one.
  // `served`: the file's record, shared by its handles; `sink`: where its
  // pages go once fetched (the kernel's page cache; empty: nowhere).
  std::unique_ptr<OrderedFetch> MakeOrderedFetch(std::shared_ptr<const Layout> layout,
                                                 std::shared_ptr<ServedRecord> served, PageSink sink = {});

  // Settles predicted item `check` (ItemCheck, core/meta.h) by reading its
  // framing: from `windows` (file offset -> bytes the caller holds, read
  // through this reader's checked reads), else its windows read now (a small
  // ranged read each, counted as fetched). OK once it is settled either way;
  // a read failure leaves it unchecked and is returned.
  Status SettleItem(ItemCheck& check, std::map<uint64_t, std::string> windows = {});

  // True once any source was seen changed (reads of it fail from then on).
  bool any_stale() const { return objects_.any_stale(); }

  // Checks sources `ids` are unchanged since indexing, as Execute does after
  // its reads (a derived source: its base file): for bytes computed from
  // them earlier and served from a cache. Stale naming the first changed.
  Status CheckSources(const std::vector<FileId>& ids);

  // Identifies every (non-derived) source by path now; Stale naming the first
  // one that changed since indexing (it then fails every read), else OK;
  // any other error: the sources could not be looked at now.
  Status Recheck();

 private:
  Status ExecuteUngated(const ReadPlan& plan, char* dst);
  Status ScatterUngated(const ReadPlan& plan, ScatterReply* reply);
  // Settles the predicted items `copies` read (CopyOp::speculative): the
  // bytes are read only where predicted; PlanAgain when one was found
  // elsewhere.
  Status PassPredictions(const std::vector<CopyOp>& copies);
  // Verify-on-first-read of the chunks `copies` touch (SetChecksumGate).
  Status PassGate(const std::vector<CopyOp>& copies);
  // Runs task(i) for each of `reads`: side by side on the IoPool with
  // `direct`, else in order after hinting them all.
  Status ForEachRead(const std::vector<SourceRead>& reads, const std::function<Status(size_t)>& task);
  // Checks the sources of `reads` unchanged (after reading them).
  Status CheckReads(const std::vector<SourceRead>& reads);
  // The bytes of read `r` in memory of their own.
  Result<FilledRange> ReadFilled(const SourceRead& r);
  // WillNeed of the ranges of reads[first..]: starts their I/O at once
  // without waiting for it.
  void Hint(const std::vector<SourceRead>& reads, size_t first);
  Status ReadOne(const SourceRead& r, char* dst, char* converted, std::vector<char>& scratch);
  const std::string& PathOf(FileId id) const { return (*files_)[id].path; }
  // The decoded bytes of derived source `id`, from the cache or decoded now.
  Result<std::shared_ptr<const std::string>> Decoded(FileId id);

  const std::vector<SourceFile>* files_;
  GroupPolicy policy_;
  SourceObjects objects_;  // each source's object, and whether it changed
  std::shared_ptr<FetchCounters> counters_;  // never null

  DecodedCache decoded_;

  ReadOptions read_;
  std::unique_ptr<ChecksumGate> gate_;
  // Both stopped by the destructor, the pusher first: their jobs use the
  // objects, and the pusher's queue prefetches.
  SourcePrefetch prefetch_;
  TensorPusher pusher_;
};

}  // namespace ckptfs
