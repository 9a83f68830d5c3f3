// Source-order fetch of a whole virtual file: each source byte fetched once.
//
// Why. The consumers of a virtual file read it in their own order
// (safetensors' header order, transformers' model order, page faults with
// the kernel's read-around), which is not the order of its sources. A read
// path that guesses streams from requests (source/readahead.h) fetches
// neighbours twice and lets parts go before every byte in them was served
// (docs/BENCHMARKS.md, "A checkpoint in object storage"). The layout knows
// better: for every byte of the file it says which source range holds it.
// So once a consumer is seen reading the file as a whole, every source range
// the file needs is fetched in the sources' own order (file, offset), in
// large ranges, several in flight, and each fetched range is held in memory
// until every source byte in it that the file needs has been served. A
// range never crosses a multiple of the range size in its file (WindowEnd,
// ordered_fetch.cc): object stores keep an object as its upload parts, and
// a GET across a part boundary makes the server read two.
//
// When (OrderedFetch::Noted). A file with at least two tensor segments, once
// requests of one open handle have begun inside two different tensors: a
// loader past the header (safetensors' load_file, transformers, safe_open in
// any order, torch.load of a .bin view, a sequential read()). A reader that
// only reads the header (requests at offset 0, whatever the kernel's
// read-around brings in) or one tensor, and every reader of a one-tensor
// file (tensors/*.npy, a bytes/*.pt), never starts it and reads as before.
// What was served before the start, through this handle or another of the
// same file (ServedRecord: the kernel keeps those pages), is left out of
// the plan.
//
// Page cache. With a PageSink (the mount's notify_store), a fetched range
// hands the whole pages it completes to the kernel's page cache at once, so
// that the consumer's reads and page faults find them there instead of
// asking the daemon; only pages that straddle two source ranges (a chunk
// boundary off a page boundary) wait for the consumer's request. Pushed
// bytes count as served: the range is freed once nothing else is needed.
//
// Pinned ranges. Where the sources can pin a range (local files:
// Source::PinsRanges), a fetch thread pushes its pages straight from the
// source's own page cache, pinned (SourceObject::Pin: no one may write the
// file meanwhile), and checks the source's identity while pinned. The sink
// is told the pin's descriptor (PageBytes::fd), and the mount splices the
// pages from the source's cache into the file's: the kernel's one copy per
// byte, where a read into a buffer and a push are two in the daemon. Only
// the few bytes of edge pages are copied out and held. The pinned bytes are
// published to readers before any page is pushed (a push waits on the
// pages a waiting reader's request has locked), so a reader waits for a
// range only while it is being pinned, and copies from the pin while it is
// pushed. A reader never takes a queued range: it reads its own bytes the
// ordinary way (from the same page cache) and takes them out of the range,
// which the pin then leaves out. On object storage, where such a read
// costs a round trip, readers take ranges as below.
//
// Memory. Held ranges of all open files of a mount share one FetchBudget
// (`ckptfs mount --fetch-hold-mib`). A fetch thread waits for room before it
// takes its next range; a reader that needs a range not fetched yet fetches
// it itself when there is room, and otherwise reads just its own bytes
// through the ordinary path. Once a range's whole pages are pushed, it keeps
// only the bytes of the pages it shares with a neighbour (a few KiB per
// tensor edge), so the bound holds what consumers have yet to ask for and
// the fetch runs ahead of them. A range is freed once all the bytes it
// serves were served, or when its file is closed. A range needed again after it was
// freed (the kernel dropped a served page, a second pass) is read through
// the ordinary path and counted as refetched (FetchCounters).
//
// Exactness. Bytes are fetched through the reader's checked read (the
// source's identity checked after the read, If-Match on S3), and a request
// served from held bytes checks the identity of its sources again before it
// returns, as every other read does: a source changed since indexing reads
// as EIO, never as held bytes. Derived sources (zstd items), converted and
// computed bytes are never planned here: they go through the ordinary path
// (computed views read their inputs through the compute cache).
//
// Predicted items. A DCP chunk placed by prediction (ItemCheck,
// core/meta.h; indexer/dcp_item.h) is planned where predicted, and its
// item's framing (a window at its head and one at its tail) is fetched with
// the ranges: the ranges cover the windows as well as the needed bytes, and
// each fetched range copies what it holds of them before it is published.
// A range's bytes go to readers and to the page cache only once every item
// whose bytes it holds (its windows or any byte between them: an item
// larger than a range spans several) is settled: from the windows its
// neighbours brought (waiting for one that is being fetched), else by
// reading them (Options::settle, a small read). An item found elsewhere than
// predicted has its bytes left out of the range; its readers' requests,
// planned speculatively, answer PlanAgain and are planned again where the
// framing says. The gate is the bytes' own: each mapping names its item,
// and Push and Serve hand out a predicted item's bytes only while
// ItemCheck::Servable says so, whatever the range's state.
//
// Lock order: OrderedFetch::mu_, then FetchBudget::mu_. No lock is held
// during I/O.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/layout.h"
#include "core/planner.h"
#include "core/status.h"
#include "source/held_bytes.h"
#include "source/interval_set.h"
#include "source/range_buffers.h"
#include "source/source.h"
#include "source/tensor_push.h"

