#include "core/hf_folder.h"
#include "core/item_views.h"
#include "core/mesh_view.h"
#include "core/views.h"

#include <gtest/gtest.h>

#include <ctime>
#include <set>
#include <nlohmann/json.hpp>

#include "core/planner.h"
#include "core/safetensors.h"

namespace ckptfs {
namespace {

std::shared_ptr<const TensorMeta> Whole(const std::string& fqn, DType dtype, Shape shape) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = fqn;
  t->dtype = dtype;
  t->shape = shape;
  Chunk c;
  c.set_box(Box::Whole(shape));
  c.set_dtype(dtype);
  c.set_bytes({0, 0, t->nbytes()});
  t->chunks.push_back(c);
  return t;
}

Checkpoint ThreeTensors() {
  Checkpoint ck;
  ck.tensors = {Whole("a", DType::kBF16, {10}), Whole("b", DType::kF32, {10}), Whole("c", DType::kU8, {10})};
  return ck;
}

// Header of a view file, parsed back.
SafetensorsHeader HeaderOf(const ViewFile& f) {
  auto plan = Plan(*f.layout, 0, 8);
  EXPECT_TRUE(plan.ok());
  const Segment& lit = f.layout->segments().at(0);
  uint64_t n = *DecodeHeaderLength(lit.literal->substr(0, 8), f.layout->size());
  return *ParseSafetensorsHeader(lit.literal->substr(8, n), n);
}

TEST(ConsolidatedView, SmallCheckpointIsOneModelSafetensors) {
  auto files = ConsolidatedView(ThreeTensors(), {}, {});
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 1u);
  EXPECT_EQ((*files)[0].name, "model.safetensors");
  auto h = HeaderOf((*files)[0]);
  EXPECT_EQ(h.metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  // Larger dtypes first: F32, BF16, U8.
  ASSERT_EQ(h.entries.size(), 3u);
  EXPECT_EQ(h.entries[0].name, "b");
  EXPECT_EQ(h.entries[1].name, "a");
  EXPECT_EQ(h.entries[2].name, "c");
  EXPECT_EQ((*files)[0].layout->size(), 8 + h.header_len + 40 + 20 + 10);
  EXPECT_EQ((8 + h.header_len) % 4096, 0u);  // data starts on a page boundary
}

TEST(ConsolidatedView, SplitsBySizeWithAnIndex) {
  ConsolidatedOptions o;
  o.max_file_bytes = 30;  // a: 20 B, b: 40 B, c: 10 B -> [a], [b], [c]
  auto files = ConsolidatedView(ThreeTensors(), {}, o);
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 4u);
  EXPECT_EQ((*files)[0].name, "model-00001-of-00003.safetensors");
  EXPECT_EQ((*files)[2].name, "model-00003-of-00003.safetensors");
  EXPECT_EQ((*files)[3].name, "model.safetensors.index.json");
  const std::string& text = *(*files)[3].layout->segments()[0].literal;
  auto j = nlohmann::json::parse(text);
  EXPECT_EQ(j["metadata"]["total_size"], 70);
  EXPECT_EQ(j["weight_map"]["b"], "model-00002-of-00003.safetensors");
}

TEST(ConsolidatedView, FollowsTheCheckpointsFileMapping) {
  Checkpoint ck = ThreeTensors();
  ck.file_index = {{"a", 2}, {"b", 1}, {"c", 2}};
  auto files = ConsolidatedView(ck, {}, {});
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 3u);
  EXPECT_EQ(HeaderOf((*files)[0]).entries.size(), 1u);
  EXPECT_EQ(HeaderOf((*files)[1]).entries.size(), 2u);
}

TEST(ConsolidatedView, MappingWithoutATensorIsAnError) {
  Checkpoint ck = ThreeTensors();
  ck.file_index = {{"a", 1}, {"b", 1}};
  auto files = ConsolidatedView(ck, {}, {});
  ASSERT_FALSE(files.ok());
  EXPECT_NE(files.status().message().find("'c'"), std::string::npos);
}

