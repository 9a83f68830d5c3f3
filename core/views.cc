#include "core/views.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/cast.h"
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

// Why no byte of `s` can be read ("" when some can): the tensor's own
// problem, or an unavailable chunk under every one of its boxes.
std::string Unservable(const TensorSlice& s) {
  if (!s.tensor->problem.empty()) return s.tensor->problem;
  std::string why;
  for (const Box& b : s.joined.empty() ? std::vector<Box>{s.box} : s.joined) {
    if (b.empty()) continue;
    bool readable = true;
    for (const Chunk& c : s.tensor->chunks)
      if (!c.unavailable().empty() && Intersect(c.box(), b)) {
        readable = false;
        if (why.empty()) why = c.unavailable();
      }
    if (readable) return "";
  }
  return why;
}

// A weight file none of whose tensors can be served is refused at open
// (EIO): safetensors maps files, and a read error under a mapping is a bus
// error that kills the process, where a failed open is a Python exception.
std::string FileProblem(const SliceList& list, const Checkpoint& ckpt) {
  if (!ckpt.incomplete.empty()) return "checkpoint incomplete: " + ckpt.incomplete;
  std::string first;
  for (const TensorSlice& s : list) {
    std::string why = Unservable(s);
    if (why.empty()) return "";
    if (first.empty()) first = "tensor '" + s.entry_name() + "': " + why;
  }
  if (list.empty()) return "";
  return "none of its " + std::to_string(list.size()) + " tensors can be served (" + first + ")";
}

// Safetensors files (+ index.json when more than one) for `groups`, then
// the sidecars. Fills *file_of (fqn -> file name) when given. A PEFT adapter
// keeps its weights in one file named as peft names it: peft reads no other
// name and no sharded adapter.
Result<std::vector<ViewFile>> HfFolder(const std::vector<SliceList>& groups, const Checkpoint& ckpt,
                                       const std::vector<SourceFile>& files,
                                       std::map<std::string, std::string>* file_of = nullptr,
                                       const DTypeView* dtype = nullptr) {
  const bool adapter = IsPeftAdapter(ckpt);
  if (adapter && groups.size() > 1)
    return Status::NotSupported("a PEFT adapter's weights must fit one adapter_model.safetensors (peft reads no "
                                "sharded adapter); these would take " + std::to_string(groups.size()) +
                                " files: raise --max-file-size");
  std::vector<ViewFile> out;
  uint64_t total = 0;
  std::map<std::string, std::string> names;  // fqn -> file, sorted for the index
  for (size_t i = 0; i < groups.size(); ++i) {
    SliceList list = groups[i];
    SortForSafetensors(list);
    ASSIGN_OR_RETURN(Layout layout, SafetensorsFileLayout(list, kHfMetadata));
    std::string name = adapter ? kPeftWeightsName
                       : groups.size() == 1 ? "model.safetensors" : ShardName(i, groups.size());
    for (const TensorSlice& s : list) {
      names.emplace_hint(names.end(), s.entry_name(), name);
      total += s.nbytes();
    }
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), FileProblem(list, ckpt)});
  }
  if (groups.size() > 1) {
    // nlohmann::json keeps keys sorted (a std::map): "metadata" before
    // "weight_map", names in order, each insert O(log n). ordered_json would
    // search linearly on every insert.
    nlohmann::json weight_map = nlohmann::json::object();
    for (const auto& [fqn, file] : names) weight_map.emplace(fqn, file);
    nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
    Layout layout;
    layout.AddLiteral(index.dump(2) + "\n");
    out.push_back({"model.safetensors.index.json", std::make_shared<const Layout>(std::move(layout)),
                   ckpt.incomplete.empty() ? "" : "checkpoint incomplete: " + ckpt.incomplete});
  }
  for (const auto& [name, id] : ckpt.sidecars) {
    Layout layout;
    if (dtype && name == "config.json") {
      ASSIGN_OR_RETURN(std::string text, ConfigForDType(dtype->config_json, dtype->to));
      layout.AddLiteral(std::move(text));
      out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ""});
      continue;
    }
    layout.AddSource(id, 0, files.at(id).size);
    out.push_back({name, std::make_shared<const Layout>(std::move(layout)), ""});
  }
  if (file_of) *file_of = std::move(names);
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

