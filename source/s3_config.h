// Where an `s3://BUCKET/PREFIX` root lives and how to reach it, resolved the
// way the AWS CLI and SDKs resolve it, so existing setups just work:
//  - endpoint: --endpoint-url, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL,
//    else `endpoint_url` of the profile in ~/.aws/config, else AWS's own
//    (https://s3.REGION.amazonaws.com);
//  - region: --region, else AWS_REGION, else AWS_DEFAULT_REGION, else the
//    profile's `region`, else us-east-1;
//  - credentials (unless --no-sign-request): AWS_ACCESS_KEY_ID +
//    AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN), else the profile
//    (AWS_PROFILE, else "default") in AWS_SHARED_CREDENTIALS_FILE or
//    ~/.aws/credentials, then in AWS_CONFIG_FILE or ~/.aws/config;
//  - the CAs trusted for https: AWS_CA_BUNDLE, else the profile's
//    `ca_bundle`, else the system's.
// Secrets are never printed: ToString() and every message leave them out.
// Pure: reads the environment and the two files only.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "core/status.h"

namespace ckptfs {

struct S3Location {
  std::string bucket;
  std::string prefix;  // "" or ending in '/': keys below it are the tree
};

// True for "s3://...".
bool IsS3Url(const std::string& root);

// Parses "s3://BUCKET[/PREFIX]"; the prefix gets a trailing '/'.
Result<S3Location> ParseS3Url(const std::string& url);

// What the command line says (mountpoint-s3's flag names).
struct S3Flags {
  std::string endpoint_url;
  std::string region;
  bool no_sign_request = false;
  bool force_path_style = false;
  unsigned max_threads = 16;
  uint64_t part_size = 8ull << 20;
  unsigned request_timeout_s = 60;  // --request-timeout-s
};

struct S3Credentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;
  std::string source;  // where they came from ("environment", "profile default in ~/.aws/credentials")
};

struct S3Config {
  S3Location location;
  std::string endpoint;  // scheme://host[:port], no trailing '/'
  bool endpoint_is_aws = false;
  std::string region;
  bool path_style = true;  // https://host/bucket/key, else https://bucket.host/key
  bool sign = true;
  S3Credentials credentials;
  std::string ca_bundle;  // PEM file of the CAs to trust for https; "" = the system's
  unsigned max_threads = 16;
  uint64_t part_size = 8ull << 20;
  // How long one request may take, its retries included (S3Client).
  int64_t retry_budget_ms = 60'000;

  // "s3://bucket/prefix" (what the user typed, canonical).
  std::string Root() const;
  // Keys the local store: endpoint, bucket and prefix.
  std::string StoreKey() const;
  // For messages: endpoint, region, addressing, where the credentials came
  // from; never the credentials.
  std::string Describe() const;
};

// Looks up an environment variable; tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup ProcessEnv();

Result<S3Config> ResolveS3Config(const std::string& url, const S3Flags& flags, const EnvLookup& env = ProcessEnv());

// Sections of an INI file as the AWS CLI reads them: "[name]" then
// "key = value" lines; '#' and ';' start comments.
std::map<std::string, std::map<std::string, std::string>> ParseAwsIni(const std::string& text);

}  // namespace ckptfs
