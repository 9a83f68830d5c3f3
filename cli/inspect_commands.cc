// The inspection subcommands: inspect, check, verify, and the tensor table
// `ls` prints. Each prints only what was asked (check and verify: only
// problems) and returns an exit code from cli/cli.h.
#include <fcntl.h>
#include <fnmatch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/convert.h"
#include "core/planner.h"
#include "core/safetensors.h"
#include "core/lora.h"
#include "core/hf_folder.h"
#include "core/views.h"
#include "fs/merged_view.h"
#include "indexer/commit_record.h"
#include "indexer/scan.h"
#include "source/checksums.h"
#include "source/posix_io.h"
#include "source/posix_source.h"
#include "source/source_reader.h"
#include "cli/commands.h"

namespace ckptfs {
namespace {

using nlohmann::json;

std::string Where(const std::string& dir) { return dir.empty() ? "." : dir; }
std::string Where(const Checkpoint& ck) { return Where(ck.dir); }

// What makes a tensor unservable: its coverage problem, else the first
// unavailable chunk; "" when it reads fine.
std::string TensorProblem(const TensorMeta& t) {
  if (!t.problem.empty()) return t.problem;
  for (const Chunk& c : t.chunks)
    if (!c.unavailable().empty()) return "chunk " + ToString(c.box()) + ": " + c.unavailable();
  return "";
}

std::set<std::string> FilesOf(const TensorMeta& t, const Checkpoint& ckpt) {
  std::set<std::string> out;
  for (const Chunk& c : t.chunks) out.insert(std::filesystem::path(ckpt.files[c.file()].path).filename());
  return out;
}

// Calls fn(offset, bytes) for consecutive blocks of a virtual file.
Status ForEachBlock(VirtualFs& fs, uint64_t ino, uint64_t size, uint64_t block,
                    const std::function<Status(uint64_t, const char*, size_t)>& fn) {
  auto h = fs.Open(ino, O_RDONLY);
  if (!h.ok()) return Status::IOError(h.status().message());
  std::vector<char> buf(block);
  Status st;
  for (uint64_t off = 0; off < size && st.ok();) {
    auto n = fs.Read(*h, buf.data(), std::min<uint64_t>(block, size - off), off);
    if (!n.ok()) {
      st = Status::IOError(std::string(std::strerror(n.status().err())) + ": " + n.status().message());
      break;
    }
    if (*n == 0) {
      st = Status::Corruption("short read at " + std::to_string(off));
      break;
    }
    st = fn(off, buf.data(), *n);
    off += *n;
  }
  fs.Release(*h);
  return st;
}

// Reads `len` bytes at `off` of a virtual file.
Result<std::string> ReadVirtual(VirtualFs& fs, const Attr& a, uint64_t off, uint64_t len) {
  auto h = fs.Open(a.ino, O_RDONLY);
  if (!h.ok()) return Status::IOError(h.status().message());
  std::string out(len, '\0');
  auto n = fs.Read(*h, out.data(), len, off);
  fs.Release(*h);
  if (!n.ok()) return Status::IOError(n.status().message());
  if (*n != len) return Status::Corruption("short read");
  return out;
}

// The header of a virtual safetensors file, parsed with the strict rules.
Result<SafetensorsHeader> VirtualHeader(VirtualFs& fs, const Attr& a) {
  ASSIGN_OR_RETURN(std::string prefix, ReadVirtual(fs, a, 0, std::min<uint64_t>(8, a.size)));
  ASSIGN_OR_RETURN(uint64_t n, DecodeHeaderLength(prefix, a.size));
  ASSIGN_OR_RETURN(std::string text, ReadVirtual(fs, a, 8, n));
  return ParseSafetensorsHeader(text, n);
}

// "; did you mean 'a' or 'b'?" for the names closest to `name` by edit
// distance (at most 3), or "".
std::string NearestNames(const std::string& name, const std::vector<std::string>& names) {
  auto distance = [](const std::string& a, const std::string& b) {
    std::vector<size_t> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (size_t i = 1; i <= a.size(); ++i) {
      size_t diag = row[0];
      row[0] = i;
      for (size_t j = 1; j <= b.size(); ++j) {
        size_t up = row[j];
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
        diag = up;
      }
    }
    return row[b.size()];
  };
  std::vector<std::pair<size_t, std::string>> scored;
  for (const std::string& n : names) scored.push_back({distance(name, n), n});
  std::sort(scored.begin(), scored.end());
  std::string out;
  for (size_t k = 0; k < scored.size() && k < 3 && scored[k].first <= std::max<size_t>(3, name.size() / 4); ++k)
    out += (out.empty() ? "; did you mean '" : "' or '") + scored[k].second;
  return out.empty() ? "" : out + "'?";
}

}  // namespace

int RunTensorTable(const std::vector<LoadedCheckpoint>& checkpoints, const std::string& pattern, bool as_json) {
  json rows = json::array();
  for (const LoadedCheckpoint& loaded : checkpoints)
    for (const Checkpoint& ck = *loaded.ckpt; const auto& t : ck.tensors) {
      if (!pattern.empty() && ::fnmatch(pattern.c_str(), t->fqn.c_str(), 0) != 0) continue;
      auto files = FilesOf(*t, ck);
      rows.push_back({{"checkpoint", ck.dir},
                      {"name", t->fqn},
                      {"dtype", std::string(DTypeName(t->dtype))},
                      {"shape", t->shape},
                      {"chunks", t->chunks.size()},
                      {"bytes", t->nbytes()},
                      {"files", std::vector<std::string>(files.begin(), files.end())},
                      {"problem", TensorProblem(*t)}});
    }
  if (as_json) {
    std::cout << rows.dump(2) << "\n";
    return kExitOk;
  }
  // A root of several checkpoints (steps of a run) gets a checkpoint column.
  const bool several = checkpoints.size() > 1;
  size_t w = 4, cw = 10;
  for (const auto& r : rows) {
    w = std::max(w, r["name"].get<std::string>().size());
    cw = std::max(cw, Where(r["checkpoint"].get<std::string>()).size());
  }
  if (several) std::printf("%-*s  ", int(cw), "checkpoint");
  std::printf("%-*s  %-8s %-20s %6s %12s  %s\n", int(w), "name", "dtype", "shape", "chunks", "bytes", "files");
  for (const auto& r : rows) {
    std::string files;
    for (const auto& f : r["files"]) files += (files.empty() ? "" : ",") + f.get<std::string>();
    if (several) std::printf("%-*s  ", int(cw), Where(r["checkpoint"].get<std::string>()).c_str());
    std::printf("%-*s  %-8s %-20s %6zu %12llu  %s%s\n", int(w), r["name"].get<std::string>().c_str(),
                r["dtype"].get<std::string>().c_str(), ShapeToString(r["shape"].get<Shape>()).c_str(),
                r["chunks"].get<size_t>(), static_cast<unsigned long long>(r["bytes"].get<uint64_t>()), files.c_str(),
                r["problem"].get<std::string>().empty() ? "" : "  [PROBLEM]");
  }
  return kExitOk;
}

namespace {

// Min, max, mean and the NaN and Inf counts of tensor `t`, read through
// the read path in blocks of about 8 MiB.
Result<json> TensorStats(const std::shared_ptr<const TensorMeta>& t, SourceReader& reader) {
  Layout layout;
  RETURN_IF_ERROR(layout.AddTensor(t, Box::Whole(t->shape)));
  const uint64_t pb = PackBytes(t->dtype), g = PackGroup(t->dtype);
  const uint64_t block = std::max<uint64_t>(pb, ((8u << 20) / pb) * pb);
  std::vector<char> buf(block);
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, sum = 0;
  uint64_t nan = 0, inf = 0, finite = 0;
  for (uint64_t off = 0; off < layout.size(); off += block) {
    ASSIGN_OR_RETURN(ReadPlan plan, reader.ReadLaidOut(layout, off, block, buf.data()));
    const uint64_t elems = plan.length / pb * g;
    for (uint64_t k = 0; k < elems; ++k) {
      double v = DecodeElement(t->dtype, reinterpret_cast<const uint8_t*>(buf.data()), k);
      if (std::isnan(v)) ++nan;
      else if (std::isinf(v)) ++inf;
      else {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
        sum += v;
        ++finite;
      }
    }
  }
  return json{{"min", finite ? json(lo) : json(nullptr)},
              {"max", finite ? json(hi) : json(nullptr)},
              {"mean", finite ? json(sum / finite) : json(nullptr)},
              {"nan", nan},
              {"inf", inf}};
}

// What `inspect --json` prints of tensor `t` of checkpoint `owner`, but its
// statistics.
json DescribeTensor(const TensorMeta& t, const Checkpoint& owner) {
  json chunks = json::array();
  for (const Chunk& c : t.chunks) {
    chunks.push_back({{"box", ToString(c.box())},
                      {"file", owner.files[c.file()].path},
                      {"bytes", {c.offset(), c.offset() + c.length()}},
                      {"strides", c.strides()},
                      {"unavailable", c.unavailable()}});
    // Placed by prediction by a mount's index: checked when first read.
    if (const auto& k = c.item_check())
      chunks.back()["predicted_in_item"] = {k->item.offset, k->item.offset + k->item.length};
  }
  json out = {{"checkpoint", owner.dir}, {"name", t.fqn}, {"dtype", std::string(DTypeName(t.dtype))},
              {"shape", t.shape}, {"numel", t.numel()}, {"bytes", t.nbytes()}, {"chunks", chunks}};
  if (std::string p = TensorProblem(t); !p.empty()) out["problem"] = p;
  return out;
}

// The text form of DescribeTensor's `out`, with its statistics.
void PrintInspect(const TensorMeta& t, const Checkpoint& owner, const json& out) {
  std::printf("%s  (checkpoint %s)\n  dtype %s  shape %s  numel %llu  bytes %llu\n", t.fqn.c_str(),
              Where(owner).c_str(), std::string(DTypeName(t.dtype)).c_str(), ShapeToString(t.shape).c_str(),
              static_cast<unsigned long long>(t.numel()), static_cast<unsigned long long>(t.nbytes()));
  if (out.contains("problem")) std::printf("  PROBLEM: %s\n", out["problem"].get<std::string>().c_str());
  std::printf("  %zu chunk(s):\n", t.chunks.size());
  for (const auto& c : out["chunks"]) {
    auto b = c["bytes"];
    std::printf("    %-20s %s bytes [%llu, %llu)%s%s\n", c["box"].get<std::string>().c_str(),
                c["file"].get<std::string>().c_str(), static_cast<unsigned long long>(b[0].get<uint64_t>()),
                static_cast<unsigned long long>(b[1].get<uint64_t>()), c["strides"].empty() ? "" : " strided",
                c["unavailable"].get<std::string>().empty() ? "" : (" UNAVAILABLE: " + c["unavailable"].get<std::string>()).c_str());
  }
  if (out.contains("stats")) {
    const json& s = out["stats"];
    std::printf("  min %s  max %s  mean %s  NaN %llu  Inf %llu\n", s["min"].dump().c_str(), s["max"].dump().c_str(),
                s["mean"].dump().c_str(), static_cast<unsigned long long>(s["nan"].get<uint64_t>()),
                static_cast<unsigned long long>(s["inf"].get<uint64_t>()));
  } else if (out.contains("stats_error")) {
    std::printf("  statistics: cannot read the tensor: %s\n", out["stats_error"].get<std::string>().c_str());
  }
}

}  // namespace

namespace {

// One tensor of a loaded checkpoint.
struct TensorMatch {
  std::shared_ptr<const TensorMeta> tensor;
  const Checkpoint* owner = nullptr;
  SourceReader* reader = nullptr;
};

// The tensors `name` names: its fqn in any checkpoint, or CKPT/FQN with
// CKPT a checkpoint's directory under the root (`.` for the root itself). `names` gets every fqn
// (unique), for suggestions.
std::vector<TensorMatch> FindTensor(VirtualFs& fs, const std::string& name, std::vector<std::string>& names) {
  std::vector<TensorMatch> exact, qualified;
  std::set<std::string> seen;
  for (const LoadedCheckpoint& loaded : fs.LoadAll())
    for (const auto& x : loaded.ckpt->tensors) {
      if (seen.insert(x->fqn).second) names.push_back(x->fqn);
      if (x->fqn == name) exact.push_back({x, loaded.ckpt, loaded.reader});
      else if (name == Where(*loaded.ckpt) + "/" + x->fqn) qualified.push_back({x, loaded.ckpt, loaded.reader});
    }
  return exact.empty() ? qualified : exact;
}

}  // namespace

int RunInspect(VirtualFs& fs, const std::string& name, bool as_json) {
  std::vector<std::string> names;
  const std::vector<TensorMatch> found = FindTensor(fs, name, names);
  if (found.empty()) {
    Error("no tensor named '" + name + "'" + NearestNames(name, names) + " (list them with `ckptfs ls ROOT`)");
    return kExitNoSource;
  }
  if (found.size() > 1) {
    std::string where;
    for (const TensorMatch& m : found) where += (where.empty() ? "" : ", ") + Where(*m.owner);
    Error("'" + name + "' is a tensor of " + std::to_string(found.size()) + " checkpoints (" + where +
          "): name one as CHECKPOINT/" + name + ", e.g. `" + Where(*found[0].owner) + "/" + name + "`");
    return kExitUsage;
  }
  const auto& [t, owner, reader] = found[0];
  json out = DescribeTensor(*t, *owner);
  int rc = kExitOk;
  if (HasRealValue(t->dtype) && t->problem.empty()) {
    Result<json> stats = TensorStats(t, *reader);
    if (stats.ok()) {
      out["stats"] = std::move(*stats);
    } else {
      out["stats_error"] = stats.status().ToString();
      rc = kExitReadError;
    }
  }
  if (as_json) std::cout << out.dump(2) << "\n";
  else PrintInspect(*t, *owner, out);
  return rc;
}

namespace {

// Sources of `ck` that changed since indexing, as problems; marks them in *changed.
void ChangedSources(const Source& source, const Checkpoint& ck, std::vector<bool>* changed,
                    std::vector<std::string>* problems) {
  changed->assign(ck.files.size(), false);
  for (size_t i = 0; i < ck.files.size(); ++i) {
    const SourceFile& f = ck.files[i];
    if (f.derived()) {  // a decoded item: as fresh as its file (listed before it)
      (*changed)[i] = (*changed)[f.base];
      continue;
    }
    auto now = source.Identify(f.path);
    std::string what = now.ok() ? source.DescribeChange(f, *now) : now.status().message();
    if (what.empty()) continue;
    (*changed)[i] = true;
    problems->push_back(f.path + ": " + what + " since indexing (re-run `ckptfs index`)");
  }
}

// Where chunk `ch` holds its bytes now: a predicted one (a mount's index,
// ItemCheck) is settled first, by reading its item's framing, as a read
// would; never trusted. An error when it cannot be served.
Result<ByteMeta> PlacedBytes(SourceReader& reader, const Chunk& ch) {
  const std::shared_ptr<ItemCheck>& k = ch.item_check();
  if (!k) return ch.bytes();
  RETURN_IF_ERROR(reader.SettleItem(*k));
  if (k->state() == ItemCheck::kVerified) return ch.bytes();
  if (k->state() == ItemCheck::kWrong && k->why().empty()) return k->actual();
  return Status::Corruption(k->why().empty() ? "its item's framing could not be checked" : k->why());
}

// Chunks of `ck` whose bytes cannot be read: the last byte of every chunk is
// read through the read path.
void UnreadableChunks(const std::shared_ptr<const Source>& source, const Checkpoint& ck,
                      const std::vector<bool>& changed, std::vector<std::string>* problems) {
  SourceReader reader(source, &ck.files);
  for (const auto& t : ck.tensors)
    for (const Chunk& ch : t->chunks) {
      const std::string where = Where(ck) + ": tensor '" + t->fqn + "' chunk " + ToString(ch.box());
      if (!ch.unavailable().empty()) {
        problems->push_back(where + " is unreadable: " + ch.unavailable());
        continue;
      }
      if (changed[ch.file()]) continue;
      auto at = PlacedBytes(reader, ch);
      if (!at.ok()) {
        problems->push_back(where + " is unreadable: " + at.status().message());
        continue;
      }
      if (at->length == 0) continue;
      ReadPlan plan;
      plan.length = 1;
      plan.copies.push_back({at->file, at->offset + at->length - 1, 0, 1});
      char byte;
      Status st = reader.Execute(plan, &byte);
      if (!st.ok()) problems->push_back(where + " is unreadable: " + st.message());
    }
}

// merged/ of a LoRA adapter. A view ckptfs does not offer (another adapter
// kind, a base outside the root) is no fault of the checkpoint: said, not
// counted. An adapter that does not fit its base is a problem.
void CheckMerge(const Source& source, const Catalog& catalog, const Checkpoint& ck,
                std::vector<std::string>* problems) {
  if (!IsPeftAdapter(ck)) return;
  auto target = MergeTarget(source, ck);
  const Checkpoint* base = nullptr;
  if (target.ok())
    for (const Checkpoint& other : catalog.checkpoints)
      if (other.dir == target->second) base = &other;
  const std::string why = !target.ok() ? target.status().message()
                          : !base      ? NoBaseCheckpoint(target->first, target->second)
                                       : "";
  if (!why.empty()) {
    std::fprintf(stderr, "ckptfs: note: %s: merged/: not created: %s\n", Where(ck).c_str(), why.c_str());
    return;
  }
  LoraMergeInput input = JoinAdapter(ck, *base, target->first);
  auto model_type = BaseModelType(source, input.joined);
  if (model_type.ok()) input.base_model_type = *model_type;
  auto view = model_type.ok() ? MergedView(input, {}) : Result<std::vector<ViewFile>>(model_type.status());
  if (view.ok()) return;
  if (view.status().code() == Status::Code::kNotSupported)  // a layer kind not merged on read
    std::fprintf(stderr, "ckptfs: note: %s: merged/: not created: %s\n", Where(ck).c_str(),
                 view.status().message().c_str());
  else
    problems->push_back(Where(ck) + ": merged/: not created: " + view.status().message());
}

}  // namespace

int RunCheck(const Common& c) {
  int rc = kExitOk;
  auto catalog = LoadCatalog(c, /*allow_stale=*/true, &rc);
  if (!catalog) return rc;
  std::shared_ptr<const Source> source = RootSource(c, &rc);
  std::vector<std::string> problems = FindInterruptedSaves(*source);
  for (const Checkpoint& ck : catalog->checkpoints) {
    for (const std::string& p : ck.problems) problems.push_back(Where(ck) + ": " + p);
    CheckMerge(*source, *catalog, ck, &problems);
    std::vector<bool> changed;
    ChangedSources(*source, ck, &changed, &problems);
    UnreadableChunks(source, ck, changed, &problems);
  }
  for (const std::string& p : problems) std::printf("%s\n", p.c_str());
  size_t files = 0;
  for (const Checkpoint& ck : catalog->checkpoints) files += ck.files.size();
  // The summary goes to stderr: stdout stays "one problem per line".
  std::fprintf(stderr, "ckptfs check: %zu checkpoint(s), %zu source file(s): %s\n", catalog->checkpoints.size(), files,
               problems.empty() ? "no problems" : (std::to_string(problems.size()) + " problem(s)").c_str());
  return problems.empty() ? kExitOk : kExitProblems;
}

namespace {

struct RefTensor {
  std::string path;
  DType dtype;
  std::vector<uint64_t> shape;
  uint64_t offset = 0, length = 0;
};

// Tensors of a real Hugging Face folder, by name.
Result<std::map<std::string, RefTensor>> ReadReference(const std::string& dir) {
  std::map<std::string, RefTensor> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() != ".safetensors") continue;
    const std::string path = e.path().string();
    uint64_t size = std::filesystem::file_size(e.path(), ec);
    ASSIGN_OR_RETURN(std::string prefix, ReadFileRange(path, 0, std::min<uint64_t>(8, size)));
    auto n = DecodeHeaderLength(prefix, size);
    if (!n.ok()) return n.status().WithContext(path);
    ASSIGN_OR_RETURN(std::string text, ReadFileRange(path, 8, *n));
    auto h = ParseSafetensorsHeader(text, *n);
    if (!h.ok()) return h.status().WithContext(path);
    for (const auto& en : h->entries)
      out[en.name] = {path, en.dtype, en.shape, h->data_start() + en.begin, en.end - en.begin};
  }
  if (ec) return Status::IOError(dir + ": " + ec.message());
  if (out.empty()) return Status::NotFound(dir + ": no .safetensors files");
  return out;
}

