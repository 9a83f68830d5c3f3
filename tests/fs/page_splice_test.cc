// SpliceStore with a regular file standing in for the FUSE device: what it
// writes there is the stream of FUSE_NOTIFY_STORE messages the kernel would
// take, each checked against the protocol's layout (linux/fuse.h) and its
// bytes against the source file's.
#include "fs/page_splice.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fuse.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>

#include "tests/temp_dirs.h"

namespace ckptfs {
namespace {

std::string ReadAll(const std::filesystem::path& p) {
  std::string out(std::filesystem::file_size(p), '\0');
  const int fd = ::open(p.c_str(), O_RDONLY);
  EXPECT_EQ(::pread(fd, out.data(), out.size(), 0), ssize_t(out.size()));
  ::close(fd);
  return out;
}

struct Files {
  std::filesystem::path dir = TempDirs::ForThisTest("page_splice");
  std::string source;
  int src = -1, dev = -1;
  explicit Files(size_t size) : source(size, '\0') {
    std::mt19937 rng(7);
    for (char& c : source) c = char(rng());
    const int w = ::open((dir / "source").c_str(), O_WRONLY | O_CREAT, 0644);
    EXPECT_EQ(::write(w, source.data(), size), ssize_t(size));
    ::close(w);
    src = ::open((dir / "source").c_str(), O_RDONLY);
    dev = ::open((dir / "device").c_str(), O_WRONLY | O_CREAT, 0644);
  }
  ~Files() {
    ::close(src);
    ::close(dev);
  }
};

TEST(PageSplice, WritesStoreMessagesOfAPipefulEachWithTheFilesBytes) {
  Files f(4 << 20);
  const uint64_t ino = 42, offset = 8192, from = 1000;  // the file's bytes off a page boundary
  const size_t len = 640 * 4096;                        // more than a pipeful
  ASSERT_EQ(SpliceStore(f.dev, ino, offset, f.src, from, len), len);
  const std::string out = ReadAll(f.dir / "device");
  size_t at = 0, stored = 0, messages = 0;
  while (at < out.size()) {
    fuse_out_header h;
    fuse_notify_store_out s;
    ASSERT_GE(out.size() - at, sizeof h + sizeof s);
    std::memcpy(&h, out.data() + at, sizeof h);
    std::memcpy(&s, out.data() + at + sizeof h, sizeof s);
    EXPECT_EQ(h.error, FUSE_NOTIFY_STORE);
    EXPECT_EQ(h.unique, 0u);  // a notification, not a reply
    EXPECT_EQ(h.len, sizeof h + sizeof s + s.size);
    EXPECT_EQ(s.nodeid, ino);
    EXPECT_EQ(s.offset, offset + stored);  // in order, page-aligned
    EXPECT_EQ(s.offset % 4096, 0u);
    EXPECT_LE(s.size, 1u << 20);
    ASSERT_LE(at + h.len, out.size());
    EXPECT_TRUE(out.compare(at + sizeof h + sizeof s, s.size, f.source, from + stored, s.size) == 0)
        << "message " << messages;
    stored += s.size;
    at += h.len;
    ++messages;
  }
  EXPECT_EQ(stored, len);
  EXPECT_GE(messages, 3u);
}

TEST(PageSplice, AFileShorterThanTheRangeStoresNothingOfTheShortMessage) {
  Files f(100 << 10);
  // The first message is whole (64 KiB of the file), the second would run past its end.
  EXPECT_EQ(SpliceStore(f.dev, 7, 0, f.src, 36 << 10, 64 << 10), size_t(64 << 10));
  const size_t first = std::filesystem::file_size(f.dir / "device");
  EXPECT_EQ(first, sizeof(fuse_out_header) + sizeof(fuse_notify_store_out) + (64 << 10));
  EXPECT_EQ(SpliceStore(f.dev, 7, 64 << 10, f.src, 36 << 10, 128 << 10), 0u);
  EXPECT_EQ(std::filesystem::file_size(f.dir / "device"), first);  // no header without its bytes
  // The thread's pipe was made anew: the next store is whole again.
  EXPECT_EQ(SpliceStore(f.dev, 7, 0, f.src, 0, 100 << 10), size_t(100 << 10));
}

}  // namespace
}  // namespace ckptfs
