// The FUSE3 low-level shim. Each handler calls one VirtualFs method and
// replies or maps the error; every handler catches everything (out of memory
// -> ENOMEM, anything else -> EIO, with a log line) so nothing escapes into
// libfuse. Write-type operations answer EROFS; the mount is also `ro`, so
// the kernel refuses most of them before they reach us.
#define FUSE_USE_VERSION FUSE_MAKE_VERSION(3, 12)
#include <fuse3/fuse_lowlevel.h>

#include <dirent.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <deque>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <thread>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <sstream>
#include <vector>

#include "fs/mount.h"
#include "fs/page_splice.h"
#include "fs/watcher.h"

namespace ckptfs {
namespace {

// Read size negotiated with the kernel: 1 MiB requests (256 pages) cut the
// per-request overhead of FUSE for large sequential and mmap reads.
constexpr unsigned kMaxIo = 1 << 20;
// Virtual files never change while mounted: let the kernel cache their
// attributes and names for long. Source entries are re-checked each second.
constexpr double kVirtualTimeout = 3600.0;
// Background requests the kernel may have in flight (see OpInit).
constexpr unsigned kMaxBackground = 64;
constexpr double kSourceTimeout = 1.0;

VirtualFs* Fs(fuse_req_t req) { return static_cast<VirtualFs*>(fuse_req_userdata(req)); }

// The mount's log (MountOptions::log), set before the loop starts.
std::function<void(const std::string&)> g_log;

void LogLine(const std::string& line) {
  if (g_log) return g_log(line);
  std::fprintf(stderr, "ckptfs: %s\n", line.c_str());
  std::fflush(stderr);
}

struct stat ToStat(const Attr& a) {
  struct stat st;
  std::memset(&st, 0, sizeof st);
  st.st_ino = a.ino;
  st.st_mode = a.mode;
  st.st_nlink = a.nlink;
  st.st_size = a.size;
  st.st_uid = a.uid;
  st.st_gid = a.gid;
  st.st_blksize = 1 << 20;
  st.st_blocks = (a.size + 511) / 512;
  st.st_mtim.tv_sec = a.mtime_ns / 1'000'000'000;
  st.st_mtim.tv_nsec = a.mtime_ns % 1'000'000'000;
  st.st_atim = st.st_mtim;
  st.st_ctim = st.st_mtim;
  return st;
}

double Timeout(const Attr& a) { return a.is_virtual ? kVirtualTimeout : kSourceTimeout; }

// Runs `body`, turning any escaping exception into an error reply.
template <typename Body>
void Guard(fuse_req_t req, const char* op, Body body) {
  try {
    body();
  } catch (const std::bad_alloc&) {
    LogLine(std::string(op) + ": out of memory");
    fuse_reply_err(req, ENOMEM);
  } catch (const std::exception& e) {
    LogLine(std::string(op) + ": " + e.what());
    fuse_reply_err(req, EIO);
  } catch (...) {
    LogLine(std::string(op) + ": unknown exception");
    fuse_reply_err(req, EIO);
  }
}

void ReplyError(fuse_req_t req, const FsError& e) { fuse_reply_err(req, e.err()); }

void OpInit(void*, struct fuse_conn_info* conn) {
  // Large reads: max_pages is derived from max_write by libfuse. On kernels
  // that cache FUSE files in large folios, max_write also bounds their size,
  // and the writeback cache (never asked for here) must stay off
  // (docs/BENCHMARKS.md, "The warm gap is the kernel's").
  conn->max_write = kMaxIo;
  conn->max_readahead = kMaxIo;
  // The kernel's read-ahead and page-fault reads are background requests;
  // its default of 12 in flight (throttled from 9) leaves FUSE worker
  // threads idle while a 4 MiB read-ahead window or several readers wait.
  conn->max_background = kMaxBackground;
  conn->congestion_threshold = kMaxBackground * 3 / 4;
  // Reads of one file may run in parallel: our read path is thread-safe.
  if (conn->capable & FUSE_CAP_ASYNC_READ) conn->want |= FUSE_CAP_ASYNC_READ;
  // No splice: measured slower than pread + reply (docs/ARCHITECTURE.md,
  // "Decisions").
  conn->want &= ~(FUSE_CAP_SPLICE_READ | FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
}

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Guard(req, "lookup", [&] {
    auto a = Fs(req)->Lookup(parent, name, /*for_kernel=*/true);
    if (!a.ok()) return ReplyError(req, a.status());
    fuse_entry_param e;
    std::memset(&e, 0, sizeof e);
    e.ino = a->ino;
    e.attr = ToStat(*a);
    e.attr_timeout = e.entry_timeout = Timeout(*a);
    fuse_reply_entry(req, &e);
  });
}

// The kernel's lookup counts: nodes of a removed checkpoint are freed once
// it holds none. No reply carries an error (libfuse: forget has none).
void OpForget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup) {
  try {
    Fs(req)->Forget(ino, nlookup);
  } catch (...) {
    LogLine("forget: exception ignored");
  }
  fuse_reply_none(req);
}

void OpForgetMulti(fuse_req_t req, size_t count, struct fuse_forget_data* forgets) {
  try {
    for (size_t i = 0; i < count; ++i) Fs(req)->Forget(forgets[i].ino, forgets[i].nlookup);
  } catch (...) {
    LogLine("forget: exception ignored");
  }
  fuse_reply_none(req);
}

void OpGetattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info*) {
  Guard(req, "getattr", [&] {
    auto a = Fs(req)->GetAttr(ino);
    if (!a.ok()) return ReplyError(req, a.status());
    struct stat st = ToStat(*a);
    fuse_reply_attr(req, &st, Timeout(*a));
  });
}

