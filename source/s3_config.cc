#include "source/s3_config.h"

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace ckptfs {
namespace {

std::string Trim(const std::string& s) {
  size_t a = s.find_first_not_of(" \t\r"), b = s.find_last_not_of(" \t\r");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

std::optional<std::string> NonEmpty(const EnvLookup& env, const std::string& name) {
  auto v = env(name);
  if (v && !v->empty()) return v;
  return std::nullopt;
}

std::string ReadText(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string HomeFile(const EnvLookup& env, const char* override_var, const char* name) {
  if (auto p = NonEmpty(env, override_var)) return *p;
  auto home = NonEmpty(env, "HOME");
  return home ? *home + "/.aws/" + name : "";
}

// The profile's section: "[name]" in credentials, "[profile name]" (or
// "[default]") in config.
const std::map<std::string, std::string>* Section(
    const std::map<std::string, std::map<std::string, std::string>>& ini, const std::string& name, bool config) {
  auto it = ini.find(config && name != "default" ? "profile " + name : name);
  return it == ini.end() ? nullptr : &it->second;
}

std::string Value(const std::map<std::string, std::string>* s, const std::string& key) {
  if (!s) return "";
  auto it = s->find(key);
  return it == s->end() ? "" : it->second;
}

Status ResolveCredentials(const EnvLookup& env, const std::string& profile, const std::string& cred_path,
                          const std::map<std::string, std::string>* config_section, S3Credentials& out) {
  auto id = NonEmpty(env, "AWS_ACCESS_KEY_ID"), secret = NonEmpty(env, "AWS_SECRET_ACCESS_KEY");
  if (id && secret) {
    out = {*id, *secret, NonEmpty(env, "AWS_SESSION_TOKEN").value_or(""), "the environment (AWS_ACCESS_KEY_ID)"};
    return Status::OK();
  }
  const auto creds = ParseAwsIni(cred_path.empty() ? "" : ReadText(cred_path));
  for (const auto* s : {Section(creds, profile, false), config_section}) {
    if (Value(s, "aws_access_key_id").empty() || Value(s, "aws_secret_access_key").empty()) continue;
    out = {Value(s, "aws_access_key_id"), Value(s, "aws_secret_access_key"), Value(s, "aws_session_token"),
           "profile '" + profile + "' in " + (s == config_section ? "the AWS config file" : cred_path)};
    return Status::OK();
  }
  return Status::PermissionDenied(
      "no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE naming a profile in " +
      (cred_path.empty() ? std::string("~/.aws/credentials") : cred_path) +
      ", or pass --no-sign-request for a public bucket");
}

}  // namespace

bool IsS3Url(const std::string& root) { return root.rfind("s3://", 0) == 0; }

Result<S3Location> ParseS3Url(const std::string& url) {
  if (!IsS3Url(url)) return Status::InvalidArgument(url + ": not an s3:// URL");
  const std::string rest = url.substr(5);
  const size_t slash = rest.find('/');
  S3Location loc;
  loc.bucket = rest.substr(0, slash);
  if (loc.bucket.empty()) return Status::InvalidArgument(url + ": no bucket; write s3://BUCKET/PREFIX");
  if (slash != std::string::npos) loc.prefix = rest.substr(slash + 1);
  while (loc.prefix.size() > 1 && loc.prefix.ends_with("//")) loc.prefix.pop_back();
  if (!loc.prefix.empty() && !loc.prefix.ends_with('/')) loc.prefix += '/';
  if (loc.prefix == "/") loc.prefix.clear();
  return loc;
}

std::map<std::string, std::map<std::string, std::string>> ParseAwsIni(const std::string& text) {
  std::map<std::string, std::map<std::string, std::string>> out;
  std::istringstream in(text);
  std::string line, section;
  while (std::getline(in, line)) {
    line = Trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = Trim(line.substr(1, line.size() - 2));
      out[section];
      continue;
    }
    const size_t eq = line.find('=');
    if (eq == std::string::npos || section.empty()) continue;
    out[section][Trim(line.substr(0, eq))] = Trim(line.substr(eq + 1));
  }
  return out;
}

EnvLookup ProcessEnv() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

Result<S3Config> ResolveS3Config(const std::string& url, const S3Flags& flags, const EnvLookup& env) {
  S3Config c;
  ASSIGN_OR_RETURN(c.location, ParseS3Url(url));
  const std::string profile = NonEmpty(env, "AWS_PROFILE").value_or("default");
  const std::string config_path = HomeFile(env, "AWS_CONFIG_FILE", "config");
  const auto config = ParseAwsIni(config_path.empty() ? "" : ReadText(config_path));
  const auto* section = Section(config, profile, true);

  c.region = !flags.region.empty() ? flags.region
                                   : NonEmpty(env, "AWS_REGION")
                                         .value_or(NonEmpty(env, "AWS_DEFAULT_REGION").value_or(Value(section, "region")));
  if (c.region.empty()) c.region = "us-east-1";

  c.endpoint = !flags.endpoint_url.empty()
                   ? flags.endpoint_url
                   : NonEmpty(env, "AWS_ENDPOINT_URL_S3")
                         .value_or(NonEmpty(env, "AWS_ENDPOINT_URL").value_or(Value(section, "endpoint_url")));
  c.endpoint_is_aws = c.endpoint.empty();
  c.ca_bundle = NonEmpty(env, "AWS_CA_BUNDLE").value_or(Value(section, "ca_bundle"));
  if (c.endpoint_is_aws) c.endpoint = "https://s3." + c.region + ".amazonaws.com";
  while (c.endpoint.ends_with('/')) c.endpoint.pop_back();
  if (c.endpoint.rfind("http://", 0) != 0 && c.endpoint.rfind("https://", 0) != 0)
    return Status::InvalidArgument("endpoint '" + c.endpoint + "' must start with http:// or https://");
  // Virtual-hosted addressing needs a bucket name that is a DNS label and a
  // DNS name for the endpoint; other S3 servers are addressed by path.
  c.path_style = flags.force_path_style || !c.endpoint_is_aws || c.location.bucket.find('.') != std::string::npos;
  c.sign = !flags.no_sign_request;
  if (flags.max_threads == 0) return Status::InvalidArgument("--max-threads must be at least 1");
  if (flags.part_size < (64 << 10))
    return Status::InvalidArgument("--part-size must be at least 64 KiB");
  if (flags.request_timeout_s == 0 || flags.request_timeout_s > 3600)
    return Status::InvalidArgument("--request-timeout-s must be 1..3600 seconds");
  c.max_threads = flags.max_threads;
  c.part_size = flags.part_size;
  c.retry_budget_ms = int64_t(flags.request_timeout_s) * 1000;
  if (c.sign)
    RETURN_IF_ERROR(ResolveCredentials(env, profile, HomeFile(env, "AWS_SHARED_CREDENTIALS_FILE", "credentials"),
                                       section, c.credentials));
  return c;
}

std::string S3Config::Root() const {
  std::string p = location.prefix;
  if (!p.empty()) p.pop_back();  // the trailing '/'
  return "s3://" + location.bucket + (p.empty() ? "" : "/" + p);
}

std::string S3Config::StoreKey() const { return endpoint + "/" + Root().substr(5); }

std::string S3Config::Describe() const {
  return "endpoint " + endpoint + ", region " + region + (path_style ? ", path-style" : ", virtual-hosted") +
         (sign ? ", credentials from " + credentials.source : ", unsigned requests") +
         (ca_bundle.empty() ? "" : ", CA bundle " + ca_bundle);
}

}  // namespace ckptfs
