// The torch.save reader against archives the real torch wrote: third-party
// fixtures (tests/fixtures/third_party, see SOURCES.md there) and files
// made by tests/indexer/testdata/make_torch_save.py, whose printed output is
// pasted below as the expected tensors. Values are compared element by
// element, gathered from the file through the reported offsets and strides,
// so a wrong offset, stride or dtype cannot pass. Then the zip edge cases:
// truncation, directories and entries pointing outside, compression.
#include "indexer/torch_zip.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "source/posix_io.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;
using namespace std::string_literals;

std::string TestData(const std::string& name) {
  return (fs::path(__FILE__).parent_path() / "testdata" / name).string();
}
std::string ThirdParty(const std::string& name) {
  return std::string(CKPTFS_FIXTURES_DIR) + "/third_party/" + name;
}

std::string Slurp(const std::string& path) {
  auto r = ReadWholeFile(path);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : "";
}

// A scratch file holding `bytes`, removed with the test.
class TempFile {
 public:
  explicit TempFile(const std::string& bytes) {
    path_ = (fs::path(::testing::TempDir()) /
             ("torch_zip_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++)))
                .string();
    std::ofstream(path_, std::ios::binary) << bytes;
  }
  ~TempFile() { fs::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  std::string path_;
};

std::string Hex(std::string_view bytes) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (char c : bytes) {
    out.push_back(kHex[uint8_t(c) >> 4]);
    out.push_back(kHex[uint8_t(c) & 15]);
  }
  return out;
}

// The tensor's elements in logical row-major order, read from the file
// through data_offset and strides; each must lie inside the reported span.
std::string Gather(const std::string& file, const TorchTensorRecord& r) {
  uint64_t item = DTypeBits(r.dtype) / 8;
  uint64_t numel = 1;
  for (uint64_t d : r.shape) numel *= d;
  std::string out;
  std::vector<uint64_t> idx(r.shape.size(), 0);
  for (uint64_t n = 0; n < numel; ++n) {
    uint64_t el = 0;
    for (size_t d = 0; d < idx.size(); ++d) el += idx[d] * r.strides[d];
    uint64_t off = r.data_offset + el * item;
    EXPECT_LE(el * item + item, r.storage_bytes_available);
    if (off + item > file.size()) {
      ADD_FAILURE() << "element past end of file";
      return out;
    }
    out += file.substr(off, item);
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < r.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

std::vector<float> GatherF32(const std::string& file, const TorchTensorRecord& r) {
  std::string b = Gather(file, r);
  std::vector<float> out(b.size() / 4);
  std::memcpy(out.data(), b.data(), out.size() * 4);
  return out;
}

struct Expected {
  std::vector<std::string> path;
  std::string torch_dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;
  uint64_t storage_offset;
  std::string hex;
};

void ExpectTensors(const TorchArchive& ar, const std::string& file, const std::vector<Expected>& want) {
  ASSERT_EQ(ar.tensors.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const TorchTensorRecord& r = ar.tensors[i];
    const Expected& w = want[i];
    SCOPED_TRACE(::testing::PrintToString(w.path));
    EXPECT_EQ(r.path, w.path);
    EXPECT_EQ(r.torch_dtype, w.torch_dtype);
    EXPECT_EQ(r.dtype, DTypeFromTorchName(w.torch_dtype).value());
    EXPECT_EQ(r.shape, w.shape);
    EXPECT_EQ(r.strides, w.strides);
    EXPECT_EQ(r.storage_offset, w.storage_offset);
    EXPECT_EQ(Hex(Gather(file, r)), w.hex);
  }
}

// An empty archive (no pickle, no tensors) when the read fails: callers
// ASSERT on what they dereference.
TorchArchive MustRead(const std::string& path) {
  auto ar = ReadTorchArchiveFile(path);
  EXPECT_TRUE(ar.ok()) << ar.status().ToString();
  return ar.ok() ? std::move(ar).value() : TorchArchive{};
}

// v[k1][k2]... through dicts; nullptr when a step is missing.
const PickleValue* Lookup(const PickleValue* v, std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys) v = v ? v->DictGet(k) : nullptr;
  return v;
}

// ---------------------------------------------------------------------------
// Archives written by torch 2.13 (make_torch_save.py output, pasted).

TEST(TorchZipTest, EveryDtypeFromTorch) {
  std::string path = TestData("dtypes.pt");
  TorchArchive ar = MustRead(path);
  ASSERT_NE(ar.pickle, nullptr);
  EXPECT_EQ(ar.root, "dtypes");
  EXPECT_FALSE(ar.pickle->has_unknown_globals());
  ExpectTensors(ar, Slurp(path), {
      {{"bf16"}, "bfloat16", {3}, {1}, 0, "c03f10c09248"},
      {{"f16"}, "float16", {2, 2}, {2, 1}, 0, "003800bcff7b0100"},
      {{"f32"}, "float32", {3}, {1}, 0, "0000803fcdccccbd00005040"},
      {{"f64"}, "float64", {1}, {1}, 0, "cd3b7f669ea0f63f"},
      {{"f8_e4m3"}, "float8_e4m3fn", {4}, {1}, 0, "30c07e00"},
      {{"f8_e5m2"}, "float8_e5m2", {2}, {1}, 0, "3cfb"},
      {{"u16"}, "uint16", {3}, {1}, 0, "00000100ffff"},
      {{"u32"}, "uint32", {1}, {1}, 0, "00286bee"},
      {{"i64"}, "int64", {2}, {1}, 0, "ffffffffffffffff0000000000010000"},
      {{"i32"}, "int32", {1}, {1}, 0, "f9ffffff"},
      {{"i16"}, "int16", {2}, {1}, 0, "d4fe2c01"},
      {{"i8"}, "int8", {2}, {1}, 0, "807f"},
      {{"u8"}, "uint8", {1}, {1}, 0, "ff"},
      {{"bool"}, "bool", {3}, {1}, 0, "010001"},
      {{"c64"}, "complex64", {1}, {1}, 0, "0000803f00000040"},
      {{"scalar"}, "float32", {}, {}, 0, "0000e040"},
      {{"empty"}, "float32", {0, 3}, {3, 1}, 0, ""},
  });
  ASSERT_EQ(ar.tensors.size(), 17u);
  EXPECT_EQ(ar.tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(ar.tensors[4].dtype, DType::kF8_E4M3);
  EXPECT_EQ(ar.tensors[5].dtype, DType::kF8_E5M2);
  EXPECT_EQ(ar.tensors[6].dtype, DType::kU16);
  EXPECT_EQ(ar.tensors[13].dtype, DType::kBOOL);
  EXPECT_EQ(ar.tensors[14].dtype, DType::kC64);
  // torch pads every storage to 64 bytes with the FB extra field.
  for (const auto& e : ar.zip.entries) {
    if (e.name.find("/data/") == std::string::npos) continue;
    EXPECT_EQ(e.data_offset % 64, 0u) << e.name;
  }
  // float8 and uint16 use _rebuild_tensor_v3 with an UntypedStorage counted
  // in bytes: the whole storage is exactly the tensor.
  EXPECT_EQ(ar.tensors[4].storage_bytes_available, 4u);
  EXPECT_EQ(ar.tensors[6].storage_bytes_available, 6u);
}

TEST(TorchZipTest, NonContiguousAndOffsetViews) {
  std::string path = TestData("views.pt");
  TorchArchive ar = MustRead(path);
  ExpectTensors(ar, Slurp(path), {
      {{"transposed"}, "float32", {4, 3}, {1, 4}, 0,
       "0000000000008040000000410000803f0000a04000001041000000400000c04000002041000040400000e04000003041"},
      {{"offset"}, "float32", {4}, {1}, 3, "00004040000080400000a0400000c040"},
      {{"column"}, "float32", {3}, {4}, 1, "0000803f0000a04000001041"},
      {{"shared_a"}, "int32", {4}, {1}, 0, "00000000010000000200000003000000"},
      {{"shared_b"}, "int32", {4}, {1}, 4, "04000000050000000600000007000000"},
  });
  ASSERT_EQ(ar.tensors.size(), 5u);
  const auto &transposed = ar.tensors[0], &offset = ar.tensors[1], &column = ar.tensors[2];
  const auto &a = ar.tensors[3], &b = ar.tensors[4];
  // Views keep their base's storage: one entry, offsets into it.
  EXPECT_EQ(column.storage_key, transposed.storage_key);
  EXPECT_EQ(column.data_offset, transposed.data_offset + 4);
  EXPECT_EQ(transposed.storage_bytes_available, 48u);
  EXPECT_EQ(offset.storage_bytes_available, (10u - 3) * 4);
  EXPECT_EQ(a.storage_key, b.storage_key);
  EXPECT_EQ(b.data_offset, a.data_offset + 16);
  EXPECT_EQ(b.storage_bytes_available, 16u);
}

TEST(TorchZipTest, NestedTrainerStateAndPlainValues) {
  std::string path = TestData("nested.pt");
  TorchArchive ar = MustRead(path);
  ExpectTensors(ar, Slurp(path), {
      {{"model", "layer.weight"}, "bfloat16", {2, 3}, {3, 1}, 0, "803f803f803f803f803f803f"},
      {{"model", "layer.bias"}, "bfloat16", {2}, {1}, 0, "00000000"},
      {{"optim", "state", "0", "step"}, "float32", {}, {}, 0, "00004040"},
      {{"optim", "state", "0", "exp_avg"}, "float32", {2, 3}, {3, 1}, 0,
       "0000803e0000803e0000803e0000803e0000803e0000803e"},
      {{"list", "0"}, "int8", {2}, {1}, 0, "0102"},
      {{"list", "1", "0"}, "int8", {1}, {1}, 0, "03"},
      {{"param"}, "float32", {2}, {1}, 0, "0000003f0000c03f"},  // nn.Parameter
  });
  ASSERT_NE(ar.pickle, nullptr);
  EXPECT_FALSE(ar.pickle->has_unknown_globals());
  const PickleValue* root = &ar.pickle->root();
  for (const char* key : {"epoch", "loss", "note", "optim", "param"}) ASSERT_NE(Lookup(root, {key}), nullptr) << key;
  EXPECT_EQ(Lookup(root, {"epoch"})->AsInt(), 3);
  EXPECT_EQ(Lookup(root, {"loss"})->AsFloat(), 0.125);
  ASSERT_NE(Lookup(root, {"note"})->AsStr(), nullptr);
  EXPECT_EQ(*Lookup(root, {"note"})->AsStr(), "hi");
  const PickleValue* groups = Lookup(root, {"optim", "param_groups"});
  ASSERT_NE(groups, nullptr);
  ASSERT_NE(groups->At(0), nullptr);
  const PickleValue* lr = Lookup(groups->At(0), {"lr"});
  ASSERT_NE(lr, nullptr);
  EXPECT_EQ(lr->AsFloat(), 0.001);
  const PickleValue* state = Lookup(root, {"optim", "state"});
  ASSERT_NE(state, nullptr);
  EXPECT_NE(state->DictGetInt(0), nullptr);
  EXPECT_TRUE(Lookup(root, {"param"})->IsCallOf("torch._utils", "_rebuild_parameter"));
}

TEST(TorchZipTest, BareTensorHasAnEmptyPath) {
  std::string path = TestData("bare.pt");
  ExpectTensors(MustRead(path), Slurp(path), {{{}, "int16", {1, 3}, {3, 1}, 0, "010002000300"}});
}

TEST(TorchZipTest, ZipWrittenByPythonZipfile) {
  // No zip64 records, no alignment padding, real sizes in local headers, and
  // a comment after the end record.
  std::string path = TestData("rezipped.pt");
  TorchArchive ar = MustRead(path);
  EXPECT_EQ(ar.root, "bare");
  ExpectTensors(ar, Slurp(path), {{{}, "int16", {1, 3}, {3, 1}, 0, "010002000300"}});
}

TEST(TorchZipTest, CompressedArchiveIsRefused) {
  auto ar = ReadTorchArchiveFile(TestData("deflated.pt"));
  ASSERT_FALSE(ar.ok());
  EXPECT_EQ(ar.status().code(), Status::Code::kNotSupported);
  EXPECT_NE(ar.status().message().find("entry 'bare/data.pkl' is compressed (method 8)"), std::string::npos)
      << ar.status().ToString();
}

TEST(TorchZipTest, HostileObjectInArchiveStaysInert) {
  const char* pwned = "/tmp/ckptfs_torch_zip_test_pwned";  // make_torch_save.py's Evil
  ::unlink(pwned);
  std::string path = TestData("evil.pt");
  TorchArchive ar = MustRead(path);
  ExpectTensors(ar, Slurp(path), {{{"w"}, "float32", {1}, {1}, 0, "00001041"}});
  ASSERT_NE(ar.pickle, nullptr);
  EXPECT_EQ(ar.pickle->unknown_globals(), std::vector<std::string>{"posix.system"});
  const PickleValue* payload = ar.pickle->root().DictGet("payload");
  ASSERT_TRUE(payload);
  EXPECT_TRUE(payload->IsCallOf("posix", "system"));
  EXPECT_EQ(*payload->args()->At(0)->AsStr(), "touch /tmp/ckptfs_torch_zip_test_pwned");
  EXPECT_NE(::access(pwned, F_OK), 0) << "reading the archive ran its payload";
}

TEST(TorchZipTest, ArchiveEmbeddedAtAnOffset) {
  std::string bare = Slurp(TestData("bare.pt"));
  TempFile f(std::string(100, 'J') + bare + std::string(50, 'K'));
  ScopedFd fd(::open(f.path().c_str(), O_RDONLY));
  auto ar = ReadTorchArchive(fd.get(), 100, bare.size(), "item");
  ASSERT_TRUE(ar.ok()) << ar.status().ToString();
  auto direct = MustRead(TestData("bare.pt"));
  ASSERT_EQ(ar->tensors.size(), 1u);
  EXPECT_EQ(ar->tensors[0].data_offset, direct.tensors[0].data_offset + 100);
  EXPECT_EQ(Hex(Gather(Slurp(f.path()), ar->tensors[0])), "010002000300");
}

// DCP FileSystemWriter output: .metadata is a plain pickle; each tensor
// chunk in the .distcp file is a torch.save archive at _StorageInfo.offset.
TEST(TorchZipTest, DcpMetadataAndDistcpItems) {
  auto meta_bytes = Slurp(TestData("dcp/.metadata"));
  auto meta = Unpickle(meta_bytes);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  const PickleDocument& doc = **meta;
  EXPECT_FALSE(doc.has_unknown_globals()) << ::testing::PrintToString(doc.unknown_globals());
  EXPECT_GE(doc.protocol(), 4);
  const PickleValue& root = doc.root();
  ASSERT_EQ(root.kind(), PickleValue::Kind::kBuild);
  EXPECT_TRUE(root.Unwrapped().IsCallOf("torch.distributed.checkpoint.metadata", "Metadata"));
  const PickleValue* state = root.build_state();

  ASSERT_NE(state, nullptr);
  const PickleValue* w = Lookup(state, {"state_dict_metadata", "w"});
  ASSERT_TRUE(w && w->build_state());
  EXPECT_TRUE(w->Unwrapped().IsCallOf("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"));
  ASSERT_NE(Lookup(w->build_state(), {"size"}), nullptr);
  EXPECT_EQ(AsShape(*Lookup(w->build_state(), {"size"})), (std::vector<uint64_t>{3, 4}));
  const PickleValue* props = Lookup(w->build_state(), {"properties"});
  ASSERT_TRUE(props && props->build_state() && props->build_state()->AsTuple());
  props = props->build_state();
  EXPECT_TRUE(props->At(0)->IsGlobal("torch", "bfloat16"));
  EXPECT_EQ(DTypeFromTorchName(props->At(0)->global_name()), DType::kBF16);
  const PickleValue* chunks = Lookup(w->build_state(), {"chunks"});
  ASSERT_TRUE(chunks && chunks->At(0) && chunks->At(0)->build_state());
  const PickleValue* offsets = Lookup(chunks->At(0)->build_state(), {"offsets"});
  const PickleValue* sizes = Lookup(chunks->At(0)->build_state(), {"sizes"});
  ASSERT_TRUE(offsets && sizes);
  EXPECT_EQ(AsShape(*offsets), (std::vector<uint64_t>{0, 0}));
  EXPECT_EQ(AsShape(*sizes), (std::vector<uint64_t>{3, 4}));
  const PickleValue* step_meta = Lookup(state, {"state_dict_metadata", "step"});
  ASSERT_NE(step_meta, nullptr);
  EXPECT_TRUE(step_meta->IsCallOf("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"));

  std::string distcp_path = TestData("dcp/__0_0.distcp");
  std::string distcp = Slurp(distcp_path);
  ScopedFd fd(::open(distcp_path.c_str(), O_RDONLY));
  std::map<std::string, std::pair<int64_t, int64_t>> items;
  const PickleValue* storage_data = Lookup(state, {"storage_data"});
  ASSERT_TRUE(storage_data && storage_data->AsDict());
  for (const auto& [index, info] : *storage_data->AsDict()) {
    const PickleValue* fqn = Lookup(index->build_state(), {"fqn"});
    const PickleValue* s = info->build_state();
    EXPECT_TRUE(info->Unwrapped().IsCallOf("torch.distributed.checkpoint.filesystem", "_StorageInfo"));
    const PickleValue* path = Lookup(s, {"relative_path"});
    const PickleValue* offset = Lookup(s, {"offset"});
    const PickleValue* length = Lookup(s, {"length"});
    ASSERT_TRUE(fqn && fqn->AsStr() && path && path->AsStr() && offset && offset->AsInt() && length &&
                length->AsInt());
    EXPECT_EQ(*path->AsStr(), "__0_0.distcp");
    items[*fqn->AsStr()] = {*offset->AsInt(), *length->AsInt()};
  }
  // As torch's FileSystemReader reported them (make_torch_save.py output).
  EXPECT_EQ(items["step"], std::make_pair(int64_t{0}, int64_t{1261}));
  EXPECT_EQ(items["w"], std::make_pair(int64_t{1261}, int64_t{1577}));
  EXPECT_EQ(items["nested.b"], std::make_pair(int64_t{2838}, int64_t{1577}));

  auto item = [&](const std::string& fqn) {
    auto ar = ReadTorchArchive(fd.get(), items[fqn].first, items[fqn].second, distcp_path + "@" + fqn);
    EXPECT_TRUE(ar.ok()) << ar.status().ToString();
    return ar.ok() ? std::move(ar).value() : TorchArchive{};
  };
  TorchArchive step = item("step");  // BYTE_IO: a torch.save of the int
  ASSERT_NE(step.pickle, nullptr);
  EXPECT_TRUE(step.tensors.empty());
  EXPECT_EQ(step.pickle->root().AsInt(), 7);
  TorchArchive w_item = item("w");
  EXPECT_EQ(w_item.root, "archive");  // torch.save into a BytesIO
  ExpectTensors(w_item, distcp, {{{}, "bfloat16", {3, 4}, {4, 1}, 0, "0000803f004040408040a040c040e0400041104120413041"}});
  ExpectTensors(item("nested.b"), distcp, {{{}, "int64", {2}, {1}, 0, "05000000000000000600000000000000"}});
}

// ---------------------------------------------------------------------------
// Third-party fixtures; expected values from torch.load (torch 2.13).

TEST(TorchZipTest, BurnFloat32AndBfloat16) {
  std::string path = ThirdParty("burn/float32.pt");
  TorchArchive ar = MustRead(path);
  ASSERT_EQ(ar.tensors.size(), 1u);
  EXPECT_EQ(ar.tensors[0].path, std::vector<std::string>{"tensor"});
  EXPECT_EQ(ar.tensors[0].dtype, DType::kF32);
  EXPECT_EQ(ar.tensors[0].shape, std::vector<uint64_t>{4});
  EXPECT_EQ(GatherF32(Slurp(path), ar.tensors[0]), (std::vector<float>{1.0f, 2.5f, -3.7f, 0.0f}));

  path = ThirdParty("burn/bfloat16.pt");
  ar = MustRead(path);
  ASSERT_EQ(ar.tensors.size(), 1u);
  EXPECT_EQ(ar.tensors[0].dtype, DType::kBF16);
  EXPECT_EQ(ar.tensors[0].torch_dtype, "bfloat16");  // from torch.BFloat16Storage
  EXPECT_EQ(ar.tensors[0].shape, std::vector<uint64_t>{3});
  // 1.5, -2.5, 3.5 as bfloat16 bits 0x3fc0, 0xc020, 0x4060 (little-endian).
  EXPECT_EQ(Hex(Gather(Slurp(path), ar.tensors[0])), "c03f20c06040");
}

TEST(TorchZipTest, BurnCheckpointNestedDicts) {
  std::string path = ThirdParty("burn/checkpoint.pt");
  std::string file = Slurp(path);
  TorchArchive ar = MustRead(path);
  ASSERT_NE(ar.pickle, nullptr);
  EXPECT_FALSE(ar.pickle->has_unknown_globals());
  ASSERT_EQ(ar.tensors.size(), 5u);
  using P = std::vector<std::string>;
  using S = std::vector<uint64_t>;
  EXPECT_EQ(ar.tensors[0].path, (P{"model_state_dict", "fc1.weight"}));
  EXPECT_EQ(ar.tensors[0].shape, (S{10, 5}));
  EXPECT_EQ(ar.tensors[0].strides, (S{5, 1}));
  EXPECT_EQ(ar.tensors[1].path, (P{"model_state_dict", "fc1.bias"}));
  EXPECT_EQ(ar.tensors[1].shape, (S{10}));
  EXPECT_EQ(ar.tensors[2].path, (P{"model_state_dict", "fc2.weight"}));
  EXPECT_EQ(ar.tensors[2].shape, (S{3, 10}));
  EXPECT_EQ(ar.tensors[3].path, (P{"model_state_dict", "fc2.bias"}));
  EXPECT_EQ(ar.tensors[4].path, (P{"optimizer_state_dict", "state", "0", "momentum_buffer"}));
  EXPECT_EQ(ar.tensors[4].shape, (S{10, 5}));

  auto w = GatherF32(file, ar.tensors[0]);
  ASSERT_EQ(w.size(), 50u);
  EXPECT_EQ(w[0], float(1.0414010286331177));
  EXPECT_EQ(w[1], float(-0.3997306227684021));
  EXPECT_EQ(w[2], float(-2.293334484100342));
  EXPECT_EQ(w[49], float(1.080486536026001));
  EXPECT_EQ(GatherF32(file, ar.tensors[3]),
            (std::vector<float>{float(1.4371334314346313), float(-0.4400617480278015), float(0.4995947778224945)}));
  const PickleValue* epoch = Lookup(&ar.pickle->root(), {"epoch"});
  const PickleValue* loss = Lookup(&ar.pickle->root(), {"loss"});
  ASSERT_TRUE(epoch && loss);
  EXPECT_EQ(epoch->AsInt(), 42);
  EXPECT_EQ(loss->AsFloat(), 0.123);
}

TEST(TorchZipTest, BurnLinearOrderedDictWithMetadata) {
  // An older archive (no .format_version): the root is an OrderedDict that
  // BUILD gives a `_metadata` attribute.
  std::string path = ThirdParty("burn/linear.pt");
  TorchArchive ar = MustRead(path);
  ASSERT_NE(ar.pickle, nullptr);
  const PickleValue& root = ar.pickle->root();
  ASSERT_EQ(root.kind(), PickleValue::Kind::kBuild);
  EXPECT_TRUE(root.Unwrapped().is_ordered_dict());
  const PickleValue* meta = root.build_state()->DictGet("_metadata");
  ASSERT_TRUE(meta && meta->is_ordered_dict());
  const PickleValue* version = Lookup(meta, {"fc1", "version"});
  ASSERT_NE(version, nullptr);
  EXPECT_EQ(version->AsInt(), 1);
  ASSERT_EQ(ar.tensors.size(), 3u);
  EXPECT_EQ(ar.tensors[0].path, std::vector<std::string>{"fc1.weight"});
  EXPECT_EQ(ar.tensors[0].shape, (std::vector<uint64_t>{3, 2}));
  EXPECT_EQ(ar.tensors[2].path, std::vector<std::string>{"fc2.weight"});
  EXPECT_EQ(ar.tensors[2].shape, (std::vector<uint64_t>{4, 3}));
  EXPECT_EQ(GatherF32(Slurp(path), ar.tensors[1]),
            (std::vector<float>{float(-0.1454697847366333), float(0.35973626375198364), float(0.09829986095428467)}));
}

TEST(TorchZipTest, CandleInt64WithAndWithoutKey) {
  std::string path = ThirdParty("candle/test.pt");
  TorchArchive ar = MustRead(path);
  ASSERT_EQ(ar.tensors.size(), 1u);
  EXPECT_EQ(ar.tensors[0].path, std::vector<std::string>{"test"});
  EXPECT_EQ(ar.tensors[0].dtype, DType::kI64);
  EXPECT_EQ(ar.tensors[0].shape, (std::vector<uint64_t>{2, 4}));
  std::string b = Gather(Slurp(path), ar.tensors[0]);
  std::vector<int64_t> v(8);
  ASSERT_EQ(b.size(), 64u);
  std::memcpy(v.data(), b.data(), 64);
  EXPECT_EQ(v, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));

  ar = MustRead(ThirdParty("candle/test_with_key.pt"));
  ASSERT_EQ(ar.tensors.size(), 1u);
  EXPECT_EQ(ar.tensors[0].path, (std::vector<std::string>{"model_state_dict", "test"}));
}

// ---------------------------------------------------------------------------
// Zip edge cases, made by patching real archives.

uint32_t Get32(const std::string& s, size_t at) {
  uint32_t v;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}
void Put16(std::string& s, size_t at, uint16_t v) { std::memcpy(s.data() + at, &v, 2); }
void Put32(std::string& s, size_t at, uint32_t v) { std::memcpy(s.data() + at, &v, 4); }
void Put64(std::string& s, size_t at, uint64_t v) { std::memcpy(s.data() + at, &v, 8); }

Status ReadBytes(const std::string& bytes) {
  TempFile f(bytes);
  auto ar = ReadTorchArchiveFile(f.path());
  return ar.ok() ? Status::OK() : ar.status();
}

// Offset of the central directory entry named `name` (rezipped.pt has no
// zip64 record, so its EOCD holds the real directory offset).
size_t CentralEntry(const std::string& zip, const std::string& name) {
  size_t cd = Get32(zip, zip.rfind("PK\x05\x06"s) + 16);
  for (size_t at = cd; at + 46 <= zip.size() && zip.compare(at, 4, "PK\x01\x02"s) == 0;) {
    uint16_t n, e, c;
    std::memcpy(&n, zip.data() + at + 28, 2);
    std::memcpy(&e, zip.data() + at + 30, 2);
    std::memcpy(&c, zip.data() + at + 32, 2);
    if (zip.compare(at + 46, n, name) == 0) return at;
    at += 46 + n + e + c;
  }
  ADD_FAILURE() << "no central entry " << name;
  return 0;
}

TEST(TorchZipEdgeTest, EveryTruncationFails) {
  // Cutting the range anywhere short of the end loses the end record or
  // leaves the directory pointing past the range.
  for (const char* name : {"bare.pt", "rezipped.pt"}) {
    std::string path = TestData(name);
    uint64_t size = fs::file_size(path);
    ScopedFd fd(::open(path.c_str(), O_RDONLY));
    for (uint64_t n = 0; n < size; ++n) {
      auto ar = ReadTorchArchive(fd.get(), 0, n, name);
      ASSERT_FALSE(ar.ok()) << name << " cut to " << n;
      EXPECT_EQ(ar.status().code(), Status::Code::kCorruption) << ar.status().ToString();
    }
  }
  std::string bare = Slurp(TestData("bare.pt"));
  EXPECT_NE(ReadBytes(bare.substr(0, 10)).message().find("zip: 10 bytes is too short"), std::string::npos);
  EXPECT_NE(ReadBytes(bare.substr(0, bare.size() - 1)).message().find("no end-of-central-directory record"),
            std::string::npos);
}

TEST(TorchZipEdgeTest, CentralDirectoryOutsideTheArchive) {
  // torch's zip64 record: the directory offset at +48.
  std::string bare = Slurp(TestData("bare.pt"));
  size_t z64 = bare.rfind("PK\x06\x06"s);
  ASSERT_NE(z64, std::string::npos);
  std::string bad = bare;
  Put64(bad, z64 + 48, 1ull << 40);
  Status s = ReadBytes(bad);
  EXPECT_EQ(s.code(), Status::Code::kCorruption);
  EXPECT_NE(s.message().find("central directory [1099511627776, +"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("lies outside the archive"), std::string::npos) << s.message();
  // ... and a zip64 locator pointing past the file.
  bad = bare;
  Put64(bad, bare.rfind("PK\x06\x07"s) + 8, ~0ull);
  EXPECT_NE(ReadBytes(bad).message().find("zip64 end record at 18446744073709551615 lies outside"), std::string::npos);

  // Plain EOCD (rezipped.pt): directory offset at +16.
  std::string plain = Slurp(TestData("rezipped.pt"));
  bad = plain;
  Put32(bad, plain.rfind("PK\x05\x06"s) + 16, 0xFFFFFF00);
  s = ReadBytes(bad);
  EXPECT_EQ(s.code(), Status::Code::kCorruption);
  EXPECT_NE(s.message().find("lies outside the archive"), std::string::npos) << s.message();
}

TEST(TorchZipEdgeTest, EntriesOutsideTheArchive) {
  std::string plain = Slurp(TestData("rezipped.pt"));
  size_t e = CentralEntry(plain, "bare/data/0");
  std::string bad = plain;
  Put32(bad, e + 42, 0x7FFFFFFF);  // local header offset
  EXPECT_NE(ReadBytes(bad).message().find("entry 'bare/data/0': local header at 2147483647 lies outside the archive"),
            std::string::npos)
      << ReadBytes(bad).message();
  bad = plain;
  Put32(bad, e + 20, 0x7FFFFFFF);  // compressed and uncompressed sizes
  Put32(bad, e + 24, 0x7FFFFFFF);
  EXPECT_NE(ReadBytes(bad).message().find("entry 'bare/data/0': data ["), std::string::npos) << ReadBytes(bad).message();
  bad = plain;
  Put32(bad, Get32(plain, e + 42), 0x12345678);  // local header signature
  EXPECT_NE(ReadBytes(bad).message().find("bad local header signature"), std::string::npos);
}

TEST(TorchZipEdgeTest, NonStoredAndEncryptedEntries) {
  std::string plain = Slurp(TestData("rezipped.pt"));
  size_t e = CentralEntry(plain, "bare/data.pkl");
  std::string bad = plain;
  Put16(bad, e + 10, 8);
  Status s = ReadBytes(bad);
  EXPECT_EQ(s.code(), Status::Code::kNotSupported);
  EXPECT_NE(s.message().find("entry 'bare/data.pkl' is compressed (method 8)"), std::string::npos) << s.message();
  bad = plain;
  Put16(bad, e + 8, 1);
  s = ReadBytes(bad);
  EXPECT_EQ(s.code(), Status::Code::kNotSupported);
  EXPECT_NE(s.message().find("is encrypted"), std::string::npos) << s.message();
}

TEST(TorchZipEdgeTest, StorageSmallerThanDeclared) {
  std::string plain = Slurp(TestData("rezipped.pt"));
  size_t e = CentralEntry(plain, "bare/data/0");
  std::string bad = plain;
  Put32(bad, e + 20, 2);
  Put32(bad, e + 24, 2);
  Status s = ReadBytes(bad);
  EXPECT_EQ(s.code(), Status::Code::kCorruption);
  EXPECT_NE(s.message().find("storage 'bare/data/0' declares 6 bytes but the entry holds 2"), std::string::npos)
      << s.message();
}

TEST(TorchZipEdgeTest, NotATorchArchiveAndBadPickle) {
  std::string plain = Slurp(TestData("rezipped.pt"));
  std::string bad = plain;
  for (size_t at = 0; (at = bad.find("bare/data.pkl", at)) != std::string::npos;) bad[at + 12] = 'X';
  EXPECT_NE(ReadBytes(bad).message().find("no <root>/data.pkl entry"), std::string::npos);

  // The pickle's PROTO byte replaced: the error names the entry and offset.
  auto dir = [&] {
    TempFile f(plain);
    ScopedFd fd(::open(f.path().c_str(), O_RDONLY));
    return ReadZipDirectory(fd.get(), 0, plain.size(), "x");
  }();
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  bad = plain;
  bad[dir->Find("bare/data.pkl")->data_offset] = '\xff';
  Status s = ReadBytes(bad);
  EXPECT_EQ(s.code(), Status::Code::kCorruption);
  EXPECT_NE(s.message().find("bare/data.pkl: pickle: offset 0: unknown opcode 0xff"), std::string::npos) << s.message();

  EXPECT_NE(ReadBytes(std::string(100, '\0')).message().find("no end-of-central-directory record"), std::string::npos);
}

// A minimal zip writer for layouts no small real file has: zip64 extra
// fields (torch writes them once offsets pass 4 GiB), padding extras.
struct ZipSpec {
  bool zip64_extra = false;  // saturate sizes/offsets in the directory
  bool short_zip64_extra = false;
  bool zip64_end = false;    // zip64 end record + locator, saturated EOCD
  uint16_t pad = 0;          // bytes of an `FB` extra in each local header
};

std::string BuildZip(const std::vector<std::pair<std::string, std::string>>& files, const ZipSpec& spec) {
  auto u16 = [](std::string& s, uint16_t v) { s.append(reinterpret_cast<const char*>(&v), 2); };
  auto u32 = [](std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); };
  auto u64 = [](std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); };
  std::string out, cd;
  for (const auto& [name, data] : files) {
    uint64_t local = out.size();
    u32(out, 0x04034b50);
    u16(out, 20), u16(out, 0), u16(out, 0), u16(out, 0), u16(out, 0);
    u32(out, 0), u32(out, data.size()), u32(out, data.size());
    u16(out, name.size());
    u16(out, spec.pad ? spec.pad + 4 : 0);
    out += name;
    if (spec.pad) u16(out, 0x4246), u16(out, spec.pad), out += std::string(spec.pad, 'Z');
    out += data;

    std::string extra;
    if (spec.zip64_extra) {
      u16(extra, 0x0001);
      u16(extra, spec.short_zip64_extra ? 8 : 24);
      u64(extra, data.size());
      if (!spec.short_zip64_extra) u64(extra, data.size()), u64(extra, local);
    }
    uint32_t sat = spec.zip64_extra ? 0xFFFFFFFF : 0;
    u32(cd, 0x02014b50);
    u16(cd, 0x031e), u16(cd, 45), u16(cd, 0), u16(cd, 0), u16(cd, 0), u16(cd, 0);
    u32(cd, 0), u32(cd, sat ? sat : data.size()), u32(cd, sat ? sat : data.size());
    u16(cd, name.size()), u16(cd, extra.size()), u16(cd, 0), u16(cd, 0), u16(cd, 0);
    u32(cd, 0), u32(cd, sat ? sat : local);
    cd += name + extra;
  }
  uint64_t cd_offset = out.size();
  out += cd;
  if (spec.zip64_end) {
    uint64_t rec = out.size();
    u32(out, 0x06064b50), u64(out, 44), u16(out, 45), u16(out, 45), u32(out, 0), u32(out, 0);
    u64(out, files.size()), u64(out, files.size()), u64(out, cd.size()), u64(out, cd_offset);
    u32(out, 0x07064b50), u32(out, 0), u64(out, rec), u32(out, 1);
  }
  u32(out, 0x06054b50), u16(out, 0), u16(out, 0);
  uint16_t n = spec.zip64_end ? 0xFFFF : files.size();
  u16(out, n), u16(out, n);
  u32(out, spec.zip64_end ? 0xFFFFFFFF : cd.size()), u32(out, spec.zip64_end ? 0xFFFFFFFF : cd_offset);
  u16(out, 0);
  return out;
}

// bare.pt's records, for rebuilding in other layouts.
std::vector<std::pair<std::string, std::string>> BareRecords() {
  std::string path = TestData("bare.pt");
  std::string file = Slurp(path);
  ScopedFd fd(::open(path.c_str(), O_RDONLY));
  auto dir = ReadZipDirectory(fd.get(), 0, file.size(), path);
  EXPECT_TRUE(dir.ok()) << dir.status().ToString();
  std::vector<std::pair<std::string, std::string>> out;
  if (!dir.ok()) return out;  // the test fails above; the rebuilt zip is then empty
  for (const char* n : {"bare/data.pkl", "bare/byteorder", "bare/data/0"}) {
    const ZipEntry* e = dir->Find(n);
    EXPECT_NE(e, nullptr) << n;
    if (e) out.emplace_back(n, file.substr(e->data_offset, e->size));
  }
  return out;
}

TEST(TorchZipEdgeTest, Zip64ExtraFieldsAndPadding) {
  ZipSpec spec;
  spec.zip64_extra = true;
  spec.zip64_end = true;
  spec.pad = 37;
  std::string zip = BuildZip(BareRecords(), spec);
  TempFile f(zip);
  TorchArchive ar = MustRead(f.path());
  ExpectTensors(ar, zip, {{{}, "int16", {1, 3}, {3, 1}, 0, "010002000300"}});

  spec.short_zip64_extra = true;
  Status s = ReadBytes(BuildZip(BareRecords(), spec));
  EXPECT_NE(s.message().find("entry 'bare/data.pkl': zip64 extra field is too short"), std::string::npos) << s.message();
}

TEST(TorchZipEdgeTest, DuplicateEntriesAndMismatchedLocalHeaders) {
  auto records = BareRecords();
  records.push_back(records.back());
  Status s = ReadBytes(BuildZip(records, {}));
  EXPECT_NE(s.message().find("duplicate entry 'bare/data/0'"), std::string::npos) << s.message();

  std::string plain = Slurp(TestData("rezipped.pt"));
  plain[plain.find("bare/data/0") + 10] = '9';  // the local header's copy of the name
  s = ReadBytes(plain);
  EXPECT_NE(s.message().find("entry 'bare/data/0': local header names a different entry"), std::string::npos)
      << s.message();
}

// ---------------------------------------------------------------------------
// Tensor rebuild calls, built by hand.

// _rebuild_tensor_v2(('storage', torch.FloatStorage, '0', 'cpu', numel),
//                    offset, size, stride, False, OrderedDict())
std::string RebuildV2(int numel, int offset, std::vector<int> size, std::vector<int> stride,
                      const std::string& storage = "ctorch\nFloatStorage\n") {
  std::string s = "\x80\x02""ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"s + storage +
                  "X\x01\x00\x00\x00""0X\x03\x00\x00\x00""cpuK"s + char(numel) + "tQK" + char(offset) + "(";
  for (int x : size) s += "K"s + char(x);
  s += "t(";
  for (int x : stride) s += "K"s + char(x);
  return s + "t\x89""ccollections\nOrderedDict\n)RtR.";
}

Result<std::optional<TorchTensorRef>> Match(const std::string& pickle) {
  auto doc = Unpickle(pickle);
  if (!doc.ok()) return doc.status();
  return MatchTorchTensor((*doc)->root());
}

TEST(TorchZipTensorMatchTest, ExtentMustFitTheStorage) {
  auto ok = Match(RebuildV2(4, 2, {2}, {1}));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  ASSERT_TRUE(*ok);
  EXPECT_EQ((*ok)->storage_offset, 2u);
  EXPECT_EQ((*ok)->storage_nbytes, 16u);
  EXPECT_EQ((*ok)->location, "cpu");

  auto past = Match(RebuildV2(4, 2, {3}, {1}));
  ASSERT_FALSE(past.ok());
  EXPECT_EQ(past.status().message(),
            "torch tensor: storage_offset 2 with size (3,) and stride (1,) reaches past the storage '0' of 16 bytes");

  // Non-contiguous: (2, 2) with strides (1, 2) reaches element 3.
  EXPECT_TRUE(Match(RebuildV2(4, 0, {2, 2}, {1, 2})).ok());
  EXPECT_FALSE(Match(RebuildV2(4, 1, {2, 2}, {1, 2})).ok());
  // Empty tensors reach nothing; the offset alone must be inside.
  EXPECT_TRUE(Match(RebuildV2(4, 4, {0, 5}, {5, 1})).ok());
  EXPECT_FALSE(Match(RebuildV2(4, 5, {0, 5}, {5, 1})).ok());
  // Huge strides must not overflow into a small extent.
  EXPECT_FALSE(Match(RebuildV2(4, 0, {2, 2}, {1, 255})).ok());
}

TEST(TorchZipTensorMatchTest, MalformedCallsAreCorruption) {
  // size and stride of different lengths
  auto r = Match(RebuildV2(4, 0, {2, 2}, {1}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kCorruption);
  // a storage type that is not a torch storage
  r = Match(RebuildV2(4, 0, {2}, {1}, "cos\nsystem\n"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("storage type os.system is not a torch storage"), std::string::npos)
      << r.status().message();
  // a typed storage safetensors cannot name
  r = Match(RebuildV2(4, 0, {2}, {1}, "ctorch\nComplexDoubleStorage\n"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Status::Code::kNotSupported);
  // v2 with an untyped storage has no dtype
  r = Match(RebuildV2(4, 0, {2}, {1}, "ctorch.storage\nUntypedStorage\n"));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("UntypedStorage has no dtype"), std::string::npos);
  // too few arguments
  r = Match("\x80\x02""ctorch._utils\n_rebuild_tensor_v2\nK\x01\x85R."s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "torch tensor: _rebuild_tensor_v2 has 1 arguments, expected 6 or more");
}

TEST(TorchZipTensorMatchTest, NonTensorsAreNotMatched) {
  for (std::string p : {"N."s, "\x80\x02]."s, "\x80\x02""cposix\nsystem\nX\x01\x00\x00\x00x\x85R."s,
                        "\x80\x02""ctorch._utils\n_rebuild_tensor_v2\nK\x01R."s /* args not a tuple */}) {
    auto r = Match(p);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_FALSE(*r);
  }
}

TEST(TorchZipTensorMatchTest, ShapesAndDtypeNames) {
  auto doc = Unpickle("\x80\x02""ctorch\nSize\nK\x02K\x03\x86\x85R."s);
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(AsShape((*doc)->root()), (std::vector<uint64_t>{2, 3}));
  doc = Unpickle("\x80\x02J\xff\xff\xff\xff\x85."s);  // (-1,)
  ASSERT_TRUE(doc.ok());
  EXPECT_FALSE(AsShape((*doc)->root()));
  EXPECT_EQ(DTypeFromTorchName("float"), DType::kF32);
  EXPECT_EQ(DTypeFromTorchName("float8_e4m3fn"), DType::kF8_E4M3);
  EXPECT_EQ(DTypeFromTorchName("float8_e8m0fnu"), DType::kF8_E8M0);
  EXPECT_EQ(DTypeFromTorchName("complex128"), std::nullopt);
  EXPECT_EQ(DTypeFromTorchStorage("BFloat16Storage"), DType::kBF16);
  EXPECT_EQ(DTypeFromTorchStorage("UntypedStorage"), std::nullopt);
}

}  // namespace
}  // namespace ckptfs
