#include "source/source_reader.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/convert.h"
#include "source/checksums.h"
#include "source/posix_source.h"
#include "source/transform.h"

namespace ckptfs {
namespace {

// Bytes per WillNeed (posix_fadvise(WILLNEED)). One call reads at most
// max(read_ahead_kb, max_sectors_kb) of the source's device (4 MiB and
// 8 MiB on the benchmark disk; commonly 512 KiB or more); on a device with
// less, part of each piece is not read ahead (a loss of speed only).
constexpr uint64_t kHintChunk = 512 << 10;

// A predicted item's two windows (SettleItem) are read in one request
// across a gap of up to this many bytes, else in two: more would fetch
// bytes no one asked for (a whole item of a MiB, to serve a page of it).
constexpr uint64_t kOneReadItem = 64 << 10;
// Plans of one read (ReadLaidOut): the first, and again after PlanAgain.
constexpr int kPlanTries = 5;

}  // namespace

SourceReader::SourceReader(std::shared_ptr<const Source> source, const std::vector<SourceFile>* files,
                           GroupPolicy policy, uint64_t decoded_cache_bytes, ReadOptions read)
    : files_(files),
      policy_(policy),
      objects_(std::move(source), files),
      counters_(std::make_shared<FetchCounters>()),
      decoded_(decoded_cache_bytes),
      read_(read),
      prefetch_(files, policy, [this](FileId id) { return objects_.Get(id); }),
      pusher_(read.push_tensor_bytes, &prefetch_,
              [this](const ReadPlan& plan, char* dst) { return Execute(plan, dst); }) {}

SourceReader::SourceReader(const std::string& root, const std::vector<SourceFile>* files, GroupPolicy policy,
                           uint64_t decoded_cache_bytes, ReadOptions read)
    : SourceReader(PosixSourceAt(root), files, policy, decoded_cache_bytes, read) {}

Result<std::shared_ptr<const std::string>> SourceReader::Decoded(FileId id) {
  if (auto kept = decoded_.Find(id)) return kept;
  const SourceFile& f = (*files_)[id];
  ASSIGN_OR_RETURN(const SourceObject* obj, objects_.Get(f.base));
  ASSIGN_OR_RETURN(std::string bytes, DecodeItem(f.transform, *obj, f.base_offset, f.base_length, f.size, f.path));
  RETURN_IF_ERROR(objects_.CheckUnchanged(f.base, *obj));
  if (bytes.size() != f.size)
    return Status::Stale(f.path + ": decodes to " + std::to_string(bytes.size()) + " bytes, indexed as " +
                         std::to_string(f.size) + "; run `ckptfs index` again");
  counters_->fetched.fetch_add(f.base_length, std::memory_order_relaxed);
  auto value = std::make_shared<const std::string>(std::move(bytes));
  decoded_.Add(id, value);
  return value;
}

SourceReader::~SourceReader() {
  pusher_.Stop();
  prefetch_.Stop();
}

std::unique_ptr<OrderedFetch> SourceReader::MakeOrderedFetch(std::shared_ptr<const Layout> layout,
                                                             std::shared_ptr<ServedRecord> served,
                                                             PageSink sink) {
  // With --verify-checksums every chunk passes its gate on the ordinary path.
  if (!read_.hold || gate_ || !layout || !OrderedFetch::Worth(*layout)) return nullptr;
  OrderedFetch::Options o;
  o.range_bytes = read_.hold_range_bytes;
  o.threads = read_.hold_threads;
  o.budget = read_.hold.get();
  o.counters = counters_.get();
  o.sink = std::move(sink);
  o.planned.resize(files_->size());
  for (FileId id = 0; id < files_->size(); ++id) o.planned[id] = !(*files_)[id].derived();
  // Whole ranges, read and then checked as every read is (the header's
  // guarantee); counted as fetched.
  auto fetch = [this](FileId id, uint64_t offset, uint64_t len, char* dst) -> Status {
    ASSIGN_OR_RETURN(const SourceObject* obj, objects_.Get(id));
    uint64_t direct = 0;
    if (read_.hold_direct) {
      Result<uint64_t> n = obj->ReadOnce(offset, len, dst);
      if (!n.ok()) return n.status();
      direct = *n;
    } else {
      RETURN_IF_ERROR(obj->ReadAt(offset, len, dst));
    }
    RETURN_IF_ERROR(objects_.CheckUnchanged(id, *obj));
    counters_->fetched.fetch_add(len, std::memory_order_relaxed);
    counters_->direct.fetch_add(direct, std::memory_order_relaxed);
    return Status::OK();
  };
  // Pinned, then checked: the checked bytes are the pushed ones.
  if (objects_.source().PinsRanges() && !read_.hold_direct)
    o.pin = [this](FileId id, uint64_t offset, uint64_t len) -> Result<std::unique_ptr<PinnedRange>> {
      ASSIGN_OR_RETURN(const SourceObject* obj, objects_.Get(id));
      ASSIGN_OR_RETURN(std::unique_ptr<PinnedRange> pinned, obj->Pin(offset, len));
      RETURN_IF_ERROR(objects_.CheckUnchanged(id, *obj));
      return pinned;
    };
  o.settle = [this](ItemCheck& check, std::map<uint64_t, std::string> windows) {
    return SettleItem(check, std::move(windows));
  };
  return std::make_unique<OrderedFetch>(
      std::move(layout), std::move(served), std::move(o), std::move(fetch),
      [this](const ReadPlan& plan, char* dst) { return Execute(plan, dst); },
      [this](const std::vector<FileId>& ids) { return CheckSources(ids); });
}

Status SourceReader::Recheck() { return objects_.Recheck(); }

Status SourceReader::ReadOne(const SourceRead& r, char* dst, char* converted, std::vector<char>& scratch) {
  if ((*files_)[r.file].derived()) {
    ASSIGN_OR_RETURN(auto bytes, Decoded(r.file));
    if (r.offset + r.length > bytes->size())
      return Status::Corruption(PathOf(r.file) + ": read past the decoded item");
    for (const auto& g : r.gathers)
      std::memcpy((g.to_scratch ? converted : dst) + g.dst_offset, bytes->data() + r.offset + g.read_offset, g.length);
    return Status::OK();
  }
  ASSIGN_OR_RETURN(const SourceObject* obj, objects_.Get(r.file));
  DirectIo* direct = read_.direct.get();
  if (r.direct()) {
    RETURN_IF_ERROR(obj->ReadAtVia(r.offset, r.length, dst + r.gathers[0].dst_offset, direct));
  } else {
    scratch.resize(r.length);
    RETURN_IF_ERROR(obj->ReadAtVia(r.offset, r.length, scratch.data(), direct));
    for (const auto& g : r.gathers)
      std::memcpy((g.to_scratch ? converted : dst) + g.dst_offset, scratch.data() + g.read_offset, g.length);
  }
  counters_->fetched.fetch_add(r.length, std::memory_order_relaxed);
  return Status::OK();
}

void SourceReader::Hint(const std::vector<SourceRead>& reads, size_t first) {
  for (size_t i = first; i < reads.size(); ++i) {
    const SourceRead& r = reads[i];
    if ((*files_)[r.file].derived()) continue;  // decoded whole, on first read
    auto obj = objects_.Get(r.file);
    // A hint that cannot be given costs nothing but speed; the read that
    // needs the bytes reports the problem.
    if (!obj.ok()) continue;
    // The kernel reads at most max(read_ahead_kb, max_sectors_kb) of one
    // WILLNEED and drops the rest (force_page_cache_ra), so long ranges go
    // in pieces (kHintChunk).
    for (uint64_t at = 0; at < r.length; at += kHintChunk)
      (*obj)->WillNeed(r.offset + at, std::min(kHintChunk, r.length - at));
  }
}



void SourceReader::ReadAhead(ReadStream& stream, const std::shared_ptr<const Layout>& layout, uint64_t offset,
                             uint64_t length, const PageSink& sink) {
  const size_t unit = layout->SegmentAt(offset);
  const size_t end_unit = length ? layout->SegmentAt(offset + length - 1) : unit;
  ReadStream::Window w = stream.OnRead(offset, length, layout->size(), read_.readahead_bytes, unit, end_unit);
  if (w.length) prefetch_.Post(layout, w, stream.generation());
  if (w.started && sink && read_.push_tensor_bytes) pusher_.Push(stream, layout, unit, offset, sink);
}

void SourceReader::SetChecksumGate(std::unique_ptr<ChecksumGate> gate) { gate_ = std::move(gate); }

Status SourceReader::PassGate(const std::vector<CopyOp>& copies) {
  return gate_->Check(copies, [this](FileId file, uint64_t offset, uint64_t length, char* out) {
    ReadPlan whole;
    whole.length = length;
    whole.copies.push_back({file, offset, 0, length});
    return ExecuteUngated(whole, out);
  });
}

Status SourceReader::Execute(const ReadPlan& plan, char* dst) {
  RETURN_IF_ERROR(PassPredictions(plan.copies));
  if (gate_) RETURN_IF_ERROR(PassGate(plan.copies));
  return ExecuteUngated(plan, dst);
}

Result<ReadPlan> SourceReader::ReadLaidOut(const Layout& layout, uint64_t offset, uint64_t length, char* dst) {
  Status st = Status::PlanAgain("");
  ReadPlan plan;
  for (int tries = 0; st.code() == Status::Code::kPlanAgain && tries < kPlanTries; ++tries) {
    ASSIGN_OR_RETURN(plan, Plan(layout, offset, length));
    st = Execute(plan, dst);
  }
  if (!st.ok()) return st;
  return plan;
}

Status SourceReader::ExecuteScatter(const ReadPlan& plan, ScatterReply* reply) {
  RETURN_IF_ERROR(PassPredictions(plan.copies));
  if (gate_) RETURN_IF_ERROR(PassGate(plan.copies));
  return ScatterUngated(plan, reply);
}

Status SourceReader::SettleItem(ItemCheck& check, std::map<uint64_t, std::string> windows) {
  if (check.state() != ItemCheck::kUnchecked) return Status::OK();
  const FileId id = check.item.file;
  const std::string what = PathOf(id) + " item at " + std::to_string(check.item.offset);
  if (!check.verify) return Status::Incomplete(what + ": no way to read its framing");
  ASSIGN_OR_RETURN(const SourceObject* obj, objects_.Get(id));
  std::unique_ptr<WindowedObject> framed;
  if (windows.empty()) {
    // A small item's two ends in one read, the bytes between them with it.
    ASSIGN_OR_RETURN(framed, WindowedObject::Fetch(*obj, check.windows, WindowGaps{kOneReadItem, kOneReadItem}));
    counters_->fetched.fetch_add(framed->bytes(), std::memory_order_relaxed);
  } else {
    framed = WindowedObject::Holding(*obj, std::move(windows));
  }
  RETURN_IF_ERROR(check.verify(*framed, check, what));
  // What the framing said holds only if the source is still the indexed one.
  return objects_.CheckUnchanged(id, *obj);
}

Status SourceReader::PassPredictions(const std::vector<CopyOp>& copies) {
  // All settled before the answer: one plan again covers every item found elsewhere.
  const CopyOp* wrong = nullptr;
  ItemCheck* last = nullptr;
  for (const CopyOp& c : copies) {
    if (!c.speculative || c.speculative == last) continue;
    last = c.speculative;
    RETURN_IF_ERROR(SettleItem(*c.speculative));
    if (ItemCheck::Servable(c.speculative)) continue;  // the gate (core/meta.h)
    if (c.speculative->state() != ItemCheck::kWrong)
      return Status::IOError(PathOf(c.file) + " item at " + std::to_string(c.speculative->item.offset) +
                             ": its framing could not be checked");
    if (!wrong) wrong = &c;
  }
  if (!wrong) return Status::OK();
  return Status::PlanAgain(PathOf(wrong->file) + " item at " + std::to_string(wrong->speculative->item.offset) +
                           ": its tensor is not where predicted");
}

Status SourceReader::CheckSources(const std::vector<FileId>& ids) {
  for (FileId raw : ids) {
    const SourceFile& f = (*files_)[raw];
    const FileId id = f.derived() ? f.base : raw;
    RETURN_IF_ERROR(objects_.Check(id));
  }
  return Status::OK();
}

namespace {

// Decodes the elements of `c` from `converted` (the plan's scratch) into
// c.length float32 bytes at `out`.
void Convert(const ConvertOp& c, const char* converted, char* out, std::vector<float>& values) {
  values.resize(c.count);
  DecodeToFloat32(c.from, reinterpret_cast<const uint8_t*>(converted + c.scratch_offset), c.first, c.count,
                  values.data());
  std::memcpy(out, reinterpret_cast<const char*>(values.data()) + c.skip, c.length);
}

}  // namespace

Status SourceReader::ForEachRead(const std::vector<SourceRead>& reads,
                                 const std::function<Status(size_t)>& task) {
  if (read_.direct && reads.size() > 1) return read_.direct->io().RunAll(reads.size(), task);
  // The first read starts at once; hinting the others first lets the disk
  // fetch them while it is waited for.
  if (read_.overlap && reads.size() > 1) Hint(reads, 1);
  for (size_t i = 0; i < reads.size(); ++i) RETURN_IF_ERROR(task(i));
  return Status::OK();
}

Status SourceReader::CheckReads(const std::vector<SourceRead>& reads) {
  // Identity checked after the reads (see the header): reads are grouped by
  // file, so this is one fstat + stat per file touched.
  // A derived source's bytes may come from the decoded cache: its base file
  // is checked instead.
  FileId last = static_cast<FileId>(-1);
  for (const SourceRead& r : reads) {
    const SourceFile& f = (*files_)[r.file];
    FileId id = f.derived() ? f.base : r.file;
    if (id == last) continue;
    last = id;
    RETURN_IF_ERROR(objects_.Check(id));
  }
  return Status::OK();
}

Status SourceReader::ExecuteUngated(const ReadPlan& plan, char* dst) {
  for (const LiteralOp& l : plan.literals) std::memcpy(dst + l.dst_offset, l.data, l.length);
  if (plan.copies.empty()) return Status::OK();
  std::vector<SourceRead> reads = GroupReads(plan.copies, policy_);
  std::vector<char> converted(plan.scratch_size);  // source bytes of ConvertOps
  RETURN_IF_ERROR(ForEachRead(reads, [&](size_t i) {
    std::vector<char> scratch;
    return ReadOne(reads[i], dst, converted.data(), scratch);
  }));
  RETURN_IF_ERROR(CheckReads(reads));
  std::vector<float> values;
  for (const ConvertOp& c : plan.converts) Convert(c, converted.data(), dst + c.dst_offset, values);
  return Status::OK();
}

Result<FilledRange> SourceReader::ReadFilled(const SourceRead& r) {
  if ((*files_)[r.file].derived()) {
    ASSIGN_OR_RETURN(auto bytes, Decoded(r.file));
    if (r.offset + r.length > bytes->size())
      return Status::Corruption(PathOf(r.file) + ": read past the decoded item");
    FilledRange f;
    f.data = bytes->data() + r.offset;
    f.shared = std::move(bytes);
    return f;
  }
  ASSIGN_OR_RETURN(const SourceObject* obj, objects_.Get(r.file));
  ASSIGN_OR_RETURN(FilledRange f, obj->ReadFilled(r.offset, r.length, read_.direct.get()));
  counters_->fetched.fetch_add(r.length, std::memory_order_relaxed);
  return f;
}

Status SourceReader::ScatterUngated(const ReadPlan& plan, ScatterReply* reply) {
  // Bytes made here rather than read: literals, converted values and the
  // caller's computed ones.
  uint64_t gathered = 0;
  for (const LiteralOp& l : plan.literals) gathered += l.length;
  for (const ConvertOp& c : plan.converts) gathered += c.length;
  for (const ComputeOp& c : plan.computes) gathered += c.length;
  reply->ReserveGather(gathered);
  for (const LiteralOp& l : plan.literals) std::memcpy(reply->Reserve(l.dst_offset, l.length), l.data, l.length);
  if (plan.copies.empty()) return Status::OK();
  std::vector<SourceRead> reads = GroupReads(plan.copies, policy_);
  std::vector<FilledRange> filled(reads.size());
  RETURN_IF_ERROR(ForEachRead(reads, [&](size_t i) -> Status {
    ASSIGN_OR_RETURN(filled[i], ReadFilled(reads[i]));
    return Status::OK();
  }));
  RETURN_IF_ERROR(CheckReads(reads));
  std::vector<char> converted(plan.scratch_size);
  for (size_t i = 0; i < reads.size(); ++i) {
    for (const SourceRead::Gather& g : reads[i].gathers) {
      if (g.to_scratch) std::memcpy(converted.data() + g.dst_offset, filled[i].data + g.read_offset, g.length);
      else reply->Add(g.dst_offset, filled[i].data + g.read_offset, g.length);
    }
    if (filled[i].buffer.data()) reply->Keep(std::move(filled[i].buffer));
    if (filled[i].shared) reply->Keep(std::move(filled[i].shared));
  }
  std::vector<float> values;
  for (const ConvertOp& c : plan.converts)
    Convert(c, converted.data(), reply->Reserve(c.dst_offset, c.length), values);
  return Status::OK();
}

}  // namespace ckptfs
