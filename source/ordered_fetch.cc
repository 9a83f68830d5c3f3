#include "source/ordered_fetch.h"

#include "source/direct_io.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <system_error>

#include <unistd.h>

namespace ckptfs {
namespace {

// Neighbouring source intervals are fetched as one range while the bytes
// between them are at most this many: the index and pickle bytes between a
// DCP file's items are a few KiB, and one GET more costs more than that.
constexpr uint64_t kMaxGap = 64 << 10;
// A gap holding fewer bytes served already than this (a page) is fetched across.
constexpr uint64_t kRefetchInGap = 4 << 10;
// The whole file is planned this much of it at a time, so that a file of
// column-split tensors (a copy per row piece) never has all its copies in
// memory at once.
constexpr uint64_t kPlanSlice = 64 << 20;

// The end of the window of `window` bytes holding source offset `offset`:
// windows start at multiples of the range size in the source file, as an
// object's upload parts do (and the GETs of s3torchconnector's client), so
// that a server that stores objects in part-sized chunks reads each chunk
// for one range, not for two.
uint64_t WindowEnd(uint64_t offset, uint64_t window) { return AlignDown(offset, window) + window; }

std::string Gb(uint64_t n) { return std::to_string(n) + " bytes"; }

}  // namespace

std::string FetchCounters::Describe() const {
  return "fetched " + Gb(fetched.load()) + " from its sources (" + Gb(ordered.load()) + " in source order, " +
         Gb(pinned.load()) + " pinned, " + Gb(direct.load()) + " with O_DIRECT, " + Gb(refetched.load()) +
         " refetched), served " + Gb(served.load());
}

uint64_t FetchBudget::RangeBytes(uint64_t capacity, uint64_t wanted) {
  return std::max<uint64_t>(kDirectAlign, AlignDown(std::min(wanted, capacity), kDirectAlign));
}

bool FetchBudget::Acquire(uint64_t n, const std::function<bool()>& stop) {
  std::unique_lock<std::mutex> lock(mu_);
  while (held_ + n > capacity_) {
    if (stop()) return false;
    room_.wait_for(lock, std::chrono::milliseconds(20));  // stop() is polled: it has no condition of ours
  }
  held_ += n;
  peak_ = std::max(peak_, held_);
  return true;
}

bool FetchBudget::TryAcquire(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (held_ + n > capacity_) return false;
  held_ += n;
  peak_ = std::max(peak_, held_);
  return true;
}

void FetchBudget::Release(uint64_t n) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ -= std::min(n, held_);
  }
  room_.notify_all();
}

uint64_t FetchBudget::held() const {
  std::lock_guard<std::mutex> lock(mu_);
  return held_;
}

uint64_t FetchBudget::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

std::string FetchBudget::Describe() const {
  return "source-order hold: peak " + Gb(peak()) + " of the " + Gb(capacity_) + " bound";
}

uint64_t ServedRecord::Add(uint64_t offset, uint64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t again = spans_.Bytes(offset, offset + length);
  if (again == 0) {
    reasking_ = false;  // new bytes: the run of requests that asked again is over
  } else if (!reasking_) {
    reasking_ = true;
    asked_since_ = IntervalSet();
  }
  spans_.Add(offset, offset + length);
  if (reasking_) asked_since_.Add(offset, offset + length);
  again_ += again;
  if (again_ >= kClearAfter) RestartLocked();
  return again;
}

void ServedRecord::AddPushed(uint64_t offset, uint64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  spans_.Add(offset, offset + length);
  if (reasking_) asked_since_.Add(offset, offset + length);
}

void ServedRecord::Restart() {
  std::lock_guard<std::mutex> lock(mu_);
  if (reasking_) RestartLocked();
}

void ServedRecord::RestartLocked() {
  spans_ = asked_since_;
  again_ = 0;
}