TEST(ConsolidatedView, IncompleteCheckpointMarksEveryWeightFile) {
  Checkpoint ck = ThreeTensors();
  ck.incomplete = "shard-00002: header is not valid JSON";
  auto files = ConsolidatedView(ck, {}, {});
  ASSERT_TRUE(files.ok());
  for (const auto& f : *files) EXPECT_EQ(f.problem, "checkpoint incomplete: " + ck.incomplete);
}

TEST(ConsolidatedView, SidecarsPassThrough) {
  Checkpoint ck = ThreeTensors();
  SourceFile cfg;
  cfg.path = "config.json";
  cfg.size = 123;
  ck.sidecars["config.json"] = 0;
  auto files = ConsolidatedView(ck, {cfg}, {});
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[1].name, "config.json");
  EXPECT_EQ((*files)[1].layout->size(), 123u);
  EXPECT_EQ((*files)[1].layout->segments()[0].kind, Segment::Kind::kSource);
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

TEST(TensorsView, FileNamesEscapeReversibly) {
  for (std::string fqn : {"model.layers.0.w", "optim/state/exp_avg", "100%", "", ".", "..", "a%2Fb"}) {
    std::string name = EscapeFileName(fqn);
    EXPECT_EQ(name.find('/'), std::string::npos) << fqn;
    EXPECT_NE(name, ".");
    EXPECT_NE(name, "..");
    EXPECT_FALSE(name.empty());
    EXPECT_EQ(UnescapeFileName(name), fqn) << name;
  }
}

TEST(TensorsView, NpyHeaderAlignsDataTo64Bytes) {
  for (Shape shape : {Shape{}, Shape{3}, Shape{2, 3, 4}, Shape{0, 7}}) {
    std::string h = NpyHeader("<f4", shape);
    EXPECT_EQ(h.size() % 64, 0u);
    EXPECT_EQ(h.substr(0, 6), "\x93NUMPY");
    EXPECT_EQ(h.back(), '\n');
    EXPECT_EQ(size_t(uint8_t(h[8])) | size_t(uint8_t(h[9])) << 8, h.size() - 10);
  }
  EXPECT_NE(NpyHeader("<f4", {3}).find("'shape': (3,)"), std::string::npos);
  EXPECT_NE(NpyHeader("|b1", {}).find("'shape': ()"), std::string::npos);
}

TEST(TensorsView, Bf16IsPresentedAsFloat32) {
  Checkpoint ck;
  ck.tensors = {Whole("w", DType::kBF16, {3, 2})};
  auto files = TensorsView(ck);
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->size(), 1u);
  EXPECT_EQ((*files)[0].name, "w.npy");
  const Layout& l = *(*files)[0].layout;
  EXPECT_NE(l.segments()[0].literal->find("'<f4'"), std::string::npos);
  EXPECT_EQ(l.size(), l.segments()[0].length + 6 * 4);
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

std::shared_ptr<const TensorMeta> WithPath(const std::string& fqn, std::vector<std::string> path) {
  auto t = std::const_pointer_cast<TensorMeta>(Whole(fqn, DType::kF32, {2}));
  t->path = std::move(path);
  return t;
}

std::vector<std::string> WeightNames(const Checkpoint& ck, ConsolidatedOptions o = {}) {
  std::vector<std::string> out;
  auto w = ModelWeights(ck, o);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  if (w.ok())
    for (const auto& s : *w) out.push_back(s.entry_name());
  return out;
}

TEST(ModelWeights, HfNamedCheckpointKeepsItsNames) {
  Checkpoint ck;
  ck.tensors = {Whole("model.embed_tokens.weight", DType::kF32, {2}), Whole("lm_head.weight", DType::kF32, {2})};
  EXPECT_EQ(WeightNames(ck), (std::vector<std::string>{"model.embed_tokens.weight", "lm_head.weight"}));
}

TEST(ModelWeights, WrapperPrefixIsRemovedAndTrainingStateDropped) {
  Checkpoint ck;  // DCP of {"model": hf.state_dict(), "optim": ..., "lr_scheduler": ...}
  ck.tensors = {WithPath("model.model.embed_tokens.weight", {"model", "model.embed_tokens.weight"}),
                WithPath("model.lm_head.weight", {"model", "lm_head.weight"}),
                WithPath("optim.state.model.lm_head.weight.exp_avg", {"optim", "state", "model.lm_head.weight", "exp_avg"}),
                WithPath("lr_scheduler.x", {"lr_scheduler", "x"})};
  EXPECT_EQ(WeightNames(ck), (std::vector<std::string>{"model.embed_tokens.weight", "lm_head.weight"}));
}

