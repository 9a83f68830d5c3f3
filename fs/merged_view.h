// merged/ and merged.<dtype>/ of a PEFT LoRA adapter folder: its base
// checkpoint with the adapter merged on read (core/lora.h).
//
// The one view that depends on two checkpoints. Rather than teach the read
// path about two readers, the view gets sources of its own: the base's and
// the adapter's file tables joined into one (core/lora.h JoinAdapter), read
// by a SourceReader of its own. Exact or an error then holds as for any
// view: every read checks the identity of the files it used, so a change of
// either checkpoint's sources answers Stale; the view is marked stale (EIO
// from then on, its pages dropped from the kernel's cache) without making
// the adapter or the base stale. The view's rows are copies of the two
// checkpoints' rows, so it stays readable while the base is unloaded.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/lora.h"
#include "core/hf_folder.h"
#include "source/source.h"
#include "source/source_reader.h"

namespace ckptfs {

struct MergedSources {
  LoraMergeInput input;  // owns the joined file table `reader` reads
  std::unique_ptr<SourceReader> reader;
  std::atomic<bool> stale{false};
};

// The adapter's config and its base's directory (relative to the root of
// `source`), from adapter_config.json read through `source`. NotSupported for adapters
// that are not merged on read, NotFound for a base outside the root; the
// message says what to do.
Result<std::pair<LoraConfig, std::string>> MergeTarget(const Source& source, const Checkpoint& adapter);

// Why there is no merged/ when `base_dir` (MergeTarget's) holds no
// checkpoint of the mount.
std::string NoBaseCheckpoint(const LoraConfig& config, const std::string& base_dir);

// config.json's model_type in `joined` (JoinAdapter's), "" without one:
// LoraMergeInput::base_model_type.
Result<std::string> BaseModelType(const Source& source, const Checkpoint& joined);

struct MergedBuild {
  std::shared_ptr<MergedSources> sources;
  std::vector<ViewFile> files;
};
// The view's sources and files. `dtype` names the served dtype (a
// merged.<dtype>/ view; its config_json is filled here) or is null.
Result<MergedBuild> BuildMergedView(std::shared_ptr<const Source> source, const Checkpoint& adapter, const Checkpoint& base,
                                    LoraConfig config, const ConsolidatedOptions& options, DTypeView* dtype,
                                    ReadOptions read);

}  // namespace ckptfs
