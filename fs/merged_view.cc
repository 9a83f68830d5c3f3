#include "fs/merged_view.h"

#include "core/sharding.h"

namespace ckptfs {
namespace {

Result<std::string> ReadText(const Source& source, const Checkpoint& ckpt, const std::string& name) {
  auto it = ckpt.sidecars.find(name);
  if (it == ckpt.sidecars.end()) return Status::NotFound(name + ": not in the folder");
  return source.ReadWhole(ckpt.files.at(it->second).path);
}

}  // namespace

Result<std::pair<LoraConfig, std::string>> MergeTarget(const Source& source, const Checkpoint& adapter) {
  ASSIGN_OR_RETURN(std::string text, ReadText(source, adapter, kPeftConfigName));
  ASSIGN_OR_RETURN(LoraConfig config, ParseLoraConfig(text));
  ASSIGN_OR_RETURN(std::string base, ResolveBaseDir(source.root(), adapter.dir, config.base_model));
  return std::make_pair(std::move(config), std::move(base));
}

std::string NoBaseCheckpoint(const LoraConfig& config, const std::string& base_dir) {
  return "its base model '" + config.base_model + "' is no checkpoint of this root (looked in '" +
         (base_dir.empty() ? "." : base_dir) + "'); set base_model_name_or_path in adapter_config.json to the "
         "base's folder, relative to the adapter or absolute, inside the mounted root";
}

Result<std::string> BaseModelType(const Source& source, const Checkpoint& joined) {
  if (!joined.sidecars.count("config.json")) return std::string();
  ASSIGN_OR_RETURN(std::string text, ReadText(source, joined, "config.json"));
  return ParseModelFacts(text).model_type;
}

Result<MergedBuild> BuildMergedView(std::shared_ptr<const Source> source, const Checkpoint& adapter, const Checkpoint& base,
                                    LoraConfig config, const ConsolidatedOptions& options, DTypeView* dtype,
                                    ReadOptions read) {
  MergedBuild out;
  out.sources = std::make_shared<MergedSources>();
  out.sources->input = JoinAdapter(adapter, base, std::move(config));
  const Checkpoint& joined = out.sources->input.joined;
  ASSIGN_OR_RETURN(out.sources->input.base_model_type, BaseModelType(*source, joined));
  if (dtype && joined.sidecars.count("config.json")) {
    ASSIGN_OR_RETURN(dtype->config_json, ReadText(*source, joined, "config.json"));
  }
  ASSIGN_OR_RETURN(out.files, MergedView(out.sources->input, options, dtype));
  out.sources->reader = std::make_unique<SourceReader>(std::move(source), &joined.files, GroupPolicy{}, 1ull << 30, read);
  return out;
}

}  // namespace ckptfs