TEST(ModelWeights, FlatCheckpointDropsTrainingStateKeys) {
  Checkpoint ck;
  ck.tensors = {Whole("layers.0.w", DType::kF32, {2}), Whole("optim.state.layers.0.w.exp_avg", DType::kF32, {2}),
                Whole("rng_state", DType::kF32, {2})};
  EXPECT_EQ(WeightNames(ck), (std::vector<std::string>{"layers.0.w"}));
}

TEST(ModelWeights, NamesFileReplacesTheRule) {
  Checkpoint ck;
  ck.tensors = {WithPath("model.a", {"model", "a"}), WithPath("model.b", {"model", "b"})};
  ConsolidatedOptions o;
  o.names = {{"model.b", "renamed.b"}};
  EXPECT_EQ(WeightNames(ck, o), (std::vector<std::string>{"renamed.b"}));
}

TEST(ModelWeights, TwoTensorsWithOneNameIsAnError) {
  Checkpoint ck;
  ck.tensors = {WithPath("model.a", {"model", "a"}), WithPath("model.a2", {"model", "a"})};
  auto w = ModelWeights(ck, {});
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("would both be named 'a'"), std::string::npos);
}

}  // namespace
}  // namespace ckptfs

namespace ckptfs {
namespace {

// Row-major flat indices of box `b` of a tensor of `shape`, in order.
std::vector<uint64_t> FlatIndices(const Shape& shape, const Box& b) {
  std::vector<uint64_t> out;
  std::vector<uint64_t> at(b.rank(), 0);
  for (uint64_t n = 0; n < b.numel(); ++n) {
    uint64_t flat = 0;
    for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + b.offsets[d] + at[d];
    out.push_back(flat);
    for (size_t d = b.rank(); d-- > 0;)
      if (++at[d] < b.lengths[d]) break;
      else at[d] = 0;
  }
  return out;
}

// The joined entry's bytes must be the row-major bytes of the parts
// concatenated along join_dim (what torch.cat gives), for every join dim.
TEST(TensorSlice, ByteOrderIsTheRowMajorOrderOfTheJoinedTensor) {
  auto t = Whole("experts.gate_up_proj", DType::kF32, {3, 8, 4});
  for (int dim = 0; dim < 3; ++dim) {
    Box a = Box::Whole(t->shape), b = Box::Whole(t->shape);
    a.offsets[dim] = 0;
    a.lengths[dim] = 1;
    b.offsets[dim] = 2;
    b.lengths[dim] = 1;
    TensorSlice s{t, a, "", {a, b}, dim};
    Shape joined = t->shape;
    joined[dim] = 2;
    EXPECT_EQ(s.shape(), joined);
    // Independent model: walk the joined tensor in C order, map each element
    // to its source element.
    std::vector<uint64_t> want;
    Box all = Box::Whole(joined);
    std::vector<uint64_t> at(3, 0);
    for (uint64_t n = 0; n < all.numel(); ++n) {
      std::vector<uint64_t> src = at;
      src[dim] = at[dim] == 0 ? 0 : 2;
      want.push_back((src[0] * 8 + src[1]) * 4 + src[2]);
      for (size_t d = 3; d-- > 0;)
        if (++at[d] < joined[d]) break;
        else at[d] = 0;
    }
    std::vector<uint64_t> got;
    for (const Box& piece : s.ByteOrder())
      for (uint64_t i : FlatIndices(t->shape, piece)) got.push_back(i);
    EXPECT_EQ(got, want) << "join dim " << dim;
    EXPECT_EQ(s.nbytes(), want.size() * 4);
  }
}

std::string Literal(const ViewFile& f) { return *f.layout->segments().at(0).literal; }

const ViewFile* Named(const std::vector<ViewFile>& files, const std::string& name) {
  for (const auto& f : files)
    if (f.name == name) return &f;
  return nullptr;
}

TEST(MeshView, LayoutJsonDescribesFusedSlicesByParts) {
  Checkpoint ck;
  ck.tensors = {Whole("model.layers.0.self_attn.qkv_proj.weight", DType::kF32, {16, 3})};
  ModelFacts facts;
  facts.model_type = "phi3";
  facts.num_heads = 4;
  facts.num_kv_heads = 2;
  auto mesh = MeshView(ck, {}, *ParseMeshSpec("tp2"), PresetRules(facts, {}), {});
  ASSERT_TRUE(mesh.ok()) << mesh.status().message();
  ASSERT_EQ(mesh->ranks.size(), 2u);
  EXPECT_TRUE(mesh->notes.empty());
  auto lj = nlohmann::json::parse(Literal(*Named(mesh->ranks[1], "layout.json")));
  auto e = lj["tensors"]["model.layers.0.self_attn.qkv_proj.weight"];
  EXPECT_EQ(e["lengths"], (std::vector<uint64_t>{8, 3}));
  EXPECT_EQ(e["join_dim"], 0);
  ASSERT_EQ(e["parts"].size(), 3u);
  EXPECT_EQ(e["parts"][1]["offsets"], (std::vector<uint64_t>{10, 0}));
  EXPECT_EQ(e["parts"][1]["lengths"], (std::vector<uint64_t>{2, 3}));
  auto h = HeaderOf(*Named(mesh->ranks[1], "model.safetensors"));
  EXPECT_EQ(h.entries.at(0).shape, (Shape{8, 3}));
}

TEST(MeshView, UnknownModelSaysTheSpecSplitNothing) {
  Checkpoint ck;
  ck.tensors = {Whole("encoder.layer.0.attention.self.query.weight", DType::kF32, {4, 12})};
  ModelFacts facts;
  facts.model_type = "bert";
  auto mesh = MeshView(ck, {}, *ParseMeshSpec("tp2"), PresetRules(facts, {}), {});
  ASSERT_TRUE(mesh.ok());
  ASSERT_EQ(mesh->notes.size(), 1u);
  EXPECT_NE(mesh->notes[0].find("tp2 split nothing"), std::string::npos) << mesh->notes[0];
  EXPECT_NE(mesh->notes[0].find("bert"), std::string::npos);
  auto lj = nlohmann::json::parse(Literal(*Named(mesh->ranks[0], "layout.json")));
  EXPECT_EQ(lj["notes"][0], mesh->notes[0]);
  // tp1 splits nothing by definition: no note.
  EXPECT_TRUE(MeshView(ck, {}, *ParseMeshSpec("tp1"), PresetRules(facts, {}), {})->notes.empty());
}

// Without config.json fused experts stay whole over tp: said once in the
// notes however many layers hold them, while the rest is still cut.
TEST(MeshView, NamesOnlyFusedExpertsAreHeldWholeWithOneNote) {
  Checkpoint ck;
  for (int layer = 0; layer < 2; ++layer) {
    const std::string e = "model.layers." + std::to_string(layer) + ".feed_forward.experts.";
    ck.tensors.push_back(Whole(e + "gate_up_proj", DType::kF32, {2, 4, 6}));
    ck.tensors.push_back(Whole(e + "down_proj", DType::kF32, {2, 3, 4}));
  }
  ck.tensors.push_back(Whole("model.embed_tokens.weight", DType::kF32, {8, 4}));
  std::vector<std::string> names;
  for (const auto& t : ck.tensors) names.push_back(t->fqn);
  auto mesh = MeshView(ck, {}, *ParseMeshSpec("tp2"), PresetRules(ModelFacts{}, names), {});
  ASSERT_TRUE(mesh.ok()) << mesh.status().message();
  ASSERT_EQ(mesh->notes.size(), 1u);
  EXPECT_NE(mesh->notes[0].find("held whole on every tp rank"), std::string::npos) << mesh->notes[0];
  auto lj = nlohmann::json::parse(Literal(*Named(mesh->ranks[1], "layout.json")));
  EXPECT_EQ(lj["notes"][0], mesh->notes[0]);
  const auto& down = lj["tensors"]["model.layers.1.feed_forward.experts.down_proj"];
  EXPECT_EQ(down["lengths"], (std::vector<uint64_t>{2, 3, 4}));
  EXPECT_EQ(lj["tensors"]["model.embed_tokens.weight"]["lengths"], (std::vector<uint64_t>{4, 4}));
}

TEST(MeshView, ImpossibleSpecBuildsNothing) {
  Checkpoint ck;
  ck.tensors = {Whole("model.layers.0.self_attn.q_proj.weight", DType::kF32, {16, 3})};
  ModelFacts facts;
  facts.model_type = "llama";
  facts.num_heads = facts.num_kv_heads = 4;
  auto mesh = MeshView(ck, {}, *ParseMeshSpec("tp3"), PresetRules(facts, {}), {});
  ASSERT_FALSE(mesh.ok());
  EXPECT_NE(mesh.status().message().find("tp3 does not divide num_attention_heads 4"), std::string::npos);
}

// Regression: ordered_json's linear key search made index.json and
// layout.json and every safetensors header quadratic (29 s for 100k
// tensors, 290 s for this test). Linear, it takes about 5 s of CPU; CPU
// time, not wall time, so a loaded machine does not fail it.
TEST(MeshView, BuildTimeIsLinearInTensors) {
  Checkpoint ck;
  for (int i = 0; i < 100000; ++i)
    ck.tensors.push_back(Whole("model.layers." + std::to_string(i) + ".mlp.up_proj.weight", DType::kF32, {4, 2}));
  ConsolidatedOptions o;
  o.max_file_bytes = 1 << 20;  // many files: index.json holds all 100k names
  const std::clock_t start = std::clock();
  auto files = ConsolidatedView(ck, {}, o);
  ASSERT_TRUE(files.ok());
  auto mesh = MeshView(ck, {}, *ParseMeshSpec("tp2"), PresetRules(ModelFacts{"llama", 0, 0}, {}), o);
  ASSERT_TRUE(mesh.ok()) << mesh.status().message();
  const double cpu_seconds = double(std::clock() - start) / CLOCKS_PER_SEC;
  EXPECT_LT(cpu_seconds, 30.0);
}

std::shared_ptr<const TensorMeta> Broken(const std::string& fqn) {
  auto t = std::const_pointer_cast<TensorMeta>(Whole(fqn, DType::kF32, {4}));
  t->chunks[0].set_unavailable("shard.safetensors is truncated");
  return t;
}

// safetensors maps the file: a file none of whose tensors can be read is
// refused at open (the problem), one with some readable tensors is served.
TEST(ConsolidatedView, FileWithNoServableTensorHasAProblem) {
  Checkpoint ck;
  ck.tensors = {Broken("a"), Broken("b")};
  auto files = ConsolidatedView(ck, {}, {});
  ASSERT_TRUE(files.ok());
  EXPECT_NE((*files)[0].problem.find("none of its 2 tensors can be served"), std::string::npos) << (*files)[0].problem;
  EXPECT_NE((*files)[0].problem.find("truncated"), std::string::npos);
  ck.tensors.push_back(Whole("c", DType::kF32, {4}));
  files = ConsolidatedView(ck, {}, {});
  EXPECT_EQ((*files)[0].problem, "");
}

TEST(ConsolidatedView, SidecarFoldersKeepTheirPaths) {
  Checkpoint ck = ThreeTensors();
  SourceFile pooling;
  pooling.path = "st/1_Pooling/config.json";
  pooling.size = 9;
  ck.sidecars["1_Pooling/config.json"] = 0;
  auto files = ConsolidatedView(ck, {pooling}, {});
  ASSERT_TRUE(files.ok());
  const ViewFile* f = Named(*files, "1_Pooling/config.json");
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->layout->size(), 9u);
}

TEST(DTypeView, ConfigNamesTheServedDTypeInEveryConfigThatHasOne) {
  auto text = ConfigForDType(R"({"model_type": "llava", "torch_dtype": "float32",
                                 "text_config": {"torch_dtype": "float32", "hidden_size": 8},
                                 "vision_config": {"hidden_size": 4}})",
                             DType::kBF16);
  ASSERT_TRUE(text.ok());
  auto j = nlohmann::json::parse(*text);
  EXPECT_EQ(j["dtype"], "bfloat16");
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_EQ(j["text_config"]["torch_dtype"], "bfloat16");
  EXPECT_FALSE(j["vision_config"].contains("torch_dtype"));  // none to rename
  EXPECT_FALSE(ConfigForDType("[1, 2]", DType::kF16).ok());
}