struct DirHandle {
  std::vector<DirEntry> entries;
};

void OpOpendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  Guard(req, "opendir", [&] {
    if ((fi->flags & O_ACCMODE) != O_RDONLY) return fuse_reply_err(req, EROFS), void();
    auto entries = Fs(req)->ReadDir(ino);
    if (!entries.ok()) return ReplyError(req, entries.status());
    fi->fh = reinterpret_cast<uint64_t>(new DirHandle{std::move(*entries)});
    fi->cache_readdir = 0;
    if (fuse_reply_open(req, fi) == -ENOENT) delete reinterpret_cast<DirHandle*>(fi->fh);
  });
}

void OpReaddir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info* fi) {
  Guard(req, "readdir", [&] {
    auto* dh = reinterpret_cast<DirHandle*>(fi->fh);
    std::vector<char> buf(size);
    size_t used = 0;
    // Offsets: 1 = ".", 2 = "..", 3 + i = entries[i].
    for (off_t i = off; i < off_t(dh->entries.size()) + 2; ++i) {
      struct stat st;
      std::memset(&st, 0, sizeof st);
      const char* name;
      if (i == 0) { name = "."; st.st_ino = ino; st.st_mode = S_IFDIR; }
      else if (i == 1) {
        name = "..";
        auto parent = Fs(req)->Lookup(ino, "..");
        st.st_ino = parent.ok() ? parent->ino : ino;
        st.st_mode = S_IFDIR;
      }
      else {
        const DirEntry& e = dh->entries[i - 2];
        name = e.name.c_str();
        st.st_ino = e.attr.ino;
        st.st_mode = e.attr.mode;
      }
      size_t need = fuse_add_direntry(req, buf.data() + used, size - used, name, &st, i + 1);
      if (need > size - used) break;
      used += need;
    }
    fuse_reply_buf(req, buf.data(), used);
  });
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  Guard(req, "releasedir", [&] {
    delete reinterpret_cast<DirHandle*>(fi->fh);
    fuse_reply_err(req, 0);
  });
}

