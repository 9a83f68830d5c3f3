#include "core/views.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "core/convert.h"
#include "core/safetensors.h"

namespace ckptfs {
namespace {

const std::map<std::string, std::string> kHfMetadata = {{"format", "pt"}};

// Groups slices into files greedily in the given order, starting a new file
// when the next slice would pass max_file_bytes or the header cap.
std::vector<SliceList> SplitBySize(const SliceList& slices, uint64_t max_file_bytes) {
  std::vector<SliceList> groups;
  uint64_t bytes = 0;
  for (const TensorSlice& s : slices) {
    bool start_new = groups.empty();
    if (!start_new && bytes > 0 && bytes + s.nbytes() > max_file_bytes) start_new = true;
    if (!start_new) {
      // Header growth is ~100 bytes a tensor; only recompute near the cap.
      uint64_t approx = 128 * (groups.back().size() + 1) + s.entry_name().size() * 2;
      if (approx > kMaxSafetensorsHeader / 2) {
        SliceList probe = groups.back();
        probe.push_back(s);
        if (SafetensorsHeaderSize(probe, kHfMetadata) > kMaxSafetensorsHeader) start_new = true;
      }
    }
    if (start_new) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(s);
    bytes += s.nbytes();
  }
  return groups;
}

// Groups by the checkpoint's own {fqn: 1-based file index} mapping.
Result<std::vector<SliceList>> SplitByMapping(const SliceList& slices, const std::map<std::string, int>& mapping) {
  int max_index = 0;
  for (const auto& [fqn, idx] : mapping) max_index = std::max(max_index, idx);
  std::vector<SliceList> groups(max_index);
  for (const TensorSlice& s : slices) {
    auto it = mapping.find(s.entry_name());
    if (it == mapping.end())
      return Status::InvalidArgument("fqn_to_file_index_mapping.json has no entry for tensor '" + s.entry_name() + "'");
    if (it->second < 1)
      return Status::InvalidArgument("fqn_to_file_index_mapping.json maps '" + s.entry_name() + "' to file index " +
                                     std::to_string(it->second) + " (indices start at 1)");
    groups[it->second - 1].push_back(s);
  }
  return groups;
}

std::string ShardName(size_t i, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return buf;
}

// Safetensors files (+ index.json when more than one) for `groups`, then
// the sidecars. Fills *file_of (fqn -> file name) when given.
Result<std::vector<ViewFile>> HfFolder(const std::vector<SliceList>& groups, const Checkpoint& ckpt,
                                       const std::vector<SourceFile>& files,
                                       std::map<std::string, std::string>* file_of = nullptr) {
  std::vector<ViewFile> out;
  uint64_t total = 0;
  std::map<std::string, std::string> names;  // fqn -> file, sorted for the index
  for (size_t i = 0; i < groups.size(); ++i) {
    SliceList list = groups[i];
    SortForSafetensors(list);
    ASSIGN_OR_RETURN(Layout layout, SafetensorsFileLayout(list, kHfMetadata));
    std::string name = groups.size() == 1 ? "model.safetensors" : ShardName(i, groups.size());
    for (const TensorSlice& s : list) {
      names[s.entry_name()] = name;
      total += s.nbytes();
    }
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ckpt.incomplete});
  }
  if (groups.size() > 1) {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (const auto& [fqn, file] : names) weight_map[fqn] = file;
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    Layout layout;
    layout.AddLiteral(index.dump(2) + "\n");
    out.push_back({"model.safetensors.index.json", std::make_shared<const Layout>(std::move(layout)), ckpt.incomplete});
  }
  for (const auto& [name, id] : ckpt.sidecars) {
    Layout layout;
    layout.AddSource(id, 0, files.at(id).size);
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ""});
  }
  if (file_of) *file_of = std::move(names);
  return out;
}

std::vector<std::string> Names(const SliceList& slices) {
  std::vector<std::string> out;
  for (const auto& s : slices) out.push_back(s.entry_name());
  return out;
}

const char* const kModelKeys[] = {"model", "module", "model_state_dict", "state_dict"};
const char* const kTrainingStateKeys[] = {
    "optim", "optimizer", "optimizers", "optim_state", "optimizer_state_dict", "optim_state_dict",
    "lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "dataloader", "data_loader", "dataloaders",
    "sampler", "rng", "rng_state", "rng_states", "rng_tracker_states", "random_state", "scaler", "grad_scaler",
    "trainer", "train_state", "args", "extra_state", "iteration", "step", "epoch", "checkpoint_version"};

std::vector<std::string> KeyPath(const TensorMeta& t) {
  return t.path.empty() ? std::vector<std::string>{t.fqn} : t.path;
}

// The first component of a flat name: "optim" in "optim.state.w.exp_avg".
std::string TopKey(const TensorMeta& t) {
  auto path = KeyPath(t);
  if (path.size() > 1) return path[0];
  return path[0].substr(0, path[0].find('.'));
}

}  // namespace

