// Helpers the format readers share (indexer/readers.h).
#include "indexer/readers.h"

#include <unistd.h>

namespace ckptfs {
namespace {

// Config and tokenizer files a Hugging Face folder carries next to weights.
const char* const kSidecarNames[] = {
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "added_tokens.json", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json"};

std::string Join(const std::string& dir, const std::string& name) {
  return dir.empty() ? name : dir + "/" + name;
}

}  // namespace

void AddSidecarFiles(const DirListing& dir, FileTable& files, Checkpoint& out) {
  // NeMo keeps them in .hf_metadata/; a plain folder keeps them beside the weights.
  const std::string meta_rel = Join(dir.rel, ".hf_metadata");
  for (const char* name : kSidecarNames) {
    for (const std::string& rel : {Join(meta_rel, name), Join(dir.rel, name)}) {
      if (::access((files.root() + "/" + rel).c_str(), R_OK) != 0) continue;
      auto id = files.Add(rel);
      if (id.ok()) out.sidecars[name] = *id;
      break;
    }
  }
}

}  // namespace ckptfs
