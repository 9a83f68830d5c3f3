#include "core/lora.h"

#include <algorithm>
#include <cmath>
#include <regex>

#include <nlohmann/json.hpp>

namespace ckptfs {
namespace {

// Ordered: rank_pattern and alpha_pattern are matched in the file's order.
using Json = nlohmann::ordered_json;

// Config fields that make PEFT's merge something other than the formulas
// of lora.h: set (non-null, non-false, non-empty) means no merge on read.
const char* const kVariantFields[] = {
    "layer_replication", "trainable_token_indices", "use_qalora", "use_bdlora",
    "alora_invocation_tokens", "arrow_config", "kasa_config", "velora_config", "monteclora_config"};

bool IsSet(const Json& j) {
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_object() || j.is_array() || j.is_string()) return !j.empty();
  return true;
}

Result<std::vector<std::pair<std::string, double>>> Patterns(const Json& j, const char* field) {
  std::vector<std::pair<std::string, double>> out;
  if (!j.contains(field) || j[field].is_null()) return out;
  if (!j[field].is_object()) return Status::InvalidArgument(std::string(field) + " is not a JSON object");
  for (const auto& [key, value] : j[field].items()) {
    if (!value.is_number())
      return Status::InvalidArgument(std::string(field) + "['" + key + "'] is not a number");
    try {
      std::regex check("(" + key + ")");
    } catch (const std::regex_error& e) {
      return Status::InvalidArgument(std::string(field) + " key '" + key + "' is not a regular expression: " + e.what());
    }
    out.push_back({key, value.get<double>()});
  }
  return out;
}

// peft.utils.other.get_pattern_key + dict.get(key, fallback).
double PatternValue(const std::vector<std::pair<std::string, double>>& patterns, const std::string& module,
                    double fallback) {
  for (const auto& [key, value] : patterns)
    if (std::regex_match(module, std::regex("(.*\\.)?(" + key + ")"))) return value;
  return fallback;
}

// target_parameters: a list of names (peft refuses a string for it).
Result<std::vector<std::string>> Names(const Json& j, const char* field) {
  std::vector<std::string> out;
  if (!j.contains(field) || j[field].is_null()) return out;
  if (!j[field].is_array()) return Status::InvalidArgument(std::string(field) + " is not a JSON list");
  for (const auto& name : j[field]) {
    if (!name.is_string() || name.get<std::string>().empty())
      return Status::InvalidArgument(std::string(field) + " holds " + name.dump() + ", not a parameter name");
    out.push_back(name.get<std::string>());
  }
  return out;
}

bool Flag(const Json& j, const char* field) { return j.contains(field) && j[field].is_boolean() && j[field].get<bool>(); }

}  // namespace

Result<LoraConfig> ParseLoraConfig(const std::string& json) {
  Json j = Json::parse(json, nullptr, false);
  if (!j.is_object()) return Status::InvalidArgument("adapter_config.json is not a JSON object");
  const std::string type = j.value("peft_type", std::string());
  if (type != "LORA")
    return Status::NotSupported("peft_type is '" + type + "': only LoRA adapters are merged on read (LoHa, LoKr, "
                                "IA3 and the other kinds are not); merge it with peft's "
                                "PeftModel.merge_and_unload() and save_pretrained()");
  for (const char* field : kVariantFields)
    if (j.contains(field) && IsSet(j[field]))
      return Status::NotSupported(std::string("adapter_config.json sets '") + field +
                                  "': this LoRA variant is not merged on read; merge it with peft's "
                                  "PeftModel.merge_and_unload() and save_pretrained()");
  LoraConfig c;
  if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string())
    c.base_model = j["base_model_name_or_path"].get<std::string>();
  if (j.contains("r") && !j["r"].is_number()) return Status::InvalidArgument("adapter_config.json: r is not a number");
  if (j.contains("lora_alpha") && !j["lora_alpha"].is_number())
    return Status::InvalidArgument("adapter_config.json: lora_alpha is not a number");
  c.r = j.value("r", 8.0);
  c.lora_alpha = j.value("lora_alpha", 8.0);
  c.use_rslora = Flag(j, "use_rslora");
  c.fan_in_fan_out = Flag(j, "fan_in_fan_out");
  c.use_dora = Flag(j, "use_dora");
  c.lora_bias = Flag(j, "lora_bias");
  ASSIGN_OR_RETURN(c.target_parameters, Names(j, "target_parameters"));
  ASSIGN_OR_RETURN(c.rank_pattern, Patterns(j, "rank_pattern"));
  ASSIGN_OR_RETURN(c.alpha_pattern, Patterns(j, "alpha_pattern"));
  return c;
}

double LoraRank(const LoraConfig& config, const std::string& module) {
  return PatternValue(config.rank_pattern, module, config.r);
}

double LoraScaling(const LoraConfig& config, const std::string& module) {
  const double r = LoraRank(config, module);
  const double alpha = PatternValue(config.alpha_pattern, module, config.lora_alpha);
  return config.use_rslora ? alpha / std::sqrt(r) : alpha / r;
}

bool ExpertsTransposed(const std::string& model_type) {
  // transformers 5's @use_experts_implementation(is_transposed=True) models.
  for (const char* t : {"gpt_oss", "aria", "aria_text", "openai_privacy_filter"})
    if (model_type == t) return true;
  return false;
}

Result<std::string> ResolveBaseDir(const std::string& root, const std::string& adapter_dir,
                                   const std::string& base_model) {
  if (base_model.empty())
    return Status::NotFound("adapter_config.json names no base model (base_model_name_or_path is empty); set it to "
                            "the base checkpoint's path, relative to the adapter folder or absolute");
  std::string path;
  if (base_model[0] == '/') {
    if (base_model != root && base_model.rfind(root + "/", 0) != 0)
      return Status::NotFound("base model '" + base_model + "' is outside the mounted root " + root +
                              "; mount a root holding both the adapter and its base");
    path = base_model.substr(std::min(base_model.size(), root.size() + 1));
  } else {
    path = adapter_dir.empty() ? base_model : adapter_dir + "/" + base_model;
  }
  std::vector<std::string> parts;
  for (size_t at = 0; at <= path.size();) {
    size_t slash = path.find('/', at);
    if (slash == std::string::npos) slash = path.size();
    const std::string part = path.substr(at, slash - at);
    at = slash + 1;
    if (part.empty() || part == ".") continue;
    if (part != "..") {
      parts.push_back(part);
    } else if (parts.empty()) {
      return Status::NotFound("base model '" + base_model + "' is outside the mounted root; mount a root holding "
                              "both the adapter and its base");
    } else {
      parts.pop_back();
    }
  }
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "/") + p;
  return out;
}

}  // namespace ckptfs