Result<SliceList> ModelWeights(const Checkpoint& ckpt, const ConsolidatedOptions& options) {
  SliceList out;
  std::map<std::string, std::string> seen;  // name -> fqn
  auto add = [&](const std::shared_ptr<const TensorMeta>& t, std::string name) -> Status {
    if (auto [it, fresh] = seen.emplace(name, t->fqn); !fresh)
      return Status::InvalidArgument("tensors '" + it->second + "' and '" + t->fqn + "' would both be named '" + name +
                                     "' in consolidated/ (pass --names FILE to choose)");
    TensorSlice s = TensorSlice::Whole(t);
    if (name != t->fqn) s.name = std::move(name);
    out.push_back(std::move(s));
    return Status::OK();
  };
  if (!options.names.empty()) {
    for (const auto& t : ckpt.tensors)
      if (auto it = options.names.find(t->fqn); it != options.names.end()) RETURN_IF_ERROR(add(t, it->second));
    return out;
  }
  std::set<std::string> tops;
  for (const auto& t : ckpt.tensors)
    if (KeyPath(*t).size() > 1) tops.insert(KeyPath(*t)[0]);
  for (const char* key : kModelKeys) {
    if (!tops.count(key)) continue;
    for (const auto& t : ckpt.tensors) {
      auto path = KeyPath(*t);
      if (path.size() < 2 || path[0] != key) continue;
      std::string name;
      for (size_t i = 1; i < path.size(); ++i) name += (i > 1 ? "." : "") + path[i];
      RETURN_IF_ERROR(add(t, name));
    }
    return out;
  }
  for (const auto& t : ckpt.tensors) {
    std::string top = TopKey(*t);
    bool training = std::find(std::begin(kTrainingStateKeys), std::end(kTrainingStateKeys), top) !=
                    std::end(kTrainingStateKeys);
    if (training) continue;
    std::string name;
    for (const std::string& part : KeyPath(*t)) name += (name.empty() ? "" : ".") + part;
    RETURN_IF_ERROR(add(t, name));
  }
  return out;
}

Result<std::vector<ViewFile>> ConsolidatedView(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                               const ConsolidatedOptions& options) {
  ASSIGN_OR_RETURN(SliceList slices, ModelWeights(ckpt, options));
  std::vector<SliceList> groups;
  if (!ckpt.file_index.empty()) {
    ASSIGN_OR_RETURN(groups, SplitByMapping(slices, ckpt.file_index));
  } else {
    groups = SplitBySize(slices, options.max_file_bytes);
  }
  return HfFolder(groups, ckpt, files);
}