void OpOpen(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info* fi) {
  Guard(req, "open", [&] {
    auto h = Fs(req)->Open(ino, fi->flags);
    if (!h.ok()) return ReplyError(req, h.status());
    auto a = Fs(req)->GetAttr(ino);
    fi->fh = *h;
    // Page cache, not direct_io: safetensors readers mmap their files.
    // Virtual files are immutable while mounted, so cached pages stay valid.
    fi->keep_cache = a.ok() && a->is_virtual;
    fi->direct_io = 0;
    if (fuse_reply_open(req, fi) == -ENOENT) Fs(req)->Release(*h);
  });
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, struct fuse_file_info* fi) {
  Guard(req, "read", [&] {
    // A scatter list over the buffers the source reads filled: one writev,
    // no copy to put the pieces in place (source/scatter_reply.h). Its
    // buffers are freed (or go back to their pool) after the reply.
    auto reply = Fs(req)->ReadScatter(fi->fh, size, off);
    if (!reply.ok()) return ReplyError(req, reply.status());
    fuse_reply_iov(req, reply->iov().data(), int(reply->iov().size()));
  });
}

void OpRelease(fuse_req_t req, fuse_ino_t, struct fuse_file_info* fi) {
  Guard(req, "release", [&] {
    Fs(req)->Release(fi->fh);
    fuse_reply_err(req, 0);
  });
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  Guard(req, "readlink", [&] {
    auto target = Fs(req)->ReadLink(ino);
    if (!target.ok()) return ReplyError(req, target.status());
    fuse_reply_readlink(req, target->c_str());
  });
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  Guard(req, "statfs", [&] {
    struct statvfs s;
    std::memset(&s, 0, sizeof s);
    s.f_bsize = s.f_frsize = 4096;
    s.f_namemax = 255;
    s.f_flag = ST_RDONLY;
    fuse_reply_statfs(req, &s);
  });
}

void OpAccess(fuse_req_t req, fuse_ino_t ino, int mask) {
  Guard(req, "access", [&] {
    if (mask & W_OK) return fuse_reply_err(req, EROFS), void();
    auto a = Fs(req)->GetAttr(ino);
    fuse_reply_err(req, a.ok() ? 0 : a.status().err());
  });
}

// --- write-type operations: all EROFS ---
void Erofs(fuse_req_t req) { fuse_reply_err(req, EROFS); }
void OpSetattr(fuse_req_t req, fuse_ino_t, struct stat*, int, struct fuse_file_info*) { Erofs(req); }
void OpMknod(fuse_req_t req, fuse_ino_t, const char*, mode_t, dev_t) { Erofs(req); }
void OpMkdir(fuse_req_t req, fuse_ino_t, const char*, mode_t) { Erofs(req); }
void OpUnlink(fuse_req_t req, fuse_ino_t, const char*) { Erofs(req); }
void OpSymlink(fuse_req_t req, const char*, fuse_ino_t, const char*) { Erofs(req); }
void OpRename(fuse_req_t req, fuse_ino_t, const char*, fuse_ino_t, const char*, unsigned) { Erofs(req); }
void OpLink(fuse_req_t req, fuse_ino_t, fuse_ino_t, const char*) { Erofs(req); }
void OpWrite(fuse_req_t req, fuse_ino_t, const char*, size_t, off_t, struct fuse_file_info*) { Erofs(req); }
void OpSetxattr(fuse_req_t req, fuse_ino_t, const char*, const char*, size_t, int) { Erofs(req); }
void OpRemovexattr(fuse_req_t req, fuse_ino_t, const char*) { Erofs(req); }
void OpCreate(fuse_req_t req, fuse_ino_t, const char*, mode_t, struct fuse_file_info*) { Erofs(req); }
void OpFallocate(fuse_req_t req, fuse_ino_t, int, off_t, off_t, struct fuse_file_info*) { Erofs(req); }
void OpGetxattr(fuse_req_t req, fuse_ino_t, const char*, size_t) { fuse_reply_err(req, ENODATA); }
void OpListxattr(fuse_req_t req, fuse_ino_t, size_t size) {
  if (size == 0) fuse_reply_xattr(req, 0); else fuse_reply_buf(req, nullptr, 0);
}