namespace ckptfs {

// What one checkpoint's reads fetched and served, for the mount's log.
struct FetchCounters {
  std::atomic<uint64_t> fetched{0};    // source bytes read (every path)
  std::atomic<uint64_t> ordered{0};    // of those, by source-order plans
  std::atomic<uint64_t> pinned{0};     // of those, pushed from pinned source bytes (SourceObject::Pin)
  std::atomic<uint64_t> direct{0};     // of those, read with O_DIRECT (SourceObject::ReadOnce)
  std::atomic<uint64_t> refetched{0};  // bytes of planned ranges read again after being freed
  std::atomic<uint64_t> served{0};     // bytes of virtual files replied to readers
  // "fetched N bytes from its sources (... in source order, ... pinned, ...), served M bytes"
  std::string Describe() const;
};

// The memory bound shared by the held ranges of a mount, and the buffers
// they are held in. Thread-safe.
class FetchBudget {
 public:
  // `range_bytes`: the mount's largest fetch (ReadOptions::hold_range_bytes);
  // `threads`: its fetches in flight per open file (hold_threads), which
  // sizes the shelf of recycled buffers (RangeBuffers).
  explicit FetchBudget(uint64_t capacity, uint64_t range_bytes = 8ull << 20, unsigned threads = 4)
      : capacity_(capacity), buffers_(RangeBytes(capacity, range_bytes), 2 * size_t(threads)) {}
  // The largest fetch a bound of `capacity` allows for a wanted one: never
  // more than the whole bound, a whole number of pages.
  static uint64_t RangeBytes(uint64_t capacity, uint64_t wanted);
  // Takes `n` bytes, waiting while they do not fit; false once `stop()`
  // holds (checked every few ms).
  bool Acquire(uint64_t n, const std::function<bool()>& stop);
  // Takes `n` bytes when they fit now.
  bool TryAcquire(uint64_t n);
  void Release(uint64_t n);
  uint64_t capacity() const { return capacity_; }
  uint64_t held() const;
  uint64_t peak() const;
  // "source-order hold: peak N bytes of the M-byte bound"
  std::string Describe() const;
  RangeBuffers& buffers() { return buffers_; }

 private:
  const uint64_t capacity_;
  RangeBuffers buffers_;
  mutable std::mutex mu_;  // guards the fields below
  std::condition_variable room_;
  uint64_t held_ = 0;
  uint64_t peak_ = 0;
};

// The bytes of one virtual file served so far, by any of its handles: the
// kernel keeps them in the file's page cache, so a plan started later
// leaves them out. The kernel does not say when it drops them, but its
// requests do: it only asks again for pages it no longer has (pages pushed
// into the page cache were not asked for, and say nothing). When requests
// have asked again for kClearAfter bytes (memory pressure over a
// long-lived mount), or when every request of a handle before its plan
// started asked again, kColdPass bytes or more (a cold pass over the file:
// drop_caches, or its pages evicted while no one read it; a loader's first
// requests are read-ahead windows of 128 KiB to 1 MiB; OrderedFetch::Noted),
// the record restarts from what the current run of such requests asked
// (and was pushed meanwhile): a request for new bytes ends a run. So the
// plan covers the file again, but for the pages the kernel has just been
// given. A page or two asked again (the kernel rereads a page now and then)
// change nothing. Thread-safe.
class ServedRecord {
 public:
  static constexpr uint64_t kClearAfter = 4 << 20;
  static constexpr uint64_t kColdPass = 256 << 10;
  // Records [offset, offset + length) as asked for and served; returns how
  // many of those bytes had been served before.
  uint64_t Add(uint64_t offset, uint64_t length);
  // Records pages pushed into the page cache.
  void AddPushed(uint64_t offset, uint64_t length);
  // Forgets all but what the current run of requests that asked again
  // asked (or was pushed meanwhile); nothing outside such a run.
  void Restart();
  IntervalSet Get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return spans_;
  }

 private:
  void RestartLocked();  // REQUIRES: mu_

  mutable std::mutex mu_;  // guards the fields below
  IntervalSet spans_;
  uint64_t again_ = 0;        // bytes asked again since the last restart
  bool reasking_ = false;     // the last request asked again: a run is on
  IntervalSet asked_since_;   // what the run asked, and what was pushed meanwhile
};