std::string EscapeFileName(const std::string& fqn) {
  std::string out;
  bool all = fqn.empty() || fqn == "." || fqn == "..";
  if (fqn.empty()) return "%";  // the one name that escapes to a lone '%'
  for (unsigned char c : fqn) {
    if (all || c == '%' || c == '/' || c == 0) {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out;
}

std::string UnescapeFileName(const std::string& name) {
  if (name == "%") return "";
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '%' && i + 2 < name.size() && std::isxdigit(static_cast<unsigned char>(name[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(name[i + 2]))) {
      out += char(std::stoi(name.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += name[i];
    }
  }
  return out;
}

std::string NpyDescr(DType t) {
  switch (t) {
    case DType::kBOOL: return "|b1";
    case DType::kU8: return "|u1";
    case DType::kI8: return "|i1";
    case DType::kI16: return "<i2";
    case DType::kU16: return "<u2";
    case DType::kF16: return "<f2";
    case DType::kI32: return "<i4";
    case DType::kU32: return "<u4";
    case DType::kF32: return "<f4";
    case DType::kF64: return "<f8";
    case DType::kI64: return "<i8";
    case DType::kU64: return "<u8";
    case DType::kC64: return "<c8";
    default: return "<f4";  // presented as float32 (NeedsFloat32View)
  }
}

std::string NpyHeader(const std::string& descr, const Shape& shape) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dims += ",";
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // magic(6) + version(2) + u16 length(2) + dict + padding + '\n' = multiple of 64
  size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += char(dict.size() & 0xff);
  out += char((dict.size() >> 8) & 0xff);
  return out + dict;
}

std::vector<ViewFile> BytesView(const Checkpoint& ckpt) {
  std::vector<ViewFile> out;
  for (const auto& [key, b] : ckpt.byte_items) {
    Layout layout;
    layout.AddSource(b.file, b.offset, b.length);
    out.push_back({EscapeFileName(key) + ".pt", std::make_shared<const Layout>(std::move(layout)), ""});
  }
  return out;
}

Result<std::vector<ViewFile>> TensorsView(const Checkpoint& ckpt) {
  std::vector<ViewFile> out;
  for (const auto& t : ckpt.tensors) {
    Layout layout;
    layout.AddLiteral(NpyHeader(NpyDescr(t->dtype), t->shape));
    if (NeedsFloat32View(t->dtype)) {
      RETURN_IF_ERROR(layout.AddTensorAsFloat32(t, Box::Whole(t->shape)));
    } else {
      RETURN_IF_ERROR(layout.AddTensor(t, Box::Whole(t->shape)));
    }
    out.push_back({EscapeFileName(t->fqn) + ".npy", std::make_shared<const Layout>(std::move(layout)), ""});
  }
  return out;
}

Status CheckMeshSpec(const Checkpoint& ckpt, const MeshSpec& spec, const ShardingRules& rules) {
  ASSIGN_OR_RETURN(SliceList weights, ModelWeights(ckpt, {}));
  const auto names = Names(weights);
  const uint64_t layers = CountIndexed(names, "layers"), experts = CountIndexed(names, "experts");
  for (uint64_t rank = 0; rank < spec.world(); ++rank)
    for (const auto& w : weights) {
      auto box = RankBox(*w.tensor, w.entry_name(), spec, rank, rules, layers, experts);
      if (!box.ok()) return box.status();
    }
  return Status::OK();
}

Result<std::vector<ViewFile>> MeshRankView(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                           const MeshSpec& spec, uint64_t rank, const ShardingRules& rules,
                                           const ConsolidatedOptions& options) {
  ASSIGN_OR_RETURN(SliceList weights, ModelWeights(ckpt, options));
  const auto names = Names(weights);
  const uint64_t layers = CountIndexed(names, "layers"), experts = CountIndexed(names, "experts");
  SliceList slices;
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (const auto& w : weights) {
    ASSIGN_OR_RETURN(std::optional<Box> box, RankBox(*w.tensor, w.entry_name(), spec, rank, rules, layers, experts));
    if (!box) continue;
    slices.push_back({w.tensor, *box, w.name});
  }
  auto groups = SplitBySize(slices, options.max_file_bytes);
  std::map<std::string, std::string> file_of;
  ASSIGN_OR_RETURN(std::vector<ViewFile> out, HfFolder(groups, ckpt, files, &file_of));
  for (const TensorSlice& s : slices)
    tensors[s.entry_name()] = {{"dtype", std::string(DTypeName(s.tensor->dtype))},
                               {"global_shape", s.tensor->shape},
                               {"offsets", s.box.offsets},
                               {"lengths", s.box.lengths},
                               {"file", file_of[s.entry_name()]}};
  const MeshCoord c = CoordOf(spec, rank);
  nlohmann::ordered_json layout = {{"mesh", spec.name},
                                   {"rank", rank},
                                   {"world_size", spec.world()},
                                   {"coords", {{"tp", c.tp}, {"pp", c.pp}, {"ep", c.ep}}},
                                   {"rules", rules.preset},
                                   {"tensors", tensors}};
  Layout lj;
  lj.AddLiteral(layout.dump(2) + "\n");
  out.push_back({"layout.json", std::make_shared<const Layout>(std::move(lj)), ""});
  return out;
}

std::string MeshReadme(const ShardingRules& rules) {
  std::string s =
      "mesh/ -- per-rank views of this checkpoint under a new parallel layout\n"
      "\n"
      "Open a directory named by a layout spec and it appears, for example:\n"
      "  ls mesh/tp4/                  rank-00000 .. rank-00003\n"
      "  mesh/tp2-pp2/rank-00003/      model.safetensors, layout.json, config.json, ...\n"
      "\n"
      "Spec: axes tp (tensor), pp (pipeline), ep (expert), each at most once, joined\n"
      "by '-': tp4, tp2-pp2, tp2-ep4. Ranks are numbered tp fastest, then ep, then pp:\n"
      "  rank = (pp_rank * ep + ep_rank) * tp + tp_rank\n"
      "\n"
      "Splits follow DTensor Shard semantics (torch.chunk sizes: ceil(n/parts) per rank,\n"
      "the last ranks smaller or empty). Pipeline stages take contiguous ranges of\n"
      "layers.<i>; embeddings go to the first stage, the final norm and lm_head to the\n"
      "last. Experts (experts.<e>.) go to ep ranks in contiguous blocks.\n"
      "\n"
      "layout.json in each rank folder gives every tensor's global shape and this\n"
      "rank's box (offsets, lengths), so a loader can check what it got.\n"
      "An impossible spec (tp larger than a split dimension, an unknown axis) is\n"
      "ENOENT, with the reason in the log and in `ckptfs ls ROOT --mesh SPEC`.\n"
      "\n"
      "Rules in use (" + rules.preset + "; first match wins, no match = replicated):\n";
  for (const auto& r : rules.rules) {
    const char* kind = r.kind == SplitKind::kColumn ? "column (dim 0)"
                       : r.kind == SplitKind::kRow  ? "row (dim 1)"
                       : r.kind == SplitKind::kVocab ? "vocab (dim 0)"
                       : r.kind == SplitKind::kDim  ? "dim"
                                                    : "replicate";
    s += "  " + r.pattern + "  ->  " + kind + (r.kind == SplitKind::kDim ? " " + std::to_string(r.dim) : "") + "\n";
  }
  s += "\nOverride or extend with `ckptfs mount --rules FILE` "
       "(JSON: {\"rules\": [{\"pattern\": REGEX, \"kind\": column|row|vocab|replicate|dim, \"dim\": N}]}).\n";
  return s;
}

}  // namespace ckptfs