OrderedFetch::OrderedFetch(std::shared_ptr<const Layout> layout, std::shared_ptr<ServedRecord> served,
                           Options options, Fetch fetch, Execute execute, Check check)
    : layout_(std::move(layout)),
      options_(std::move(options)),
      fetch_(std::move(fetch)),
      execute_(std::move(execute)),
      check_(std::move(check)),
      served_(served ? std::move(served) : std::make_shared<ServedRecord>()) {
  options_.range_bytes = FetchBudget::RangeBytes(options_.budget->capacity(), options_.range_bytes);
  options_.threads = std::max(1u, options_.threads);
}

OrderedFetch::~OrderedFetch() {
  stop_ = true;
  changed_.notify_all();
  for (std::thread& t : threads_) t.join();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < ranges_.size(); ++i)
      if (ranges_[i].state == State::kHeld) Free(i);
  }
  // The buffers kept for this file's fetch threads are not needed between loads.
  if (started_.load()) options_.budget->buffers().Trim();
}

bool OrderedFetch::Worth(const Layout& layout) {
  size_t tensors = 0;
  for (const Segment& s : layout.segments()) tensors += s.kind == Segment::Kind::kTensor;
  return tensors >= 2;
}

std::vector<std::pair<uint64_t, uint64_t>> OrderedFetch::range_spans() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const Range& r : ranges_) out.emplace_back(r.offset, r.length);
  return out;
}

bool OrderedFetch::Noted(uint64_t offset, uint64_t length) {
  if (length == 0) return started_.load();
  const uint64_t again = served_->Add(offset, length);
  if (started_.load()) return true;
  std::lock_guard<std::mutex> lock(mu_);
  if (started_.load()) return true;
  asked_bytes_ += length;
  asked_again_ += again;
  const size_t unit = layout_->SegmentAt(offset);
  if (unit < layout_->segments().size() && layout_->segments()[unit].kind == Segment::Kind::kTensor)
    tensors_begun_.insert(unit);
  if (tensors_begun_.size() < 2) return false;
  // Every byte asked so far had been served, more than a page or two: the
  // kernel has dropped the file's pages, and the record is stale
  // (ServedRecord).
  if (asked_again_ == asked_bytes_ && asked_again_ >= ServedRecord::kColdPass) served_->Restart();
  Build();
  started_ = true;
  for (unsigned t = 0; t < options_.threads; ++t) {
    try {
      threads_.emplace_back([this] { Work(); });
    } catch (const std::system_error&) {
      break;  // fewer in flight; readers fetch what no thread takes
    }
  }
  return true;
}

