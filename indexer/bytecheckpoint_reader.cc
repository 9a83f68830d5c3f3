// Reader for ByteCheckpoint (bytecheckpoint 0.0.2) checkpoints: a root with
// `model/` and `optimizer/`, each a DCP-style directory (`.metadata` +
// `__R_N.distcp`) whose Metadata (module `bytecheckpoint.*`) adds
// `all_tensor_metadata`: per item, a pickled `_rebuild_tensor_v2` call giving
// dtype, shape, strides and storage offset. Tensor items are raw storage
// bytes (not zips); BYTE_IO items are torch.save blobs.
//
// FSDP flat parameters saved "decomposed" are 1-d `<prefix>_flat_param`
// tensors described by model/.metadata's `user_defined_dict`:
// `fsdp_flat_param_to_fqns`, `fsdp_numels_with_padding`,
// `fsdp_is_padding_mask`, `fsdp_shapes`. Each is split here into its
// parameters' regular boxes (FlatRangeToBoxes); the optimizer's
// `state.<flat>.<key>` tensors are split with the model's tables. Padding is
// never part of a tensor.
//
// Names: `model.<name>` and `optimizer.<name>`, with key paths
// (model, <name>) so the model-weight rule serves the model part in
// consolidated/ under its own names.

#include <algorithm>
#include <map>

#include "core/coverage.h"
#include "indexer/dcp_metadata.h"
#include "indexer/format_reader.h"
#include "indexer/pickle.h"
#include "indexer/readers.h"
#include "indexer/torch_zip.h"