// The kernel caps FUSE readahead at 128 KiB whatever max_readahead says;
// the per-device knob in sysfs lifts it, so sequential and mmap reads arrive
// as 1 MiB requests. Needs root; a failure only costs speed, so it is
// reported, not fatal. The device number comes from /proc/self/mountinfo,
// because stat() on the mountpoint would wait on our own, not yet running,
// request loop.
std::string TuneReadahead(const std::string& mountpoint) {
  char real[PATH_MAX];
  if (!::realpath(mountpoint.c_str(), real)) return "realpath failed";
  std::ifstream info("/proc/self/mountinfo");
  std::string line, dev;
  while (std::getline(info, line)) {
    std::istringstream fields(line);
    std::string id, parent, majmin, root, point;
    fields >> id >> parent >> majmin >> root >> point;
    if (point == real) dev = majmin;  // the last match is the newest mount
  }
  if (dev.empty()) return "mount not found in /proc/self/mountinfo";
  std::ofstream knob("/sys/class/bdi/" + dev + "/read_ahead_kb");
  knob << (kMaxIo >> 10);
  knob.flush();
  if (!knob) return "cannot write /sys/class/bdi/" + dev + "/read_ahead_kb (not root?)";
  return "";
}

fuse_lowlevel_ops MakeOps() {
  fuse_lowlevel_ops ops;
  std::memset(&ops, 0, sizeof ops);
  ops.init = OpInit;
  ops.lookup = OpLookup;
  ops.forget = OpForget;
  ops.forget_multi = OpForgetMulti;
  ops.getattr = OpGetattr;
  ops.opendir = OpOpendir;
  ops.readdir = OpReaddir;
  ops.releasedir = OpReleasedir;
  ops.open = OpOpen;
  ops.read = OpRead;
  ops.release = OpRelease;
  ops.readlink = OpReadlink;
  ops.statfs = OpStatfs;
  ops.access = OpAccess;
  ops.setattr = OpSetattr;
  ops.mknod = OpMknod;
  ops.mkdir = OpMkdir;
  ops.unlink = OpUnlink;
  ops.rmdir = OpUnlink;
  ops.symlink = OpSymlink;
  ops.rename = OpRename;
  ops.link = OpLink;
  ops.write = OpWrite;
  ops.setxattr = OpSetxattr;
  ops.removexattr = OpRemovexattr;
  ops.create = OpCreate;
  ops.fallocate = OpFallocate;
  ops.getxattr = OpGetxattr;
  ops.listxattr = OpListxattr;
  return ops;
}

// Stores the pages VirtualFs pushes ahead of their readers (FsOptions::store)
// in the kernel's page cache. A store and an invalidation never overlap: a
// store checks that its bytes are still valid and stores them under the
// shared side of order(), an invalidation is sent under the exclusive side
// (Invalidator). So a store either ends before the invalidation that drops
// its pages, or starts after the checkpoint was marked stale and does
// nothing.
class PageStore {
 public:
  explicit PageStore(struct fuse_session* se) : se_(se) {}
  void Store(uint64_t ino, uint64_t offset, const PageBytes& bytes, const std::function<bool()>& valid) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (stopped_ || !valid()) return;
    // From a pinned file's page cache where it can; the rest from memory.
    const size_t spliced =
        bytes.fd >= 0 ? SpliceStore(fuse_session_fd(se_), ino, offset, bytes.fd, bytes.fd_offset, bytes.len) : 0;
    spliced_.fetch_add(spliced, std::memory_order_relaxed);
    if (spliced == bytes.len) return;
    copied_.fetch_add(bytes.len - spliced, std::memory_order_relaxed);
    struct fuse_bufvec bv = FUSE_BUFVEC_INIT(bytes.len - spliced);
    bv.buf[0].mem = const_cast<char*>(bytes.data + spliced);
    // An error (the kernel has forgotten the inode, say) only loses the push.
    fuse_lowlevel_notify_store(se_, ino, off_t(offset + spliced), &bv, fuse_buf_copy_flags(0));
  }
  // For the fetch report: how the pushed pages went in.
  std::string Report() const {
    return "pushed pages: " + std::to_string(spliced_.load()) + " bytes spliced from pinned source files, " +
           std::to_string(copied_.load()) + " bytes from memory";
  }
  // Later stores do nothing: the session is about to go.
  void Stop() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    stopped_ = true;
  }
  std::shared_mutex& order() { return mu_; }

 private:
  struct fuse_session* se_;
  std::shared_mutex mu_;  // guards stopped_; orders stores against invalidations
  bool stopped_ = false;
  std::atomic<uint64_t> spliced_{0}, copied_{0};  // bytes stored each way
};

