#include "source/posix_source.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "core/planner.h"
#include "source/source_reader.h"
#include "tests/temp_dirs.h"

extern char** environ;

namespace ckptfs {
namespace {

namespace fs = std::filesystem;

constexpr long kFuseMagic = 0x65735546;

std::string RandomBytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = char(rng());
  return s;
}

void WriteFile(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

TEST(PosixSource, RenumbersInodesOnlyOnFilesystemsThatDoSo) {
  EXPECT_TRUE(RenumbersInodes(kFuseMagic));
  EXPECT_FALSE(RenumbersInodes(0xEF53));      // ext4
  EXPECT_FALSE(RenumbersInodes(0x58465342));  // xfs
  EXPECT_FALSE(RenumbersInodes(0x01021994));  // tmpfs
}

TEST(PosixSource, ListsFilesDirsAndLinksSeparately) {
  fs::path dir = fs::temp_directory_path() / ("ckptfs_posix_source_" + std::to_string(::getpid()));
  fs::create_directories(dir / "sub");
  WriteFile(dir / "b.bin", "xy");
  WriteFile(dir / "a.json", "{}");
  fs::create_directory_symlink(dir / "sub", dir / "linked");
  fs::create_symlink(dir / "a.json", dir / "alias.json");
  auto src = PosixSource::OpenRoot(dir.string());
  ASSERT_TRUE(src.ok()) << src.status().message();
  auto l = (*src)->List("");
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->files, (std::vector<std::string>{"a.json", "alias.json", "b.bin"}));
  EXPECT_EQ(l->dirs, (std::vector<std::string>{"sub"}));
  EXPECT_EQ(l->linked_dirs, (std::vector<std::string>{"linked"}));
  auto id = (*src)->Identify("b.bin");
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(id->size, 2u);
  EXPECT_NE(id->inode, 0u);  // the temp directory keeps inodes stable
  EXPECT_FALSE((*src)->Identify("sub").ok());
  fs::remove_all(dir);
}

// A FUSE passthrough that gives a file a new inode number on every stat
// (tests/source/renumbering_fs.cc), mounted for the test's duration.
class RenumberingMount : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("ckptfs_renumber_" + std::to_string(::getpid()));
    fs::create_directories(base_ / "src");
    fs::create_directories(base_ / "mnt");
    const std::string helper = CKPTFS_RENUMBERING_FS;
    const std::string src = (base_ / "src").string(), mnt = (base_ / "mnt").string();
    char* argv[] = {const_cast<char*>(helper.c_str()), const_cast<char*>(src.c_str()),
                    const_cast<char*>(mnt.c_str()), nullptr};
    ASSERT_EQ(::posix_spawn(&pid_, helper.c_str(), nullptr, nullptr, argv, environ), 0);
    // Bounded wait for the mount to appear.
    for (int i = 0; i < 200 && !Mounted(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(25));
    ASSERT_TRUE(Mounted()) << "renumbering_fs did not mount " << mnt;
  }
  void TearDown() override {
    if (pid_ > 0) {
      std::string cmd = "fusermount3 -u " + (base_ / "mnt").string();
      if (std::system(cmd.c_str()) != 0) ::kill(pid_, SIGTERM);
      int status;
      ::waitpid(pid_, &status, 0);
    }
    fs::remove_all(base_);
  }
  bool Mounted() const {
    struct statfs s;
    return ::statfs((base_ / "mnt").c_str(), &s) == 0 && long(uint32_t(s.f_type)) == kFuseMagic;
  }
  fs::path base_;
  pid_t pid_ = -1;
};

