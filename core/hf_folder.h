// consolidated/ and its dtype views (consolidated.<dtype>/): a checkpoint's
// model weights as a Hugging Face model folder, which weights those are,
// and the casts of a dtype view. Pure; mesh/ and merged/ build their
// folders with the same functions (core/mesh_view.h, core/lora.h).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/meta.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/views.h"

namespace ckptfs {

struct ConsolidatedOptions {
  // Hugging Face's default max_shard_size ("5GB" = 5 * 10^9 bytes).
  uint64_t max_file_bytes = 5'000'000'000;
  // {fqn: name} overriding ModelWeights' rule (`--names FILE`); a tensor not
  // listed is left out.
  std::map<std::string, std::string> names;
};

// Which tensors are model weights, and under which names (consolidated/ and
// mesh/ hold only these). The rule, on each tensor's key path (TensorMeta::path,
// or just its fqn for flat formats):
//  - a checkpoint whose top-level keys include a model key (model, module,
//    model_state_dict, state_dict) keeps the tensors under the first such key
//    in that order, named by the rest of their path joined with '.'
//    ({"model": hf.state_dict(), "optim": ...} -> hf.state_dict()'s names);
//  - otherwise every tensor is kept under its own name, except those under a
//    training-state key (optim, optimizer, lr_scheduler, scheduler,
//    dataloader, rng_state, ...), which are never weights;
//  - `options.names`, when given, replaces the rule.
// Tied embeddings need nothing: a checkpoint without lm_head.weight yields a
// folder without it, as transformers expects. Two tensors with one name are
// an error.
Result<SliceList> ModelWeights(const Checkpoint& ckpt, const ConsolidatedOptions& options);

// A dtype view of a folder (`consolidated.bf16/`, `mesh/tp2.fp16/`): every
// castable tensor (core/cast.h) not already in `to` is cast on read; tensors
// whose name in the view matches `keep` (std::regex, ECMAScript, searched)
// are served as saved. config.json is rewritten to name the served dtype:
// `dtype`, and `torch_dtype` where the source has it (in sub-configs such as
// text_config too); `config_json` is the source's text ("" when it has none).
struct DTypeView {
  DType to = DType::kBF16;
  std::string keep;
  std::string config_json;
};

// Marks the slices a dtype view casts. InvalidArgument for a bad `keep`.
Status CastSlices(SliceList& slices, const DTypeView& view);
// `config_json` with its dtype fields set to `to` (see DTypeView).
Result<std::string> ConfigForDType(const std::string& config_json, DType to);

// A PEFT adapter folder (adapter_config.json beside the weights): its
// consolidated/ is again an adapter folder, weights in kPeftWeightsName;
// a LoRA adapter also gets merged/ (core/lora.h).
inline constexpr const char* kPeftConfigName = "adapter_config.json";
inline constexpr const char* kPeftWeightsName = "adapter_model.safetensors";
bool IsPeftAdapter(const Checkpoint& ckpt);

// The Hugging Face folder for `ckpt`: model.safetensors, or
// model-0000i-of-0000N.safetensors + model.safetensors.index.json (split by
// ckpt.file_index when present, else by max_file_bytes and the header cap),
// plus the sidecar files. `files` is the catalog's file table. For a PEFT
// adapter, adapter_model.safetensors (NotSupported when it would need
// more than one file).
// With `dtype`, the folder's dtype view (consolidated.<dtype>/).
Result<std::vector<ViewFile>> ConsolidatedView(const Checkpoint& ckpt,
                                               const std::vector<SourceFile>& files,
                                               const ConsolidatedOptions& options,
                                               const DTypeView* dtype = nullptr);

// The Hugging Face folder of `slices` (ConsolidatedView once the slices
// are chosen and cast): for views whose tensors are not simply ckpt's.
Result<std::vector<ViewFile>> HfFolderOf(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                         const SliceList& slices, const ConsolidatedOptions& options,
                                         const DTypeView* dtype = nullptr);

// HfFolderOf split by size alone (a mesh rank's slices are not the
// checkpoint's files, so its file-index mapping does not apply); fills
// *file_of (name in the folder -> weight file) when given.
Result<std::vector<ViewFile>> HfFolderBySize(const Checkpoint& ckpt, const std::vector<SourceFile>& files,
                                             const SliceList& slices, uint64_t max_file_bytes,
                                             std::map<std::string, std::string>* file_of,
                                             const DTypeView* dtype = nullptr);

}  // namespace ckptfs
