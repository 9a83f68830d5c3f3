// The LoRA merge (core/lora.h) against a per-element reference written here:
// W[i][j] + s * sum_k B[i][k] * A[k][j] summed in double, the inputs of each
// block cut out of whole row-major arrays by the test itself. peft is the
// oracle of the e2e tests (tests/e2e/test_merged.py).
#include "core/lora.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/cast.h"
#include "core/safetensors.h"

namespace ckptfs {
namespace {

std::shared_ptr<const TensorMeta> Meta(const std::string& fqn, Shape shape, DType dtype = DType::kF32, FileId file = 0) {
  auto t = std::make_shared<TensorMeta>();
  t->fqn = fqn;
  t->dtype = dtype;
  t->shape = shape;
  Chunk c;
  c.set_box(Box::Whole(shape));
  c.set_dtype(dtype);
  c.set_bytes({file, 0, t->nbytes()});
  t->chunks.push_back(c);
  return t;
}

// A row-major float32 array and its shape.
struct Array {
  Shape shape;
  std::vector<float> v;
  float at(uint64_t i, uint64_t j) const { return v[i * (shape.size() > 1 ? shape[1] : 1) + j]; }
};

Array Random(Shape shape, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0, 1);
  uint64_t n = 1;
  for (uint64_t s : shape) n *= s;
  Array a{shape, std::vector<float>(n)};
  for (float& x : a.v) x = d(gen);
  return a;
}

// The row-major float32 bytes of `box` of `a` (any rank), dims from `d` on,
// starting at flat element `base`.
void CutDims(const Array& a, const Box& box, size_t d, uint64_t base, std::string* out) {
  if (d == box.rank()) {
    out->append(reinterpret_cast<const char*>(&a.v[base]), 4);
    return;
  }
  uint64_t stride = 1;
  for (size_t k = d + 1; k < a.shape.size(); ++k) stride *= a.shape[k];
  for (uint64_t i = 0; i < box.lengths[d]; ++i) CutDims(a, box, d + 1, base + (box.offsets[d] + i) * stride, out);
}

std::string Cut(const Array& a, const Box& box) {
  std::string out;
  CutDims(a, box, 0, 0, &out);
  return out;
}

// Every block of `c`, its inputs cut from `arrays` (by fqn), concatenated.
std::vector<uint8_t> RunAll(const Computation& c, const std::map<std::string, const Array*>& arrays) {
  std::vector<uint8_t> out;
  for (uint64_t b = 0; b < c.block_count(); ++b) {
    std::vector<BlockBytes> inputs;
    for (const ComputeInput& in : c.InputsOf(b)) {
      const std::string cut = Cut(*arrays.at(in.tensor->fqn), in.box);
      inputs.emplace_back(cut.begin(), cut.end());
    }
    auto bytes = c.Compute(b, inputs);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    EXPECT_EQ(bytes->size(), c.block_end(b) - c.block_begin(b));
    out.insert(out.end(), bytes->begin(), bytes->end());
  }
  EXPECT_EQ(out.size(), c.nbytes());
  return out;
}

float F32At(const std::vector<uint8_t>& bytes, uint64_t k) {
  float f;
  std::memcpy(&f, bytes.data() + 4 * k, 4);
  return f;
}

// W + s * B @ A, or transposed W + s * (B @ A)^T, element by element.
double Reference(const Array& w, const Array& a, const Array& b, double s, bool transposed, uint64_t i, uint64_t j) {
  double d = 0;
  for (uint64_t k = 0; k < a.shape[0]; ++k) d += transposed ? double(b.at(j, k)) * a.at(k, i) : double(b.at(i, k)) * a.at(k, j);
  return w.at(i, j) + s * d;
}

void ExpectMerged(const Array& w, const Array& a, const Array& b, double s, bool transposed) {
  auto merge = MakeLoraMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), nullptr, s, transposed},
                             DType::kF32);
  ASSERT_TRUE(merge.ok()) << merge.status().ToString();
  auto out = RunAll(**merge, {{"w", &w}, {"a", &a}, {"b", &b}});
  for (uint64_t i = 0; i < w.shape[0]; ++i)
    for (uint64_t j = 0; j < w.shape[1]; ++j) {
      const double want = Reference(w, a, b, s, transposed, i, j);
      ASSERT_NEAR(F32At(out, i * w.shape[1] + j), want, 1e-5 * (1 + std::fabs(want))) << i << "," << j;
    }
}