// Sends the kernel the invalidations VirtualFs asks for, from a thread of
// its own: a reader that finds a source changed must not invalidate the
// inode it is reading (the kernel would wait on the page lock that read
// holds), nor a lookup that unloads a checkpoint the entries it is under.
class Invalidator {
 public:
  // Invalidations are sent under the exclusive side of `order` (PageStore).
  Invalidator(struct fuse_session* se, std::shared_mutex& order) : se_(se), order_(order), thread_([this] { Run(); }) {}
  ~Invalidator() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  // Pages and attributes of inode `ino`.
  void Push(uint64_t ino) { Enqueue({ino, ""}); }
  // The name `name` in directory `parent`.
  void PushEntry(uint64_t parent, const std::string& name) { Enqueue({parent, name}); }

 private:
  struct Item {
    uint64_t ino;
    std::string name;  // empty: the inode itself
  };
  void Enqueue(Item item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_one();
  }
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      Item item = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      {
        std::unique_lock<std::shared_mutex> exclusive(order_);
        // -ENOENT: the kernel has forgotten it already; nothing cached.
        if (item.name.empty()) fuse_lowlevel_notify_inval_inode(se_, item.ino, 0, 0);
        else fuse_lowlevel_notify_inval_entry(se_, item.ino, item.name.c_str(), item.name.size());
      }
      lock.lock();
    }
  }

  struct fuse_session* se_;
  std::shared_mutex& order_;
  std::mutex mu_;  // guards queue_, stop_
  std::condition_variable cv_;
  std::deque<Item> queue_;
  bool stop_ = false;
  std::thread thread_;
};

// libfuse splits -o values at commas; a backslash escapes one.
std::string EscapeOption(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == ',' || ch == '\\') out += '\\';
    out += ch;
  }
  return out;
}

bool IsMountpoint(const std::string& abs) {
  std::ifstream info("/proc/self/mountinfo");
  std::string line;
  while (std::getline(info, line)) {
    std::istringstream fields(line);
    std::string id, parent, majmin, root, point;
    fields >> id >> parent >> majmin >> root >> point;
    if (point == abs) return true;
  }
  return false;
}

bool IsEmptyDir(const std::string& abs) {
  DIR* d = ::opendir(abs.c_str());
  if (!d) return false;
  bool empty = true;
  while (struct dirent* e = ::readdir(d))
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) empty = false;
  ::closedir(d);
  return empty;
}

// The source watcher: re-checks sources on changes and watches each
// checkpoint's directories. Started after daemonizing (threads do not
// survive fork).
struct Watching {
  std::unique_ptr<LiveRoot> live;  // declared first: the watcher's thread uses it
  std::unique_ptr<SourceWatcher> watcher;
};

// `watching->watcher` is destroyed (its thread joined) before `live`.
void StartWatcher(VirtualFs* fs, const MountOptions& options, Watching* watching) {
  SourceWatcher::Options wo;
  wo.rescan = std::chrono::milliseconds(options.rescan_ms);
  if (options.live.scan) watching->live = std::make_unique<LiveRoot>(fs, options.live);
  LiveRoot* live = watching->live.get();
  watching->watcher = std::make_unique<SourceWatcher>(
      [fs, live] {
        fs->RecheckSources();
        if (live) live->Refresh();
      },
      wo);
  if (live) live->set_watcher(watching->watcher.get());
  auto log = [&](const Status& s) {
    if (!s.ok() && options.log) options.log("watch: " + s.message());
  };
  log(watching->watcher->Start());
  // The root itself from the start: in an empty training root the first
  // step would otherwise wait for the periodic rescan's walk.
  if (live && fs->tree().watchable()) log(watching->watcher->Watch(fs->root()));
  for (const std::string& dir : fs->SourceDirs()) log(watching->watcher->Watch(dir));
}

