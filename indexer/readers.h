// Factories for the format readers (one .cc each) and helpers they share.
#pragma once

#include <memory>
#include <string>

#include "core/meta.h"
#include "indexer/format_reader.h"

namespace ckptfs {

std::unique_ptr<FormatReader> MakeSafetensorsReader();
std::unique_ptr<FormatReader> MakeDcpReader();
std::unique_ptr<FormatReader> MakeTorchSaveReader();

// Registers the config and tokenizer files a Hugging Face folder carries
// (config.json, tokenizer.json, ...) as out.sidecars, from `<dir>/.hf_metadata/`
// (NeMo) or else `<dir>/`.
void AddSidecarFiles(const DirListing& dir, FileTable& files, Checkpoint& out);

// Reads {fqn: 1-based file index} (NeMo's fqn_to_file_index_mapping.json, or
// a mapping given on the command line) into out.file_index.
Status LoadFileIndexMapping(const std::string& path, Checkpoint& out);

}  // namespace ckptfs
