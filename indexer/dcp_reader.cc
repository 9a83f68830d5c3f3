// Reader for PyTorch Distributed Checkpoint directories (FileSystemWriter):
// `.metadata` (a pickle, read with the restricted unpickler: nothing in it
// runs) plus `__R_N.distcp` files holding one item per chunk (docs/FORMATS.md).
// Also Megatron-Core torch_dist (the same layout plus metadata.json and
// common.pt), whose distributed-optimizer shards are flattened
// (`nd_reformulated`) and decomposed here into regular boxes.
//
// Each tensor chunk's item is a torch.save archive embedded at the item's
// offset; the chunk's ByteMeta points at the storage bytes inside it, with its
// strides. BYTE_IO items (non-tensor values) become byte items served as
// `bytes/<key>.pt`. A transformed item (zstd) is a clear per-chunk error.

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "core/coverage.h"
#include "indexer/dcp_item.h"
#include "indexer/dcp_metadata.h"
#include "indexer/format_reader.h"
#include "indexer/pickle.h"
#include "indexer/readers.h"
#include "indexer/torch_zip.h"
#include "source/in_parallel.h"
#include "source/transform.h"

namespace ckptfs {
namespace {

// What the metadata files declare, gathered before any .distcp is opened.
struct DcpPlan {
  std::map<std::string, TensorMeta> tensors;
  std::map<std::string, std::vector<Box>> declared;  // fqn -> chunk boxes from metadata
  std::map<ChunkKey, StorageInfo> storage;
  std::map<std::string, StorageInfo> byte_storage;
  std::map<std::string, std::vector<uint64_t>> reformulated;  // Megatron: fqn -> original global shape
  std::map<std::string, Shape> saved_shape;  // Megatron: fqn -> the flattened shape it was saved with
  std::vector<std::unique_ptr<const PickleDocument>> docs;    // keep values alive while reading
};

// One open object per .distcp file, opened at its first item.
using ObjectCache = std::map<std::string, Result<std::unique_ptr<SourceObject>>>;

// The framing of items read ahead, by .distcp file (FetchFraming).
using FramedObjects = std::map<std::string, std::unique_ptr<WindowedObject>>;

// One declared chunk, in the order chunks are added.
struct ChunkWork {
  const std::string* fqn;
  const Box* box;
};

// Chunks whose items' framing is held in memory at once: at most
// kTorchArchiveHeadBytes + kTorchArchiveTailBytes each (32 MiB).
constexpr size_t kFramingBatch = 8192;

// .distcp files whose framing is read at once (FetchFraming): over object
// storage each reads its windows with --max-threads GETs in flight, and one
// file's few dozen small GETs leave most of those idle.
constexpr size_t kFramingFiles = 8;

// Over object storage, the gaps between items' framing read with it rather
// than split into another GET: each up to 256 KiB (a few ms of transfer,
// less than a request's round trip), at most 16 MiB per file read at once.
constexpr WindowGaps kFramingGaps{256 << 10, 16 << 20};

// Decoded items are held in memory while indexing; this bounds one.
constexpr uint64_t kMaxDecodedItem = 8ull << 30;

Result<std::string> Decode(const StorageInfo& si, const SourceObject& in, const std::string& what) {
  if (si.transforms.size() != 1 || TransformName(si.transforms[0]).empty()) {
    std::string all;
    for (const auto& t : si.transforms) all += (all.empty() ? "" : ", ") + t;
    return Status::NotSupported(what + ": transform " + all + " is not supported (ckptfs decodes stream.zstd/1)");
  }
  return DecodeItem(TransformName(si.transforms[0]), in, si.offset, si.length, kMaxDecodedItem, what);
}

// Parses a decoded item held in memory.
Result<TorchArchive> ReadDecoded(std::string bytes, const std::string& what) {
  const uint64_t n = bytes.size();
  return ReadTorchArchive(MemoryObject(std::move(bytes)), 0, n, what + " (decoded)");
}

// `.metadata`, else the per-rank `__R.metadata` files newer torch writes
// when it saves without collectives.
std::vector<std::string> MetadataFiles(const DirListing& dir) {
  if (dir.has_file(".metadata")) return {".metadata"};
  std::vector<std::string> out;
  for (const auto& f : dir.files)
    if (f.starts_with("__") && f.ends_with(".metadata")) out.push_back(f);
  return out;
}

// Adds a chunk; a Megatron-flattened one is decomposed into the boxes of
// the original tensor it covers (docs/FORMATS.md, Megatron-Core).
// `reformulated` maps a Megatron-flattened fqn to its saved (reformulated)
// shape; t.shape is already the original one.
void AddChunk(TensorMeta& t, Chunk c, const std::map<std::string, Shape>& reformulated, Checkpoint& out) {
  auto it = reformulated.find(t.fqn);
  if (it == reformulated.end()) {
    t.chunks.push_back(std::move(c));
    return;
  }
  const Shape& saved = it->second;
  const size_t n = t.shape.size();
  // Saved as [X/x, Y/y, ..., x*y*...]: block shape b[d] = orig[d] / saved[d].
  Shape block(n);
  for (size_t d = 0; d < n; ++d) block[d] = saved[d] ? t.shape[d] / saved[d] : 0;
  const Box box = c.box();
  for (size_t d = 0; d < n; ++d)
    if (box.lengths[d] != 1) {
      AddProblem(out, "tensor '" + t.fqn + "' chunk " + ToString(box) + ": a flattened chunk must span one block",
                 false);
      return;
    }
  const uint64_t itemsize = DTypeBits(t.dtype) / 8;
  const uint64_t begin = box.offsets[n], end = begin + box.lengths[n];
  for (const auto& [piece, flat] : FlatRangeToBoxes(block, begin, end)) {
    Box global = piece;
    for (size_t d = 0; d < n; ++d) global.offsets[d] += box.offsets[d] * block[d];
    Chunk p(global, {c.file(), c.offset() + (flat - begin) * itemsize, piece.numel() * itemsize}, c.dtype());
    p.set_unavailable(c.unavailable());
    t.chunks.push_back(std::move(p));
  }
}

// Unpickles one metadata file into `plan`; a file that cannot be used is a
// problem that makes the checkpoint incomplete.
void LoadMetadataFile(const std::string& rel, FileTable& files, DcpPlan& plan, Checkpoint& out) {
  auto id = files.Add(rel);
  auto text = id.ok() ? files.ReadWhole(*id) : Result<std::string>(id.status());
  if (!text.ok()) return AddReadProblem(out, files, rel, text.status(), true);
  auto doc = Unpickle(*text);
  if (!doc.ok()) return AddProblem(out, rel + ": " + doc.status().message(), true);
  // Globals off the allowlist stay inert either way; classes of the
  // checkpointing libraries themselves (torch's planner records,
  // Megatron's MCoreMetadata and MCoreSavePlan) are expected there, but
  // anything else (os.system, builtins.eval ...) has no business in a
  // checkpoint's metadata: refuse the file and say what it names.
  std::string foreign;
  for (const auto& g : (*doc)->unknown_globals())
    if (!g.starts_with("torch.") && !g.starts_with("megatron.core.")) foreign += (foreign.empty() ? "" : ", ") + g;
  if (!foreign.empty())
    return AddProblem(out,
                      rel + ": refusing the metadata: it references globals a checkpoint never needs (" + foreign +
                          "); nothing was executed",
                      true);
  const PickleValue* root = &(*doc)->root();
  // torch's Metadata, or a subclass such as Megatron's MCoreMetadata.
  if (!ClassOf(root).ends_with("Metadata") || !Field(root, "state_dict_metadata"))
    return AddProblem(out, rel + ": not a DCP Metadata object (" + std::string(ClassOf(root)) + ")", true);
  Status st = ReadDcpMetadata(rel, root, plan.tensors, plan.declared, plan.storage, plan.byte_storage,
                              plan.reformulated, nullptr);
  // Tensors of a dtype the index cannot hold are named; the rest is served.
  if (!st.ok()) AddProblem(out, st.message(), st.code() != Status::Code::kNotSupported);
  plan.docs.push_back(std::move(*doc));
}

// Megatron: gives flattened tensors their original shape (remembering the
// saved one in plan.saved_shape); chunks are decomposed as they are added.
void ApplyReformulation(DcpPlan& plan, Checkpoint& out) {
  for (const auto& [fqn, orig] : plan.reformulated) {
    auto it = plan.tensors.find(fqn);
    if (it == plan.tensors.end()) continue;
    TensorMeta& t = it->second;
    // Saved [X/x, Y/y, ..., x*y*...]: each block count divides its dim and
    // the last dim is the block's element count.
    bool fits = t.shape.size() == orig.size() + 1;
    uint64_t block_numel = 1;
    for (size_t d = 0; fits && d < orig.size(); ++d) {
      fits = t.shape[d] > 0 && orig[d] % t.shape[d] == 0;
      if (fits) block_numel *= orig[d] / t.shape[d];
    }
    fits = fits && t.shape.back() == block_numel;
    if (!fits) {
      AddProblem(out,
                 "tensor '" + fqn + "': saved shape " + ShapeToString(t.shape) + " is not a reformulation of " +
                     ShapeToString(orig),
                 false);
      continue;
    }
    plan.saved_shape[fqn] = t.shape;
    t.shape = orig;
  }
}

// The archive of an item; a transformed item is decoded once here to index
// it, and again (into a bounded cache) when read, so its chunk points into
// the decoded bytes: `data_file` becomes their derived file.
Result<TorchArchive> ReadItem(const StorageInfo& si, const SourceObject& in, FileId id, FileTable& files,
                                     const std::string& item, FileId& data_file) {
  if (si.transforms.empty()) return ReadTorchArchive(in, si.offset, si.length, item);
  ASSIGN_OR_RETURN(std::string decoded, Decode(si, in, item));
  data_file = files.AddDerived(id, si.offset, si.length, TransformName(si.transforms[0]), decoded.size());
  return ReadDecoded(std::move(decoded), item);
}

// The storage_data entry of chunk `box` of tensor `t`, or null.
const StorageInfo* FindItem(const DcpPlan& plan, const std::string& fqn, const Box& box, const TensorMeta& t) {
  // An F4 tensor was float4_e2m1fn_x2: storage_data keys its chunks by
  // torch's offsets, whose last dim counts bytes of two values.
  std::vector<uint64_t> key = box.offsets;
  if (t.dtype == DType::kF4 && !key.empty()) key.back() /= 2;
  auto it = plan.storage.find({fqn, key});
  return it == plan.storage.end() ? nullptr : &it->second;
}

// The object of file `id` (`rel`), opened once.
const Result<std::unique_ptr<SourceObject>>& ObjectOf(const std::string& rel, FileId id, FileTable& files,
                                                      ObjectCache& objects) {
  auto it = objects.find(rel);
  if (it == objects.end()) it = objects.emplace(rel, files.Open(id)).first;
  return it->second;
}

// The head and tail of every plain item of `batch`, read ahead per .distcp
// file (WindowedObject): one read per gap between neighbouring items (the
// tail of one and the head of the next touch), several in flight over
// object storage and up to kFramingFiles files at once, instead of a round
// trip per zip record. A file that cannot be opened or read is left out:
// its items read their bytes one by one and say why they could not.
FramedObjects FetchFraming(const DirListing& dir, FileTable& files, const DcpPlan& plan, const ChunkWork* batch,
                           size_t n, ObjectCache& objects) {
  std::map<std::string, std::vector<std::pair<uint64_t, uint64_t>>> windows;
  std::vector<std::string> order;  // files as their first items come: FileIds as before
  for (size_t i = 0; i < n; ++i) {
    auto t = plan.tensors.find(*batch[i].fqn);
    const StorageInfo* si = t == plan.tensors.end() ? nullptr : FindItem(plan, t->first, *batch[i].box, t->second);
    if (!si || !si->transforms.empty() || si->length == 0) continue;
    const uint64_t head = std::min(si->length, kTorchArchiveHeadBytes);
    const uint64_t tail = std::min(si->length, kTorchArchiveTailBytes);
    auto& w = windows[JoinRel(dir.rel, si->relative_path)];
    if (w.empty()) order.push_back(JoinRel(dir.rel, si->relative_path));
    w.emplace_back(si->offset, head);
    w.emplace_back(si->offset + si->length - tail, tail);
  }
  // The files are opened here, one after the other (the table and the
  // cache are not shared), then read side by side.
  struct Job {
    const std::string* rel;
    const SourceObject* obj;
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    std::unique_ptr<WindowedObject> framed;
  };
  std::vector<Job> jobs;
  for (const std::string& rel : order) {
    auto& ranges = windows[rel];
    auto id = files.Add(rel);
    if (!id.ok()) continue;
    const uint64_t size = files.at(*id).size;
    std::erase_if(ranges, [size](const auto& r) { return r.first >= size; });
    for (auto& r : ranges) r.second = std::min(r.second, size - r.first);  // a truncated file: its items say so
    const auto& obj = ObjectOf(rel, *id, files, objects);
    if (obj.ok()) jobs.push_back({&rel, obj->get(), std::move(ranges), nullptr});
  }
  // Over a backend with round trips to hide, a short gap costs less read
  // than asked for again.
  const WindowGaps gaps =
      files.source().PreferredFetch() ? kFramingGaps : WindowGaps{};
  ForEachInParallel(jobs.size(), kFramingFiles, [&](size_t i) {
    if (auto w = WindowedObject::Fetch(*jobs[i].obj, std::move(jobs[i].ranges), gaps); w.ok())
      jobs[i].framed = std::move(*w);
  });
  FramedObjects out;
  for (Job& j : jobs)
    if (j.framed) out.emplace(*j.rel, std::move(j.framed));
  return out;
}

// One declared chunk of tensor `fqn`: its item, a torch.save archive, is
// found through storage_data and parsed (from `framed` where its framing
// was read ahead); a chunk whose item cannot be used is kept, unavailable,
// with its reason.
void AddTensorChunk(const DirListing& dir, FileTable& files, const DcpPlan& plan, const std::string& fqn,
                    const Box& box, TensorMeta& t, ObjectCache& objects, const FramedObjects& framed,
                    Checkpoint& out) {
  const std::string who = "tensor '" + fqn + "' chunk " + ToString(box);
  const StorageInfo* found = FindItem(plan, fqn, box, t);
  if (!found) return AddProblem(out, who + ": no item in the metadata's storage_data", false);
  const StorageInfo& si = *found;
  const std::string rel = JoinRel(dir.rel, si.relative_path);
  auto id = files.Add(rel);
  if (!id.ok()) return AddReadProblem(out, files, who, id.status(), true);
  Chunk c(box, {*id, si.offset, si.length}, t.dtype);
  const auto& obj = ObjectOf(rel, *id, files, objects);
  auto window = framed.find(rel);
  const std::string item = rel + " item at " + std::to_string(si.offset);
  FileId data_file = *id;
  Result<TorchArchive> archive =
      !obj.ok() ? Result<TorchArchive>(obj.status().WithContext(item))
                : ReadItem(si, window != framed.end() ? *window->second : **obj, *id, files, item, data_file);
  if (!archive.ok()) {
    NoteReadFailure(files, archive.status().WithContext(who));
    c.set_unavailable(archive.status().message());
  } else
    PlaceItemChunk(*archive, rel, data_file, t.dtype, c);
  if (!c.unavailable().empty()) AddProblem(out, who + ": " + c.unavailable(), false);
  AddChunk(t, std::move(c), plan.saved_shape, out);
}

// The check of the predicted placement of chunk `box` of tensor `fqn`, or
// null when its item cannot be predicted (transformed, Megatron-flattened,
// past its file's end, a dtype or length torch.save would not write).
std::shared_ptr<ItemCheck> Predict(const DirListing& dir, FileTable& files, const DcpPlan& plan,
                                   const std::string& fqn, const Box& box, const TensorMeta& t) {
  const StorageInfo* si = FindItem(plan, fqn, box, t);
  if (!si || !si->transforms.empty() || si->length == 0 || plan.saved_shape.count(fqn)) return nullptr;
  auto id = files.Add(JoinRel(dir.rel, si->relative_path));
  if (!id.ok() || si->offset > files.at(*id).size || si->length > files.at(*id).size - si->offset) return nullptr;
  return PredictItem({*id, si->offset, si->length}, t.dtype, box.lengths);
}

// Whether torch.save wrote this checkpoint's items as predicted: the first
// predictable item's framing is read now (its two windows) and checked. An
// older or newer torch that frames items otherwise has every item read as
// before, not every one found wrong on first read. The item checked is
// `*sample`.
bool PredictionHolds(const DirListing& dir, FileTable& files, const DcpPlan& plan,
                     const std::vector<ChunkWork>& work, ObjectCache& objects, ByteMeta* sample) {
  for (const ChunkWork& w : work) {
    auto t = plan.tensors.find(*w.fqn);
    if (t == plan.tensors.end()) continue;
    auto check = Predict(dir, files, plan, t->first, *w.box, t->second);
    if (!check) continue;
    const std::string& rel = files.at(check->item.file).path;
    const auto& obj = ObjectOf(rel, check->item.file, files, objects);
    if (!obj.ok()) return false;
    auto framed = WindowedObject::Fetch(**obj, check->windows);
    *sample = check->item;
    return framed.ok() && VerifyItem(**framed, *check, rel).ok() && check->state() == ItemCheck::kVerified;
  }
  return false;
}

// A declared chunk of tensor `fqn` placed by prediction (indexer/dcp_item.h),
// or false for the framing to be read now. The item PredictionHolds read
// is placed for good.
bool AddPredictedChunk(const DirListing& dir, FileTable& files, const DcpPlan& plan, const std::string& fqn,
                       const Box& box, TensorMeta& t, const ByteMeta& sample, Checkpoint& out) {
  auto check = Predict(dir, files, plan, fqn, box, t);
  if (!check) return false;
  Chunk c(box, check->predicted, t.dtype);
  if (!(check->item == sample)) c.set_item_check(std::move(check));
  AddChunk(t, std::move(c), plan.saved_shape, out);
  return true;
}

// BYTE_IO items (non-tensor values), served as `bytes/<key>.pt`.
void AddByteItems(const DirListing& dir, FileTable& files, const std::map<std::string, StorageInfo>& items,
                         Checkpoint& out) {
  for (const auto& [key, si] : items) {
    auto id = files.Add(JoinRel(dir.rel, si.relative_path));
    if (!id.ok()) {
      AddReadProblem(out, files, "item '" + key + "'", id.status(), false);
      continue;
    }
    if (si.offset + si.length > files.at(*id).size) {
      AddProblem(out, "item '" + key + "' runs past the end of " + si.relative_path + " (truncated?)", false);
      continue;
    }
    if (si.transforms.empty()) {
      out.byte_items[key] = {*id, si.offset, si.length};
      continue;
    }
    auto in = files.Open(*id);
    auto decoded = in.ok() ? Decode(si, **in, "item '" + key + "'") : Result<std::string>(in.status());
    if (!decoded.ok()) {
      AddReadProblem(out, files, "", decoded.status(), false);
      continue;
    }
    FileId d = files.AddDerived(*id, si.offset, si.length, TransformName(si.transforms[0]), decoded->size());
    out.byte_items[key] = {d, 0, decoded->size()};
  }
}

class DcpReader : public FormatReader {
 public:
  std::string name() const override { return "dcp"; }

