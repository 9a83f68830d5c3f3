#include "core/views.h"

#include <gtest/gtest.h>
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
  c.shard.box = Box::Whole(shape);
  c.basic.dtype = dtype;
  c.bytes = {0, 0, t->nbytes()};
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
  for (const auto& f : *files) EXPECT_EQ(f.problem, ck.incomplete);
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