void OrderedFetch::Build() {
  std::map<FileId, IntervalSet> needed;
  std::map<FileId, std::vector<Mapping>> maps;
  std::map<FileId, IntervalSet> left_out;  // source bytes of what was served already
  std::map<FileId, IntervalSet> spans;     // what the ranges cover: needed bytes and predicted items' windows
  const IntervalSet served = served_->Get();
  for (uint64_t at = 0; at < layout_->size(); at += kPlanSlice) {
    auto plan = Plan(*layout_, at, std::min(kPlanSlice, layout_->size() - at));
    if (!plan.ok()) continue;  // the read of those bytes will say why
    for (const CopyOp& c : plan->copies) {
      if (c.to_scratch || c.file >= options_.planned.size() || !options_.planned[c.file]) continue;
      // The copy's virtual bytes less those served already, as source bytes.
      const uint64_t v = at + c.dst_offset;
      uint64_t pos = v;
      auto add = [&](uint64_t b, uint64_t e) {
        if (b >= e) return;
        if (c.speculative && options_.settle) AddWindows(*c.speculative, spans);
        needed[c.file].Add(c.src_offset + (b - v), c.src_offset + (e - v));
        if (options_.sink) maps[c.file].push_back({c.src_offset + (b - v), b, e - b, c.speculative});
      };
      auto skip = [&](uint64_t b, uint64_t e) {
        if (b < e) left_out[c.file].Add(c.src_offset + (b - v), c.src_offset + (e - v));
      };
      auto it = served.spans().upper_bound(v);
      if (it != served.spans().begin()) --it;
      for (; it != served.spans().end() && it->first < v + c.length; ++it) {
        const auto [b, e] = *it;
        if (e <= pos) continue;
        add(pos, std::max(pos, b));
        skip(std::max(pos, b), std::min(e, v + c.length));
        pos = std::max(pos, e);
      }
      add(pos, v + c.length);
    }
  }
  for (const auto& [file, set] : needed)
    for (const auto& [b, e] : set.spans()) spans[file].Add(b, e);
  for (const auto& [file, set] : spans) {
    const IntervalSet& want = needed[file];
    for (const auto& [b, e] : set.spans()) {
      for (uint64_t pos = b; pos < e;) {
        Range* r = ranges_.empty() ? nullptr : &ranges_.back();
        // Across a small gap, unless it holds a page or more served
        // already: those would be fetched a second time (the kernel keeps
        // what it was served in whole pages). Less than a page is fetched
        // again: a strided item (a transposed view) served in part before
        // the plan has such bytes every few hundred bytes, and a range
        // between each two cost a GET each (8,500 for a 6 MB step).
        const bool joins = r && r->file == file && pos - (r->offset + r->length) <= kMaxGap &&
                           pos < WindowEnd(r->offset, options_.range_bytes) &&
                           left_out[file].Bytes(r->offset + r->length, pos) < kRefetchInGap;
        if (!joins) {
          ranges_.push_back({});
          r = &ranges_.back();
          r->file = file;
          r->offset = pos;
        }
        // A range stays inside its window (WindowEnd), so its aligned span
        // (AlignSpan, what its buffer holds) is at most range_bytes: a
        // buffer of the usual size (RangeBuffers).
        const uint64_t take = std::min(e, WindowEnd(r->offset, options_.range_bytes));
        auto it = want.spans().upper_bound(pos);
        if (it != want.spans().begin()) --it;
        for (; it != want.spans().end() && it->first < take; ++it)
          if (std::max(pos, it->first) < std::min(take, it->second))
            r->needed.Add(std::max(pos, it->first), std::min(take, it->second));
        r->length = take - r->offset;
        pos = take;
      }
    }
  }
  AttachMappings(maps);
  AttachItems();
}

void OrderedFetch::AddWindows(ItemCheck& k, std::map<FileId, IntervalSet>& spans) {
  if (windows_.count(&k)) return;
  Windows& w = windows_[&k];
  w.bytes.resize(k.windows.size());  // filled as ranges land (SettleItems)
  w.taken.resize(k.windows.size());
  for (const auto& [offset, len] : k.windows) spans[k.item.file].Add(offset, offset + len);
}

void OrderedFetch::AttachItems() {
  for (const auto& [k, w] : windows_) {
    const FileId file = k->item.file;
    // Its windows and, between them, its predicted bytes: every range
    // holding any of them settles it before it publishes a byte.
    std::vector<std::pair<uint64_t, uint64_t>> spans = k->windows;
    spans.emplace_back(k->predicted.offset, k->predicted.length);
    for (const auto& [offset, len] : spans) {
      auto r = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(file, offset),
                                [](const std::pair<FileId, uint64_t>& key, const Range& x) {
                                  return key < std::make_pair(x.file, x.offset);
                                });
      if (r != ranges_.begin()) --r;
      for (; r != ranges_.end() && r->file == file && r->offset < offset + len; ++r)
        // Only k is attached in this pass: a range holding it already has it last.
        if (r->offset + r->length > offset && (r->items.empty() || r->items.back() != k)) r->items.push_back(k);
    }
  }
}

std::map<uint64_t, std::string> OrderedFetch::WindowsOf(ItemCheck* k) const {
  const Windows& w = windows_.at(k);
  std::map<uint64_t, std::string> out;
  for (size_t j = 0; j < k->windows.size(); ++j) {
    const auto [offset, len] = k->windows[j];
    if (w.taken[j].Bytes(offset, offset + len) != len) return {};
    // The head and tail of a small item overlap or touch: one window.
    auto prev = out.empty() ? out.end() : std::prev(out.end());
    if (prev != out.end() && prev->first + prev->second.size() >= offset) {
      const uint64_t keep = offset - prev->first;
      prev->second.resize(std::max<uint64_t>(prev->second.size(), keep + len));
      prev->second.replace(keep, len, w.bytes[j]);
    } else {
      out.emplace(offset, w.bytes[j]);
    }
  }
  return out;
}