namespace ckptfs {
namespace {

const char* const kParts[] = {"model", "optimizer"};

// One parameter inside a flat parameter.
struct FlatPiece {
  std::string name;  // full parameter name
  Shape shape;
  uint64_t offset;   // element offset in the flat parameter
};

// flat param name -> its pieces, from user_defined_dict.
using FlatTables = std::map<std::string, std::vector<FlatPiece>>;

Result<FlatTables> ReadFlatTables(const PickleValue* user, const std::string& rel) {
  FlatTables out;
  if (!user || !user->AsDict()) return out;
  const PickleValue* fqns = user->DictGet("fsdp_flat_param_to_fqns");
  const PickleValue* numels = user->DictGet("fsdp_numels_with_padding");
  const PickleValue* mask = user->DictGet("fsdp_is_padding_mask");
  const PickleValue* shapes = user->DictGet("fsdp_shapes");
  if (!fqns || !fqns->AsDict()) return out;
  if (!numels || !mask || !shapes || !numels->AsDict() || !mask->AsDict() || !shapes->AsDict())
    return Status::Corruption(rel + ": user_defined_dict has fsdp_flat_param_to_fqns but not its other tables");
  for (const PickleDictEntry& e : *fqns->AsDict()) {
    const std::string* flat = e.key->AsStr();
    const PickleValue* n = numels->DictGet(flat ? *flat : "");
    const PickleValue* m = mask->DictGet(flat ? *flat : "");
    const PickleValue* sh = shapes->DictGet(flat ? *flat : "");
    if (!flat || !e.value->AsSequence() || !n || !n->AsSequence() || !m || !m->AsSequence() || !sh ||
        !sh->AsSequence() || n->AsSequence()->size() != m->AsSequence()->size())
      return Status::Corruption(rel + ": malformed FSDP tables for a flat parameter");
    // "<prefix>_flat_param": parameter names are relative to the prefix; a
    // parameter held directly by the wrapped module is spelt ".name".
    std::string prefix = flat->ends_with("_flat_param") ? flat->substr(0, flat->size() - 11) : "";
    std::vector<FlatPiece> pieces;
    uint64_t at = 0;
    size_t k = 0;
    for (size_t i = 0; i < n->AsSequence()->size(); ++i) {
      auto numel = UInt(n->At(i));
      auto pad = m->At(i)->AsBool();
      if (!numel || !pad) return Status::Corruption(rel + ": malformed FSDP numels/padding for " + *flat);
      if (!*pad) {
        const PickleValue* name = e.value->At(k);
        const PickleValue* shape = sh->At(k);
        auto dims = shape ? AsShape(*shape) : std::nullopt;
        if (!name || !name->AsStr() || !dims || CheckedNumel(*dims).value_or(~0ull) != *numel)
          return Status::Corruption(rel + ": FSDP piece " + std::to_string(k) + " of " + *flat + " is malformed");
        std::string param = *name->AsStr();
        if (param.starts_with(".")) param = param.substr(1);
        pieces.push_back({prefix + param, *dims, at});
        ++k;
      }
      at += *numel;
    }
    out[*flat] = std::move(pieces);
  }
  return out;
}

// The chunk an item describes: raw storage bytes, placed by the item's
// pickled tensor description.
Result<Chunk> ItemChunk(const StorageInfo& si, const std::string& meta, const std::string& sub,
                               const TensorMeta& t, const Box& box, FileTable& files, const std::string& who) {
  if (!si.transforms.empty()) return Status::NotSupported(who + ": transformed ByteCheckpoint items are not supported");
  ASSIGN_OR_RETURN(FileId id, files.Add(JoinRel(sub, si.relative_path)));
  auto doc = Unpickle(meta);
  if (!doc.ok()) return doc.status().WithContext(who);
  ASSIGN_OR_RETURN(std::optional<TorchTensorRef> ref, MatchTorchTensor((*doc)->root()));
  if (!ref) return Status::Corruption(who + ": its tensor metadata is not a tensor description");
  if (ref->dtype != t.dtype || ref->shape != box.lengths)
    return Status::Corruption(who + ": the item is " + std::string(DTypeName(ref->dtype)) + ShapeToString(ref->shape) +
                              ", the metadata says " + std::string(DTypeName(t.dtype)) + ShapeToString(box.lengths));
  const uint64_t skip = ref->storage_offset * (DTypeBits(t.dtype) / 8);
  if (skip > si.length || si.offset + si.length > files.at(id).size)
    return Status::Corruption(who + ": the item runs past the end of " + si.relative_path + " (truncated?)");
  Chunk c(box, {id, si.offset + skip, si.length - skip}, t.dtype);
  c.set_strides(NormalizeStrides(ref->shape, ref->strides));
  return c;
}

// The output tensor `part.name`, created like `proto` on first use.
TensorMeta& Target(std::map<std::string, TensorMeta>& all, const std::string& part, const std::string& name,
                          const TensorMeta& proto) {
  const std::string fqn = part + "." + name;
  TensorMeta& t = all[fqn];
  if (t.fqn.empty()) {
    t.fqn = fqn;
    t.dtype = proto.dtype;
    t.shape = proto.shape;
    t.path = {part, name};
  }
  return t;
}

// The pieces a declared tensor splits into: a flat parameter's own, or, for
// its optimizer state `state.<flat>.<suffix>` (1-D), the same pieces named
// `state.<piece>.<suffix>`. Null when it is not flat.
const std::vector<FlatPiece>* FlatPiecesOf(const std::string& fqn, const TensorMeta& t, const FlatTables& flat,
                                           std::string* prefix, std::string* suffix) {
  if (auto it = flat.find(fqn); it != flat.end()) return &it->second;
  if (!fqn.starts_with("state.") || t.shape.size() != 1) return nullptr;
  const std::vector<FlatPiece>* pieces = nullptr;
  for (const auto& [f, p] : flat)
    if (fqn.size() > 6 + f.size() + 1 && fqn.compare(6, f.size(), f) == 0 && fqn[6 + f.size()] == '.') {
      pieces = &p;
      *prefix = "state.";
      *suffix = fqn.substr(6 + f.size());
    }
  return pieces;
}

// Cuts `chunk` (flat range box.offsets[0] + [0, box.lengths[0]) of a flat
// tensor of `dtype`) along `pieces` into chunks of the pieces' tensors.
void AddFlatPieces(const Chunk& chunk, const Box& box, DType dtype, const std::vector<FlatPiece>& pieces,
                   const std::string& part, const std::string& prefix, const std::string& suffix,
                   std::map<std::string, TensorMeta>& all) {
  const uint64_t begin = box.offsets[0], end = begin + box.lengths[0];
  const uint64_t itemsize = DTypeBits(dtype) / 8;
  for (const FlatPiece& p : pieces) {
    const uint64_t pn = Box::Whole(p.shape).numel();
    const uint64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + pn);
    if (lo >= hi) continue;
    TensorMeta proto;
    proto.dtype = dtype;
    proto.shape = p.shape;
    TensorMeta& dst = Target(all, part, prefix + p.name + suffix, proto);
    for (const auto& [piece_box, first] : FlatRangeToBoxes(p.shape, lo - p.offset, hi - p.offset)) {
      Chunk c(piece_box, {chunk.file(), chunk.offset() + (p.offset + first - begin) * itemsize,
                          piece_box.numel() * itemsize}, chunk.dtype());
      c.set_unavailable(chunk.unavailable());
      dst.chunks.push_back(std::move(c));
    }
  }
}

// The non-tensor items of one part, served under `bytes/`.
void AddByteItems(const std::string& part, const std::string& sub, const std::map<std::string, StorageInfo>& items,
                  FileTable& files, Checkpoint& out) {
  for (const auto& [key, si] : items) {
    auto id = files.Add(JoinRel(sub, si.relative_path));
    if (!id.ok() || si.offset + si.length > files.at(*id).size) {
      AddProblem(out, part + ": item '" + key + "' cannot be served (missing or truncated file)", false);
      continue;
    }
    out.byte_items[part + "." + key] = {*id, si.offset, si.length};
  }
}

class ByteCheckpointReader : public FormatReader {
 public:
  std::string name() const override { return "bytecheckpoint"; }