TEST(DTypeView, CastsFloatsNotKeptNotAlreadyInTheDType) {
  Checkpoint ck;
  ck.tensors = {Whole("a.weight", DType::kF32, {2}), Whole("b.router.bias", DType::kF32, {2}),
                Whole("c.ids", DType::kI64, {2}), Whole("d.weight", DType::kBF16, {2}),
                Whole("e.packed", DType::kF4, {2})};
  auto slices = ModelWeights(ck, {});
  ASSERT_TRUE(slices.ok());
  ASSERT_TRUE(CastSlices(*slices, {DType::kBF16, "router", ""}).ok());
  std::map<std::string, bool> cast;
  for (const TensorSlice& sl : *slices) cast[sl.entry_name()] = sl.cast.has_value();
  EXPECT_EQ(cast, (std::map<std::string, bool>{
                      {"a.weight", true}, {"b.router.bias", false}, {"c.ids", false}, {"d.weight", false},
                      {"e.packed", false}}));
  EXPECT_EQ(CastSlices(*slices, {DType::kBF16, "(", ""}).code(), Status::Code::kInvalidArgument);
}

// The view directory names docs/SEMANTICS.md ("Virtual namespace") lists.
TEST(ViewKinds, EveryDocumentedViewNameIsRecognised) {
  struct Case {
    const char* name;
    ViewKind kind;
    const char* suffix;
  };
  for (const Case& c : {Case{"consolidated", ViewKind::kConsolidated, ""},
                        Case{"consolidated.bf16", ViewKind::kConsolidated, "bf16"},
                        Case{"consolidated.fp16", ViewKind::kConsolidated, "fp16"},
                        Case{"consolidated.fp32", ViewKind::kConsolidated, "fp32"},
                        Case{"merged", ViewKind::kMerged, ""},
                        Case{"merged.bf16", ViewKind::kMerged, "bf16"},
                        Case{"mesh", ViewKind::kMesh, ""},
                        Case{"tensors", ViewKind::kTensors, ""},
                        Case{"bytes", ViewKind::kBytes, ""}}) {
    auto v = ParseViewName(c.name);
    ASSERT_TRUE(v.has_value()) << c.name;
    EXPECT_EQ(v->kind, c.kind) << c.name;
    EXPECT_EQ(v->dtype_suffix, c.suffix) << c.name;
  }
  // Any other suffix is still a request for the dtype view, refused by the
  // builder with the reason in the log (docs/SEMANTICS.md).
  EXPECT_EQ(ParseViewName("consolidated.int8")->dtype_suffix, "int8");
}