// Regression: an indexed file on a filesystem that renumbers inodes (s3fs,
// gcsfuse) read as "replaced (inode changed) since indexing" once its inode
// number changed, though its bytes had not.
TEST_F(RenumberingMount, UnchangedFileReadsWithoutFalseStaleAndAChangeIsStillSeen) {
  const std::string bytes = RandomBytes(1 << 20, 7);
  WriteFile(base_ / "src" / "shard.bin", bytes);
  const fs::path mnt = base_ / "mnt";
  struct stat a, b;
  ASSERT_EQ(::stat((mnt / "shard.bin").c_str(), &a), 0);
  ASSERT_EQ(::stat((mnt / "shard.bin").c_str(), &b), 0);
  ASSERT_NE(a.st_ino, b.st_ino) << "the helper must renumber, or this test proves nothing";

  auto src = PosixSource::OpenRoot(mnt.string());
  ASSERT_TRUE(src.ok()) << src.status().message();
  auto id = (*src)->Identify("shard.bin");
  ASSERT_TRUE(id.ok()) << id.status().message();
  std::vector<SourceFile> files{*id};
  files[0].path = "shard.bin";
  SourceReader reader(*src, &files);
  std::mt19937 rng(3);
  for (int i = 0; i < 50; ++i) {
    const uint64_t off = rng() % bytes.size(), len = 1 + rng() % (bytes.size() - off);
    ReadPlan plan;
    plan.length = std::min<uint64_t>(len, 64 << 10);
    plan.copies.push_back({0, off, 0, plan.length});
    std::string got(plan.length, '\0');
    Status st = reader.Execute(plan, got.data());
    ASSERT_TRUE(st.ok()) << "read " << i << ": " << st.message();
    ASSERT_EQ(got, bytes.substr(off, plan.length)) << "read " << i;
  }
  EXPECT_TRUE(reader.Recheck().ok());

  // Same size, new bytes: the mtime and ctime move, and the read says so.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  WriteFile(base_ / "src" / "shard.bin", RandomBytes(bytes.size(), 8));
  ReadPlan plan;
  plan.length = 16;
  plan.copies.push_back({0, 0, 0, 16});
  char out[16];
  Status st = reader.Execute(plan, out);
  EXPECT_EQ(st.code(), Status::Code::kStale) << st.message();
  EXPECT_NE(st.message().find("since indexing"), std::string::npos) << st.message();
}

// An object that counts the reads that reach it.
class CountingObject : public MemoryObject {
 public:
  using MemoryObject::MemoryObject;
  Status ReadAt(uint64_t offset, uint64_t len, char* dst) const override {
    ++reads;
    return MemoryObject::ReadAt(offset, len, dst);
  }
  mutable int reads = 0;
};

// A pinned range (SourceObject::Pin) holds the file's bytes, and a writer's
// open waits until the pin is released: the pinned bytes stay the ones
// checked after pinning. The writer here is a thread of this process,
// which breaks the lease as any other opener does.
TEST(PosixPin, HoldsTheFilesBytesAndAWritersOpenWaitsForItsRelease) {
  fs::path dir = TempDirs::Make("ckptfs-pin");
  const std::string bytes = RandomBytes(3 << 20, 11);
  WriteFile(dir / "f", bytes);
  auto src = PosixSource::OpenRoot(dir.string());
  ASSERT_TRUE(src.ok());
  auto obj = (*src)->Open("f");
  ASSERT_TRUE(obj.ok()) << obj.status().message();
  const uint64_t offset = 5000, len = (2 << 20) + 123;
  auto pin = (*obj)->Pin(offset, len);
  ASSERT_TRUE(pin.ok()) << pin.status().message();
  EXPECT_TRUE(std::string((*pin)->data(), len) == bytes.substr(offset, len));
  std::atomic<bool> opened{false};
  std::thread writer([&] {
    int fd = ::open((dir / "f").c_str(), O_WRONLY);
    opened = true;
    if (fd >= 0) {
      EXPECT_EQ(::pwrite(fd, "XYZ", 3, off_t(offset)), 3);
      ::close(fd);
    }
  });
  // An open that did not wait would be done in microseconds.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_FALSE(opened.load()) << "a writer opened the file while it was pinned";
  EXPECT_TRUE(std::string((*pin)->data(), len) == bytes.substr(offset, len)) << "pinned bytes changed";
  pin->reset();
  writer.join();
  EXPECT_TRUE(opened.load());
  std::string now(3, '\0');
  ASSERT_TRUE((*obj)->ReadAt(offset, 3, now.data()).ok());
  EXPECT_EQ(now, "XYZ");  // released: the writer went ahead
  fs::remove_all(dir);
}