bool IsPeftAdapter(const Checkpoint& ckpt) { return ckpt.sidecars.count(kPeftConfigName) > 0; }

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

Status CastSlices(SliceList& slices, const DTypeView& view) {
  std::regex keep;
  try {
    if (!view.keep.empty()) keep = std::regex(view.keep);
  } catch (const std::regex_error& e) {
    return Status::InvalidArgument("--keep-dtype '" + view.keep + "' is not a valid regular expression: " + e.what());
  }
  for (TensorSlice& s : slices) {
    const DType from = s.tensor->dtype;
    if (!IsCastable(from) || from == view.to) continue;
    if (!view.keep.empty() && std::regex_search(s.entry_name(), keep)) continue;
    s.cast = view.to;  // a computed slice (a LoRA merge) is then stored as `to`
  }
  return Status::OK();
}

Result<std::string> ConfigForDType(const std::string& config_json, DType to) {
  auto j = nlohmann::ordered_json::parse(config_json, nullptr, false);
  if (!j.is_object()) return Status::InvalidArgument("config.json is not a JSON object; cannot name the served dtype");
  const std::string name(TorchDTypeName(to));
  j["dtype"] = name;
  if (j.contains("torch_dtype")) j["torch_dtype"] = name;
  // Composite models (text_config, vision_config) carry their own.
  for (auto& [key, sub] : j.items())
    if (sub.is_object())
      for (const char* field : {"dtype", "torch_dtype"})
        if (sub.contains(field)) sub[field] = name;
  return j.dump(2) + "\n";
}

Result<std::vector<ViewFile>> ConsolidatedView(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                               const ConsolidatedOptions& options, const DTypeView* dtype) {
  ASSIGN_OR_RETURN(SliceList slices, ModelWeights(ckpt, options));
  if (dtype) RETURN_IF_ERROR(CastSlices(slices, *dtype));
  return HfFolderOf(ckpt, files, slices, options, dtype);
}

