// PEFT LoRA adapters merged into their base model on read (`merged/`,
// `merged.<dtype>/`; see docs/ARCHITECTURE.md, read path step 3b).
//
// What PEFT's `merge_and_unload()` computes, per targeted weight W
// (peft/tuners/lora/layer.py, variants.py, dora.py, as of peft 0.21):
//   W' = W + scaling * B @ A                 Linear
//   W' = W + scaling * (B @ A)^T             fan_in_fan_out (GPT-2's Conv1D,
//                                            whose weight is stored [in, out]:
//                                            peft decides by the layer's type,
//                                            seen here in W's shape);
//                                            Embedding (lora_embedding_A/B)
//   W' = m / ||W + ΔW||_row * (W + ΔW)       DoRA (m: lora_magnitude_vector;
//                                            the norm of each output row)
//   bias' = bias + scaling * lora_B.bias     lora_bias
//   W'[e] = W[e] + scaling * B_e @ A_e       target_parameters on a fused
//                                            3-d expert parameter W [E, d1, d2]
//                                            (ParamWrapper): A is [r*E, in],
//                                            A_e its rows e*r .. e*r+r-1; B is
//                                            [out, r*E], B_e its columns k*E+e
//                                            (k < r: experts interleaved);
//                                            [out, in] = [d1, d2], or, where the
//                                            experts module is_transposed
//                                            (gpt-oss, Aria), ΔW[e] = (B_e A_e)^T
//                                            with [in, out] = [d1, d2]
// with scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora,
// r and lora_alpha taken from rank_pattern / alpha_pattern where a pattern
// matches the module's name (peft.utils.other.get_pattern_key: the first
// key K, in the file's order, for which the name matches `(.*\.)?(K)$`).
// Saved copies of whole base tensors (modules_to_save, `bias: "all"`, the
// `base_layer` weights PEFT saves next to embedding LoRA) replace the base's.
//
// Each merged tensor is a Computation (core/compute.h) evaluated in float32
// with Eigen, one block of output rows at a time: a block reads only its
// rows of W and B (or, transposed, its columns of A) and all of the other
// factor, so memory stays bounded by the block size whatever the matrix.
// The result is stored in the base tensor's dtype, or the view's dtype,
// rounded as core/cast.h rounds.
//
// A 2-d target parameter merges as a Linear weight. Which parameter each
// ParamWrapper's factors belong to is not in their names (peft nests one
// wrapper per parameter of a module: `<module>.lora_A`,
// `<module>.base_layer.lora_A`, ... by the model's registration order), so
// it is found by shape: the one targeted parameter of the module the factors
// fit. The orientation of a 3-d parameter shows in its shape too, unless
// d1 == d2; then it is the base's config.json model_type's (is_transposed
// in transformers 5: gpt_oss, aria, aria_text, openai_privacy_filter).
// transformers 5 saves most fused experts per expert (conversion_mapping.py:
// `experts.<e>.gate_proj.weight` + `up_proj` for `gate_up_proj`,
// `experts.<e>.down_proj.weight`; Mixtral's `block_sparse_moe.experts.<e>.`
// `w1` + `w3`, `w2`): such a base's tensors are merged as their rows of the
// fused parameter, which the model holds as [E, out, in].
//
// Anything this cannot reproduce exactly (another adapter kind, a LoRA
// variant, a tensor it does not recognise, shapes that do not fit) is an
// error naming the cause, never a view that differs from PEFT's merge.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/compute.h"
#include "core/meta.h"
#include "core/status.h"
#include "core/hf_folder.h"