bool OrderedFetch::WindowsComing(ItemCheck* k) const {
  for (const auto& [offset, len] : k->windows) {
    // The first range that may hold the window's first byte, as AttachItems finds it.
    auto r = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(k->item.file, offset),
                              [](const std::pair<FileId, uint64_t>& key, const Range& x) {
                                return key < std::make_pair(x.file, x.offset);
                              });
    if (r != ranges_.begin()) --r;
    for (; r != ranges_.end() && r->file == k->item.file && r->offset < offset + len; ++r)
      if (r->offset + r->length > offset && r->state == State::kFetching && r->reading && !r->recorded)
        return true;
  }
  return false;
}

void OrderedFetch::SettleItems(size_t i, const char* bytes) {
  Range& r = ranges_[i];
  std::vector<ItemCheck*> mine;  // the items whose predicted bytes it holds
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (ItemCheck* k : r.items) {
      Windows& w = windows_[k];
      for (size_t j = 0; j < k->windows.size() && k->state() == ItemCheck::kUnchecked; ++j) {
        const auto [offset, len] = k->windows[j];
        const uint64_t b = std::max(offset, r.offset), e = std::min(offset + len, r.offset + r.length);
        if (b >= e) continue;
        w.bytes[j].resize(len);
        std::memcpy(w.bytes[j].data() + (b - offset), bytes + (b - r.offset), e - b);
        w.taken[j].Add(b, e);
      }
      const ByteMeta& p = k->predicted;
      if (p.offset < r.offset + r.length && r.offset < p.offset + p.length) mine.push_back(k);
    }
    r.recorded = true;
  }
  changed_.notify_all();
  for (ItemCheck* k : mine) {
    std::map<uint64_t, std::string> held;
    {
      std::unique_lock<std::mutex> lock(mu_);
      changed_.wait(lock, [&] {
        return k->state() != ItemCheck::kUnchecked || stop_.load() || !(held = WindowsOf(k)).empty() ||
               !WindowsComing(k);
      });
    }
    // A failure leaves it unchecked: its readers' ordinary path reads it again and says why.
    if (k->state() == ItemCheck::kUnchecked && !stop_.load()) (void)options_.settle(*k, std::move(held));
  }
  changed_.notify_all();  // other ranges' waits for these items
  std::lock_guard<std::mutex> lock(mu_);
  for (ItemCheck* k : mine) {
    // Settled: its windows' bytes go (a few KiB per item, a million items in a large checkpoint).
    if (k->state() != ItemCheck::kUnchecked) windows_[k].bytes = std::vector<std::string>(k->windows.size());
    if (k->state() == ItemCheck::kVerified) continue;
    const ByteMeta& p = k->predicted;
    r.needed.Remove(p.offset, p.offset + p.length);
    std::erase_if(r.maps, [&](const Mapping& m) { return m.src >= p.offset && m.src < p.offset + p.length; });
  }
}

void OrderedFetch::AttachMappings(std::map<FileId, std::vector<Mapping>>& maps) {
  for (const auto& [file, ms] : maps) {
    for (const Mapping& m : ms) {
      // The first range that may hold the mapping's first byte, as Split finds it.
      auto r = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(file, m.src),
                                [](const std::pair<FileId, uint64_t>& k, const Range& x) {
                                  return k < std::make_pair(x.file, x.offset);
                                });
      if (r != ranges_.begin()) --r;
      for (; r != ranges_.end() && r->file == file && r->offset < m.src + m.len; ++r) {
        const uint64_t b = std::max(m.src, r->offset), e = std::min(m.src + m.len, r->offset + r->length);
        if (b < e) r->maps.push_back({b, m.virt + (b - m.src), e - b, m.item});
      }
    }
  }
}