// Calls `tick` every `period` on a thread of its own until destroyed.
class Ticker {
 public:
  Ticker(std::chrono::milliseconds period, std::function<void()> tick)
      : thread_([this, period, tick = std::move(tick)] {
          std::unique_lock<std::mutex> lock(mu_);
          while (!cv_.wait_for(lock, period, [this] { return stop_; })) tick();
        }) {}
  ~Ticker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;   // guarded by mu_
  std::thread thread_;  // last: it starts once the members above exist
};

// `handler` for `sig` while it lives; the previous one again after.
class ScopedHandler {
 public:
  ScopedHandler(int sig, void (*handler)(int), int flags) : sig_(sig) {
    struct sigaction sa {};
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = flags;
    installed_ = ::sigaction(sig, &sa, &old_) == 0;
  }
  ~ScopedHandler() {
    if (installed_) ::sigaction(sig_, &old_, nullptr);
  }
  ScopedHandler(const ScopedHandler&) = delete;
  ScopedHandler& operator=(const ScopedHandler&) = delete;

 private:
  int sig_;
  struct sigaction old_ {};
  bool installed_ = false;
};

// SIGUSR1 asks for VirtualFs::FetchReport. The handler only sets a flag
// (async-signal-safe, whichever thread takes it); a ticker looks at the
// flag every 200 ms (the report comes that soon after the signal) and
// writes the report.
std::atomic<bool> g_report_asked{false};
void AskReport(int) { g_report_asked.store(true); }

class FetchReporter {
 public:
  FetchReporter(const VirtualFs* fs, const PageStore* store, std::function<void(const std::string&)> report)
      : fs_(fs), store_(store), report_(std::move(report)) {
    if (!report_) return;
    handler_.emplace(SIGUSR1, AskReport, SA_RESTART);
    ticker_.emplace(std::chrono::milliseconds(200), [this] {
      if (g_report_asked.exchange(false)) Report();
    });
  }
  void Report() const {
    if (!report_) return;
    for (const std::string& line : fs_->FetchReport()) report_(line);
    report_(store_->Report());
  }

 private:
  const VirtualFs* fs_;
  const PageStore* store_;
  std::function<void(const std::string&)> report_;
  std::optional<ScopedHandler> handler_;
  std::optional<Ticker> ticker_;  // after handler_: stopped before the handler goes
};

// Ends the loop once a stop signal (SIGINT, SIGTERM, SIGHUP) ended the
// session. libfuse's handler only marks the session ended, and its loop's
// thread waits until a worker posts or a signal interrupts that wait: a
// signal taken by any other thread of the daemon (ours, or a worker busy
// with a request), or one that lands between the loop's check and its
// wait, would leave the mount up until the next request. So a ticker looks
// every 50 ms and, once the session ended, interrupts the loop's thread
// with SIGUSR2 (a handler that does nothing, no SA_RESTART) until the loop
// returns. The stop signals are also unblocked in the loop's thread,
// whatever mask the daemon inherited. Made on the loop's thread.
class LoopWaker {
 public:
  explicit LoopWaker(fuse_session* se)
      : ticker_(std::chrono::milliseconds(50), [se, loop = ::pthread_self()] {
          if (fuse_session_exited(se)) ::pthread_kill(loop, SIGUSR2);
        }) {
    sigset_t stop;
    sigemptyset(&stop);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&stop, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
  }

 private:
  ScopedHandler wake_{SIGUSR2, [](int) {}, 0};
  Ticker ticker_;  // after wake_: stopped before the handler goes
};

}  // namespace

Result<std::string> CheckMountpoint(const std::string& mountpoint, bool allow_non_empty) {
  char real[PATH_MAX];
  if (!::realpath(mountpoint.c_str(), real))
    return Status::InvalidArgument("mountpoint " + mountpoint + ": " + std::strerror(errno) +
                                   (errno == ENOENT ? " (create it with mkdir first)" : ""));
  struct stat st;
  if (::stat(real, &st) != 0) return Status::InvalidArgument("mountpoint " + mountpoint + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) return Status::InvalidArgument("mountpoint " + mountpoint + " is not a directory");
  if (IsMountpoint(real))
    return Status::InvalidArgument("mountpoint " + mountpoint + " is already mounted (unmount it first: fusermount3 -u " +
                                   real + ")");
  if (!allow_non_empty && !IsEmptyDir(real))
    return Status::InvalidArgument("mountpoint " + mountpoint +
                                   " is not empty (mounting would hide its files; use --allow-non-empty to do it anyway)");
  return std::string(real);
}