// One source range of a whole-file plan (OrderedFetch), and where its
// needed bytes go in the virtual file.
enum class RangeState { kQueued, kFetching, kHeld, kDone, kFailed };
struct PlannedRange {
  // Source bytes [src, src + len) are virtual bytes [virt, virt + len);
  // `item`: the predicted item they belong to (CopyOp::speculative), whose
  // bytes are pushed only once it is verified (ItemCheck::Servable).
  struct Mapping {
    uint64_t src, virt, len;
    ItemCheck* item = nullptr;
  };
  FileId file = 0;
  uint64_t offset = 0, length = 0;
  IntervalSet needed;  // source bytes in it still to be served
  RangeState state = RangeState::kQueued;
  bool fetched = false;
  bool reading = false;        // its fetch has begun (a range claimed by a reader may wait its turn)
  bool recorded = false;       // its bytes of predicted items' windows were taken (SettleItems)
  std::vector<ItemCheck*> items;  // predicted items whose windows or bytes it holds bytes of
  HeldBytes held;              // while kHeld
  std::vector<Mapping> maps;  // where its needed bytes go in the virtual file
};

// How an OrderedFetch fetches (OrderedFetch::Options).
struct OrderedFetchOptions {
  uint64_t range_bytes = 8ull << 20;  // largest fetch (S3: --part-size)
  unsigned threads = 4;               // fetches in flight (S3: --max-threads)
  FetchBudget* budget = nullptr;      // not owned; outlives this
  FetchCounters* counters = nullptr;  // not owned; outlives this
  std::vector<bool> planned;          // by FileId: false for sources left to the ordinary path (derived)
  PageSink sink;                      // the file's pages go here once fetched (empty: none are pushed)
  // Where set (with a sink), the fetch threads push ranges from pinned
  // source bytes (see "Pinned ranges" above); NotSupported or any error:
  // that range is fetched instead.
  using Pin = std::function<Result<std::unique_ptr<PinnedRange>>(FileId file, uint64_t offset, uint64_t len)>;
  Pin pin;
  // Settles a predicted item from its windows' bytes (file offset -> bytes;
  // empty: read them now): SourceReader::SettleItem. Unset: predicted items
  // are left to the ordinary path.
  using Settle = std::function<Status(ItemCheck& check, std::map<uint64_t, std::string> windows)>;
  Settle settle;
};

// A piece of a copy, inside planned range `range` or in none (npos).
struct FetchPiece {
  static constexpr size_t npos = static_cast<size_t>(-1);
  size_t range;
  uint64_t src, dst, length;
  FileId file;
  ItemCheck* speculative = nullptr;  // the copy's (CopyOp::speculative)
};

class OrderedFetch {
 public:
  // Reads [offset, offset + len) of `file` into dst, identity-checked and
  // counted in FetchCounters::fetched. dst meets SourceObject::ReadOnce's
  // contract: room for an O_DIRECT read of the aligned span around it.
  using Fetch = std::function<Status(FileId file, uint64_t offset, uint64_t len, char* dst)>;
  // The ordinary path: fills dst as the plan says (SourceReader::Execute).
  using Execute = std::function<Status(const ReadPlan& plan, char* dst)>;
  // Checks sources `ids` unchanged since indexing (SourceReader::CheckSources).
  using Check = std::function<Status(const std::vector<FileId>& ids)>;

  using Options = OrderedFetchOptions;

  // `served` is the file's record, shared by its handles (null: this
  // handle's alone).
  OrderedFetch(std::shared_ptr<const Layout> layout, std::shared_ptr<ServedRecord> served, Options options,
               Fetch fetch, Execute execute, Check check);
  // Stops the fetch threads (waits for the running fetches) and frees what is held.
  ~OrderedFetch();
  OrderedFetch(const OrderedFetch&) = delete;
  OrderedFetch& operator=(const OrderedFetch&) = delete;

  // True for layouts worth a whole-file plan: two tensor segments or more.
  static bool Worth(const Layout& layout);

  // Records that [offset, offset + length) is being served (in the file's
  // ServedRecord; call before reading it, so that a plan started meanwhile
  // leaves it out); before the plan started, starts it when the rule in the
  // header says so (restarting a stale record: ServedRecord). Returns
  // whether the plan has started: then the request must go through Serve(),
  // since a plan another request started between the caller's last look
  // and this record may hold the request's bytes (read the ordinary way,
  // they would be fetched twice).
  bool Noted(uint64_t offset, uint64_t length);
  bool started() const { return started_.load(); }

