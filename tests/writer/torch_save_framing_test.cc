// torch.save framing, read back by the indexer's own zip and pickle reader
// (indexer/torch_zip.h, written against torch's real output): the entries
// torch.save writes, the tensor where the layout says, 64-aligned, in zip
// and zip64 forms. tests/e2e/test_writer.py torch.loads the same framing.
#include "indexer/torch_save_framing.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <fstream>

#include "indexer/torch_zip.h"

namespace ckptfs {
namespace {

struct Written {
  std::string path;
  TorchSaveFraming framing;
};

// Writes `pad` junk bytes, then the archive around `data`.
Written WriteArchive(const std::string& dtype, std::vector<uint64_t> shape, const std::string& data, uint64_t pad,
                     bool zip64) {
  auto f = TorchSaveFraming::Plan({dtype, shape, data.size(), pad, "", zip64});
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  uint32_t crc = crc32(0, reinterpret_cast<const Bytef*>(data.data()), data.size());
  std::string bytes = std::string(pad, 'J') + f->Head(crc) + data + f->Tail(crc);
  EXPECT_EQ(bytes.size(), pad + f->total_size());
  std::string path = testing::TempDir() + "framing_" + dtype + std::to_string(pad) + (zip64 ? "z" : "") + ".bin";
  std::ofstream(path, std::ios::binary) << bytes;
  return {path, *f};
}

TEST(TorchSaveFraming, IndexerReadsTheTensorWhereTheLayoutSays) {
  std::string data;
  for (int i = 0; i < 6; ++i) data += std::string("\x01\x02\x03\x04", 4);
  for (bool zip64 : {false, true})
    for (uint64_t pad : {0, 5, 63, 100}) {
      Written w = WriteArchive("float32", {2, 3}, data, pad, zip64);
      int fd = ::open(w.path.c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      auto a = ReadTorchArchive(fd, pad, w.framing.total_size(), w.path);
      ::close(fd);
      ASSERT_TRUE(a.ok()) << a.status().ToString();
      ASSERT_EQ(a->tensors.size(), 1u);
      const auto& t = a->tensors[0];
      EXPECT_EQ(t.torch_dtype, "float32");
      EXPECT_EQ(t.shape, (std::vector<uint64_t>{2, 3}));
      EXPECT_EQ(t.strides, (std::vector<uint64_t>{3, 1}));
      EXPECT_EQ(t.data_offset, pad + w.framing.data_offset());
      EXPECT_EQ(t.data_offset % 64, 0u);
      std::vector<std::string> names;
      for (const auto& e : a->zip.entries) names.push_back(e.name);
      EXPECT_EQ(names, (std::vector<std::string>{"archive/data.pkl", "archive/.format_version",
                                                 "archive/.storage_alignment", "archive/byteorder", "archive/data/0",
                                                 "archive/version", "archive/.data/serialization_id"}));
      EXPECT_EQ(a->zip.Find("archive/data/0")->crc32,
                uint32_t(crc32(0, reinterpret_cast<const Bytef*>(data.data()), data.size())));
    }
}

TEST(TorchSaveFraming, DTypesWithoutALegacyStorageUseRebuildV3) {
  std::string data(8, '\x7f');
  for (const char* dt :
       {"uint16", "float8_e4m3fn", "bfloat16", "bool", "int64", "float4_e2m1fn_x2", "float8_e8m0fnu"}) {
    uint64_t es = TorchSaveFraming::ElementSize(dt);
    Written w = WriteArchive(dt, {8 / es}, data, 0, false);
    auto a = ReadTorchArchiveFile(w.path);
    ASSERT_TRUE(a.ok()) << dt << ": " << a.status().ToString();
    ASSERT_EQ(a->tensors.size(), 1u);
    EXPECT_EQ(a->tensors[0].torch_dtype, dt);
    EXPECT_EQ(a->tensors[0].shape, (std::vector<uint64_t>{8 / es}));
  }
}

TEST(TorchSaveFraming, ScalarsEmptyTensorsAndLargeDims) {
  for (auto shape : {std::vector<uint64_t>{}, std::vector<uint64_t>{0, 3}, std::vector<uint64_t>{70000, 1},
                     std::vector<uint64_t>{1, 2, 1, 3, 1}}) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    Written w = WriteArchive("int8", shape, std::string(n, '\x05'), 3, false);
    // The archive starts after 3 junk bytes: read it in place.
    int fd = ::open(w.path.c_str(), O_RDONLY);
    auto r = ReadTorchArchive(fd, 3, w.framing.total_size(), w.path);
    ::close(fd);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->tensors[0].shape, shape);
  }
}

TEST(TorchSaveFraming, RefusesMismatchedSizesAndUnknownDTypes) {
  EXPECT_EQ(TorchSaveFraming::Plan({"float32", {3}, 10, 0, "", false}).status().code(), Status::Code::kInvalidArgument);
  EXPECT_EQ(TorchSaveFraming::Plan({"float128", {3}, 48, 0, "", false}).status().code(), Status::Code::kNotSupported);
}

TEST(TorchSaveFraming, PickleMatchesTorchSaveByteForByte) {
  // torch.save(torch.zeros(2, 3)) in torch 2.x pickles these opcodes; ours
  // lacks only the BINPUT memo entries, which nothing refers back to.
  auto p = TorchTensorPickle("float32", {2, 3});
  ASSERT_TRUE(p.ok());
  using namespace std::string_literals;
  const std::string want = "\x80\x02"s + "ctorch._utils\n_rebuild_tensor_v2\n" + "((" + "X\x07\0\0\0storage"s +
                           "ctorch\nFloatStorage\n" + "X\x01\0\0\0"s + "0" + "X\x03\0\0\0"s + "cpu" + "K\x06" + "tQ" +
                           "K\0"s + "K\x02K\x03\x86" + "K\x03K\x01\x86" + "\x89" + "ccollections\nOrderedDict\n" +
                           ")R" + "tR.";
  EXPECT_EQ(*p, want);
}

}  // namespace
}  // namespace ckptfs
