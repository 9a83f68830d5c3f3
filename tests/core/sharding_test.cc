#include "core/sharding.h"

#include <gtest/gtest.h>

#include <random>

#include "core/coverage.h"

namespace ckptfs {
namespace {

TEST(MeshSpec, ParsesAndCanonicalises) {
  auto s = ParseMeshSpec("pp2-tp4");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->name, "tp4-pp2");
  EXPECT_EQ(s->world(), 8u);
  EXPECT_EQ(ParseMeshSpec("tp2-ep4")->ep, 4u);
}

TEST(MeshSpec, RejectsWithReasons) {
  EXPECT_NE(ParseMeshSpec("dp2").status().message().find("unknown axis 'dp'"), std::string::npos);
  EXPECT_NE(ParseMeshSpec("tp2-tp2").status().message().find("given twice"), std::string::npos);
  EXPECT_NE(ParseMeshSpec("tp0").status().message().find("at least 1"), std::string::npos);
  EXPECT_NE(ParseMeshSpec("tp").status().message().find("needs a size"), std::string::npos);
  EXPECT_NE(ParseMeshSpec("tp2x").status().message().find("needs a size"), std::string::npos);
  EXPECT_FALSE(ParseMeshSpec("").ok());
}

TEST(MeshSpec, RankOrderIsTpFastestThenEpThenPp) {
  auto s = *ParseMeshSpec("tp2-pp3-ep2");
  MeshCoord c = CoordOf(s, 7);  // 7 = (pp 1 * ep 2 + ep 1) * tp 2 + tp 1
  EXPECT_EQ(c.tp, 1u);
  EXPECT_EQ(c.ep, 1u);
  EXPECT_EQ(c.pp, 1u);
}

TEST(ChunkRange, FollowsTorchChunk) {
  // torch.arange(7).chunk(3) -> sizes 3, 3, 1; torch.arange(4).chunk(3) -> 2, 2 (and an empty third)
  EXPECT_EQ(ChunkRange(7, 3, 2), (std::pair<uint64_t, uint64_t>{6, 7}));
  EXPECT_EQ(ChunkRange(4, 3, 2), (std::pair<uint64_t, uint64_t>{4, 4}));
  EXPECT_EQ(ChunkRange(256, 3, 1), (std::pair<uint64_t, uint64_t>{86, 172}));
}

TensorMeta Tensor(const std::string& fqn, Shape shape) {
  TensorMeta t;
  t.fqn = fqn;
  t.dtype = DType::kBF16;
  t.shape = shape;
  return t;
}

// Each rank's boxes of `t` (nullopt where it holds none), or the error.
Result<std::vector<std::optional<RankSlice>>> Slices(const TensorMeta& t, const MeshSpec& spec,
                                                     const ShardingRules& rules, ModelCounts counts) {
  ASSIGN_OR_RETURN(TensorPlacement p, PlaceTensor(t.shape, t.fqn, spec, rules, counts));
  std::vector<std::optional<RankSlice>> out;
  for (uint64_t r = 0; r < spec.world(); ++r) out.push_back(SliceOf(p, spec, r));
  return out;
}

ModelFacts Facts(const std::string& type, uint64_t heads, uint64_t kv_heads) {
  ModelFacts f;
  f.model_type = type;
  f.num_heads = heads;
  f.num_kv_heads = kv_heads;
  return f;
}

Box Rows(uint64_t begin, uint64_t end, uint64_t cols) { return Box{{begin, 0}, {end - begin, cols}}; }

// Property: over all ranks of a spec, split tensors are tiled exactly once
// and replicated tensors appear whole on every rank of their stage/group.
TEST(PlaceTensor, RanksTileSplitTensorsAndReplicateTheRest) {
  std::mt19937_64 rng(7);
  const char* names[] = {"model.layers.{L}.self_attn.q_proj.weight", "model.layers.{L}.self_attn.o_proj.weight",
                         "model.layers.{L}.mlp.down_proj.weight", "model.layers.{L}.input_layernorm.weight",
                         "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"};
  for (int iter = 0; iter < 200; ++iter) {
    uint64_t layers = 1 + rng() % 5;
    std::vector<TensorMeta> tensors;
    for (const char* n : names) {
      std::string name = n;
      bool per_layer = name.find("{L}") != std::string::npos;
      bool vector = name.find("norm") != std::string::npos;
      for (uint64_t l = 0; l < (per_layer ? layers : 1); ++l) {
        std::string fqn = name;
        if (per_layer) fqn.replace(fqn.find("{L}"), 3, std::to_string(l));
        Shape shape = vector ? Shape{1 + rng() % 9} : Shape{1 + rng() % 13, 1 + rng() % 11};
        tensors.push_back(Tensor(fqn, shape));
      }
    }
    std::vector<std::string> fqns;
    for (const auto& t : tensors) fqns.push_back(t.fqn);
    ShardingRules rules = PresetRules(Facts("llama", 0, 0), fqns);  // no head counts: element splits
    MeshSpec spec;
    spec.tp = 1 + rng() % 4;
    spec.pp = 1 + rng() % std::min<uint64_t>(layers, 3);
    for (const auto& t : tensors) {
      auto slices = Slices(t, spec, rules, {layers, 0});
      if (!slices.ok()) {
        EXPECT_NE(slices.status().message().find("larger than dim"), std::string::npos) << slices.status().message();
        continue;
      }
      TensorMeta covered = t;  // boxes of one pipeline stage, as chunks
      std::vector<Box> boxes;
      for (const auto& s : *slices)
        if (s) {
          ASSERT_EQ(s->boxes.size(), 1u) << t.fqn;
          boxes.push_back(s->boxes[0]);
        }
      bool replicated = t.fqn.find("norm") != std::string::npos;
      ASSERT_EQ(boxes.size(), spec.tp) << t.fqn << " lives on exactly one stage";
      if (replicated) {
        for (const Box& b : boxes) EXPECT_EQ(b, Box::Whole(t.shape)) << t.fqn;
        continue;
      }
      for (const Box& b : boxes) {
        Chunk c;
        c.set_box(b);
        c.set_dtype(t.dtype);
        c.set_bytes({0, 0, *ByteSize(t.dtype, b.numel())});
        if (b.numel() > 0) covered.chunks.push_back(c);
      }
      EXPECT_TRUE(CheckCoverage(covered).empty()) << t.fqn << " tp" << spec.tp;
    }
  }
}

// vLLM's QKVParallelLinear at tp4 on 4 query / 2 KV heads of size 4: one
// query head per rank; KV head 0 on ranks 0-1, head 1 on ranks 2-3.
TEST(PlaceTensor, KvHeadsAreReplicatedWhenTpExceedsThem) {
  auto rules = PresetRules(Facts("llama", 4, 2), {});
  auto spec = *ParseMeshSpec("tp4");
  auto k = Slices(Tensor("model.layers.0.self_attn.k_proj.weight", {8, 16}), spec, rules, {1, 0});
  ASSERT_TRUE(k.ok()) << k.status().message();
  for (uint64_t r = 0; r < 4; ++r) EXPECT_EQ((*k)[r]->boxes, std::vector<Box>{Rows(4 * (r / 2), 4 * (r / 2) + 4, 16)});
  auto kb = Slices(Tensor("model.layers.0.self_attn.v_proj.bias", {8}), spec, rules, {1, 0});
  EXPECT_EQ((*kb)[3]->boxes, (std::vector<Box>{Box{{4}, {4}}}));
  auto q = Slices(Tensor("model.layers.0.self_attn.q_proj.weight", {16, 16}), spec, rules, {1, 0});
  for (uint64_t r = 0; r < 4; ++r) EXPECT_EQ((*q)[r]->boxes, std::vector<Box>{Rows(4 * r, 4 * r + 4, 16)});
}

TEST(PlaceTensor, RefusesHeadSplitsTheFrameworksRefuse) {
  auto why = [](uint64_t heads, uint64_t kv, const char* spec, const char* fqn, Shape shape) {
    auto s = Slices(Tensor(fqn, shape), *ParseMeshSpec(spec), PresetRules(Facts("llama", heads, kv), {}), {1, 0});
    return s.ok() ? std::string("ok") : s.status().message();
  };
  const char* q = "model.layers.0.self_attn.q_proj.weight";
  const char* k = "model.layers.0.self_attn.k_proj.weight";
  EXPECT_NE(why(4, 2, "tp3", q, {16, 16}).find("tp3 does not divide num_attention_heads 4"), std::string::npos);
  EXPECT_NE(why(4, 2, "tp8", q, {16, 16}).find("tp8 is larger than num_attention_heads 4"), std::string::npos);
  EXPECT_NE(why(12, 4, "tp6", k, {16, 16}).find("tp6 is not a multiple of num_key_value_heads 4"),
            std::string::npos);
  EXPECT_NE(why(4, 2, "tp2", q, {15, 16}).find("not a whole number of heads"), std::string::npos);
  EXPECT_EQ(why(12, 4, "tp8", k, {16, 16}), "ok");
  // Without head counts (no config.json) q_proj splits like any column.
  EXPECT_EQ(why(0, 0, "tp3", q, {16, 16}), "ok");
}

// Phi-3: qkv_proj rows are [q (4 heads); k (2); v (2)] of head size 2.
TEST(PlaceTensor, FusedQkvIsSplitPerPartAndJoined) {
  auto rules = PresetRules(Facts("phi3", 4, 2), {});
  auto tp2 = Slices(Tensor("model.layers.0.self_attn.qkv_proj.weight", {16, 3}), *ParseMeshSpec("tp2"), rules, {1, 0});
  ASSERT_TRUE(tp2.ok()) << tp2.status().message();
  EXPECT_EQ((*tp2)[1]->boxes, (std::vector<Box>{Rows(4, 8, 3), Rows(10, 12, 3), Rows(14, 16, 3)}));
  EXPECT_EQ((*tp2)[1]->join_dim, 0);
  EXPECT_EQ((*tp2)[1]->shape(), (Shape{8, 3}));
  auto tp4 = Slices(Tensor("model.layers.0.self_attn.qkv_proj.weight", {16, 3}), *ParseMeshSpec("tp4"), rules, {1, 0});
  EXPECT_EQ((*tp4)[2]->boxes, (std::vector<Box>{Rows(4, 6, 3), Rows(10, 12, 3), Rows(14, 16, 3)}));
  auto gu = Slices(Tensor("model.layers.0.mlp.gate_up_proj.weight", {12, 3}), *ParseMeshSpec("tp2"), rules, {1, 0});
  EXPECT_EQ((*gu)[0]->boxes, (std::vector<Box>{Rows(0, 3, 3), Rows(6, 9, 3)}));
  EXPECT_EQ((*gu)[1]->boxes, (std::vector<Box>{Rows(3, 6, 3), Rows(9, 12, 3)}));
  auto no_heads = Slices(Tensor("model.layers.0.self_attn.qkv_proj.weight", {16, 3}), *ParseMeshSpec("tp2"),
                         PresetRules(Facts("phi3", 0, 0), {}), {1, 0});
  EXPECT_NE(no_heads.status().message().find("num_attention_heads"), std::string::npos);
}

// transformers 5 MoE: experts.gate_up_proj [E, 2I, H], experts.down_proj
// [E, H, I]. ep takes dim 0 in blocks; tp splits gate and up (dim 1) and
// down's input (dim 2).
TEST(PlaceTensor, FusedExpertsSliceDim0OverEpAndSplitWithinExperts) {
  auto rules = PresetRules(Facts("mixtral", 4, 2), {});
  auto spec = *ParseMeshSpec("tp2-ep2");
  TensorMeta gu = Tensor("model.layers.0.mlp.experts.gate_up_proj", {4, 12, 5});
  TensorMeta down = Tensor("model.layers.0.mlp.experts.down_proj", {4, 5, 6});
  ModelCounts counts = CountModel({{gu.fqn, gu.shape}, {down.fqn, down.shape}});
  EXPECT_EQ(counts.experts, 4u);
  auto g = Slices(gu, spec, rules, counts);
  ASSERT_TRUE(g.ok()) << g.status().message();
  // rank 3 = ep 1, tp 1: experts 2-3, gate rows 3-5 and up rows 9-11.
  EXPECT_EQ((*g)[3]->boxes, (std::vector<Box>{Box{{2, 3, 0}, {2, 3, 5}}, Box{{2, 9, 0}, {2, 3, 5}}}));
  EXPECT_EQ((*g)[3]->join_dim, 1);
  auto d = Slices(down, spec, rules, counts);
  EXPECT_EQ((*d)[1]->boxes, (std::vector<Box>{Box{{0, 0, 3}, {2, 5, 3}}}));
  auto ep4 = Slices(gu, *ParseMeshSpec("ep8"), rules, counts);
  EXPECT_NE(ep4.status().message().find("needs at least 8 experts"), std::string::npos);
}

TEST(PlaceTensor, ExpertsGoToEpGroupsInBlocks) {
  auto spec = *ParseMeshSpec("ep2");
  auto rules = PresetRules(Facts("mixtral", 0, 0), {});
  TensorMeta e3 = Tensor("model.layers.0.mlp.experts.3.w1.weight", {4, 4});
  auto s = Slices(e3, spec, rules, {1, 4});
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE((*s)[0].has_value());
  EXPECT_TRUE((*s)[1].has_value());
  TensorMeta dense = Tensor("model.layers.0.self_attn.q_proj.weight", {4, 4});
  EXPECT_FALSE(Slices(dense, spec, rules, {1, 0}).ok());  // ep without experts is impossible
}

TEST(PlaceTensor, RulesFileOverridesPreset) {
  auto rules = LoadRulesFile(R"({"rules": [{"pattern": "q_proj", "kind": "dim", "dim": 1}]})",
                             PresetRules(Facts("llama", 0, 0), {}));
  ASSERT_TRUE(rules.ok());
  TensorMeta q = Tensor("model.layers.0.self_attn.q_proj.weight", {4, 6});
  auto s = Slices(q, *ParseMeshSpec("tp2"), *rules, {1, 0});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ((*s)[1]->boxes, (std::vector<Box>{Box{{0, 3}, {4, 3}}}));
  EXPECT_FALSE(LoadRulesFile(R"({"rules": [{"pattern": "(", "kind": "row"}]})", {}).ok());
  EXPECT_FALSE(LoadRulesFile(R"({"rules": [{"pattern": "x", "kind": "diagonal"}]})", {}).ok());
  EXPECT_TRUE(LoadRulesFile(R"({"rules": [{"pattern": "x", "kind": "qkv"}]})", {}).ok());
}

TEST(PresetRules, UnknownModelsSayNothingIsSplit) {
  auto gpt2 = PresetRules(Facts("gpt2", 4, 4), {"transformer.h.0.attn.c_attn.weight"});
  EXPECT_EQ(gpt2.preset, "generic");
  EXPECT_TRUE(gpt2.rules.empty());
  EXPECT_NE(gpt2.unknown_model.find("model_type 'gpt2'"), std::string::npos);
  EXPECT_NE(gpt2.unknown_model.find("c_attn"), std::string::npos);
  EXPECT_TRUE(PresetRules(Facts("phi3", 4, 4), {}).unknown_model.empty());
}

TEST(ParseModelFacts, ReadsHeadsWithTransformersDefaults) {
  auto f = ParseModelFacts(R"({"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 2})");
  EXPECT_EQ(f.model_type, "llama");
  EXPECT_EQ(f.num_heads, 8u);
  EXPECT_EQ(f.num_kv_heads, 2u);
  EXPECT_EQ(ParseModelFacts(R"({"num_attention_heads": 8})").num_kv_heads, 8u);  // MHA
  auto mm = ParseModelFacts(R"({"model_type": "gemma3", "text_config": {"num_attention_heads": 4, "num_key_value_heads": 1}})");
  EXPECT_EQ(mm.num_heads, 4u);
  EXPECT_EQ(mm.num_kv_heads, 1u);
  EXPECT_EQ(ParseModelFacts("not json").num_heads, 0u);
}

}  // namespace
}  // namespace ckptfs
