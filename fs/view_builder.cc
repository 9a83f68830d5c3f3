#include "fs/view_builder.h"

#include <climits>
#include <cstdio>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <utility>
#include <vector>

#include "core/cast.h"
#include "core/item_views.h"
#include "core/mesh_view.h"
#include "core/views.h"
#include "fs/merged_view.h"

namespace ckptfs {
namespace {

constexpr uint64_t kNoFile = UINT64_MAX;  // the size of a tensor left out of tensors/

// Why an item (a tensor, a non-tensor item) named `item` gets no file named
// `file`: a name of more than NAME_MAX bytes no lookup can ask for, and
// listed it fails the whole directory's readdir. "" when it fits.
std::string NameTooLong(const std::string& item, const std::string& file) {
  if (file.size() <= NAME_MAX) return "";
  return "no file for '" + item.substr(0, 64) + "...': its file name would be " + std::to_string(file.size()) +
         " bytes, over the " + std::to_string(NAME_MAX) + " a name may have";
}

// A view directory's files, built outside the node table's lock.
struct PendingDir {
  std::string name;
  std::vector<ViewFile> files;
  bool is_mesh = false;
  bool is_npy = false;
};

// The text of sidecar `name` of `ckpt` ("" when it has none or it cannot be read).
std::string ReadSidecar(const Source& source, const Checkpoint& ckpt, const std::string& name) {
  auto it = ckpt.sidecars.find(name);
  if (it == ckpt.sidecars.end()) return "";
  auto text = source.ReadWholeIndexed(ckpt.files[it->second]);
  return text.ok() ? *text : "";
}

// "tp2.bf16" -> {"tp2", "bf16"}; "tp2" -> {"tp2", ""}.
std::pair<std::string, std::string> SplitDTypeSuffix(const std::string& name) {
  const size_t dot = name.rfind('.');
  if (dot == std::string::npos) return {name, ""};
  return {name.substr(0, dot), name.substr(dot + 1)};
}

}  // namespace

ViewBuilder::ViewBuilder(const FsOptions& options, const SourceTree& tree, NodeTable& nodes, CheckpointSet& ckpts)
    : options_(options), tree_(tree), nodes_(nodes), ckpts_(ckpts) {}

// Builds consolidated/, bytes/ and mesh/ of checkpoint `i` and attaches
// them to `dir`, with tensors/ empty until first used (FillNpy: one file
// per tensor is the largest view, and the one least often listed). One bad
// view must not hide the others: failures are logged and the view left out.
Status ViewBuilder::Build(int i, FsNode* dir) {
  Served* served = ckpts_.ServedAt(i);
  const Checkpoint& ckpt = served->ckpt;
  std::vector<PendingDir> pending;
  if (auto files = ConsolidatedView(ckpt, ckpt.files, options_.consolidated); files.ok())
    pending.push_back({ViewDirName(ViewKind::kConsolidated), std::move(*files)});
  else
    options_.Log(JoinRel(ckpt.dir, ViewDirName(ViewKind::kConsolidated)) + ": not created: " +
                 files.status().message());
  bool mergeable = false;
  if (IsPeftAdapter(ckpt)) {
    const std::string why = MergedRefusal(ckpt);
    if (!why.empty()) options_.Log(JoinRel(ckpt.dir, ViewDirName(ViewKind::kMerged)) + "/: not created: " + why);
    mergeable = why.empty();
  }
  pending.push_back({ViewDirName(ViewKind::kTensors), {}, false, true});
  if (auto items = BytesView(ckpt); !items.empty()) {
    std::erase_if(items, [&](const ViewFile& f) {
      const std::string why = NameTooLong(f.name.substr(0, f.name.size() - 3), f.name);  // less ".pt"
      if (!why.empty()) options_.Log(JoinRel(ckpt.dir, ViewDirName(ViewKind::kBytes)) + ": " + why);
      return !why.empty();
    });
    pending.push_back({ViewDirName(ViewKind::kBytes), std::move(items)});
  }
  if (auto rules = RulesFor(ckpt); rules.ok()) {
    Layout text;
    text.AddLiteral(MeshReadme(*rules));
    pending.push_back(
        {ViewDirName(ViewKind::kMesh), {{"README", std::make_shared<const Layout>(std::move(text)), ""}}, true});
  } else {
    options_.Log(JoinRel(ckpt.dir, ViewDirName(ViewKind::kMesh)) + ": not created: " + rules.status().message());
  }
  std::unique_lock lock(nodes_.mu());
  if (served->removed) return Status::OK();  // replaced while loading: attach nothing
  dir->ckpt = i;
  // Loaded again after an unload, the views' nodes are still there and get
  // their layouts back; tensors/ keeps its files (each layout is made on open).
  for (PendingDir& p : pending) {
    FsNode* view = nodes_.AddVirtual(dir, p.name, /*is_dir=*/true, i);
    if (view->is_mesh != p.is_mesh) view->is_mesh = p.is_mesh;
    if (const bool fill = p.is_npy && view->children.empty(); view->is_npy != fill) view->is_npy = fill;
    for (ViewFile& f : p.files) nodes_.AddViewFile(view, std::move(f), i);
  }
  if (mergeable)  // built on first lookup
    nodes_.AddVirtual(dir, ViewDirName(ViewKind::kMerged), /*is_dir=*/true, i)->is_dtype_view = true;
  return Status::OK();
}

Result<DTypeView> ViewBuilder::DTypeViewFor(const Checkpoint& ckpt, const std::string& suffix) const {
  auto to = ParseViewDType(suffix);
  if (!to) return Status::NotFound("unknown dtype '" + suffix + "': the dtype views are .bf16, .fp16 and .fp32");
  DTypeView view{*to, options_.keep_dtype, ""};
  if (ckpt.sidecars.count("config.json")) view.config_json = ReadSidecar(*tree_.source(), ckpt, "config.json");
  return view;
}

FsResult<ViewBuilder::BuildTurn> ViewBuilder::TakeBuildTurn(int i, FsNode* dir, const std::string& name) {
  Served* served = ckpts_.ServedAt(i);
  if (Status st = ckpts_.EnsureLoaded(i); !st.ok()) return CheckpointSet::LoadFailure(st);
  if (served->removed) return FsError(ESTALE, JoinRel(served->dir, "") + ": replaced or removed; look it up again");
  BuildTurn turn{std::unique_lock<std::mutex>(served->load_mu)};
  std::shared_lock lock(nodes_.mu());
  if (auto it = dir->children.find(name);
      it != dir->children.end() && nodes_.NodeLocked(it->second) && nodes_.NodeLocked(it->second)->built)
    turn.built = it->second;
  return turn;
}

// Builds consolidated.<dtype>/ on first lookup; ENOENT, with a log line,
// for a name that is no dtype view.
FsResult<uint64_t> ViewBuilder::OpenDTypeView(FsNode* dir, const std::string& name) {
  int i;
  {
    std::shared_lock lock(nodes_.mu());
    i = dir->ckpt;
  }
  if (i < 0) return FsError(ENOENT, JoinRel(dir->rel, name) + ": no checkpoint here now");
  ASSIGN_OR_RETURN(BuildTurn turn, TakeBuildTurn(i, dir, name));  // the caller holds a pin
  if (turn.built) return turn.built;
  const Served* served = ckpts_.ServedAt(i);
  const Checkpoint& ckpt = served->ckpt;
  const std::string where = JoinRel(ckpt.dir, name);
  auto fail = [&](const std::string& why) {
    options_.Log(where + ": " + why);
    return FsError(ENOENT, where + ": " + why);
  };
  auto view = DTypeViewFor(ckpt, ParseViewName(name)->dtype_suffix);
  if (!view.ok()) return fail(view.status().message());
  auto files = ConsolidatedView(ckpt, ckpt.files, options_.consolidated, &*view);
  if (!files.ok()) return fail("not created: " + files.status().message());
  std::unique_lock lock(nodes_.mu());
  if (dir->ckpt != i) return FsError(ESTALE, served->dir + ": replaced or removed; look it up again");
  FsNode* view_dir = nodes_.AddVirtual(dir, name, /*is_dir=*/true, i);  // or the one built before an unload
  view_dir->is_dtype_view = true;
  view_dir->built = true;
  for (ViewFile& f : *files) nodes_.AddViewFile(view_dir, std::move(f), i);
  return view_dir->ino;
}

std::string ViewBuilder::MergedRefusal(const Checkpoint& ckpt) const {
  auto target = MergeTarget(*tree_.source(), ckpt);
  if (!target.ok()) return target.status().message();
  return ckpts_.IndexOf(target->second) >= 0 ? "" : NoBaseCheckpoint(target->first, target->second);
}

Result<Checkpoint> ViewBuilder::RowsOf(const std::string& dir) {
  const int i = ckpts_.IndexOf(dir);
  if (i < 0) return Status::NotFound("no checkpoint in '" + JoinRel(dir, "") + "' now");
  auto s = ckpts_.Acquire(i);
  if (!s.ok()) return Status::IOError(s.status().message());
  Checkpoint copy = (*s)->ckpt;  // pinned: not unloaded while copied
  ckpts_.Unpin(*s);
  return copy;
}

// Built outside every lock: the base is pinned only while its rows are
// copied, and the adapter's load_mu is taken only to attach, never with
// the base's held.
FsResult<uint64_t> ViewBuilder::OpenMergedView(FsNode* dir, const std::string& name) {
  int i;
  bool mergeable;
  {
    std::shared_lock lock(nodes_.mu());
    i = dir->ckpt;
    mergeable = dir->children.count(ViewDirName(ViewKind::kMerged)) > 0;  // BuildViews' verdict, logged once there
  }
  if (i < 0) return FsError(ENOENT, JoinRel(dir->rel, name) + ": no checkpoint here now");
  if (!mergeable) return FsError(ENOENT, JoinRel(dir->rel, name) + ": no merged view here (see the log)");
  Served* served = ckpts_.ServedAt(i);
  auto adapter = RowsOf(served->dir);  // the caller holds a pin: loads, never waits for an unload
  if (!adapter.ok()) return CheckpointSet::LoadFailure(adapter.status());
  const std::string where = JoinRel(served->dir, name);
  auto fail = [&](const std::string& why) {
    options_.Log(where + "/: not created: " + why);
    return FsError(ENOENT, where + ": not created: " + why);
  };
  auto target = MergeTarget(*tree_.source(), *adapter);
  if (!target.ok()) return fail(target.status().message());
  auto base = RowsOf(target->second);
  if (!base.ok()) return fail("its base " + JoinRel(target->second, "") + ": " + base.status().message());
  std::optional<DTypeView> dtype;
  if (const std::string suffix = ParseViewName(name)->dtype_suffix; !suffix.empty()) {
    auto to = ParseViewDType(suffix);
    if (!to) return fail("unknown dtype '" + suffix + "': the dtype views are .bf16, .fp16 and .fp32");
    dtype = DTypeView{*to, options_.keep_dtype, ""};
  }
  auto built = BuildMergedView(tree_.source(), *adapter, *base, std::move(target->first), options_.consolidated,
                               dtype ? &*dtype : nullptr, options_.read);
  if (!built.ok()) return fail(built.status().message());
  std::lock_guard<std::mutex> load(served->load_mu);  // guards served->merged
  std::unique_lock lock(nodes_.mu());
  if (dir->ckpt != i) return FsError(ESTALE, served->dir + ": replaced or removed; look it up again");
  FsNode* view_dir = nodes_.AddVirtual(dir, name, /*is_dir=*/true, i);  // or the one built before an unload
  if (view_dir->built) return view_dir->ino;  // built by another thread meanwhile
  view_dir->is_dtype_view = true;
  view_dir->built = true;
  for (ViewFile& f : built->files) nodes_.AddViewFile(view_dir, std::move(f), i, built->sources);
  served->merged.push_back(std::move(built->sources));
  return view_dir->ino;
}

// The preset for the checkpoint's model family (config.json's model_type,
// else its tensor names) and the head counts head-aware splits need, with
// the --rules file's rules first.
Result<ShardingRules> ViewBuilder::RulesFor(const Checkpoint& ckpt) const {
  ModelFacts facts;
  if (ckpt.sidecars.count("config.json")) facts = ParseModelFacts(ReadSidecar(*tree_.source(), ckpt, "config.json"));
  std::vector<std::string> names;
  if (auto weights = ModelWeights(ckpt, options_.consolidated); weights.ok())
    for (const auto& w : *weights) names.push_back(w.entry_name());
  ShardingRules rules = PresetRules(facts, names);
  if (options_.rules_json.empty()) return rules;
  return LoadRulesFile(options_.rules_json, std::move(rules));
}

// Builds mesh/<spec>/rank-NNNNN/ on first lookup. ENOENT, with a log line
// saying why, for a spec that is malformed or impossible for the checkpoint.
// REQUIRES: its checkpoint pinned.
FsResult<uint64_t> ViewBuilder::OpenMesh(FsNode* mesh_dir, const std::string& name) {
  ASSIGN_OR_RETURN(BuildTurn turn, TakeBuildTurn(mesh_dir->ckpt, mesh_dir, name));
  if (turn.built) return turn.built;
  const Checkpoint& ckpt = ckpts_.ServedAt(mesh_dir->ckpt)->ckpt;
  const std::string where = JoinRel(JoinRel(ckpt.dir, ViewDirName(ViewKind::kMesh)), name);
  auto fail = [&](const std::string& why) {
    options_.Log(where + ": " + why);
    return FsError(ENOENT, where + ": " + why);
  };
  // tp2.bf16: the spec's dtype view.
  const auto [spec_name, suffix] = SplitDTypeSuffix(name);
  std::optional<DTypeView> dtype;
  if (!suffix.empty()) {
    auto view = DTypeViewFor(ckpt, suffix);
    if (!view.ok()) return fail(view.status().message());
    dtype = std::move(*view);
  }
  auto spec = ParseMeshSpec(spec_name);
  if (!spec.ok()) return fail(spec.status().message());
  if (spec->name != spec_name)
    return fail("not the canonical name; open mesh/" + spec->name + (suffix.empty() ? "" : "." + suffix));
  auto rules = RulesFor(ckpt);
  if (!rules.ok()) return fail(rules.status().message());
  auto mesh = MeshView(ckpt, ckpt.files, *spec, *rules, options_.consolidated, dtype ? &*dtype : nullptr);
  if (!mesh.ok()) return fail(mesh.status().message());
  for (const std::string& note : mesh->notes) options_.Log(where + ": " + note);
  std::vector<std::vector<ViewFile>>& ranks = mesh->ranks;
  std::unique_lock lock(nodes_.mu());
  FsNode* dir = nodes_.AddVirtual(mesh_dir, name, /*is_dir=*/true, mesh_dir->ckpt);  // or the one built before an unload
  dir->is_spec = true;
  dir->built = true;
  for (uint64_t r = 0; r < ranks.size(); ++r) {
    char rank_name[32];
    std::snprintf(rank_name, sizeof rank_name, "rank-%05llu", static_cast<unsigned long long>(r));
    FsNode* rank_dir = nodes_.AddVirtual(dir, rank_name, /*is_dir=*/true, mesh_dir->ckpt);
    for (ViewFile& f : ranks[r]) nodes_.AddViewFile(rank_dir, std::move(f), mesh_dir->ckpt);
  }
  return dir->ino;
}

// Makes the files of tensors/ (`npy_dir`) on its first lookup or listing:
// names and sizes only, each file's layout being made again when it is
// opened (EnsureLayout). A tensor that cannot be presented leaves the
// folder empty, with a log line.
// REQUIRES: its checkpoint pinned.
FsError ViewBuilder::FillNpy(FsNode* npy_dir) {
  Served* served = ckpts_.ServedAt(npy_dir->ckpt);
  if (Status st = ckpts_.EnsureLoaded(npy_dir->ckpt); !st.ok()) return CheckpointSet::LoadFailure(st);
  if (served->removed) return FsError(ESTALE, JoinRel(served->dir, "") + ": replaced or removed; look it up again");
  std::lock_guard<std::mutex> load(served->load_mu);  // one fill at a time
  {
    std::shared_lock lock(nodes_.mu());
    if (!npy_dir->is_npy) return FsError();  // filled by another thread meanwhile
  }
  // Sizes first, nodes after: layouts made and freed between the nodes would
  // leave the heap fragmented (pages that neither hold much nor go back).
  const auto& tensors = served->ckpt.tensors;
  const std::string where = JoinRel(served->ckpt.dir, ViewDirName(ViewKind::kTensors));
  std::vector<uint64_t> sizes;  // kNoFile: a tensor with no file here
  sizes.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (std::string why = NameTooLong(t->fqn, EscapeFileName(t->fqn) + ".npy"); !why.empty()) {
      options_.Log(where + ": " + why + " (consolidated/ serves the tensor)");
      sizes.push_back(kNoFile);
      continue;
    }
    auto f = NpyFile(t);
    if (!f.ok()) {
      options_.Log(where + ": no files: " + f.status().message());
      sizes.clear();
      break;
    }
    sizes.push_back(f->layout->size());
  }
  std::unique_lock lock(nodes_.mu());
  npy_dir->is_npy = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == kNoFile) continue;
    FsNode* n = nodes_.AddVirtual(npy_dir, EscapeFileName(tensors[i]->fqn) + ".npy", /*is_dir=*/false, npy_dir->ckpt);
    n->size = sizes[i];
    n->npy = int(i);
  }
  return FsError();
}