// Refused (NotSupported, so the caller reads instead) while someone has the
// file open for writing, and for a range past its end; ReadAt then says
// what is wrong.
TEST(PosixPin, RefusedWhileOpenForWritingAndPastTheEnd) {
  fs::path dir = TempDirs::Make("ckptfs-pin");
  WriteFile(dir / "f", RandomBytes(10000, 12));
  auto src = PosixSource::OpenRoot(dir.string());
  ASSERT_TRUE(src.ok());
  auto obj = (*src)->Open("f");
  ASSERT_TRUE(obj.ok());
  {
    const int fd = ::open((dir / "f").c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    auto pin = (*obj)->Pin(0, 4096);
    EXPECT_EQ(pin.status().code(), Status::Code::kNotSupported) << pin.status().message();
    ::close(fd);
  }
  EXPECT_TRUE((*obj)->Pin(0, 4096).ok());  // the writer is gone
  auto past = (*obj)->Pin(8192, 8192);
  EXPECT_EQ(past.status().code(), Status::Code::kNotSupported) << past.status().message();
  std::string buf(8192, '\0');
  EXPECT_EQ((*obj)->ReadAt(8192, 8192, buf.data()).code(), Status::Code::kCorruption);
  fs::remove_all(dir);
}

TEST(WindowedObject, ReadsInsideWindowsStayInMemoryOthersGoThrough) {
  std::string bytes(10000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = char(i * 7 % 251);
  CountingObject inner(bytes);
  // Two touching ranges and an overlapping one: read as two windows.
  auto w = WindowedObject::Fetch(inner, {{1000, 500}, {1500, 500}, {5000, 100}, {5050, 100}});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(inner.reads, 2);
  EXPECT_EQ((*w)->bytes(), 1000u + 150u);
  std::string got(1000, '\0');
  ASSERT_TRUE((*w)->ReadAt(1200, 800, got.data()).ok());  // across the touching pair: one window
  EXPECT_EQ(got.substr(0, 800), bytes.substr(1200, 800));
  ASSERT_TRUE((*w)->ReadAt(5000, 150, got.data()).ok());
  EXPECT_EQ(got.substr(0, 150), bytes.substr(5000, 150));
  EXPECT_EQ(inner.reads, 2);
  ASSERT_TRUE((*w)->ReadAt(1900, 200, got.data()).ok());  // past a window's end: from the object
  EXPECT_EQ(got.substr(0, 200), bytes.substr(1900, 200));
  EXPECT_EQ(inner.reads, 3);
  // A range past the end fails the fetch as the object's read does.
  EXPECT_EQ(WindowedObject::Fetch(inner, {{9990, 20}}).status().code(), Status::Code::kCorruption);
}

TEST(WindowedObject, GapsUpToTheLongestAreReadWhileTheBudgetLasts) {
  std::string bytes(10000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = char(i * 13 % 251);
  CountingObject inner(bytes);
  // Gaps of 100, 300, 100 and 100 bytes: the 300 is too long; the budget
  // of 250 covers two of the three short ones, in file order.
  auto w = WindowedObject::Fetch(inner, {{0, 50}, {150, 50}, {500, 50}, {650, 50}, {800, 50}, {950, 50}},
                                 WindowGaps{200, 250});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ(inner.reads, 4);                       // [0,200) [500,700) [800,850) [950,1000)
  EXPECT_EQ((*w)->bytes(), 200u + 200u + 50u + 50u);
  std::string got(200, '\0');
  ASSERT_TRUE((*w)->ReadAt(0, 200, got.data()).ok());  // the bridged gap holds the object's bytes
  EXPECT_EQ(got, bytes.substr(0, 200));
  ASSERT_TRUE((*w)->ReadAt(500, 200, got.data()).ok());
  EXPECT_EQ(got, bytes.substr(500, 200));
  EXPECT_EQ(inner.reads, 4);
}

}  // namespace
}  // namespace ckptfs
