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
  EXPECT_FALSE(LoadRulesFile(R"({"rules": [{"pattern": "x", "kind": "row", "transposed": 1}]})", {}).ok());
  // "transposed": a Conv1D weight [in=4, out=6]; column cuts its dim 1.
  auto conv = LoadRulesFile(R"({"rules": [{"pattern": "c_fc", "kind": "column", "transposed": true}]})", {});
  ASSERT_TRUE(conv.ok());
  auto c = Slices(Tensor("h.0.mlp.c_fc.weight", {4, 6}), *ParseMeshSpec("tp2"), *conv, {1, 0});
  EXPECT_EQ((*c)[1]->boxes, (std::vector<Box>{Box{{0, 3}, {4, 3}}}));
}

TEST(PresetRules, UnknownModelsSayNothingIsSplit) {
  auto bert = PresetRules(Facts("bert", 4, 4), {"encoder.layer.0.attention.self.query.weight"});
  EXPECT_EQ(bert.preset, "generic");
  EXPECT_TRUE(bert.rules.empty());
  EXPECT_NE(bert.unknown_model.find("model_type 'bert'"), std::string::npos);
  EXPECT_TRUE(PresetRules(Facts("phi3", 4, 4), {}).unknown_model.empty());
}

// model_type first; architectures for a model_type no preset names (Kimi-K2
// is DeepseekV3ForCausalLM under model_type "kimi_k2"); names without either.
TEST(PresetRules, ChosenByModelTypeThenArchitecturesThenNames) {
  EXPECT_EQ(PresetRules(Facts("deepseek_v3", 4, 4), {}).preset, "deepseek_v3");
  EXPECT_EQ(PresetRules(Facts("llama4_text", 4, 2), {}).preset, "llama4");
  EXPECT_EQ(PresetRules(Facts("llama4", 4, 2), {}).preset, "llama4");
  EXPECT_EQ(PresetRules(Facts("gpt2", 4, 4), {}).preset, "gpt2");
  ModelFacts kimi = Facts("kimi_k2", 4, 4);
  kimi.architectures = {"DeepseekV3ForCausalLM"};
  EXPECT_EQ(PresetRules(kimi, {}).preset, "deepseek_v3");
  EXPECT_EQ(PresetRules(Facts("", 0, 0), {"model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                                          "model.embed_tokens.weight"}).preset, "deepseek_v3");
  EXPECT_EQ(PresetRules(Facts("", 0, 0), {"model.embed_tokens.weight"}).preset, "llama");
}

// Each rank's boxes of a tensor under a preset, as a list per rank.
std::vector<std::vector<Box>> BoxesOf(const std::string& fqn, Shape shape, const char* spec,
                                      const ShardingRules& rules, ModelCounts counts = {2, 4}) {
  auto s = Slices(Tensor(fqn, shape), *ParseMeshSpec(spec), rules, counts);
  EXPECT_TRUE(s.ok()) << fqn << ": " << s.status().message();
  std::vector<std::vector<Box>> out;
  if (s.ok())
    for (const auto& r : *s) out.push_back(r ? r->boxes : std::vector<Box>{});
  return out;
}

Box Cols(uint64_t rows, uint64_t begin, uint64_t end) { return Box{{0, begin}, {rows, end - begin}}; }

// DeepSeek-V3 MLA with 4 heads, qk_nope 8 + qk_rope 4 (qk_head_dim 12),
// v_head_dim 6, q_lora_rank 16, kv_lora_rank 12, hidden 32. vLLM's
// DeepseekV2MLAAttention: q_a_proj and kv_a_proj_with_mqa replicated,
// q_b_proj and kv_b_proj column-parallel (2 heads per rank at tp2), o_proj
// row-parallel; experts and shared experts as a dense MLP.
TEST(PlaceTensor, DeepseekV3MlaCutsUpProjectionsInWholeHeads) {
  auto rules = PresetRules(Facts("deepseek_v3", 4, 4), {});
  const std::string a = "model.layers.0.self_attn.";
  for (const char* whole : {"q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_layernorm.weight",
                            "kv_a_layernorm.weight"}) {
    Shape shape = std::string(whole).find("layernorm") != std::string::npos ? Shape{16} : Shape{16, 32};
    for (const auto& r : BoxesOf(a + whole, shape, "tp2", rules))
      EXPECT_EQ(r, std::vector<Box>{Box::Whole(shape)}) << whole;
  }
  auto qb = BoxesOf(a + "q_b_proj.weight", {48, 16}, "tp2", rules);  // 4 heads x 12
  EXPECT_EQ(qb[1], std::vector<Box>{Rows(24, 48, 16)});
  auto kvb = BoxesOf(a + "kv_b_proj.weight", {56, 12}, "tp2", rules);  // 4 heads x (8 + 6)
  EXPECT_EQ(kvb[0], std::vector<Box>{Rows(0, 28, 12)});
  auto o = BoxesOf(a + "o_proj.weight", {32, 24}, "tp2", rules);  // input: 4 heads x 6
  EXPECT_EQ(o[1], std::vector<Box>{Cols(32, 12, 24)});
  auto shared = BoxesOf("model.layers.1.mlp.shared_experts.down_proj.weight", {32, 16}, "tp2", rules);
  EXPECT_EQ(shared[1], std::vector<Box>{Cols(32, 8, 16)});
  auto gate = BoxesOf("model.layers.1.mlp.gate.weight", {4, 32}, "tp2", rules);
  EXPECT_EQ(gate[1], std::vector<Box>{Box::Whole({4, 32})});
  auto bias = BoxesOf("model.layers.1.mlp.gate.e_score_correction_bias", {4}, "tp2", rules);
  EXPECT_EQ(bias[1], std::vector<Box>{Box::Whole({4})});
  // transformers 5: experts.gate_up_proj [E=4, 2I=16, H=32]
  auto gu = BoxesOf("model.layers.1.mlp.experts.gate_up_proj", {4, 16, 32}, "tp2", rules);
  EXPECT_EQ(gu[1], (std::vector<Box>{Box{{0, 4, 0}, {4, 4, 32}}, Box{{0, 12, 0}, {4, 4, 32}}}));
  // 3 heads: tp2 cannot hold whole heads.
  auto three = Slices(Tensor(a + "kv_b_proj.weight", {42, 12}), *ParseMeshSpec("tp2"),
                      PresetRules(Facts("deepseek_v3", 3, 3), {}), {1, 0});
  EXPECT_NE(three.status().message().find("tp2 does not divide num_attention_heads 3"), std::string::npos)
      << three.status().message();
}

// Llama-4 stores fused experts [E, H, 2I] and [E, I, H] (I = 24, H = 32):
// gate is columns [0, 24) of dim 2, up [24, 48). tp2 rank 1 holds gate
// [12, 24) and up [36, 48), down rows [12, 24) of dim 1.
TEST(PlaceTensor, Llama4FusedExpertsAreCutOnTheIntermediateDim) {
  auto rules = PresetRules(Facts("llama4_text", 4, 2), {});
  const std::string e = "model.layers.1.feed_forward.experts.";
  auto gu = Slices(Tensor(e + "gate_up_proj", {4, 32, 48}), *ParseMeshSpec("tp2"), rules, {2, 4});
  ASSERT_TRUE(gu.ok()) << gu.status().message();
  EXPECT_EQ((*gu)[1]->boxes, (std::vector<Box>{Box{{0, 0, 12}, {4, 32, 12}}, Box{{0, 0, 36}, {4, 32, 12}}}));
  EXPECT_EQ((*gu)[1]->join_dim, 2);
  auto down = BoxesOf(e + "down_proj", {4, 24, 32}, "tp2", rules);
  EXPECT_EQ(down[1], (std::vector<Box>{Box{{0, 12, 0}, {4, 12, 32}}}));
  // tp2-ep2 rank 3 (tp 1, ep 1): experts 2-3.
  auto ep = BoxesOf(e + "down_proj", {4, 24, 32}, "tp2-ep2", rules);
  EXPECT_EQ(ep[3], (std::vector<Box>{Box{{2, 12, 0}, {2, 12, 32}}}));
  auto shared = BoxesOf("model.layers.1.feed_forward.shared_expert.gate_proj.weight", {24, 32}, "tp2", rules);
  EXPECT_EQ(shared[1], std::vector<Box>{Rows(12, 24, 32)});
  auto router = BoxesOf("model.layers.1.feed_forward.router.weight", {4, 32}, "tp2", rules);
  EXPECT_EQ(router[1], std::vector<Box>{Box::Whole({4, 32})});
  // Llama4ForConditionalGeneration: the vision tower's heads are not the
  // text model's; it stays whole, the language model is cut.
  auto mm = PresetRules(Facts("llama4", 4, 2), {});
  auto vq = BoxesOf("vision_model.model.layers.0.self_attn.q_proj.weight", {24, 24}, "tp2", mm);
  EXPECT_EQ(vq[1], std::vector<Box>{Box::Whole({24, 24})});
  auto proj = BoxesOf("multi_modal_projector.linear_1.weight", {32, 24}, "tp2", mm);
  EXPECT_EQ(proj[1], std::vector<Box>{Box::Whole({32, 24})});
  auto tq = BoxesOf("language_model.model.layers.0.self_attn.q_proj.weight", {32, 32}, "tp2", mm);
  EXPECT_EQ(tq[1], std::vector<Box>{Rows(16, 32, 32)});
}

// GPT-2's Conv1D weights are [in, out]: c_attn [32, 96] holds q, k, v
// (4 heads of 8) side by side on dim 1; tp2 rank 1 takes heads 2-3 of each.
TEST(PlaceTensor, Gpt2Conv1DIsCutOnItsOutputColumns) {
  auto rules = PresetRules(Facts("gpt2", 4, 4), {});
  const std::string h = "transformer.h.0.";
  auto qkv = Slices(Tensor(h + "attn.c_attn.weight", {32, 96}), *ParseMeshSpec("tp2"), rules, {1, 0});
  ASSERT_TRUE(qkv.ok()) << qkv.status().message();
  EXPECT_EQ((*qkv)[1]->boxes, (std::vector<Box>{Cols(32, 16, 32), Cols(32, 48, 64), Cols(32, 80, 96)}));
  EXPECT_EQ((*qkv)[1]->join_dim, 1);
  auto qkv_bias = BoxesOf(h + "attn.c_attn.bias", {96}, "tp2", rules);
  EXPECT_EQ(qkv_bias[0], (std::vector<Box>{Box{{0}, {16}}, Box{{32}, {16}}, Box{{64}, {16}}}));
  EXPECT_EQ(BoxesOf(h + "attn.c_proj.weight", {32, 32}, "tp2", rules)[1], std::vector<Box>{Rows(16, 32, 32)});
  EXPECT_EQ(BoxesOf(h + "attn.c_proj.bias", {32}, "tp2", rules)[1], std::vector<Box>{Box::Whole({32})});
  EXPECT_EQ(BoxesOf(h + "mlp.c_fc.weight", {32, 128}, "tp2", rules)[1], std::vector<Box>{Cols(32, 64, 128)});
  EXPECT_EQ(BoxesOf(h + "mlp.c_fc.bias", {128}, "tp2", rules)[1], (std::vector<Box>{Box{{64}, {64}}}));
  EXPECT_EQ(BoxesOf(h + "mlp.c_proj.weight", {128, 32}, "tp2", rules)[1], std::vector<Box>{Rows(64, 128, 32)});
  EXPECT_EQ(BoxesOf("transformer.wte.weight", {64, 32}, "tp2", rules)[1], std::vector<Box>{Rows(32, 64, 32)});
  EXPECT_EQ(BoxesOf("transformer.wpe.weight", {64, 32}, "tp2", rules)[1], std::vector<Box>{Box::Whole({64, 32})});
  EXPECT_EQ(BoxesOf(h + "ln_1.weight", {32}, "tp2", rules)[1], std::vector<Box>{Box::Whole({32})});
  auto tp3 = Slices(Tensor(h + "attn.c_attn.weight", {32, 96}), *ParseMeshSpec("tp3"), rules, {1, 0});
  EXPECT_NE(tp3.status().message().find("tp3 does not divide num_attention_heads 4"), std::string::npos);
  // Its layers are h.<i>., not layers.<i>.: pp has no layers to stage.
  TensorMeta ln = Tensor(h + "ln_1.weight", {32});
  auto pp2 = Slices(ln, *ParseMeshSpec("pp2"), rules, CountModel({{ln.fqn, ln.shape}}));
  EXPECT_NE(pp2.status().message().find("pp2 needs at least 2 layers; the checkpoint has 0"), std::string::npos);
}

// Regression: without config.json the names-based preset cut Llama-4's
// experts.down_proj [E, I, H] on dim 2, the hidden dim. Names cannot tell
// [E, H, 2I] from [E, 2I, H]: fused experts stay whole over tp, with a note;
// ep still takes dim 0, the expert, in either layout.
TEST(PlaceTensor, RegressionNamesOnlyNeverCutFusedExpertsOnAGuessedDim) {
  const std::string e = "model.layers.1.feed_forward.experts.";
  std::vector<std::string> names = {"model.embed_tokens.weight", e + "gate_up_proj", e + "down_proj"};
  auto rules = PresetRules(Facts("", 0, 0), names);
  EXPECT_EQ(rules.preset, "llama");
  for (auto [name, shape] : {std::pair{e + "down_proj", Shape{4, 24, 32}}, {e + "gate_up_proj", Shape{4, 32, 48}}}) {
    auto p = PlaceTensor(shape, name, *ParseMeshSpec("tp2"), rules, {2, 4});
    ASSERT_TRUE(p.ok()) << p.status().message();
    EXPECT_EQ(p->dim, -1) << name;
    EXPECT_NE(p->note.find("[E, H, 2I]"), std::string::npos) << p->note;
    EXPECT_NE(p->note.find("config.json"), std::string::npos) << p->note;
    EXPECT_EQ(BoxesOf(name, shape, "tp2", rules)[1], std::vector<Box>{Box::Whole(shape)}) << name;
  }
  auto ep = BoxesOf(e + "down_proj", {4, 24, 32}, "tp2-ep2", rules);
  EXPECT_EQ(ep[3], (std::vector<Box>{Box{{2, 0, 0}, {2, 24, 32}}}));
  // config.json says which layout it is: no note, cut.
  auto llama4 = PresetRules(Facts("llama4", 0, 0), names);
  auto known = PlaceTensor({4, 24, 32}, e + "down_proj", *ParseMeshSpec("tp2"), llama4, {2, 4});
  EXPECT_EQ(known->dim, 1);
  EXPECT_TRUE(known->note.empty());
  // A rules file can say how to cut them.
  auto file = LoadRulesFile(R"({"rules": [{"pattern": "experts\\.down_proj$", "kind": "row", "transposed": true}]})",
                            rules);
  ASSERT_TRUE(file.ok()) << file.status().message();
  auto p = PlaceTensor({4, 24, 32}, e + "down_proj", *ParseMeshSpec("tp2"), *file, {2, 4});
  EXPECT_EQ(p->dim, 1);
  EXPECT_TRUE(p->note.empty());
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
  auto gpt2 = ParseModelFacts(R"({"model_type": "gpt2", "n_head": 12, "architectures": ["GPT2LMHeadModel"]})");
  EXPECT_EQ(gpt2.num_heads, 12u);
  EXPECT_EQ(gpt2.num_kv_heads, 12u);
  EXPECT_EQ(gpt2.architectures, std::vector<std::string>{"GPT2LMHeadModel"});
}

}  // namespace
}  // namespace ckptfs
