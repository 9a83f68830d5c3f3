#include "fs/open_files.h"

#include <fcntl.h>

#include <cstring>
#include <utility>
#include <vector>

namespace ckptfs {
namespace {

// Plans made again after PlanAgain before a read gives up (OpenFiles::Read).
constexpr int kPlanAgainTries = 4;

}  // namespace

struct OpenFiles::Handle {
  std::shared_ptr<const FsNode> node;
  std::unique_ptr<TreeFile> file;  // source files
  Served* served = nullptr;  // virtual files: holds it loaded (Served::handles)
  mutable ReadStream stream;  // virtual files: follows the reader for read-ahead
  PageSink push;  // virtual files of a checkpoint: where pushed pages go (FsOptions::store)
  // Virtual files worth it: the whole file fetched in source order once its
  // reader reads it as a whole (source/ordered_fetch.h); null otherwise.
  std::unique_ptr<OrderedFetch> order;
};

OpenFiles::OpenFiles(const FsOptions& options, const SourceTree& tree, NodeTable& nodes, CheckpointSet& ckpts,
                     ViewBuilder& views, ComputeCache& compute)
    : options_(options),
      tree_(tree),
      nodes_(nodes),
      ckpts_(ckpts),
      views_(views),
      compute_(compute),
      limiter_([this](const std::string& line) { options_.Log(line); }) {}

void OpenFiles::LogServed(int ckpt, const FsError& e, const std::string& line) {
  limiter_.Log(ckpts_.ServedAt(ckpt)->dir + '\0' + std::to_string(e.err()) + '\0' + CauseKey(e.message()), line);
}

void OpenFiles::MarkMergedStale(const std::shared_ptr<MergedSources>& ms, int ckpt, const std::string& why) {
  if (ms->stale.exchange(true)) return;
  compute_.Drop(ckpt);
  options_.Log(JoinRel(ckpts_.ServedAt(ckpt)->dir, "") + ": merged view: " + why +
               "; it reads as EIO until the adapter is indexed again");
  if (!options_.invalidate) return;
  for (uint64_t ino : nodes_.Select([&](const FsNode& n) { return n.sources == ms; })) options_.invalidate(ino);
}

FsResult<uint64_t> OpenFiles::Open(uint64_t ino, int flags) {
  std::shared_ptr<FsNode> n = nodes_.Find(ino);
  if (!n) return FsError(ENOENT, "unknown inode " + std::to_string(ino));
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & (O_TRUNC | O_CREAT | O_APPEND)))
    return FsError(EROFS, nodes_.PathOf(*n) + ": read-only file system");
  if (n->is_dir()) return FsError(EISDIR, nodes_.PathOf(*n) + " is a directory");
  // Refused here rather than at read: a mapped file whose pages fail to read
  // kills its reader with SIGBUS, a failed open is an exception it can catch.
  if (!n->problem.empty()) {
    FsError e(EIO, nodes_.PathOf(*n) + ": " + n->problem);
    LogServed(n->ckpt, e, nodes_.PathOf(*n) + ": open failed (" + std::strerror(EIO) + "): " + n->problem);
    return e;
  }
  auto h = std::make_unique<Handle>();
  h->node = n;
  if (n->kind == NodeKind::kSourceLink) return FsError(ELOOP, n->rel + ": a symlink (the kernel follows it)");
  if (n->kind == NodeKind::kSourceFile) {
    ASSIGN_OR_RETURN(h->file, tree_.OpenFile(n->rel));
  }
  if (n->kind == NodeKind::kVirtualFile) {
    // Loads its checkpoint again if it was unloaded since the kernel looked
    // the file up: the inode is still this file's.
    auto s = ckpts_.Acquire(n->ckpt);
    if (!s.ok()) {
      LogServed(n->ckpt, s.status(), nodes_.PathOf(*n) + ": open failed (" + std::strerror(s.status().err()) +
                                         "): " + s.status().message());
      return s.status();
    }
    h->served = *s;
    if (FsError e = views_.EnsureLayout(n.get(), **s); !e.ok()) {
      ckpts_.Unpin(*s);
      return e;
    }
    h->push = PushSink(*n, *s);
    std::shared_ptr<ServedRecord> record;
    if (OrderedFetch::Worth(*n->layout)) {
      std::lock_guard<std::mutex> lock(records_mu_);
      auto& r = records_[n->ino];
      if (!r) r = std::make_shared<ServedRecord>();
      record = r;
    }
    h->order = ReaderOf(*h)->MakeOrderedFetch(n->layout, std::move(record), h->push);
  }
  ckpts_.Touch(n->ckpt);
  return reinterpret_cast<uint64_t>(h.release());
}

