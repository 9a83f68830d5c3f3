// What the S3 stager decides without a server: the part size for an
// object's size (S3's limits: parts >= 5 MiB, at most 10,000 of them) and
// the configurations it refuses. Uploads themselves run against a real
// SeaweedFS in tests/e2e/test_writer_s3*.py.
#include <gtest/gtest.h>

#include "writer/s3_stager.h"

namespace ckptfs {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

TEST(S3Stager, PartSizeKeepsAnObjectWithinTenThousandParts) {
  EXPECT_EQ(PartBytesFor(0, 16 * kMiB), 16 * kMiB);
  EXPECT_EQ(PartBytesFor(100 * kMiB, 1 * kMiB), 5 * kMiB);  // never under S3's minimum
  EXPECT_EQ(PartBytesFor(10'000 * 16 * kMiB, 16 * kMiB), 16 * kMiB);  // exactly 10,000 parts
  // One byte more needs a larger part, rounded up to a MiB.
  EXPECT_EQ(PartBytesFor(10'000 * 16 * kMiB + 1, 16 * kMiB), 17 * kMiB);
  const uint64_t tib = 1ull << 40;
  const uint64_t p = PartBytesFor(tib, 16 * kMiB);
  EXPECT_EQ(p % kMiB, 0u);
  EXPECT_LE((tib + p - 1) / p, kS3MaxParts);
  EXPECT_GT((tib + (p - kMiB) - 1) / (p - kMiB), kS3MaxParts);  // and it is the smallest such
}

TEST(S3Stager, RefusesPartsUnderFiveMiBAndRingsOfOneBuffer) {
  S3Config config;
  config.location.bucket = "b";
  config.endpoint = "http://127.0.0.1:1";
  auto client = std::make_shared<S3Client>(config);
  S3StagerOptions small;
  small.part_bytes = 4 * kMiB;
  auto r = S3Stager::Create(small, client, MakeHostCopyEngine());
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("5 MiB"), std::string::npos) << r.status().ToString();
  S3StagerOptions one;
  one.part_bytes = 5 * kMiB;
  one.buffers = 1;
  EXPECT_FALSE(S3Stager::Create(one, client, MakeHostCopyEngine()).ok());
  EXPECT_FALSE(S3Stager::Create(S3StagerOptions{}, nullptr, MakeHostCopyEngine()).ok());
}

}  // namespace
}  // namespace ckptfs