namespace ckptfs {

// The fields of adapter_config.json the merge reads.
struct LoraConfig {
  std::string base_model;  // base_model_name_or_path
  double r = 8;
  double lora_alpha = 8;
  bool use_rslora = false;
  bool fan_in_fan_out = false;
  bool use_dora = false;
  bool lora_bias = false;
  // Parameter names ("mlp.experts.gate_up_proj"), matched as peft matches
  // them: the full name, or a tail of it after a '.'.
  std::vector<std::string> target_parameters;
  // Module-name pattern -> value, in the order the file lists them.
  std::vector<std::pair<std::string, double>> rank_pattern, alpha_pattern;
};

// NotSupported naming the field when the adapter is no plain LoRA (another
// peft_type, or a LoRA variant whose merge differs); InvalidArgument for
// JSON that is not an adapter config.
Result<LoraConfig> ParseLoraConfig(const std::string& json);

// PEFT's scaling for module `module` (its name in the base model, e.g.
// "model.layers.0.self_attn.q_proj"); `r` out of rank_pattern or the config.
double LoraScaling(const LoraConfig& config, const std::string& module);
double LoraRank(const LoraConfig& config, const std::string& module);

// The base checkpoint's directory relative to the mounted root, from
// base_model_name_or_path: absolute (under `root`, the root's absolute
// path) or relative to the adapter's directory `adapter_dir`. NotFound
// saying why for a name outside the root or a hub id.
Result<std::string> ResolveBaseDir(const std::string& root, const std::string& adapter_dir,
                                   const std::string& base_model);

// One merged weight: W (`base`) with B @ A added; or, for a bias, `base`
// with scaling * `b` added (`a` null).
struct LoraTerm {
  std::shared_ptr<const TensorMeta> base, a, b;
  std::shared_ptr<const TensorMeta> magnitude;  // DoRA; null otherwise
  double scaling = 1;
  bool transposed = false;  // ΔW = (B @ A)^T
};

// The merged tensor, stored as `to`. InvalidArgument naming the tensors
// when their shapes do not fit (W [out, in], A [r, in], B [out, r]; or
// transposed W [in, out], A [r, in], B [out, r]; a bias [out], B.bias [out]).
Result<std::shared_ptr<const Computation>> MakeLoraMerge(LoraTerm term, DType to);

// One merged fused-expert parameter W [E, d1, d2] (see above): `a`
// [rank * E, in], `b` [out, rank * E]. Or, `base` 2-d, the part of it a
// checkpoint stores per expert (transformers 5 fuses
// `experts.<e>.gate_proj.weight` and `up_proj` into `gate_up_proj` on load
// and splits it again on save): rows [row0, row0 + base rows) of expert
// `expert`'s [out, in].
struct LoraExpertTerm {
  std::shared_ptr<const TensorMeta> base, a, b;
  double scaling = 1;
  uint64_t rank = 0;
  bool transposed = false;  // experts is_transposed: [in, out] = [d1, d2]
  uint64_t experts = 0;     // E: base's dim 0, or the fused parameter's
  uint64_t expert = 0, row0 = 0;  // a 2-d base: where it sits in the fused parameter
};

// The merged expert tensor, stored as `to`, a block of the output (an
// expert's rows, or several whole experts) at a time: a block reads its part
// of W, its experts' rows of A (transposed: and its columns) and B's rows for
// its output rows (transposed: columns), all r*E columns of them, as B's
// experts are interleaved. InvalidArgument naming the tensors when the
// shapes do not fit; NotSupported when one block would need more than
// 64 MiB of float32 inputs.
Result<std::shared_ptr<const Computation>> MakeLoraExpertMerge(LoraExpertTerm term, DType to);

// Whether transformers 5 declares the fused experts of `model_type` (config.json)
// is_transposed, stored [E, in, out].
bool ExpertsTransposed(const std::string& model_type);

// The adapter and its base as one checkpoint: the base's files, then the
// adapter's (its FileIds shifted past the base's), the base's tensors, the
// sidecars of both (the adapter's where both have one; adapter_config.json
// left out), and the adapter's tensors, renumbered, in `adapter_tensors`.
struct LoraMergeInput {
  Checkpoint joined;
  std::vector<std::shared_ptr<const TensorMeta>> adapter_tensors;
  LoraConfig config;
  // The base's config.json model_type ("" without one): the orientation of
  // square expert parameters.
  std::string base_model_type;
};
LoraMergeInput JoinAdapter(const Checkpoint& adapter, const Checkpoint& base, LoraConfig config);

// merged/ (or, with `dtype`, merged.<dtype>/): the base's HF folder with
// every adapted tensor merged. Errors name the adapter tensor at fault.
Result<std::vector<ViewFile>> MergedView(const LoraMergeInput& in, const ConsolidatedOptions& options,
                                         const DTypeView* dtype = nullptr);

}  // namespace ckptfs