FsResult<size_t> OpenFiles::Read(uint64_t handle, char* buf, size_t size, uint64_t offset) {
  const Handle* h = reinterpret_cast<const Handle*>(handle);
  const FsNode& n = *h->node;
  if (n.kind == NodeKind::kSourceFile) {
    FsResult<size_t> got = h->file->Read(buf, size, offset);
    if (!got.ok())  // no checkpoint to name: keyed by the file
      limiter_.Log(n.rel + '\0' + std::to_string(got.status().err()),
                   n.rel + ": read of " + std::to_string(size) + " bytes at " + std::to_string(offset) + " failed (" +
                       std::strerror(got.status().err()) + "): " + got.status().message());
    return got;
  }
  ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(*h, size, offset));
  SourceReader* reader = ReaderOf(*h);
  // Noted before the bytes are read: a plan that starts meanwhile (on
  // another request) leaves them out, rather than fetch them again.
  const bool ordered = h->order && h->order->Noted(offset, plan.length);
  Status st = ordered ? h->order->Serve(plan, buf) : reader->Execute(plan, buf);
  // Planned on a prediction the item's framing did not confirm (ItemCheck):
  // planned again where the framing says. Each time settles every item of
  // the plan, so once is the rule; a few bound a race with a rescan.
  for (int again = 0; st.code() == Status::Code::kPlanAgain && again < kPlanAgainTries; ++again) {
    ASSIGN_OR_RETURN(plan, PlanRead(*h, size, offset));
    st = ordered ? h->order->Serve(plan, buf) : reader->Execute(plan, buf);
  }
  if (st.ok() && !plan.computes.empty()) st = compute_.Fill(plan.computes, buf, *reader, n.ckpt);
  if (!st.ok()) return ReadFailed(n, size, offset, st);
  reader->counters().served.fetch_add(plan.length, std::memory_order_relaxed);
  // A file planned in source order reads nothing ahead by the request
  // stream: what the stream guessed would be fetched a second time.
  if (!h->order) reader->ReadAhead(h->stream, n.layout, offset, plan.length, h->push);
  return plan.length;
}

FsError OpenFiles::ReadFailed(const FsNode& n, size_t size, uint64_t offset, const FsError& e) {
  LogServed(n.ckpt, e, nodes_.PathOf(n) + ": read of " + std::to_string(size) + " bytes at " + std::to_string(offset) +
      " failed (" + std::strerror(e.err()) + "): " + e.message());
  return e;
}

FsError OpenFiles::ReadFailed(const FsNode& n, size_t size, uint64_t offset, const Status& st) {
  if (st.code() == Status::Code::kStale && n.sources) MarkMergedStale(n.sources, n.ckpt, st.message());
  else if (st.code() == Status::Code::kStale) InvalidateCheckpoint(n.ckpt, st.message());
  return ReadFailed(n, size, offset, FsError::From(st));
}

PageSink OpenFiles::PushSink(const FsNode& n, const Served* served) const {
  // A merged/ file's tensors are computed, and its reader is not the
  // checkpoint's: nothing is pushed.
  if (!options_.store || n.sources) return {};
  return [store = options_.store, ino = n.ino, served](uint64_t offset, const PageBytes& bytes) {
    store(ino, offset, bytes, [served] { return !served->stale.load(); });
  };
}

// Kept loaded by the open handle; a merged/ file reads two checkpoints' files.
SourceReader* OpenFiles::ReaderOf(const Handle& h) {
  return h.node->sources ? h.node->sources->reader.get() : h.served->reader.get();
}

FsResult<ReadPlan> OpenFiles::PlanRead(const Handle& h, size_t size, uint64_t offset) {
  const FsNode& n = *h.node;
  if (!n.problem.empty()) return ReadFailed(n, size, offset, FsError(EIO, n.problem));
  if (n.sources && n.sources->stale.load())
    return ReadFailed(n, size, offset,
                      FsError(EIO, nodes_.PathOf(n) + ": a source of the adapter or of its base changed since indexing; "
                                                      "the merged view reads as EIO until the adapter is loaded again"));
  // One changed source makes the whole checkpoint suspect: files the read
  // does not touch may belong to a save that replaced them all.
  if (h.served->stale.load())
    return ReadFailed(n, size, offset,
                      FsError(EIO, JoinRel(h.served->dir, "") + ": a source changed since indexing; the checkpoint "
                                                                "reads as EIO until it is indexed again"));
  auto plan = Plan(*n.layout, offset, size);
  if (!plan.ok()) return ReadFailed(n, size, offset, FsError::From(plan.status()));
  return std::move(plan).value();
}

