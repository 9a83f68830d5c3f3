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

// Property: over all ranks of a spec, split tensors are tiled exactly once
// and replicated tensors appear whole on every rank of their stage/group.
TEST(RankBox, RanksTileSplitTensorsAndReplicateTheRest) {
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
    ShardingRules rules = PresetRules("llama", fqns);
    MeshSpec spec;
    spec.tp = 1 + rng() % 4;
    spec.pp = 1 + rng() % std::min<uint64_t>(layers, 3);
    for (const auto& t : tensors) {
      TensorMeta covered = t;  // boxes of one pipeline stage, as chunks
      std::vector<Box> boxes;
      bool impossible = false;
      for (uint64_t r = 0; r < spec.world(); ++r) {
        auto b = RankBox(t, t.fqn, spec, r, rules, layers, 0);
        if (!b.ok()) {
          impossible = true;
          EXPECT_NE(b.status().message().find("larger than dim"), std::string::npos) << b.status().message();
          break;
        }
        if (*b) boxes.push_back(**b);
      }
      if (impossible) continue;
      bool replicated = t.fqn.find("norm") != std::string::npos;
      ASSERT_FALSE(boxes.empty()) << t.fqn;
      ASSERT_EQ(boxes.size(), spec.tp) << t.fqn << " lives on exactly one stage";
      if (replicated) {
        for (const Box& b : boxes) EXPECT_EQ(b, Box::Whole(t.shape)) << t.fqn;
        continue;
      }
      for (const Box& b : boxes) {
        Chunk c;
        c.shard.box = b;
        c.basic.dtype = t.dtype;
        c.bytes.length = *ByteSize(t.dtype, b.numel());
        if (b.numel() > 0) covered.chunks.push_back(c);
      }
      EXPECT_TRUE(CheckCoverage(covered).empty()) << t.fqn << " tp" << spec.tp;
    }
  }
}

TEST(RankBox, ExpertsGoToEpGroupsInBlocks) {
  auto spec = *ParseMeshSpec("ep2");
  auto rules = PresetRules("mixtral", {});
  TensorMeta e3 = Tensor("model.layers.0.mlp.experts.3.w1.weight", {4, 4});
  EXPECT_FALSE(RankBox(e3, e3.fqn, spec, 0, rules, 1, 4)->has_value());
  EXPECT_TRUE(RankBox(e3, e3.fqn, spec, 1, rules, 1, 4)->has_value());
  TensorMeta dense = Tensor("model.layers.0.self_attn.q_proj.weight", {4, 4});
  EXPECT_FALSE(RankBox(dense, dense.fqn, spec, 0, rules, 1, 0).ok());  // ep without experts is impossible
}

TEST(RankBox, RulesFileOverridesPreset) {
  auto rules = LoadRulesFile(R"({"rules": [{"pattern": "q_proj", "kind": "dim", "dim": 1}]})",
                             PresetRules("llama", {}));
  ASSERT_TRUE(rules.ok());
  TensorMeta q = Tensor("model.layers.0.self_attn.q_proj.weight", {4, 6});
  auto box = RankBox(q, q.fqn, *ParseMeshSpec("tp2"), 1, *rules, 1, 0);
  ASSERT_TRUE(box.ok());
  EXPECT_EQ(**box, (Box{{0, 3}, {4, 3}}));
  EXPECT_FALSE(LoadRulesFile(R"({"rules": [{"pattern": "(", "kind": "row"}]})", {}).ok());
  EXPECT_FALSE(LoadRulesFile(R"({"rules": [{"pattern": "x", "kind": "diagonal"}]})", {}).ok());
}

}  // namespace
}  // namespace ckptfs