// A tensors/ file's layout is made on its first open and kept while its
// checkpoint stays loaded; a mesh file's is made with its spec, which is
// built again when its checkpoint was unloaded since.
// REQUIRES: a handle of the checkpoint held.
FsError ViewBuilder::EnsureLayout(FsNode* n, const Served& served) {
  FsNode* spec = nullptr;
  {
    std::shared_lock lock(nodes_.mu());
    if (n->layout) return FsError();
    for (FsNode* up = n; !spec;) {
      FsNode* parent = nodes_.NodeLocked(up->parent);
      if (!parent || parent->kind != NodeKind::kVirtualDir) break;
      if (parent->is_spec || parent->is_dtype_view) spec = parent;
      up = parent;
    }
  }
  if (n->npy >= 0) {
    auto f = NpyFile(served.ckpt.tensors.at(n->npy));
    if (!f.ok()) return FsError::From(f.status());
    std::unique_lock lock(nodes_.mu());
    if (!n->layout) n->layout = std::move(f->layout);
    return FsError();
  }
  if (spec) {
    std::shared_ptr<FsNode> up = nodes_.Find(spec->parent);
    if (!up) return FsError(ESTALE, nodes_.PathOf(*n) + ": its checkpoint was replaced or removed");
    const auto view = ParseViewName(spec->name);
    auto built = spec->is_spec                             ? OpenMesh(up.get(), spec->name)
                 : view && view->kind == ViewKind::kMerged ? OpenMergedView(up.get(), spec->name)
                                                           : OpenDTypeView(up.get(), spec->name);
    if (!built.ok()) return built.status();
  }
  std::shared_lock lock(nodes_.mu());
  if (n->layout) return FsError();
  return FsError(EIO, nodes_.PathOf(*n) + ": its view was not made again when " + JoinRel(served.dir, "") +
                          " was loaded again (see the log)");
}

