// Reader for torch.save checkpoints: `pytorch_model.bin` (or the shards an
// `pytorch_model.bin.index.json` names), `*.pt` / `*.pth` files (DeepSpeed's
// mp_rank_00_model_states.pt among them) and PyTorch Lightning `*.ckpt`
// files ({"state_dict": ..., "optimizer_states": [...], ...}). Each
// tensor's storage bytes are read in place from the stored zip entry
// (indexer/torch_zip.h); the pickle is never executed.
//
// Names: the tensor's key path in the saved object joined with '.'
// ({"model": {"layers.0.w": t}} -> "model.layers.0.w"). When a folder holds
// several generic .pt files (model.pt, optim.pt), each file's stem leads the
// path, so the model-weight rule can tell them apart.
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/coverage.h"
#include "indexer/format_reader.h"
#include "indexer/readers.h"
#include "indexer/torch_zip.h"

namespace ckptfs {
namespace {

bool IsHfShard(const std::string& f) { return f.starts_with("pytorch_model") && f.ends_with(".bin"); }
bool IsGeneric(const std::string& f) { return f.ends_with(".pt") || f.ends_with(".pth") || f.ends_with(".ckpt"); }

class TorchSaveReader : public FormatReader {
 public:
  std::string name() const override { return "torch-save"; }

  bool Recognise(const DirListing& dir) const override {
    return std::any_of(dir.files.begin(), dir.files.end(),
                       [](const std::string& f) { return IsHfShard(f) || IsGeneric(f); });
  }

  Status Read(const DirListing& dir, FileTable& files, Checkpoint& out) const override {
    auto problem = [&](const std::string& msg, bool incomplete) { AddProblem(out, msg, incomplete); };
    out.format = "torch-save";
    std::vector<std::string> names;
    if (dir.has_file("pytorch_model.bin.index.json")) {
      names = IndexedFiles(files, dir, "pytorch_model.bin.index.json", out);
    } else {
      for (const auto& f : dir.files)
        if (IsHfShard(f) || IsGeneric(f)) names.push_back(f);
    }
    const size_t generic = std::count_if(names.begin(), names.end(), IsGeneric);

    std::map<std::string, TensorMeta> tensors;
    for (const std::string& name : names) {
      const std::string rel = JoinRel(dir.rel, name);
      if (!dir.has_file(name)) {
        problem(rel + ": listed in pytorch_model.bin.index.json but missing", true);
        continue;
      }
      auto id = files.Add(rel);
      if (!id.ok()) {
        AddReadProblem(out, files, "", id.status(), true);
        continue;
      }
      auto in = files.Open(*id);
      auto archive = in.ok() ? ReadTorchArchive(**in, 0, files.at(*id).size, rel) : Result<TorchArchive>(in.status());
      if (!archive.ok()) {
        AddReadProblem(out, files, rel, archive.status(), true);
        continue;
      }
      if (archive->pickle->has_unknown_globals()) {
        std::string g;
        for (const auto& x : archive->pickle->unknown_globals()) g += (g.empty() ? "" : ", ") + x;
        problem(rel + ": its pickle references globals a checkpoint never needs (" + g +
                    "); they were kept inert, nothing was executed",
                false);
      }
      const std::string stem = std::filesystem::path(name).stem().string();
      for (const TorchTensorRecord& r : archive->tensors) {
        std::vector<std::string> path = r.path;
        if (path.empty()) path = {stem};
        else if (IsGeneric(name) && generic > 1) path.insert(path.begin(), stem);
        std::string fqn;
        for (const auto& p : path) fqn += (fqn.empty() ? "" : ".") + p;
        TensorMeta& t = tensors[fqn];
        if (!t.chunks.empty()) {
          problem(rel + ": tensor '" + fqn + "' is also in another file; the first is served", false);
          continue;
        }
        t.fqn = fqn;
        t.path = path.size() > 1 ? path : std::vector<std::string>{};
        t.dtype = r.dtype;
        t.shape = r.shape;
        Chunk c(Box::Whole(r.shape), {*id, r.data_offset, r.storage_bytes_available}, r.dtype);
        c.set_strides(NormalizeStrides(r.shape, r.strides));
        t.chunks.push_back(std::move(c));
      }
    }
    FinishTensors(tensors, out);
    AddSidecarFiles(dir, files, out);
    return Status::OK();
  }
};

}  // namespace

std::unique_ptr<FormatReader> MakeTorchSaveReader() { return std::make_unique<TorchSaveReader>(); }

}  // namespace ckptfs
