#include "source/s3_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "source/s3_client.h"

namespace ckptfs {
namespace {

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

TEST(S3Config, ParsesUrlsWithAndWithoutPrefix) {
  auto a = ParseS3Url("s3://bucket/runs/a b+c");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bucket, "bucket");
  EXPECT_EQ(a->prefix, "runs/a b+c/");
  auto b = ParseS3Url("s3://bucket");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->prefix, "");
  EXPECT_EQ(ParseS3Url("s3://bucket/")->prefix, "");
  EXPECT_FALSE(ParseS3Url("s3:///x").ok());
  EXPECT_FALSE(ParseS3Url("/local/dir").ok());
}

TEST(S3Config, EnvironmentBeforeProfileAndFlagsBeforeEnvironment) {
  auto c = ResolveS3Config("s3://b/p", {}, Env({{"AWS_ACCESS_KEY_ID", "id"}, {"AWS_SECRET_ACCESS_KEY", "sk"},
                                                {"AWS_REGION", "eu-west-1"}, {"AWS_DEFAULT_REGION", "us-west-2"},
                                                {"AWS_ENDPOINT_URL", "http://a:1"}, {"AWS_ENDPOINT_URL_S3", "http://s3:2/"}}));
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->region, "eu-west-1");
  EXPECT_EQ(c->endpoint, "http://s3:2");
  EXPECT_TRUE(c->path_style);
  EXPECT_EQ(c->credentials.access_key_id, "id");
  S3Flags flags;
  flags.region = "ap-south-1";
  flags.endpoint_url = "http://flag:3";
  c = ResolveS3Config("s3://b/p", flags, Env({{"AWS_ACCESS_KEY_ID", "id"}, {"AWS_SECRET_ACCESS_KEY", "sk"},
                                             {"AWS_REGION", "eu-west-1"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->region, "ap-south-1");
  EXPECT_EQ(c->endpoint, "http://flag:3");
}

TEST(S3Config, AwsDefaultEndpointIsVirtualHostedUnlessForced) {
  S3Flags flags;
  flags.no_sign_request = true;
  auto c = ResolveS3Config("s3://bucket/p", flags, Env({}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->endpoint, "https://s3.us-east-1.amazonaws.com");
  EXPECT_FALSE(c->path_style);
  flags.force_path_style = true;
  EXPECT_TRUE(ResolveS3Config("s3://bucket/p", flags, Env({}))->path_style);
}

TEST(S3Config, RequestTimeoutIsTheRetryBudgetInMilliseconds) {
  S3Flags flags;
  flags.no_sign_request = true;
  EXPECT_EQ(ResolveS3Config("s3://b/p", flags, Env({}))->retry_budget_ms, 60'000);
  flags.request_timeout_s = 7;
  EXPECT_EQ(ResolveS3Config("s3://b/p", flags, Env({}))->retry_budget_ms, 7'000);
  for (unsigned bad : {0u, 3601u}) {
    flags.request_timeout_s = bad;
    auto c = ResolveS3Config("s3://b/p", flags, Env({}));
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find("--request-timeout-s"), std::string::npos) << c.status().message();
  }
}

// The URLs requests go to, spelled out by hand: the bucket in the host
// name for AWS, in the path when forced, for a dotted bucket (no TLS
// certificate covers it as a host) and for any other endpoint.
TEST(S3Config, RequestUrlsPutTheBucketInTheHostOrThePath) {
  S3Flags flags;
  flags.no_sign_request = true;
  auto aws = ResolveS3Config("s3://my-bucket/runs", flags, Env({{"AWS_REGION", "eu-west-1"}}));
  ASSERT_TRUE(aws.ok());
  EXPECT_EQ(S3Url(*aws, aws->endpoint, "runs/a b+c/é.distcp", ""),
            "https://my-bucket.s3.eu-west-1.amazonaws.com/runs/a%20b%2Bc/%C3%A9.distcp");
  EXPECT_EQ(S3Url(*aws, aws->endpoint, "", "list-type=2&prefix=runs%2F"),
            "https://my-bucket.s3.eu-west-1.amazonaws.com/?list-type=2&prefix=runs%2F");
  flags.force_path_style = true;
  auto forced = ResolveS3Config("s3://my-bucket/runs", flags, Env({{"AWS_REGION", "eu-west-1"}}));
  EXPECT_EQ(S3Url(*forced, forced->endpoint, "runs/x", ""),
            "https://s3.eu-west-1.amazonaws.com/my-bucket/runs/x");
  flags.force_path_style = false;
  auto dotted = ResolveS3Config("s3://my.bucket/runs", flags, Env({}));
  EXPECT_EQ(S3Url(*dotted, dotted->endpoint, "runs/x", ""),
            "https://s3.us-east-1.amazonaws.com/my.bucket/runs/x");
  auto other = ResolveS3Config("s3://my-bucket/runs", flags, Env({{"AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"}}));
  EXPECT_EQ(S3Url(*other, other->endpoint, "runs/x", ""), "http://127.0.0.1:9000/my-bucket/runs/x");
}

TEST(S3Config, CaBundleFromTheEnvironmentElseTheProfile) {
  S3Flags flags;
  flags.no_sign_request = true;
  const std::string dir = ::testing::TempDir();
  const std::string config = dir + "/aws-config-ca";
  {
    std::ofstream f(config);
    f << "[profile p]\nca_bundle = /etc/corp-ca.pem\n";
  }
  auto from_profile = ResolveS3Config("s3://b/p", flags, Env({{"AWS_CONFIG_FILE", config}, {"AWS_PROFILE", "p"}}));
  ASSERT_TRUE(from_profile.ok()) << from_profile.status().message();
  EXPECT_EQ(from_profile->ca_bundle, "/etc/corp-ca.pem");
  EXPECT_NE(from_profile->Describe().find("CA bundle /etc/corp-ca.pem"), std::string::npos);
  auto from_env = ResolveS3Config(
      "s3://b/p", flags, Env({{"AWS_CONFIG_FILE", config}, {"AWS_PROFILE", "p"}, {"AWS_CA_BUNDLE", "/x/ca.pem"}}));
  EXPECT_EQ(from_env->ca_bundle, "/x/ca.pem");
  EXPECT_EQ(ResolveS3Config("s3://b/p", flags, Env({}))->ca_bundle, "");
}

TEST(S3Config, NoCredentialsIsAnErrorThatSaysWhatToSet) {
  auto c = ResolveS3Config("s3://b/p", {}, Env({{"HOME", "/nonexistent"}}));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), Status::Code::kPermissionDenied);
  EXPECT_NE(c.status().message().find("AWS_ACCESS_KEY_ID"), std::string::npos);
  EXPECT_NE(c.status().message().find("--no-sign-request"), std::string::npos);
}

TEST(S3Config, ParsesAwsIniProfiles) {
  auto ini = ParseAwsIni("# comment\n[default]\naws_access_key_id = A\n[profile x]\n region=eu-1 \n; c\n");
  EXPECT_EQ(ini["default"]["aws_access_key_id"], "A");
  EXPECT_EQ(ini["profile x"]["region"], "eu-1");
}

TEST(S3Config, DescribeNeverShowsTheSecret) {
  auto c = ResolveS3Config("s3://b/p", {}, Env({{"AWS_ACCESS_KEY_ID", "id"}, {"AWS_SECRET_ACCESS_KEY", "TOPSECRET"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->Describe().find("TOPSECRET"), std::string::npos);
  EXPECT_EQ(c->StoreKey().find("TOPSECRET"), std::string::npos);
}

TEST(S3Client, EncodesKeysAsS3Wants) {
  EXPECT_EQ(S3Encode("a b+c/ü~.-_", true), "a%20b%2Bc/%C3%BC~.-_");
  EXPECT_EQ(S3Encode("a/b", false), "a%2Fb");
}

}  // namespace
}  // namespace ckptfs