TEST(ViewKinds, NearMissesAreNoViews) {
  for (const char* name : {"consolidatedx", "consolidated.", "merged.", "mergedx", "mesh.bf16", "tensors.fp16",
                           "bytes.bf16", "Consolidated", "consolidate", "tensor", ".consolidated", "", "."})
    EXPECT_FALSE(ParseViewName(name).has_value()) << "'" << name << "'";
}

TEST(ViewKinds, NamesAreUniqueAndRoundTrip) {
  std::set<std::string> names;
  for (const ViewKindInfo& k : kViewKinds) {
    EXPECT_TRUE(names.insert(k.name).second) << k.name;
    EXPECT_EQ(std::string(ViewDirName(k.kind)), k.name);
    EXPECT_EQ(ParseViewName(k.name)->kind, k.kind);
  }
  // docs/SEMANTICS.md: five view directories.
  EXPECT_EQ(names, (std::set<std::string>{"consolidated", "merged", "mesh", "tensors", "bytes"}));
}

TEST(ViewKinds, VerifyReadsConsolidatedAndTensors) {
  // docs/CLI.md, verify: "reading every byte of consolidated/ and tensors/".
  std::set<std::string> verified;
  for (const ViewKindInfo& k : kViewKinds)
    if (k.verified) verified.insert(k.name);
  EXPECT_EQ(verified, (std::set<std::string>{"consolidated", "tensors"}));
}

}  // namespace
}  // namespace ckptfs