TEST(LoraMerge, LinearIsWPlusScaledBTimesA) {
  ExpectMerged(Random({5, 7}, 1), Random({3, 7}, 2), Random({5, 3}, 3), 2.5, false);
}

TEST(LoraMerge, FanInFanOutAddsTheTransposedProduct) {
  // Conv1D: W is [in, out] = [7, 5]; A [r, in], B [out, r].
  ExpectMerged(Random({7, 5}, 1), Random({3, 7}, 2), Random({5, 3}, 3), 0.5, true);
}

TEST(LoraMerge, ManyBlocksEachReadOnlyTheirRows) {
  // 2100 rows of 4000 bytes: three blocks of kComputeBlockBytes.
  Array w = Random({2100, 1000}, 4), a = Random({2, 1000}, 5), b = Random({2100, 2}, 6);
  auto merge = MakeLoraMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), nullptr, 1.0, false},
                             DType::kF32);
  ASSERT_TRUE(merge.ok());
  ASSERT_EQ((*merge)->block_count(), 3u);
  auto inputs = (*merge)->InputsOf(1);
  ASSERT_EQ(inputs.size(), 3u);
  EXPECT_EQ(inputs[0].box, (Box{{1048, 0}, {1048, 1000}}));  // W's rows
  EXPECT_EQ(inputs[1].box, (Box{{0, 0}, {2, 1000}}));        // all of A
  EXPECT_EQ(inputs[2].box, (Box{{1048, 0}, {1048, 2}}));     // B's rows
  ExpectMerged(w, a, b, 1.0, false);
}

TEST(LoraMerge, TransposedBlocksReadTheirColumnsOfA) {
  Array w = Random({2100, 1000}, 7), a = Random({2, 2100}, 8), b = Random({1000, 2}, 9);
  auto merge = MakeLoraMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), nullptr, 1.0, true},
                             DType::kF32);
  ASSERT_TRUE(merge.ok());
  auto inputs = (*merge)->InputsOf(2);
  EXPECT_EQ(inputs[1].box, (Box{{0, 2096}, {2, 4}}));
  EXPECT_EQ(inputs[2].box, (Box{{0, 0}, {1000, 2}}));
  ExpectMerged(w, a, b, 1.0, true);
}

TEST(LoraMerge, DoraScalesEachRowToItsMagnitude) {
  Array w = Random({6, 4}, 10), a = Random({2, 4}, 11), b = Random({6, 2}, 12), m = Random({6}, 13);
  const double s = 1.5;
  auto merge = MakeLoraMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), Meta("m", m.shape), s, false},
                             DType::kF32);
  ASSERT_TRUE(merge.ok());
  auto out = RunAll(**merge, {{"w", &w}, {"a", &a}, {"b", &b}, {"m", &m}});
  for (uint64_t i = 0; i < 6; ++i) {
    double norm = 0;
    for (uint64_t j = 0; j < 4; ++j) norm += std::pow(Reference(w, a, b, s, false, i, j), 2);
    norm = std::sqrt(norm);
    for (uint64_t j = 0; j < 4; ++j) {
      const double want = m.v[i] / norm * Reference(w, a, b, s, false, i, j);
      EXPECT_NEAR(F32At(out, i * 4 + j), want, 1e-5 * (1 + std::fabs(want)));
    }
  }
}

TEST(LoraMerge, BiasAddsScaledLoraBias) {
  Array bias = Random({9}, 14), lb = Random({9}, 15);
  auto merge = MakeLoraMerge({Meta("bias", bias.shape), nullptr, Meta("lb", lb.shape), nullptr, 0.25, false},
                             DType::kF32);
  ASSERT_TRUE(merge.ok());
  auto out = RunAll(**merge, {{"bias", &bias}, {"lb", &lb}});
  for (uint64_t i = 0; i < 9; ++i) EXPECT_FLOAT_EQ(F32At(out, i), bias.v[i] + 0.25f * lb.v[i]);
}