// Compares a tensor's bytes at `at` in virtual file `vf` with the reference
// copy, in blocks; "" when equal, else what differs.
std::string CompareTensorBytes(VirtualFs& fs, const Attr& vf, uint64_t at, const RefTensor& r) {
  ScopedFd fd(::open(r.path.c_str(), O_RDONLY | O_CLOEXEC));
  auto h = fs.Open(vf.ino, O_RDONLY);
  if (fd.get() < 0 || !h.ok()) {
    if (h.ok()) fs.Release(*h);
    return "cannot open both copies";
  }
  const uint64_t block = 8 << 20;
  std::vector<char> a(block), b(block);
  std::string why;
  for (uint64_t off = 0; off < r.length && why.empty(); off += block) {
    uint64_t n = std::min(block, r.length - off);
    auto got = fs.Read(*h, a.data(), n, at + off);
    Status rs = PreadFull(fd.get(), b.data(), n, r.offset + off, r.path);
    if (!got.ok() || *got != n || !rs.ok()) {
      why = "read failed: " + (got.ok() ? rs.message() : got.status().message());
    } else if (auto mm = std::mismatch(a.begin(), a.begin() + n, b.begin()); mm.first != a.begin() + n) {
      why = "differs from " + r.path + " at byte " + std::to_string(off + (mm.first - a.begin())) + " of the tensor";
    }
  }
  fs.Release(*h);
  return why;
}

}  // namespace