FsResult<ScatterReply> OpenFiles::ReadScatter(uint64_t handle, size_t size, uint64_t offset) {
  const Handle* h = reinterpret_cast<const Handle*>(handle);
  const FsNode& n = *h->node;
  ScatterReply reply;
  // A file planned in source order is served from held ranges, gathered.
  if (n.kind != NodeKind::kVirtualFile || h->order) {
    // One buffer per thread, kept (see the header).
    thread_local std::vector<char> buf;
    if (buf.size() < size) buf.resize(size);
    ASSIGN_OR_RETURN(size_t got, Read(handle, buf.data(), size, offset));
    reply.Add(0, buf.data(), got);
    if (Status st = reply.Finish(); !st.ok()) return FsError::From(st);
    return reply;
  }
  ASSIGN_OR_RETURN(ReadPlan plan, PlanRead(*h, size, offset));
  SourceReader* reader = ReaderOf(*h);
  Status st = reader->ExecuteScatter(plan, &reply);
  // As in Read; a plan answered PlanAgain has put nothing in the reply.
  for (int again = 0; st.code() == Status::Code::kPlanAgain && again < kPlanAgainTries; ++again) {
    ASSIGN_OR_RETURN(plan, PlanRead(*h, size, offset));
    st = reader->ExecuteScatter(plan, &reply);
  }
  // Computed bytes are gathered: each op into the memory ExecuteScatter set aside.
  for (size_t i = 0; st.ok() && i < plan.computes.size(); ++i) {
    ComputeOp op = plan.computes[i];
    char* out = reply.Reserve(op.dst_offset, op.length);
    op.dst_offset = 0;
    st = compute_.Fill({op}, out, *reader, n.ckpt);
  }
  if (st.ok()) st = reply.Finish();
  if (!st.ok()) return ReadFailed(n, size, offset, st);
  reader->counters().served.fetch_add(plan.length, std::memory_order_relaxed);
  reader->ReadAhead(h->stream, n.layout, offset, plan.length, h->push);
  return reply;
}

void OpenFiles::InvalidateCheckpoint(int i, const std::string& why) {
  Served* s = ckpts_.ServedAt(i);
  if (s->stale.exchange(true)) return;
  compute_.Drop(i);
  options_.Log(JoinRel(s->dir, "") + ": a source changed since indexing (" + why +
               "); its views read as EIO until it is indexed again");
  if (!options_.invalidate) return;
  const std::vector<uint64_t> inos =
      nodes_.Select([&](const FsNode& n) { return n.kind == NodeKind::kVirtualFile && n.ckpt == i; });
  for (uint64_t ino : inos) options_.invalidate(ino);
}

size_t OpenFiles::RecheckSources() {
  limiter_.Flush();  // the counts of a fault that stopped
  size_t changed = 0;
  for (int i : ckpts_.Live()) {
    Served* s = ckpts_.ServedAt(i);
    if (s->stale.load()) continue;
    Status changed_now;
    std::vector<std::pair<std::shared_ptr<MergedSources>, Status>> merged_changed;
    {
      std::lock_guard<std::mutex> load(s->load_mu);  // the reader is not unloaded meanwhile
      // Null until loaded (nothing served, nothing cached) and once unloaded.
      if (s->reader) changed_now = s->reader->Recheck();
      for (const auto& ms : s->merged)
        if (Status st = ms->stale ? Status::OK() : ms->reader->Recheck(); !st.ok()) merged_changed.push_back({ms, st});
    }
    // Only a change counts: a source that cannot be looked at now (an
    // outage) is looked at again on the next pass.
    for (const auto& [ms, st] : merged_changed)
      if (st.code() == Status::Code::kStale) MarkMergedStale(ms, i, st.message());
    if (changed_now.code() == Status::Code::kStale) {
      InvalidateCheckpoint(i, changed_now.message());
      ++changed;
    }
  }
  return changed;
}

void OpenFiles::Release(uint64_t handle) {
  std::unique_ptr<Handle> h(reinterpret_cast<Handle*>(handle));
  h->order.reset();  // its threads use the reader, which the pin keeps
  if (h->served) ckpts_.Unpin(h->served);
}

}  // namespace ckptfs