TEST(LoraMerge, StoredAsBF16RoundsTheFloat32Result) {
  Array w = Random({4, 3}, 16), a = Random({1, 3}, 17), b = Random({4, 1}, 18);
  auto merge = MakeLoraMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), nullptr, 1.0, false},
                             DType::kBF16);
  ASSERT_TRUE(merge.ok());
  EXPECT_EQ((*merge)->nbytes(), 4u * 3 * 2);
  auto out = RunAll(**merge, {{"w", &w}, {"a", &a}, {"b", &b}});
  for (uint64_t k = 0; k < 12; ++k) {
    const float want = w.v[k] + b.v[k / 3] * a.v[k % 3];  // rank 1: one product, exact in float
    uint32_t bits;
    std::memcpy(&bits, &want, 4);
    uint16_t got;
    std::memcpy(&got, out.data() + 2 * k, 2);
    EXPECT_EQ(got, F32ToBF16Bits(bits)) << k;
  }
}

TEST(LoraMerge, ShapesThatDoNotFitAreRefusedWithTheTensorNamed) {
  auto merge = MakeLoraMerge({Meta("w", {5, 7}), Meta("a", {3, 6}), Meta("lora_B", {5, 3}), nullptr, 1.0, false},
                             DType::kF32);
  ASSERT_FALSE(merge.ok());
  EXPECT_EQ(merge.status().code(), Status::Code::kInvalidArgument);
  EXPECT_NE(merge.status().message().find("'lora_B' does not fit base tensor 'w' [5, 7]"), std::string::npos)
      << merge.status().message();
}

// A merge block is at least one whole row and needs all of A: a row so wide
// that this passes 256 MiB is refused with the tensor named, not computed
// with unbounded memory. One just under the bound is merged in row blocks.
TEST(LoraMerge, RowsTooWideToMergeOnReadAreRefused) {
  const uint64_t wide = (256ull << 20) / 4 / 17 + 1;  // rank 16: 17 fp32 rows of this width pass 256 MiB
  auto merge = MakeLoraMerge({Meta("w", {2, wide}), Meta("a", {16, wide}), Meta("b", {2, 16}), nullptr, 1.0, false},
                             DType::kBF16);
  ASSERT_FALSE(merge.ok());
  EXPECT_EQ(merge.status().code(), Status::Code::kNotSupported);
  EXPECT_NE(merge.status().message().find("LoRA merge of 'w'"), std::string::npos) << merge.status().message();
  auto fits = MakeLoraMerge({Meta("w", {2, wide - 1}), Meta("a", {16, wide - 1}), Meta("b", {2, 16}), nullptr, 1.0,
                             false}, DType::kBF16);
  ASSERT_TRUE(fits.ok()) << fits.status().ToString();
  EXPECT_EQ((*fits)->block_count(), 2u);  // rows stay whole, wider than a block
  EXPECT_EQ((*fits)->BlockBox(1), (Box{{1, 0}, {1, wide - 1}}));
}

// W[e][x][y] + s * ΔW[e][x][y] for a fused expert parameter W [E, d1, d2],
// from peft's layout (A [r*E, in]: expert e's rows e*r + k; B [out, r*E]:
// expert e's columns k*E + e), spelled out index by index.
double ExpertReference(const Array& w, const Array& a, const Array& b, uint64_t r, double s, bool transposed,
                       uint64_t e, uint64_t x, uint64_t y) {
  const uint64_t E = w.shape[0];
  double d = 0;
  for (uint64_t k = 0; k < r; ++k)
    d += transposed ? double(b.at(y, k * E + e)) * a.at(e * r + k, x) : double(b.at(x, k * E + e)) * a.at(e * r + k, y);
  return w.v[(e * w.shape[1] + x) * w.shape[2] + y] + s * d;
}

void ExpectExpertMerged(const Array& w, const Array& a, const Array& b, uint64_t r, double s, bool transposed) {
  auto merge = MakeLoraExpertMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), s, r, transposed, 0, 0, 0},
                                   DType::kF32);
  ASSERT_TRUE(merge.ok()) << merge.status().ToString();
  auto out = RunAll(**merge, {{"w", &w}, {"a", &a}, {"b", &b}});
  for (uint64_t e = 0; e < w.shape[0]; ++e)
    for (uint64_t x = 0; x < w.shape[1]; ++x)
      for (uint64_t y = 0; y < w.shape[2]; ++y) {
        const double want = ExpertReference(w, a, b, r, s, transposed, e, x, y);
        ASSERT_NEAR(F32At(out, (e * w.shape[1] + x) * w.shape[2] + y), want, 1e-5 * (1 + std::fabs(want)))
            << e << "," << x << "," << y;
      }
}