std::vector<std::pair<uint64_t, uint64_t>> OrderedFetch::Push(const Range& r, const char* bytes, uint64_t at,
                                                               int fd) {
  static const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  std::vector<std::pair<uint64_t, uint64_t>> pushed, needed;
  for (const Mapping& m : r.maps) {
    // The gate (header): a predicted item's bytes only once it is verified.
    if (!ItemCheck::Servable(m.item)) continue;
    // What readers have not been served meanwhile: the rest is in the page cache.
    needed.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = r.needed.spans().upper_bound(m.src);
      if (it != r.needed.spans().begin()) --it;
      for (; it != r.needed.spans().end() && it->first < m.src + m.len; ++it)
        if (std::max(m.src, it->first) < std::min(m.src + m.len, it->second))
          needed.emplace_back(std::max(m.src, it->first), std::min(m.src + m.len, it->second));
    }
    for (const auto& [sb, se] : needed) {
      // Whole pages only: the consumer's request fills a page shared with a neighbour.
      const uint64_t vb = m.virt + (sb - m.src), ve = m.virt + (se - m.src);
      const uint64_t b = (vb + page - 1) / page * page, e = ve / page * page;
      if (e <= b) continue;
      const uint64_t src = m.src + (b - m.virt);
      served_->AddPushed(b, e - b);
      options_.sink(b, PageBytes{bytes + (src - at), e - b, fd, src});
      options_.counters->served.fetch_add(e - b, std::memory_order_relaxed);
      pushed.emplace_back(src, e - b);
    }
  }
  return pushed;
}

void OrderedFetch::Split(const CopyOp& c, std::vector<Piece>* out) const {
  const uint64_t end = c.src_offset + c.length;
  // The first range that may hold the copy's first byte.
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), std::make_pair(c.file, c.src_offset),
                             [](const std::pair<FileId, uint64_t>& k, const Range& r) {
                               return k < std::make_pair(r.file, r.offset);
                             });
  if (it != ranges_.begin()) --it;
  uint64_t pos = c.src_offset;
  auto piece = [&](size_t range, uint64_t b, uint64_t e) {
    if (b < e) out->push_back({range, b, c.dst_offset + (b - c.src_offset), e - b, c.file, c.speculative});
  };
  for (; it != ranges_.end() && pos < end; ++it) {
    if (it->file != c.file) {
      if (it->file > c.file) break;
      continue;
    }
    const uint64_t rb = it->offset, re = it->offset + it->length;
    if (re <= pos) continue;
    if (rb >= end) break;
    piece(npos, pos, std::max(pos, rb));  // between ranges: not planned
    const uint64_t e = std::min(end, re);
    piece(size_t(it - ranges_.begin()), std::max(pos, rb), e);
    pos = e;
  }
  piece(npos, pos, end);
}

void OrderedFetch::Work() {
  auto stop = [this] { return stop_.load(); };
  while (!stop()) {
    // Room first, then the next range: a range is never claimed while its
    // fetch waits for memory (its readers would wait on it).
    if (!options_.budget->Acquire(options_.range_bytes, stop)) return;
    size_t i;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (next_ < ranges_.size() && ranges_[next_].state != State::kQueued) ++next_;
      if (next_ == ranges_.size()) {
        options_.budget->Release(options_.range_bytes);
        return;
      }
      i = next_++;
      ranges_[i].state = State::kFetching;
    }
    options_.budget->Release(options_.range_bytes - ranges_[i].length);
    if (pinning() && ranges_[i].items.empty()) PushPinned(i);
    else FetchRange(i, true);
  }
}