  bool Recognise(const DirListing& dir) const override {
    bool has_distcp = std::any_of(dir.files.begin(), dir.files.end(),
                                  [](const std::string& f) { return f.ends_with(".distcp"); });
    return has_distcp && !MetadataFiles(dir).empty();
  }

  Status Read(const DirListing& dir, FileTable& files, Checkpoint& out) const override {
    out.format = dir.has_file("metadata.json") ? "megatron-torch-dist" : "dcp";
    DcpPlan plan;
    for (const std::string& meta_name : MetadataFiles(dir))
      LoadMetadataFile(JoinRel(dir.rel, meta_name), files, plan, out);
    ApplyReformulation(plan, out);
    std::vector<ChunkWork> work;
    for (const auto& [fqn, boxes] : plan.declared)
      for (const Box& box : boxes) work.push_back({&fqn, &box});
    ObjectCache objects;
    // Over object storage, when the mount asks, items are placed by
    // prediction and their framing read with their bytes (indexer/dcp_item.h).
    ByteMeta sample;
    if (files.predict_items() && files.source().PreferredFetch() &&
        PredictionHolds(dir, files, plan, work, objects, &sample))
      std::erase_if(work, [&](const ChunkWork& w) {
        return AddPredictedChunk(dir, files, plan, *w.fqn, *w.box, plan.tensors[*w.fqn], sample, out);
      });
    for (size_t at = 0; at < work.size(); at += kFramingBatch) {
      const size_t n = std::min(kFramingBatch, work.size() - at);
      const FramedObjects framed = FetchFraming(dir, files, plan, work.data() + at, n, objects);
      for (size_t i = at; i < at + n; ++i)
        AddTensorChunk(dir, files, plan, *work[i].fqn, *work[i].box, plan.tensors[*work[i].fqn], objects, framed, out);
    }
    AddByteItems(dir, files, plan.byte_storage, out);
    FinishTensors(plan.tensors, out);
    AddSidecarFiles(dir, files, out);
    return Status::OK();
  }
};

}  // namespace

std::unique_ptr<FormatReader> MakeDcpReader() { return std::make_unique<DcpReader>(); }

}  // namespace ckptfs