TEST(LoraExpertMerge, OutInExpertsTakeTheirRowsOfAAndInterleavedColumnsOfB) {
  // Qwen-MoE / Mixtral gate_up_proj [E, 2I, H] = [3, 10, 7]: A [r*E, H], B [2I, r*E].
  ExpectExpertMerged(Random({3, 10, 7}, 1), Random({6, 7}, 2), Random({10, 6}, 3), 2, 1.5, false);
}

TEST(LoraExpertMerge, TransposedExpertsAddEachExpertsProductTransposed) {
  // gpt-oss gate_up_proj [E, H, 2I] = [3, 7, 10] (is_transposed): A [r*E, H], B [2I, r*E].
  ExpectExpertMerged(Random({3, 7, 10}, 4), Random({12, 7}, 5), Random({10, 12}, 6), 4, 0.25, true);
}

TEST(LoraExpertMerge, BlocksWithinAnExpertReadOnlyThatExpertsRowsOfA) {
  // An expert of 1100 x 1000 float32 (4.4 MB) is two blocks; A's rows for
  // one expert only, B's rows for the block's output rows only.
  Array w = Random({2, 1100, 1000}, 7), a = Random({6, 1000}, 8), b = Random({1100, 6}, 9);
  auto merge = MakeLoraExpertMerge({Meta("w", w.shape), Meta("a", a.shape), Meta("b", b.shape), 0.5, 3, false, 0, 0, 0},
                                   DType::kF32);
  ASSERT_TRUE(merge.ok()) << merge.status().ToString();
  ASSERT_EQ((*merge)->block_count(), 4u);
  const auto in = (*merge)->InputsOf(3);  // expert 1, rows 1048..1099
  EXPECT_EQ(in[0].box, (Box{{1, 1048, 0}, {1, 52, 1000}}));
  EXPECT_EQ(in[1].box, (Box{{3, 0}, {3, 1000}}));
  EXPECT_EQ(in[2].box, (Box{{1048, 0}, {52, 6}}));
  ExpectExpertMerged(w, a, b, 3, 0.5, false);
}

TEST(LoraExpertMerge, FactorsThatDoNotFitAreNamed) {
  auto merge = MakeLoraExpertMerge({Meta("w", {3, 10, 7}), Meta("a", {6, 7}), Meta("lora_B", {10, 6}), 1, 3, false, 0, 0, 0},
                                   DType::kF32);  // r = 3 wants A [9, 7]
  ASSERT_FALSE(merge.ok());
  EXPECT_NE(merge.status().message().find("'lora_B' does not fit expert parameter 'w' [3, 10, 7]"), std::string::npos)
      << merge.status().message();
}