Result<std::vector<ViewFile>> HfFolderOf(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                         const SliceList& slices, const ConsolidatedOptions& options,
                                         const DTypeView* dtype) {
  std::vector<SliceList> groups;
  if (!ckpt.file_index.empty()) {
    ASSIGN_OR_RETURN(groups, SplitByMapping(slices, ckpt.file_index));
  } else {
    groups = SplitBySize(slices, options.max_file_bytes);
  }
  return HfFolder(groups, ckpt, files, nullptr, dtype);
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

Result<ViewFile> NpyFile(std::shared_ptr<const TensorMeta> t) {
  Layout layout;
  layout.Reserve(2);
  layout.AddLiteral(NpyHeader(NpyDescr(t->dtype), t->shape));
  const Box whole = Box::Whole(t->shape);
  std::string name = EscapeFileName(t->fqn) + ".npy";
  if (NeedsFloat32View(t->dtype)) {
    RETURN_IF_ERROR(layout.AddTensorAsFloat32(std::move(t), whole));
  } else {
    RETURN_IF_ERROR(layout.AddTensor(std::move(t), whole));
  }
  return ViewFile{std::move(name), std::make_shared<const Layout>(std::move(layout)), ""};
}

Result<std::vector<ViewFile>> TensorsView(const Checkpoint& ckpt) {
  std::vector<ViewFile> out;
  out.reserve(ckpt.tensors.size());
  for (const auto& t : ckpt.tensors) {
    ASSIGN_OR_RETURN(ViewFile f, NpyFile(t));
    out.push_back(std::move(f));
  }
  return out;
}

namespace {

// Appends to a JSON object in O(1): ordered_json's own insert searches the
// keys linearly (quadratic over 100k tensors). Keys here are unique.
void Append(nlohmann::ordered_json& object, std::string key, nlohmann::ordered_json value) {
  using Base = std::vector<std::pair<const std::string, nlohmann::ordered_json>>;
  static_cast<Base&>(object.get_ref<nlohmann::ordered_json::object_t&>())
      .emplace_back(std::move(key), std::move(value));
}

nlohmann::ordered_json BoxJson(const Box& b) { return {{"offsets", Shape(b.offsets)}, {"lengths", Shape(b.lengths)}}; }

// layout.json's entry for one slice: its box, or for a fused tensor the
// boxes joined along join_dim.
nlohmann::ordered_json SliceJson(const TensorSlice& s, const std::string& file) {
  nlohmann::ordered_json j = {{"dtype", std::string(DTypeName(s.dtype()))},
                              {"global_shape", s.tensor->shape}};
  if (s.joined.empty()) {
    j["offsets"] = Shape(s.box.offsets);
    j["lengths"] = Shape(s.box.lengths);
  } else {
    j["lengths"] = s.shape();
    j["join_dim"] = s.join_dim;
    nlohmann::ordered_json parts = nlohmann::ordered_json::array();
    for (const Box& b : s.joined) parts.push_back(BoxJson(b));
    j["parts"] = std::move(parts);
  }
  j["file"] = file;
  return j;
}

// What a user should know about the spec as a whole (layout.json "notes",
// and the log): tensors a rule holds whole for a reason (each reason once),
// a tp spec that split nothing, and why.
std::vector<std::string> MeshNotes(const MeshSpec& spec, const ShardingRules& rules,
                                   const std::vector<TensorPlacement>& placements) {
  if (spec.tp == 1) return {};
  std::vector<std::string> notes;
  for (const TensorPlacement& p : placements)
    if (!p.note.empty() && std::find(notes.begin(), notes.end(), p.note) == notes.end()) notes.push_back(p.note);
  bool split = std::any_of(placements.begin(), placements.end(), [](const TensorPlacement& p) { return p.dim >= 0; });
  if (split) return notes;
  std::string why = !rules.unknown_model.empty()
                        ? rules.unknown_model
                        : "no rule of the '" + rules.preset + "' rules matched a tensor it could split";
  notes.push_back("tp" + std::to_string(spec.tp) + " split nothing: " + why + "; every rank holds whole copies. " +
                  "Say how to split with `ckptfs mount --rules FILE` (see mesh/README)");
  return notes;
}

// One rank's folder: its slices in safetensors file(s), the sidecars, and
// layout.json.
Result<std::vector<ViewFile>> MeshRankFiles(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                            const MeshSpec& spec, uint64_t rank, const ShardingRules& rules,
                                            const SliceList& slices, const std::vector<std::string>& notes,
                                            const ConsolidatedOptions& options, const DTypeView* dtype) {
  std::map<std::string, std::string> file_of;
  ASSIGN_OR_RETURN(std::vector<ViewFile> out,
                   HfFolder(SplitBySize(slices, options.max_file_bytes), ckpt, files, &file_of, dtype));
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (const TensorSlice& s : slices) Append(tensors, s.entry_name(), SliceJson(s, file_of[s.entry_name()]));
  const MeshCoord c = CoordOf(spec, rank);
  nlohmann::ordered_json layout = {{"mesh", spec.name},
                                   {"rank", rank},
                                   {"world_size", spec.world()},
                                   {"coords", {{"tp", c.tp}, {"pp", c.pp}, {"ep", c.ep}}},
                                   {"rules", rules.preset},
                                   {"notes", notes}};
  Append(layout, "tensors", std::move(tensors));
  Layout lj;
  lj.AddLiteral(layout.dump(2) + "\n");
  out.push_back({"layout.json", std::make_shared<const Layout>(std::move(lj)), ""});
  return out;
}

}  // namespace

Result<MeshFiles> MeshView(const Checkpoint& ckpt, const std::vector<SourceFile>& files, const MeshSpec& spec,
                           const ShardingRules& rules, const ConsolidatedOptions& options,
                           const DTypeView* dtype) {
  ASSIGN_OR_RETURN(SliceList weights, ModelWeights(ckpt, options));
  if (dtype) RETURN_IF_ERROR(CastSlices(weights, *dtype));
  std::vector<std::pair<std::string, Shape>> shapes;
  shapes.reserve(weights.size());
  for (const auto& w : weights) shapes.emplace_back(w.entry_name(), w.tensor->shape);
  const ModelCounts counts = CountModel(shapes);
  // Every tensor is placed (and the spec checked) before any file is built.
  std::vector<TensorPlacement> placements;
  placements.reserve(weights.size());
  for (const auto& w : weights) {
    auto p = PlaceTensor(w.tensor->shape, w.entry_name(), spec, rules, counts);
    if (!p.ok()) {
      // A head split refused on some tensor (k_proj sorts before q_proj) is
      // reported for the model: "tp3 does not divide num_attention_heads 4".
      const std::string& why = p.status().message();
      Status model = CheckHeads(spec, rules);
      bool heads = why.find("num_attention_heads") != std::string::npos ||
                   why.find("num_key_value_heads") != std::string::npos;
      return heads && !model.ok() ? model : p.status();
    }
    placements.push_back(std::move(*p));
  }
  MeshFiles out;
  out.notes = MeshNotes(spec, rules, placements);
  for (uint64_t rank = 0; rank < spec.world(); ++rank) {
    SliceList slices;
    for (size_t i = 0; i < weights.size(); ++i) {
      std::optional<RankSlice> r = SliceOf(placements[i], spec, rank);
      if (!r) continue;
      TensorSlice s{weights[i].tensor, r->boxes[0], weights[i].name, {}, 0, weights[i].cast};
      if (r->boxes.size() > 1) {
        s.joined = std::move(r->boxes);
        s.join_dim = r->join_dim;
      }
      slices.push_back(std::move(s));
    }
    ASSIGN_OR_RETURN(std::vector<ViewFile> rank_files, MeshRankFiles(ckpt, files, spec, rank, rules, slices,
                                                                     out.notes, options, dtype));
    out.ranks.push_back(std::move(rank_files));
  }
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
      "Plain splits follow DTensor Shard semantics (torch.chunk sizes: ceil(n/parts)\n"
      "per rank, the last ranks smaller or empty). Attention heads are never cut:\n"
      "q_heads/kv_heads/qkv split in whole heads (num_attention_heads and\n"
      "num_key_value_heads from config.json); when tp exceeds the KV heads each KV\n"
      "head is replicated on tp/num_key_value_heads ranks, as vLLM loads it. Fused\n"
      "tensors (qkv, gate_up) are split per part and a rank's parts joined again.\n"
      "Pipeline stages take contiguous ranges of layers.<i>; embeddings go to the\n"
      "first stage, the final norm and lm_head to the last. Experts (experts.<e>.,\n"
      "or dim 0 of fused experts.gate_up_proj / experts.down_proj) go to ep ranks in\n"
      "contiguous blocks; tp then splits within each expert.\n"
      "\n"
      "layout.json in each rank folder gives every tensor's global shape and this\n"
      "rank's box (offsets, lengths; for a fused tensor its parts and join_dim), so a\n"
      "loader can check what it got; its \"notes\" say when a spec split nothing.\n"
      "An impossible spec (tp larger than a split dimension or not dividing the\n"
      "heads, an unknown axis) is ENOENT, with the reason in the log and in\n"
      "`ckptfs ls ROOT --mesh SPEC`.\n"
      "\n";
  if (!rules.unknown_model.empty()) s += "Nothing is split over tp: " + rules.unknown_model + ".\n\n";
  s += "Rules in use (" + rules.preset + "; first match wins, no match = replicated):\n";
  for (const auto& r : rules.rules)
    s += "  " + r.pattern + "  ->  " + SplitKindName(r.kind) +
         (r.kind == SplitKind::kDim ? " " + std::to_string(r.dim) : "") + (r.transposed ? " (stored [in, out])" : "") +
         (r.note.empty() ? "" : "\n      " + r.note) + "\n";
  s += "\nOverride or extend with `ckptfs mount --rules FILE` (JSON: {\"rules\": [{\"pattern\": REGEX,\n"
       "\"kind\": column|row|vocab|replicate|dim|q_heads|kv_heads|qkv|gate_up, \"dim\": N,\n"
       "\"transposed\": true for weights stored [in, out]}]}).\n";
  return s;
}

}  // namespace ckptfs
