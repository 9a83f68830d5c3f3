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
#include "core/views.h"

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

// The adapter and its base as one checkpoint: the base's files, then the
// adapter's (its FileIds shifted past the base's), the base's tensors, the
// sidecars of both (the adapter's where both have one; adapter_config.json
// left out), and the adapter's tensors, renumbered, in `adapter_tensors`.
struct LoraMergeInput {
  Checkpoint joined;
  std::vector<std::shared_ptr<const TensorMeta>> adapter_tensors;
  LoraConfig config;
};
LoraMergeInput JoinAdapter(const Checkpoint& adapter, const Checkpoint& base, LoraConfig config);

// merged/ (or, with `dtype`, merged.<dtype>/): the base's HF folder with
// every adapted tensor merged. Errors name the adapter tensor at fault.
Result<std::vector<ViewFile>> MergedView(const LoraMergeInput& in, const ConsolidatedOptions& options,
                                         const DTypeView* dtype = nullptr);

}  // namespace ckptfs