TEST(LoraConfigTest, TargetParametersAreAListOfNames) {
  auto c = ParseLoraConfig(R"({"peft_type": "LORA", "target_parameters": ["mlp.experts.gate_up_proj", "down_proj"]})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->target_parameters, (std::vector<std::string>{"mlp.experts.gate_up_proj", "down_proj"}));
  EXPECT_EQ(ParseLoraConfig(R"({"peft_type": "LORA", "target_parameters": "down_proj"})").status().code(),
            Status::Code::kInvalidArgument);
  EXPECT_TRUE(ExpertsTransposed("gpt_oss"));
  EXPECT_FALSE(ExpertsTransposed("llama4_text"));  // Llama4TextExperts: [E, H, 2I] but not is_transposed
}

TEST(LoraConfigTest, OtherAdapterKindsAndVariantsAreNotSupported) {
  auto loha = ParseLoraConfig(R"({"peft_type": "LOHA", "r": 4})");
  ASSERT_EQ(loha.status().code(), Status::Code::kNotSupported);
  EXPECT_NE(loha.status().message().find("'LOHA'"), std::string::npos);
  auto replicated = ParseLoraConfig(R"({"peft_type": "LORA", "layer_replication": [[0, 2]]})");
  ASSERT_EQ(replicated.status().code(), Status::Code::kNotSupported);
  EXPECT_NE(replicated.status().message().find("layer_replication"), std::string::npos);
  EXPECT_TRUE(ParseLoraConfig(R"({"peft_type": "LORA", "layer_replication": null, "use_qalora": false})").ok());
}

TEST(LoraConfigTest, ScalingFollowsPeftsPatternsAndRsLora) {
  auto c = ParseLoraConfig(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
      "rank_pattern": {"layers.1.self_attn.q_proj": 2, "q_proj": 4},
      "alpha_pattern": {"v_proj": 3}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  // First matching key in file order; a key matches whole dotted suffixes only.
  EXPECT_EQ(LoraScaling(*c, "model.layers.1.self_attn.q_proj"), 16.0 / 2);
  EXPECT_EQ(LoraScaling(*c, "model.layers.0.self_attn.q_proj"), 16.0 / 4);
  EXPECT_EQ(LoraScaling(*c, "model.layers.0.self_attn.xq_proj"), 16.0 / 8);
  EXPECT_EQ(LoraScaling(*c, "model.layers.0.self_attn.v_proj"), 3.0 / 8);
  c->use_rslora = true;
  EXPECT_DOUBLE_EQ(LoraScaling(*c, "model.layers.0.self_attn.k_proj"), 16.0 / std::sqrt(8.0));
}

TEST(LoraConfigTest, BaseDirIsRelativeToTheAdapterOrUnderTheRoot) {
  EXPECT_EQ(*ResolveBaseDir("/r", "runs/adapter", "../base"), "runs/base");
  EXPECT_EQ(*ResolveBaseDir("/r", "adapter", "/r/models/base"), "models/base");
  EXPECT_EQ(ResolveBaseDir("/r", "adapter", "/elsewhere/base").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(ResolveBaseDir("/r", "adapter", "../../base").status().code(), Status::Code::kNotFound);
  EXPECT_EQ(ResolveBaseDir("/r", "adapter", "").status().code(), Status::Code::kNotFound);
}

SourceFile File(const std::string& path) {
  SourceFile f;
  f.path = path;
  f.size = 1000;
  return f;
}

// A base of two weights and an adapter for one of them, plus a saved lm_head.
struct Pair {
  Checkpoint base, adapter;
};
Pair SmallPair() {
  Pair p;
  p.base.dir = "base";
  p.base.files = {File("base/model.safetensors"), File("base/config.json"), File("base/tokenizer.json")};
  p.base.tensors = {Meta("lm_head.weight", {8, 4}), Meta("q.weight", {6, 4})};
  p.base.sidecars = {{"config.json", 1}, {"tokenizer.json", 2}};
  p.adapter.dir = "adapter";
  p.adapter.files = {File("adapter/adapter_model.safetensors"), File("adapter/adapter_config.json"),
                     File("adapter/tokenizer.json")};
  p.adapter.tensors = {Meta("base_model.model.lm_head.weight", {8, 4}),
                       Meta("base_model.model.q.lora_A.weight", {2, 4}), Meta("base_model.model.q.lora_B.weight", {6, 2})};
  p.adapter.sidecars = {{"adapter_config.json", 1}, {"tokenizer.json", 2}};
  return p;
}

TEST(MergedViewTest, BaseNamesMergedWeightsAndTheAdaptersSidecars) {
  Pair p = SmallPair();
  LoraConfig config;
  config.r = 2;
  auto in = JoinAdapter(p.adapter, p.base, config);
  ASSERT_EQ(in.joined.files.size(), 6u);
  auto files = MergedView(in, {});
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  std::map<std::string, const ViewFile*> by_name;
  for (const ViewFile& f : *files) by_name[f.name] = &f;
  ASSERT_EQ(by_name.size(), 3u);  // model.safetensors, config.json, tokenizer.json
  EXPECT_EQ(by_name["tokenizer.json"]->layout->segments()[0].file, 5u);  // the adapter's, shifted past the base's
  EXPECT_EQ(by_name["config.json"]->layout->segments()[0].file, 1u);
  const Layout& model = *by_name.at("model.safetensors")->layout;
  ASSERT_EQ(model.segments().size(), 3u);
  const Segment& lm_head = model.segments()[1];  // sorted by name: lm_head.weight, q.weight
  ASSERT_EQ(lm_head.kind, Segment::Kind::kTensor);
  EXPECT_EQ(lm_head.tensor->fqn, "base_model.model.lm_head.weight");  // modules_to_save: the adapter's copy
  EXPECT_EQ(lm_head.tensor->chunks[0].file(), 3u);
  EXPECT_EQ(model.segments()[2].kind, Segment::Kind::kComputed);
  std::string header = model.segments()[0].literal->substr(8);
  EXPECT_NE(header.find("\"lm_head.weight\""), std::string::npos);
  EXPECT_EQ(header.find("base_model"), std::string::npos);
}

// peft sets fan_in_fan_out per layer by its type (False for a Linear, True
// for a Conv1D), so a config saying True still merges a Linear plainly.
TEST(MergedViewTest, FanInFanOutFollowsTheLayersShapeAsPeftsTypeCheckDoes) {
  Pair p = SmallPair();
  LoraConfig config;
  config.r = 2;
  config.fan_in_fan_out = true;  // q.weight [6, 4] with A [2, 4], B [6, 2] is a Linear's
  auto files = MergedView(JoinAdapter(p.adapter, p.base, config), {});
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  const Computation& merge = *files->at(0).layout->segments()[2].computed;
  ASSERT_EQ(merge.InputsOf(0).size(), 3u);
  EXPECT_EQ(merge.InputsOf(0)[1].box, (Box{{0, 0}, {2, 4}}));  // all of A: not transposed
}

TEST(MergedViewTest, AnAdapterTensorTheBaseLacksIsNamed) {
  Pair p = SmallPair();
  p.adapter.tensors.push_back(Meta("base_model.model.k.lora_A.weight", {2, 4}));
  p.adapter.tensors.push_back(Meta("base_model.model.k.lora_B.weight", {6, 2}));
  LoraConfig config;
  config.r = 2;
  auto files = MergedView(JoinAdapter(p.adapter, p.base, config), {});
  ASSERT_FALSE(files.ok());
  EXPECT_NE(files.status().message().find("'base_model.model.k.lora_B.weight' targets 'k.weight'"), std::string::npos)
      << files.status().message();
}

TEST(MergedViewTest, ARankOtherThanTheConfigsIsRefused) {
  Pair p = SmallPair();
  LoraConfig config;  // r = 8, but lora_A has 2 rows
  auto files = MergedView(JoinAdapter(p.adapter, p.base, config), {});
  ASSERT_FALSE(files.ok());
  EXPECT_NE(files.status().message().find("has rank 2"), std::string::npos) << files.status().message();
}

// What ZeRO-3 or FSDP saves from parameters it did not gather: empty
// placeholders, or one rank's flat slice.
TEST(MergedViewTest, AnUngatheredFactorIsNamedAsSuch) {
  for (const Shape& saved : {Shape{0}, Shape{4}, Shape{0, 4}}) {
    Pair p = SmallPair();
    p.adapter.tensors[1] = Meta("base_model.model.q.lora_A.weight", saved);
    LoraConfig config;
    config.r = 2;
    auto files = MergedView(JoinAdapter(p.adapter, p.base, config), {});
    ASSERT_FALSE(files.ok());
    EXPECT_NE(files.status().message().find("'base_model.model.q.lora_A.weight' is " + ShapeToString(saved) +
                                            ", not a 2-d LoRA factor: the adapter was saved from parameters FSDP "
                                            "or DeepSpeed ZeRO-3 had not gathered"),
              std::string::npos)
        << files.status().message();
  }
}

// A MoE layer: gate_up_proj [E=2, 2I=6, H=4], down_proj [2, 4, 3], each
// adapted through target_parameters; peft nests the wrappers, the second
// registered parameter outermost ("experts.lora_A"), the first under it
// ("experts.base_layer.lora_A").
Pair ExpertPair(uint64_t down_rank = 2) {
  Pair p;
  p.base.dir = "base";
  p.base.files = {File("base/model.safetensors"), File("base/config.json")};
  p.base.tensors = {Meta("m.experts.gate_up_proj", {2, 6, 4}), Meta("m.experts.down_proj", {2, 4, 3})};
  p.base.sidecars = {{"config.json", 1}};
  p.adapter.dir = "adapter";
  p.adapter.files = {File("adapter/adapter_model.safetensors"), File("adapter/adapter_config.json")};
  p.adapter.tensors = {Meta("base_model.model.m.experts.base_layer.lora_A.weight", {4, 4}),
                       Meta("base_model.model.m.experts.base_layer.lora_B.weight", {6, 4}),
                       Meta("base_model.model.m.experts.lora_A.weight", {2 * down_rank, 3}),
                       Meta("base_model.model.m.experts.lora_B.weight", {4, 2 * down_rank})};
  p.adapter.sidecars = {{"adapter_config.json", 1}};
  return p;
}

LoraConfig ExpertConfig() {
  LoraConfig config;
  config.r = 2;
  config.target_parameters = {"experts.gate_up_proj", "experts.down_proj"};
  return config;
}

// The computed segment of `name` in merged/'s model.safetensors.
const Computation* MergeOf(const std::vector<ViewFile>& files, const std::string& name) {
  for (const ViewFile& f : files)
    for (const Segment& s : f.layout->segments())
      if (s.kind == Segment::Kind::kComputed && s.computed->shape().size() == 3 &&
          s.computed->what().find("'" + name + "'") != std::string::npos)
        return s.computed.get();
  return nullptr;
}

TEST(MergedViewTest, EachParamWrapperMergesIntoTheParameterItsFactorsFit) {
  Pair p = ExpertPair(/*down_rank=*/3);
  LoraConfig config = ExpertConfig();
  config.rank_pattern = {{"down_proj", 3}};  // matched against "m.experts.down_proj", as peft's current_key
  config.lora_alpha = 6;
  auto files = MergedView(JoinAdapter(p.adapter, p.base, config), {});
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  const Computation* gate_up = MergeOf(*files, "m.experts.gate_up_proj");
  const Computation* down = MergeOf(*files, "m.experts.down_proj");
  ASSERT_TRUE(gate_up && down);
  EXPECT_EQ(gate_up->InputsOf(0)[1].tensor->fqn, "base_model.model.m.experts.base_layer.lora_A.weight");
  EXPECT_EQ(down->InputsOf(0)[1].tensor->fqn, "base_model.model.m.experts.lora_A.weight");
  EXPECT_EQ(down->InputsOf(0)[1].box, (Box{{0, 0}, {6, 3}}));  // rank 3 x 2 experts, in = I
  // Values: down_proj with scaling 6 / 3, against the naive reference.
  Array w = Random({2, 4, 3}, 1), a = Random({6, 3}, 2), b = Random({4, 6}, 3);
  auto out = RunAll(*down, {{"m.experts.down_proj", &w}, {"base_model.model.m.experts.lora_A.weight", &a},
                            {"base_model.model.m.experts.lora_B.weight", &b}});
  for (uint64_t e = 0; e < 2; ++e)
    for (uint64_t x = 0; x < 4; ++x)
      for (uint64_t y = 0; y < 3; ++y) {
        const double want = ExpertReference(w, a, b, 3, 2.0, false, e, x, y);
        EXPECT_NEAR(F32At(out, (e * 4 + x) * 3 + y), want, 1e-5 * (1 + std::fabs(want)));
      }
}

TEST(MergedViewTest, ASquareExpertParameterTakesItsOrientationFromTheModelType) {
  Pair p = ExpertPair();
  p.base.tensors[0] = Meta("m.experts.gate_up_proj", {2, 4, 4});  // 2I == H
  p.adapter.tensors[1] = Meta("base_model.model.m.experts.base_layer.lora_B.weight", {4, 4});
  LoraMergeInput in = JoinAdapter(p.adapter, p.base, ExpertConfig());
  auto unknown = MergedView(in, {});
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("expert parameter 'm.experts.gate_up_proj' is [2, 4, 4]"),
            std::string::npos)
      << unknown.status().message();
  for (const char* type : {"qwen2_moe", "gpt_oss"}) {
    in.base_model_type = type;
    auto files = MergedView(in, {});
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    const Computation* gate_up = MergeOf(*files, "m.experts.gate_up_proj");
    ASSERT_TRUE(gate_up);
    // gpt-oss's experts are is_transposed: ΔW[e] = (B_e A_e)^T.
    const bool transposed = std::string(type) == "gpt_oss";
    Array w = Random({2, 4, 4}, 1), a = Random({4, 4}, 2), b = Random({4, 4}, 3);
    auto out = RunAll(*gate_up, {{"m.experts.gate_up_proj", &w},
                                 {"base_model.model.m.experts.base_layer.lora_A.weight", &a},
                                 {"base_model.model.m.experts.base_layer.lora_B.weight", &b}});
    for (uint64_t e = 0; e < 2; ++e)
      for (uint64_t x = 0; x < 4; ++x)
        for (uint64_t y = 0; y < 4; ++y) {
          const double want = ExpertReference(w, a, b, 2, 4.0, transposed, e, x, y);
          EXPECT_NEAR(F32At(out, (e * 4 + x) * 4 + y), want, 1e-5 * (1 + std::fabs(want))) << type;
        }
  }
}

// transformers 5 saves Qwen-MoE's fused experts per expert:
// experts.<e>.gate_proj.weight [I, H] and up_proj (gate_up_proj[e]'s first
// and last I rows), experts.<e>.down_proj.weight [H, I].
TEST(MergedViewTest, PerExpertWeightsOfTheFileMergeAsTheirRowsOfTheFusedParameter) {
  Pair p = ExpertPair();
  p.base.tensors.clear();
  for (int e = 0; e < 2; ++e)
    for (const char* part : {"gate_proj", "up_proj"})
      p.base.tensors.push_back(Meta("m.experts." + std::to_string(e) + "." + part + ".weight", {3, 4}));
  for (int e = 0; e < 2; ++e) p.base.tensors.push_back(Meta("m.experts." + std::to_string(e) + ".down_proj.weight", {4, 3}));
  auto files = MergedView(JoinAdapter(p.adapter, p.base, ExpertConfig()), {});
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  // The fused expert 1 of gate_up_proj [2, 6, 4], and its up_proj rows 3..5.
  Array fused = Random({2, 6, 4}, 1), a = Random({4, 4}, 2), b = Random({6, 4}, 3);
  Array up{{3, 4}, std::vector<float>(fused.v.begin() + 24 + 12, fused.v.begin() + 48)};
  const Computation* merge = nullptr;
  for (const ViewFile& f : *files)
    for (const Segment& s : f.layout->segments())
      if (s.kind == Segment::Kind::kComputed && s.computed->what().find("'m.experts.1.up_proj.weight'") != std::string::npos)
        merge = s.computed.get();
  ASSERT_TRUE(merge);
  auto out = RunAll(*merge, {{"m.experts.1.up_proj.weight", &up},
                             {"base_model.model.m.experts.base_layer.lora_A.weight", &a},
                             {"base_model.model.m.experts.base_layer.lora_B.weight", &b}});
  for (uint64_t x = 0; x < 3; ++x)
    for (uint64_t y = 0; y < 4; ++y) {
      const double want = ExpertReference(fused, a, b, 2, 4.0, false, 1, 3 + x, y);
      EXPECT_NEAR(F32At(out, x * 4 + y), want, 1e-5 * (1 + std::fabs(want))) << x << "," << y;
    }
  int merged = 0;
  for (const ViewFile& f : *files)
    for (const Segment& s : f.layout->segments()) merged += s.kind == Segment::Kind::kComputed;
  EXPECT_EQ(merged, 6);  // every expert's gate, up and down
}

TEST(MergedViewTest, FactorsFittingNoTargetedParameterAreNamed) {
  Pair p = ExpertPair();
  auto config = ExpertConfig();
  config.r = 3;  // the factors were saved with r = 2
  auto files = MergedView(JoinAdapter(p.adapter, p.base, config), {});
  ASSERT_FALSE(files.ok());
  EXPECT_NE(files.status().message().find("fits none of the targeted parameters of 'm.experts'"), std::string::npos)
      << files.status().message();
}

}  // namespace
}  // namespace ckptfs