namespace {

struct VFile {
  std::string path;
  Attr attr;
};

// The files of every checkpoint's views that verify reads (consolidated/
// and tensors/: core/views.h).
std::vector<VFile> ViewFiles(VirtualFs& fs, const std::vector<LoadedCheckpoint>& loaded) {
  std::vector<VFile> files;
  for (const LoadedCheckpoint& l : loaded)
    for (const Checkpoint& ck = *l.ckpt; const ViewKindInfo& view : kViewKinds) {
      if (!view.verified) continue;
      std::string dir = JoinRel(ck.dir, view.name);
      auto d = fs.Resolve(dir);
      if (!d.ok() || !d->is_virtual) continue;
      auto entries = fs.ReadDir(d->ino);
      if (!entries.ok()) continue;
      for (const auto& e : *entries)
        if (!e.attr.is_dir() && e.attr.is_virtual) files.push_back({dir + "/" + e.name, e.attr});
    }
  return files;
}

// Reads every byte of `files` and validates each safetensors file.
void ReadEveryByte(VirtualFs& fs, const std::vector<VFile>& files, uint64_t total, std::vector<std::string>* problems) {
  uint64_t done = 0;
  Progress progress("verify", total, "bytes");
  for (const auto& f : files) {
    Status st = ForEachBlock(fs, f.attr.ino, f.attr.size, 8 << 20, [&](uint64_t, const char*, size_t n) {
      progress.Update(done += n);
      return Status::OK();
    });
    if (!st.ok()) {
      problems->push_back(f.path + ": " + st.message());
      continue;
    }
    if (f.path.ends_with(".safetensors")) {
      auto h = VirtualHeader(fs, f.attr);
      Status valid = h.ok() ? CheckSafetensorsFileSize(*h, f.attr.size) : h.status();
      if (!valid.ok()) problems->push_back(f.path + ": not a valid safetensors file: " + valid.message());
    }
  }
}

// The checksums `l` is verified against: its writer's commit record read
// now (so the files are checked against what the writer wrote, however the
// index was built), else those the index holds. nullopt, with a problem or
// a warning said, when the record cannot be used.
std::optional<Checkpoint> WithWriterChecksums(const Source& source, const LoadedCheckpoint& l,
                                              std::vector<std::string>* problems, std::vector<std::string>* warnings) {
  Checkpoint ck = *l.ckpt;
  Status record = UseCommitRecord(source, ck);
  const std::string dir = ck.dir.empty() ? std::string(".") : ck.dir;
  if (record.ok() || record.code() == Status::Code::kNotFound) return ck;
  if (record.code() == Status::Code::kStale) {
    warnings->push_back(dir + ": its commit record is not used: " + record.message() + "; none of its checksums checked");
    return std::nullopt;
  }
  problems->push_back(dir + ": saved by ckptfs's writer, but its commit record is not used: " + record.message() +
                      " (the files or the record changed since the save); no checksum checked. Re-save the step");
  return std::nullopt;
}

// Every chunk and file whose writer recorded a CRC32C, read again and compared.
ChecksumReport CheckChecksums(const Source& source, const std::vector<LoadedCheckpoint>& loaded,
                              std::vector<std::string>* problems, std::vector<std::string>* warnings) {
  std::vector<std::pair<Checkpoint, SourceReader*>> checked;
  uint64_t total = 0;
  for (const LoadedCheckpoint& l : loaded) {
    auto ck = WithWriterChecksums(source, l, problems, warnings);
    if (!ck) continue;
    for (const auto& t : ck->tensors)
      for (const Chunk& c : t->chunks)
        if (c.has_crc32c()) total += c.length();
    checked.emplace_back(std::move(*ck), l.reader);
  }
  ChecksumReport all;
  if (total == 0) return all;
  Progress progress("checksums", total, "bytes");
  for (auto& [ck, reader] : checked) {
    const uint64_t before = all.bytes;
    ChecksumReport r = VerifyChunkChecksums(ck, *reader, [&](uint64_t n) { progress.Update(before + n); });
    all.chunks += r.chunks;
    all.files += r.files;
    all.bytes += r.bytes;
    for (std::string& p : r.problems) problems->push_back((ck.dir.empty() ? "" : ck.dir + ": ") + p);
  }
  return all;
}

// Compares consolidated/ tensor by tensor with the Hugging Face folder
// `against`. False (after printing why) when the folder cannot be read.
bool CompareAgainst(VirtualFs& fs, const std::vector<VFile>& files, const std::string& against,
                    std::vector<std::string>* problems_out) {
  std::vector<std::string>& problems = *problems_out;
  auto ref = ReadReference(against);
  if (!ref.ok()) {
    Error(ref.status().message());
    return false;
  }
  // Our tensors: entries of the consolidated safetensors files.
  std::map<std::string, std::pair<const VFile*, SafetensorsEntry>> ours;
  std::map<std::string, uint64_t> data_start;
  for (const auto& f : files) {
    if (!f.path.ends_with(".safetensors") || f.path.find("/tensors/") != std::string::npos) continue;
    auto h = VirtualHeader(fs, f.attr);
    if (!h.ok()) continue;  // already reported
    for (const auto& e : h->entries) {
      ours[e.name] = {&f, e};
      data_start[e.name] = h->data_start();
    }
  }
  for (const auto& [name, r] : *ref) {
    auto it = ours.find(name);
    if (it == ours.end()) {
      problems.push_back("tensor '" + name + "' is in " + against + " but not in consolidated/");
      continue;
    }
    const auto& [vf, e] = it->second;
    if (e.dtype != r.dtype || e.shape != r.shape) {
      problems.push_back("tensor '" + name + "': consolidated/ has " + std::string(DTypeName(e.dtype)) +
                         ShapeToString(e.shape) + ", reference has " + std::string(DTypeName(r.dtype)) +
                         ShapeToString(r.shape));
      continue;
    }
    if (std::string why = CompareTensorBytes(fs, vf->attr, data_start[name] + e.begin, r); !why.empty())
      problems.push_back("tensor '" + name + "': " + why);
  }
  for (const auto& [name, v] : ours)
    if (!ref->count(name)) problems.push_back("tensor '" + name + "' is in consolidated/ but not in " + against);
  return true;
}

}  // namespace