bool ViewBuilder::ViewsAttached(const FsNode& dir) const {
  std::shared_lock lock(nodes_.mu());
  return dir.ckpt >= 0;
}

FsError ViewBuilder::EnsureFilled(FsNode* dir) {
  bool unfilled;
  {
    std::shared_lock lock(nodes_.mu());
    unfilled = dir->is_npy;
  }
  return unfilled ? FillNpy(dir) : FsError();
}

FsResult<uint64_t> ViewBuilder::Child(FsNode* p, const std::string& name) {
  if (FsError e = EnsureFilled(p); !e.ok()) return e;
  uint64_t child = 0;
  bool built = true;
  {
    std::shared_lock lock(nodes_.mu());
    auto it = p->children.find(name);
    if (it != p->children.end()) child = it->second;
    if (const FsNode* c = child ? nodes_.NodeLocked(child) : nullptr; c && (c->is_spec || c->is_dtype_view))
      built = c->built;
  }
  if ((!child || !built) && p->is_mesh) {
    ASSIGN_OR_RETURN(child, OpenMesh(p, name));
  }
  // A view opened by name, built on first lookup: consolidated.<dtype>/,
  // merged/ and merged.<dtype>/.
  const auto view = p->kind == NodeKind::kSourceDir ? ParseViewName(name) : std::nullopt;
  const bool dtype_view = view && view->kind == ViewKind::kConsolidated && !view->dtype_suffix.empty();
  if ((!child || !built) && dtype_view && ViewsAttached(*p)) {
    ASSIGN_OR_RETURN(child, OpenDTypeView(p, name));
  }
  if ((!child || !built) && view && view->kind == ViewKind::kMerged && ViewsAttached(*p)) {
    ASSIGN_OR_RETURN(child, OpenMergedView(p, name));
  }
  return child;
}

}  // namespace ckptfs