  bool Recognise(const DirListing& dir) const override {
    for (const char* part : kParts) {
      if (!std::binary_search(dir.dirs.begin(), dir.dirs.end(), std::string(part))) continue;
      // Cheap: the pickle names its module as a string near the start.
      const std::string meta = JoinRel(dir.rel, std::string(part) + "/.metadata");
      auto head = dir.source->ReadRange(meta, 0, 512);
      if (!head.ok()) {
        auto whole = dir.source->ReadWhole(meta);
        if (!whole.ok()) continue;
        head = std::move(whole);
      }
      if (head->find("bytecheckpoint") != std::string::npos) return true;
    }
    return false;
  }

  std::vector<std::string> ClaimedSubdirs(const DirListing&) const override { return {"model", "optimizer"}; }

  Status Read(const DirListing& dir, FileTable& files, Checkpoint& out) const override {
    out.format = "bytecheckpoint";
    std::map<std::string, TensorMeta> all;
    FlatTables flat;
    for (const char* part : kParts) {
      const std::string sub = JoinRel(dir.rel, part);
      const std::string meta_rel = sub + "/.metadata";
      if (!files.source().Identify(meta_rel).ok()) continue;
      Status st = ReadPart(part, sub, files, out, all, flat);
      if (!st.ok()) AddReadProblem(out, files, "", st, true);
    }
    FinishTensors(all, out);
    AddSidecarFiles(dir, files, out);
    return Status::OK();
  }

 private:
  static Status ReadPart(const std::string& part, const std::string& sub, FileTable& files, Checkpoint& out,
                         std::map<std::string, TensorMeta>& all, FlatTables& flat) {
    const std::string rel = sub + "/.metadata";
    ASSIGN_OR_RETURN(FileId meta_id, files.Add(rel));
    ASSIGN_OR_RETURN(std::string text, files.ReadWhole(meta_id));
    auto doc = Unpickle(text);
    if (!doc.ok()) return doc.status().WithContext(rel);
    std::string foreign;
    for (const auto& g : (*doc)->unknown_globals())
      if (!g.starts_with("torch.") && !g.starts_with("bytecheckpoint."))
        foreign += (foreign.empty() ? "" : ", ") + g;
    if (!foreign.empty())
      return Status::Corruption(rel + ": refusing the metadata: it references globals a checkpoint never needs (" +
                                foreign + "); nothing was executed");
    const PickleValue* root = &(*doc)->root();
    std::map<std::string, TensorMeta> tensors;
    std::map<std::string, std::vector<Box>> declared;
    std::map<ChunkKey, StorageInfo> storage;
    std::map<std::string, StorageInfo> byte_storage;
    std::map<std::string, std::vector<uint64_t>> reformulated;
    std::map<ChunkKey, std::string> tensor_meta;
    RETURN_IF_ERROR(ReadDcpMetadata(rel, root, tensors, declared, storage, byte_storage, reformulated, &tensor_meta));
    if (part == "model") {
      ASSIGN_OR_RETURN(flat, ReadFlatTables(Field(root, "user_defined_dict"), rel));
    }
    for (auto& [fqn, boxes] : declared) {
      const TensorMeta& t = tensors[fqn];
      std::string prefix, suffix;
      const std::vector<FlatPiece>* pieces = FlatPiecesOf(fqn, t, flat, &prefix, &suffix);
      for (const Box& box : boxes) {
        const std::string who = part + ": tensor '" + fqn + "' chunk " + ToString(box);
        auto si = storage.find({fqn, box.offsets});
        auto tm = tensor_meta.find({fqn, box.offsets});
        if (si == storage.end() || tm == tensor_meta.end()) {
          AddProblem(out, who + ": no item or tensor metadata in " + rel, false);
          continue;
        }
        auto chunk = ItemChunk(si->second, tm->second, sub, t, box, files, who);
        if (!chunk.ok()) AddReadProblem(out, files, "", chunk.status(), false);
        else if (pieces) AddFlatPieces(*chunk, box, t.dtype, *pieces, part, prefix, suffix, all);
        else Target(all, part, fqn, t).chunks.push_back(std::move(*chunk));
      }
    }
    AddByteItems(part, sub, byte_storage, files, out);
    return Status::OK();
  }
};

}  // namespace

std::unique_ptr<FormatReader> MakeByteCheckpointReader() { return std::make_unique<ByteCheckpointReader>(); }

}  // namespace ckptfs