int RunVerify(VirtualFs& fs, const std::string& against, bool as_json) {
  std::vector<LoadedCheckpoint> loaded = fs.LoadAll();
  std::vector<VFile> files = ViewFiles(fs, loaded);
  uint64_t total = 0;
  for (const auto& f : files) total += f.attr.size;
  std::vector<std::string> problems;
  ReadEveryByte(fs, files, total, &problems);
  std::vector<std::string> warnings;
  ChecksumReport sums = CheckChecksums(*fs.tree().source(), loaded, &problems, &warnings);
  if (!against.empty() && !CompareAgainst(fs, files, against, &problems)) return kExitNoSource;
  for (const auto& w : warnings) std::fprintf(stderr, "ckptfs: warning: %s\n", w.c_str());
  if (as_json) {
    std::cout << json({{"files", files.size()}, {"bytes", total}, {"checksummed_chunks", sums.chunks},
                       {"checksummed_bytes", sums.bytes}, {"checksummed_files", sums.files}, {"problems", problems}, {"warnings", warnings}})
                     .dump(2)
              << "\n";
  } else {
    for (const auto& p : problems) std::printf("%s\n", p.c_str());
    std::string crc = sums.chunks ? ", " + std::to_string(sums.chunks) + " chunk checksum(s) checked" : "";
    std::fprintf(stderr, "ckptfs verify: %zu view file(s), %s read%s: %s\n", files.size(), HumanBytes(total).c_str(),
                 crc.c_str(), problems.empty() ? "no problems" : (std::to_string(problems.size()) + " problem(s)").c_str());
  }
  return problems.empty() ? kExitOk : kExitProblems;
}