void OrderedFetch::FetchRange(size_t i, bool push) {
  Range& r = ranges_[i];  // offset, length and file never change once built
  const AlignedSpan span = AlignSpan(r.offset, r.length);
  std::shared_ptr<char[]> buffer = options_.budget->buffers().Take(span.length);
  // Its readers read it the ordinary way, which reports the cause.
  Status st = buffer ? Status::OK() : Status::IOError("out of memory for a source range");
  char* bytes = buffer ? buffer.get() + span.skip : nullptr;  // written whole by fetch_ before it is read
  if (!r.items.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    r.reading = true;  // its windows are coming (WindowsComing)
  }
  if (st.ok()) st = fetch_(r.file, r.offset, r.length, bytes);
  if (st.ok() && !r.items.empty()) SettleItems(i, bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (st.ok()) {
      r.fetched = true;
      options_.counters->ordered.fetch_add(r.length, std::memory_order_relaxed);
      r.held = HeldBytes(buffer, r.offset, r.length, span.skip);
      r.state = State::kHeld;
      if (r.needed.empty() || stop_.load()) Free(i);
    } else {
      // Its readers read through the ordinary path, which reports the cause.
      r.state = State::kFailed;
      options_.budget->Release(r.length);
    }
  }
  changed_.notify_all();
  if (!st.ok() || !push || !options_.sink || stop_.load()) return;
  // Outside the lock: readers of the range's other bytes need not wait.
  const auto pushed = Push(r, bytes, r.offset);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [src, len] : pushed)
    if (r.state == State::kHeld) Delivered(i, src, len);
  // What is left is what the consumer has yet to ask for: its budget goes
  // back to the fetch.
  const uint64_t before = r.held.size();
  if (r.state == State::kHeld && r.held.Compact(r.needed)) options_.budget->Release(before - r.held.size());
}

void OrderedFetch::PushPinned(size_t i) {
  Range& r = ranges_[i];  // offset, length and file never change once built
  uint64_t first = 0, last = 0, bytes_needed = 0;  // what its readers have not been served yet
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (r.needed.empty()) {  // its readers read it all themselves
      options_.budget->Release(r.length);
      r.state = State::kDone;
    } else {
      first = r.needed.spans().begin()->first;
      last = r.needed.spans().rbegin()->second;
      bytes_needed = r.needed.Bytes(first, last);
    }
  }
  if (bytes_needed == 0) return changed_.notify_all();
  auto pinned = options_.pin(r.file, first, last - first);
  if (!pinned.ok()) return FetchRange(i, true);
  options_.counters->fetched.fetch_add(bytes_needed, std::memory_order_relaxed);
  options_.counters->ordered.fetch_add(bytes_needed, std::memory_order_relaxed);
  options_.counters->pinned.fetch_add(bytes_needed, std::memory_order_relaxed);
  std::shared_ptr<PinnedRange> pin = std::move(*pinned);
  // Readers copy from the pinned bytes while they are pushed (their copies
  // keep the pin), as from any held range: published first (FetchRange).
  std::shared_ptr<char[]> bytes(pin, const_cast<char*>(pin->data()));
  {
    std::lock_guard<std::mutex> lock(mu_);
    r.fetched = true;
    r.held = HeldBytes(bytes, first, last - first, 0, /*mapped=*/true);
    r.state = State::kHeld;
    options_.budget->Release(r.length - (last - first));
    if (stop_.load()) Free(i);
  }
  changed_.notify_all();
  if (stop_.load()) return;
  const auto pushed = Push(r, bytes.get(), first, pin->fd());
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [src, len] : pushed)
    if (r.state == State::kHeld) Delivered(i, src, len);
  if (r.state != State::kHeld) return;
  // The pin ends with the copies out of it: only the edges of pages shared
  // with a neighbour are kept, in memory of their own.
  const uint64_t before = r.held.size();
  if (r.held.Keep(r.needed)) {
    options_.budget->Release(before - r.held.size());
  } else {
    Free(i);  // out of memory, or unreadable pages: its readers read the ordinary way
    r.state = State::kFailed;
  }
}

void OrderedFetch::TakeHeld(const Piece& p, std::vector<HeldBytes::Copy>* held, std::vector<CopyOp>* rest) const {
  std::vector<std::pair<uint64_t, uint64_t>> missing;
  ranges_[p.range].held.Take(p.src, p.length, p.dst, held, &missing);
  for (const auto& [src, len] : missing) {
    rest->push_back({p.file, src, p.dst + (src - p.src), len, false, p.speculative});
    options_.counters->refetched.fetch_add(len, std::memory_order_relaxed);
  }
}

