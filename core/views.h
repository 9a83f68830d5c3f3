// Views: the virtual files made from a checkpoint (see docs/ARCHITECTURE.md,
// "Virtual namespace"). Pure functions from the catalog to named Layouts; fs/ puts
// them in the tree and cli/ reads them through the same planner.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/meta.h"
#include "core/sharding.h"
#include "core/status.h"

namespace ckptfs {

struct ViewFile {
  std::string name;  // relative to the view directory
  std::shared_ptr<const Layout> layout;
  // Non-empty when the file cannot be served (the checkpoint is incomplete,
  // or none of the file's tensors can be read): it is still listed so `ls`
  // shows what would be there, but opening it fails (EIO) with this reason.
  std::string problem;
};

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

// Every rank's folder under `spec`: its slice of each tensor it holds (in
// model.safetensors, or split files + index.json when large), the sidecars,
// and layout.json giving each tensor's global shape and this rank's box
// (or, for a fused tensor, the boxes joined), plus `notes` for the whole
// spec (a tp spec that split nothing says so). InvalidArgument with the
// reason when the spec is impossible for this checkpoint; no file is built
// then.
struct MeshFiles {
  std::vector<std::vector<ViewFile>> ranks;  // by rank
  std::vector<std::string> notes;
};
Result<MeshFiles> MeshView(const Checkpoint& ckpt, const std::vector<SourceFile>& files, const MeshSpec& spec,
                           const ShardingRules& rules, const ConsolidatedOptions& options,
                           const DTypeView* dtype = nullptr);

// tensors/: one NumPy .npy file per tensor (NPY 1.0 header + C-order data),
// named EscapeFileName(fqn) + ".npy". Dtypes NumPy lacks (BF16, F8_*, F4,
// F6_*) are presented as float32, converted on read; C64 as complex64.
Result<std::vector<ViewFile>> TensorsView(const Checkpoint& ckpt);
// One file of tensors/.
Result<ViewFile> NpyFile(std::shared_ptr<const TensorMeta> t);

// bytes/: each non-tensor item (DCP BYTE_IO) as `<escaped key>.pt`, its
// bytes exactly as saved (a torch.save blob: torch.load reads it).
std::vector<ViewFile> BytesView(const Checkpoint& ckpt);

// A file name for any fqn, reversibly: '%' -> "%25", '/' -> "%2F", and a
// name that is empty, "." or ".." gets its characters escaped too.
std::string EscapeFileName(const std::string& fqn);
std::string UnescapeFileName(const std::string& name);

// The NPY 1.0 header for a C-order array of `descr` ('<f4', '|b1', ...)
// and `shape`, padded so the data starts on a 64-byte boundary.
std::string NpyHeader(const std::string& descr, const Shape& shape);
// NumPy's descr for a dtype as stored in .npy views ('<f4' for converted ones).
std::string NpyDescr(DType t);

// The text of mesh/README: the grammar, rank order and rules in use.
std::string MeshReadme(const ShardingRules& rules);

}  // namespace ckptfs
