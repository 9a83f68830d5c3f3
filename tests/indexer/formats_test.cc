// The format registry and the contract of FormatReader::Recognise
// (indexer/format_reader.h).
#include "indexer/format_reader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include "source/posix_source.h"

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

TEST(Formats, EveryRowMakesAReaderOfItsOwnNameAndNamesAreUnique) {
  std::set<std::string> names;
  ASSERT_FALSE(Formats().empty());
  for (const FormatEntry& f : Formats()) {
    ASSERT_NE(f.make, nullptr) << f.name;
    EXPECT_EQ(f.make()->name(), f.name);
    EXPECT_TRUE(names.insert(f.name).second) << "two rows named " << f.name;
    EXPECT_NE(std::string(f.recognises), "") << f.name;
  }
}

TEST(Formats, AllReadersFollowTheRegistryInOrder) {
  auto readers = AllReaders();
  ASSERT_EQ(readers.size(), Formats().size());
  for (size_t i = 0; i < readers.size(); ++i) EXPECT_EQ(readers[i]->name(), Formats()[i].name);
}

TEST(Formats, TheNoCheckpointMessageNamesWhatEveryReaderLooksFor) {
  const std::string text = DescribeRecognised();
  for (const FormatEntry& f : Formats()) EXPECT_NE(text.find(f.recognises), std::string::npos) << f.name;
  // The formats docs/FORMATS.md documents, each named to the user.
  for (const char* word : {"DCP", "Megatron", "ByteCheckpoint", ".safetensors", "torch.save", ".pt", ".bin"})
    EXPECT_NE(text.find(word), std::string::npos) << word;
}

// A POSIX source that records what is asked of it.
class CountingSource : public PosixSource {
 public:
  using PosixSource::PosixSource;
  Result<SourceListing> List(const std::string& rel) const override {
    ++lists;
    return PosixSource::List(rel);
  }
  Result<std::unique_ptr<SourceObject>> Open(const std::string& rel) const override {
    ASSIGN_OR_RETURN(auto inner, PosixSource::Open(rel));
    std::lock_guard<std::mutex> lock(mu);
    opened.push_back(rel);
    return std::unique_ptr<SourceObject>(std::make_unique<Counted>(std::move(inner), this));
  }

  mutable std::atomic<int> lists{0};
  mutable std::atomic<uint64_t> max_read{0};  // the largest single read
  mutable std::mutex mu;
  mutable std::vector<std::string> opened;

 private:
  class Counted : public SourceObject {
   public:
    Counted(std::unique_ptr<SourceObject> inner, const CountingSource* owner)
        : inner_(std::move(inner)), owner_(owner) {}
    Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override {
      if (len > owner_->max_read) owner_->max_read = len;
      return inner_->ReadAt(offset, len, dst);
    }
    Result<SourceFile> Identity() const override { return inner_->Identity(); }

   private:
    std::unique_ptr<SourceObject> inner_;
    const CountingSource* owner_;
  };
};

class RecogniseContract : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("formats_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    // One directory that every reader's names could match: model/ and
    // optimizer/ with a large .metadata that is no ByteCheckpoint's, DCP
    // and safetensors and torch.save files side by side.
    for (const char* part : {"model", "optimizer"}) {
      fs::create_directories(dir_ / part);
      std::ofstream(dir_ / part / ".metadata") << std::string(1 << 20, 'x');
    }
    for (const char* f : {".metadata", "__0_0.distcp", "model.safetensors", "pytorch_model.bin", "a.pt"})
      std::ofstream(dir_ / f) << std::string(4096, 'y');
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(RecogniseContract, ReadersListNothingAndReadAtMost512BytesOfFilesTheListingNames) {
  CountingSource source(fs::canonical(dir_).string());
  auto listing = source.List("");
  ASSERT_TRUE(listing.ok());
  DirListing dir{&source, "", listing->files, listing->dirs, listing->linked_dirs, listing->known};
  source.lists = 0;
  for (const auto& reader : AllReaders()) {
    // Every name matches; only ByteCheckpoint's .metadata says otherwise.
    const bool expected = reader->name() != "bytecheckpoint";
    EXPECT_EQ(reader->Recognise(dir), expected) << reader->name();
    EXPECT_EQ(source.lists, 0) << reader->name() << " listed a directory";
  }
  // ByteCheckpoint looked inside the .metadata its names could not judge,
  // and read no more than the head of it.
  EXPECT_FALSE(source.opened.empty());
  EXPECT_GT(source.max_read, 0u);
  EXPECT_LE(source.max_read, 512u);
  for (const std::string& rel : source.opened)
    EXPECT_TRUE(rel == "model/.metadata" || rel == "optimizer/.metadata") << rel;
  // Nothing written: the directory holds what it held.
  size_t entries = 0;
  for (auto it = fs::recursive_directory_iterator(dir_); it != fs::recursive_directory_iterator(); ++it) ++entries;
  EXPECT_EQ(entries, 2u + 2u + 5u);
}

}  // namespace
}  // namespace ckptfs