namespace {

// libfuse's command line for the session. default_permissions: the kernel
// checks each caller against the modes we report, which is what keeps
// --allow-other from widening access.
std::vector<std::string> FuseArgs(const MountOptions& options) {
  std::vector<std::string> argv = {
      "ckptfs", "-o",
      "ro,default_permissions,fsname=" + EscapeOption(options.fsname.empty() ? "ckptfs" : options.fsname) +
          ",subtype=ckptfs"};
  if (options.allow_other) argv.push_back("-oallow_other");
  if (options.debug) argv.push_back("-d");
  return argv;
}

// Serves the mounted session until it is unmounted or signalled: wires the
// kernel's page store and invalidations into `fs`, watches the sources,
// reports what was fetched, and unwires them all before it returns the
// loop's status.
int ServeSession(struct fuse_session* se, VirtualFs* fs, const MountOptions& options) {
  // Shared with the push threads, which may outlive this scope: stopped
  // before the session goes.
  auto store = std::make_shared<PageStore>(se);
  fs->set_store([store](uint64_t ino, uint64_t offset, const PageBytes& bytes, const std::function<bool()>& valid) {
    store->Store(ino, offset, bytes, valid);
  });
  Invalidator invalidator(se, store->order());
  fs->set_invalidate([&invalidator](uint64_t ino) { invalidator.Push(ino); });
  fs->set_invalidate_entry(
      [&invalidator](uint64_t parent, const std::string& name) { invalidator.PushEntry(parent, name); });
  Watching watching;
  if (options.watch) StartWatcher(fs, options, &watching);
  FetchReporter reporter(fs, store.get(), options.report);
  struct fuse_loop_config* cfg = fuse_loop_cfg_create();
  fuse_loop_cfg_set_max_threads(cfg, options.max_threads);
  fuse_loop_cfg_set_clone_fd(cfg, 0);
  int rc;
  {
    LoopWaker waker(se);
    rc = fuse_session_loop_mt(se, cfg);
  }
  fuse_loop_cfg_destroy(cfg);
  reporter.Report();
  watching.watcher.reset();
  fs->set_invalidate({});
  fs->set_invalidate_entry({});
  fs->set_store({});
  store->Stop();
  return rc;
}

}  // namespace

Status MountAndServe(std::unique_ptr<VirtualFs> fs, const std::string& mountpoint,
                     const MountOptions& options) {
  g_log = options.log;
  std::vector<std::string> argv_s = FuseArgs(options);
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  struct fuse_args args = FUSE_ARGS_INIT(int(argv.size()), argv.data());

  fuse_lowlevel_ops ops = MakeOps();
  struct fuse_session* se = fuse_session_new(&args, &ops, sizeof ops, fs.get());
  if (!se) return Status::InvalidArgument("could not create the FUSE session (bad options?)");
  if (fuse_set_signal_handlers(se) != 0) {
    fuse_session_destroy(se);
    return Status::IOError("could not install signal handlers");
  }
  if (fuse_session_mount(se, mountpoint.c_str()) != 0) {
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return Status::IOError("could not mount at " + mountpoint +
                           " (does it exist, is it empty, is /dev/fuse usable? see docs/TROUBLESHOOTING.md)");
  }
  if (std::string why = TuneReadahead(mountpoint); !why.empty())
    LogLine("readahead stays at the kernel default (128 KiB): " + why);
  if (options.mounted) options.mounted();
  const int rc = ServeSession(se, fs.get(), options);
  fuse_session_unmount(se);
  fuse_remove_signal_handlers(se);
  fuse_session_destroy(se);
  fuse_opt_free_args(&args);
  if (rc != 0 && rc != SIGTERM && rc != SIGINT && rc != SIGHUP)
    return Status::IOError("FUSE loop ended with error " + std::to_string(rc));
  return Status::OK();
}

}  // namespace ckptfs