  // Fills dst as `plan` says (its ComputeOps are left to the caller): literals, then every copy from a held range where
  // there is one (waiting for a range being fetched, fetching a queued one),
  // the rest through the ordinary path; then the sources of held bytes are
  // checked unchanged. REQUIRES: started().
  Status Serve(const ReadPlan& plan, char* dst);

  std::vector<std::pair<uint64_t, uint64_t>> range_spans() const;  // for tests: (source offset, length) of each

 private:
  using State = RangeState;
  using Mapping = PlannedRange::Mapping;
  using Range = PlannedRange;
  using Piece = FetchPiece;
  static constexpr size_t npos = FetchPiece::npos;

  // Builds ranges_ from the whole file's plan less what was served. REQUIRES: mu_.
  void Build();
  // Gives each range the mappings of its bytes (`maps`: by file). REQUIRES: mu_.
  void AttachMappings(std::map<FileId, std::vector<Mapping>>& maps);
  // Hands range `r`'s whole pages not served meanwhile to options_.sink from `bytes` (source bytes from
  // `at` on; also at those offsets of pinned file `fd`, if >= 0); returns them (source offset, length). Takes mu_.
  std::vector<std::pair<uint64_t, uint64_t>> Push(const Range& r, const char* bytes, uint64_t at, int fd = -1);
  // The pieces of `c`, split at range boundaries. REQUIRES: mu_.
  void Split(const CopyOp& c, std::vector<Piece>* out) const;
  // The fetch threads' loop: ranges in order while there are any.
  void Work();
  // Predicted items (header): adds the windows of item `k`, some of whose
  // bytes the plan needs, to `spans` (by file), once. REQUIRES: mu_.
  void AddWindows(ItemCheck& k, std::map<FileId, IntervalSet>& spans);
  // Gives each range the predicted items whose windows or bytes it holds bytes of. REQUIRES: mu_.
  void AttachItems();
  // Settles the predicted items whose bytes range `i` holds, from `bytes`
  // (its fetched bytes) and its neighbours'; leaves out the bytes of those
  // found elsewhere or not settled. Before the range is published.
  void SettleItems(size_t i, const char* bytes);
  // Item `k`'s windows, once every byte of them was taken from a range; empty otherwise. REQUIRES: mu_.
  std::map<uint64_t, std::string> WindowsOf(ItemCheck* k) const;
  // Whether a range being read, not yet recorded, holds bytes of k's windows. REQUIRES: mu_.
  bool WindowsComing(ItemCheck* k) const;
  // Fetches range `i` (claimed: kFetching, its budget taken) and publishes
  // it; with `push`, then hands its pages to options_.sink. Only the fetch
  // threads push: a reader's thread holds the kernel's locks on the pages
  // of its own request, and a push into them would wait for itself.
  void FetchRange(size_t i, bool push);
  // FetchRange from the span of range `i` still needed, pinned (its needed bytes counted as fetched);
  // holds only what it could not push. FetchRange where it cannot be pinned.
  void PushPinned(size_t i);
  // Whether the fetch threads push from pinned bytes (a sink and a pin).
  bool pinning() const { return options_.pin && options_.sink; }
  // Splits piece `p` of held range p.range into copies from its kept bytes
  // (`held`) and the rest (`rest`, read the ordinary way). REQUIRES: mu_.
  void TakeHeld(const Piece& p, std::vector<HeldBytes::Copy>* held, std::vector<CopyOp>* rest) const;
  // Marks [src, src + len) of range `i` served; frees it when nothing is left. REQUIRES: mu_.
  void Delivered(size_t i, uint64_t src, uint64_t len);
  // Frees range `i`'s bytes and budget. REQUIRES: mu_.
  void Free(size_t i);

  std::shared_ptr<const Layout> layout_;
  Options options_;
  Fetch fetch_;
  Execute execute_;
  Check check_;

  mutable std::mutex mu_;  // guards the fields below
  std::condition_variable changed_;  // a range left kFetching
  std::vector<Range> ranges_;        // sorted by (file, offset)
  size_t next_ = 0;                  // first range the fetch threads may still take
  std::shared_ptr<ServedRecord> served_;  // never null
  std::set<size_t> tensors_begun_;   // tensor segments a request began in
  // Predicted items' windows (header), as ranges bring them: the bytes of
  // each window, and which of them were taken. The bytes are held from the
  // first range that brings some until the item is settled.
  struct Windows {
    std::vector<std::string> bytes;  // parallel to ItemCheck::windows
    std::vector<IntervalSet> taken;
  };
  std::map<ItemCheck*, Windows> windows_;
  // Bytes this handle asked for before the plan started, and how many of
  // them had been served before (ServedRecord).
  uint64_t asked_bytes_ = 0, asked_again_ = 0;
  std::atomic<bool> started_{false};
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

}  // namespace ckptfs
