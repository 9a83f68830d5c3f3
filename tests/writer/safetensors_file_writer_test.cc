// One safetensors file through the stager: the layout safetensors' own
// serializer makes (dtype order, then name), the header parsed back by the
// indexer's codec, each tensor's bytes and CRC32C, and the refusals.
// Byte-for-byte equality with `safetensors.torch.save` for every dtype is
// tests/e2e/test_writer_hf.py's.
#include "writer/safetensors_file_writer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "core/crc32c.h"
#include "tests/temp_dirs.h"

namespace ckptfs {
namespace {

std::string TempPath(const std::string& name) {
  return TempDirs::Make("st_writer") / name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::unique_ptr<Stager> SmallStager() {
  StagerOptions o;
  o.buffer_bytes = 64;  // smaller than most tensors below: they cross buffers
  o.buffers = 2;
  o.zip_crc32 = false;
  auto st = Stager::Create(o, MakeHostCopyEngine());
  EXPECT_TRUE(st.ok()) << st.status().ToString();
  return std::move(*st);
}

TEST(SafetensorsFileWriter, LaysOutAsTheReferenceAndRecordsEachTensorsCrc) {
  auto stager = SmallStager();
  const std::string path = TempPath("shard.safetensors");
  auto w = SafetensorsFileWriter::Create(stager.get(), path);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  // Added out of the file's order: bf16 "b", f32 "z", i64 "y", f32 "a", bf16 "a".
  const std::vector<std::pair<std::string, std::string>> tensors = {
      {"b", "bfloat16"}, {"z", "float32"}, {"y", "int64"}, {"a", "float32"}, {"a16", "bfloat16"}};
  std::vector<std::string> data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t elem = tensors[i].second == "int64" ? 8 : tensors[i].second == "float32" ? 4 : 2;
    data.push_back(std::string(elem * 30, char('A' + i)));
    ASSERT_EQ(*(*w)->AddTensor(tensors[i].first, tensors[i].second, {5, 6}, data.back().size()), i);
  }
  ASSERT_TRUE((*w)->Seal({{"k", "v"}}).ok());
  for (size_t i = 0; i < data.size(); ++i)
    ASSERT_TRUE((*w)->Write(uint32_t(i), Slice{data[i].data(), data[i].size()}, false).ok());
  auto results = (*w)->Finish();
  ASSERT_TRUE(results.ok()) << results.status().ToString();

  const std::string file = ReadAll(path);
  auto n = DecodeHeaderLength(std::string_view(file).substr(0, 8), file.size());
  ASSERT_TRUE(n.ok());
  EXPECT_EQ((8 + *n) % 8, 0u);
  auto h = ParseSafetensorsHeader(std::string_view(file).substr(8, *n), *n);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  EXPECT_TRUE(CheckSafetensorsFileSize(*h, file.size()).ok());
  std::vector<std::string> order;
  for (const auto& e : h->entries) order.push_back(e.name);
  EXPECT_EQ(order, (std::vector<std::string>{"y", "a", "z", "a16", "b"}));  // I64 > F32 > BF16, then by name
  EXPECT_EQ(h->metadata, (std::map<std::string, std::string>{{"k", "v"}}));
  ASSERT_EQ(results->size(), data.size());
  for (size_t i = 0; i < data.size(); ++i) {
    const SafetensorsItemResult& r = (*results)[i];
    EXPECT_EQ(file.substr(r.offset, r.length), data[i]) << tensors[i].first;
    EXPECT_EQ(r.crc32c, Crc32c(0, data[i].data(), data[i].size())) << tensors[i].first;
  }
}

TEST(SafetensorsFileWriter, RefusesWhatAFileCannotHold) {
  auto stager = SmallStager();
  auto w = SafetensorsFileWriter::Create(stager.get(), TempPath("x.safetensors"));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor("w", "float32", {2}, 8).ok());
  EXPECT_EQ((*w)->AddTensor("w", "float32", {2}, 8).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ((*w)->AddTensor("v", "float32", {2}, 7).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ((*w)->AddTensor("u", "complex128", {2}, 32).status().code(), Status::Code::kNotSupported);
  EXPECT_FALSE((*w)->Write(0, Slice{"12345678", 8}, true).ok());  // before Seal
  ASSERT_TRUE((*w)->Seal({}).ok());
  EXPECT_FALSE((*w)->AddTensor("late", "float32", {1}, 4).ok());
  EXPECT_FALSE((*w)->Finish().ok());  // "w" got none of its 8 bytes
}

TEST(SafetensorsFileWriter, TypesAreThoseSafetensorsTorchSaveWrites) {
  auto f4 = SafetensorsTypeOf("float4_e2m1fn_x2", {3, 4});  // bytes of two values: the last dim doubles
  ASSERT_TRUE(f4.ok()) << f4.status().ToString();
  EXPECT_EQ(f4->dtype, DType::kF4);
  EXPECT_EQ(f4->shape, (std::vector<uint64_t>{3, 8}));
  EXPECT_EQ(SafetensorsTypeOf("float8_e8m0fnu", {2})->dtype, DType::kF8_E8M0);
  EXPECT_EQ(SafetensorsTypeOf("float8_e5m2fnuz", {2})->dtype, DType::kF8_E5M2FNUZ);
  EXPECT_EQ(SafetensorsTypeOf("uint64", {})->shape, std::vector<uint64_t>{});
  for (const char* refused : {"complex128", "complex32", "uint4", "bits8"}) {
    auto r = SafetensorsTypeOf(refused, {2});
    EXPECT_EQ(r.status().code(), Status::Code::kNotSupported) << refused;
    EXPECT_NE(r.status().message().find(std::string("torch.") + refused), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(SafetensorsTypeOf("float4_e2m1fn_x2", {}).status().code(), Status::Code::kNotSupported);  // 0-d
}

TEST(SafetensorsFileWriter, DTypeOrderIsTheCratesEnumOrder) {
  // Larger first in a file, as safetensors.torch.save 0.8 lays out one
  // tensor of each: U64 I64 F64 C64 F32 U32 I32 BF16 F16 U16 I16
  // F8_E5M2FNUZ F8_E4M3FNUZ F8_E8M0 F8_E4M3 F8_E5M2 I8 U8 F4 BOOL.
  const DType file_order[] = {DType::kU64, DType::kI64, DType::kF64, DType::kC64, DType::kF32, DType::kU32,
                              DType::kI32, DType::kBF16, DType::kF16, DType::kU16, DType::kI16,
                              DType::kF8_E5M2FNUZ, DType::kF8_E4M3FNUZ, DType::kF8_E8M0, DType::kF8_E4M3,
                              DType::kF8_E5M2, DType::kI8, DType::kU8, DType::kF4, DType::kBOOL};
  for (size_t i = 1; i < std::size(file_order); ++i)
    EXPECT_GT(SafetensorsDTypeOrder(file_order[i - 1]), SafetensorsDTypeOrder(file_order[i])) << i;
}

}  // namespace
}  // namespace ckptfs