void OrderedFetch::Free(size_t i) {
  Range& r = ranges_[i];
  if (r.state == State::kHeld) options_.budget->Release(r.held.size());
  r.held.Reset();
  r.state = State::kDone;
}

void OrderedFetch::Delivered(size_t i, uint64_t src, uint64_t len) {
  Range& r = ranges_[i];
  r.needed.Remove(src, src + len);
  if (!r.needed.empty()) return;
  if (r.state == State::kHeld) Free(i);
  else if (r.state == State::kQueued) r.state = State::kDone;
  // kFetching: FetchRange frees it when it lands.
}

Status OrderedFetch::Serve(const ReadPlan& plan, char* dst) {
  for (const LiteralOp& l : plan.literals) std::memcpy(dst + l.dst_offset, l.data, l.length);
  std::vector<Piece> pieces;
  std::vector<size_t> claimed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const CopyOp& c : plan.copies)
      if (!c.to_scratch) Split(c, &pieces);
    // A range no fetch thread has reached is fetched now, by this reader,
    // whole, when there is room; else only the reader's bytes are read.
    // Ranges to be pinned are the fetch threads' alone (header): this
    // reader's bytes leave them now and are read the ordinary way, so that
    // a pin taken meanwhile neither fetches them too nor serves them.
    for (Piece& p : pieces) {
      if (p.range == npos || ranges_[p.range].state != State::kQueued) continue;
      if (pinning()) {
        ranges_[p.range].needed.Remove(p.src, p.src + p.length);
        p.range = npos;
        continue;
      }
      if (!options_.budget->TryAcquire(ranges_[p.range].length)) continue;
      ranges_[p.range].state = State::kFetching;
      claimed.push_back(p.range);
    }
  }
  for (size_t i : claimed) FetchRange(i, false);
  std::vector<HeldBytes::Copy> held;
  // The ordinary path's share: pieces not held, and the bytes of converted
  // values (never planned) with their conversions.
  ReadPlan rest;
  rest.length = plan.length;
  rest.converts = plan.converts;
  rest.scratch_size = plan.scratch_size;
  std::vector<FileId> held_files;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (const Piece& p : pieces) {
      if (p.range != npos) {
        changed_.wait(lock, [&] { return ranges_[p.range].state != State::kFetching; });
        const Range& r = ranges_[p.range];
        // Planned on a prediction found wrong meanwhile: the request is planned again.
        if (p.speculative && p.speculative->state() == ItemCheck::kWrong)
          return Status::PlanAgain("item at " + std::to_string(p.speculative->item.offset) +
                                   ": its tensor is not where predicted");
        // The gate (header); an unsettled item's bytes go the ordinary way, which settles it.
        if (r.state == State::kHeld && ItemCheck::Servable(p.speculative)) {
          TakeHeld(p, &held, &rest.copies);
          held_files.push_back(p.file);
          continue;
        }
        if (r.fetched) options_.counters->refetched.fetch_add(p.length, std::memory_order_relaxed);
      }
      rest.copies.push_back({p.file, p.src, p.dst, p.length, false, p.speculative});
    }
  }
  for (const CopyOp& c : plan.copies)
    if (c.to_scratch) rest.copies.push_back(c);
  for (const HeldBytes::Copy& h : held) {
    if (h.mapped) RETURN_IF_ERROR(HeldBytes::ReadIn(h.from, h.length));
    std::memcpy(dst + h.dst, h.from, h.length);
  }
  if (!rest.copies.empty() || !rest.converts.empty()) RETURN_IF_ERROR(execute_(rest, dst));
  std::sort(held_files.begin(), held_files.end());
  held_files.erase(std::unique(held_files.begin(), held_files.end()), held_files.end());
  // Held bytes were the indexed ones when fetched; the sources must still
  // be those now, as for every read (see the header).
  RETURN_IF_ERROR(check_(held_files));
  std::lock_guard<std::mutex> lock(mu_);
  for (const Piece& p : pieces)
    if (p.range != npos) Delivered(p.range, p.src, p.length);
  return Status::OK();
}

}  // namespace ckptfs