Handler DefineInspect(CLI::App* cmd, Common& c) {
  struct Flags {
    std::string name;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  cmd->add_option("ROOT", c.root, "Checkpoint directory")->required();
  cmd->add_option("NAME", f->name,
                  "Tensor name (fqn), as `ckptfs ls` prints it; CHECKPOINT/NAME when several checkpoints under "
                  "ROOT hold it (CHECKPOINT as in ls's checkpoint column)")
      ->required();
  cmd->add_flag("--json", f->json, "Print JSON");
  AddCommon(cmd, c, true);
  cmd->footer(
      "\nExamples:\n  ckptfs inspect /ckpts/step_100 model.embed_tokens.weight\n"
      "  ckptfs inspect /ckpts/run1 step_200/model.embed_tokens.weight   # a root of several checkpoints\n");
  return [f, &c] {
    int rc = kExitOk;
    auto fs = OpenFs(c, &rc);
    return fs ? RunInspect(*fs, f->name, f->json) : rc;
  };
}

Handler DefineCheck(CLI::App* cmd, Common& c) {
  cmd->add_option("ROOT", c.root, "Checkpoint directory")->required();
  AddCommon(cmd, c, false);
  cmd->footer("\nExample:\n  ckptfs check /ckpts/step_100 && echo clean\n\nPrints each problem, then one summary line; exit status 0 when clean, 5 when there are problems.\n");
  return [&c] { return RunCheck(c); };
}

Handler DefineVerify(CLI::App* cmd, Common& c) {
  struct Flags {
    std::string against;
    bool json = false;
  };
  auto f = std::make_shared<Flags>();
  cmd->add_option("ROOT", c.root, "Checkpoint directory")->required();
  cmd->add_option("--against", f->against, "Compare consolidated/ tensor by tensor with this Hugging Face folder");
  cmd->add_flag("--json", f->json, "Print JSON");
  AddCommon(cmd, c, true);
  cmd->footer("\nExamples:\n  ckptfs verify /ckpts/step_100\n  ckptfs verify /ckpts/step_100 --against /models/reference-hf\n\n"
              "Prints each problem, then one summary line; exit status 0 when clean, 5 when there are problems.\n");
  return [f, &c] {
    int rc = kExitOk;
    auto fs = OpenFs(c, &rc);
    return fs ? RunVerify(*fs, f->against, f->json) : rc;
  };
}

}  // namespace ckptfs
