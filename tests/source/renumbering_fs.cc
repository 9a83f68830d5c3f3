// A read-only FUSE passthrough of a directory that reports a new inode
// number every time a file's attributes are asked for, as s3fs and gcsfuse
// do once the kernel has dropped their inodes. Used by posix_source_test to
// check that such filesystems never cause false "changed since indexing"
// errors. Usage: renumbering_fs SOURCE_DIR MOUNTPOINT (stays in the
// foreground; unmount with fusermount3 -u).
#define FUSE_USE_VERSION 35
#include <dirent.h>
#include <fcntl.h>
#include <fuse3/fuse.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

namespace {

std::string g_source;
std::atomic<uint64_t> g_next_ino{1'000'000};

std::string Real(const char* path) { return g_source + path; }

void* Init(struct fuse_conn_info*, struct fuse_config* cfg) {
  cfg->use_ino = 1;  // report our st_ino, not libfuse's node ids
  // Nothing cached: every stat() reaches getattr and gets a new number.
  cfg->entry_timeout = 0;
  cfg->attr_timeout = 0;
  cfg->negative_timeout = 0;
  return nullptr;
}

int GetAttr(const char* path, struct stat* st, struct fuse_file_info*) {
  if (::lstat(Real(path).c_str(), st) != 0) return -errno;
  st->st_ino = g_next_ino.fetch_add(1);
  return 0;
}

int ReadDir(const char* path, void* buf, fuse_fill_dir_t fill, off_t, struct fuse_file_info*,
            enum fuse_readdir_flags) {
  DIR* d = ::opendir(Real(path).c_str());
  if (!d) return -errno;
  while (struct dirent* e = ::readdir(d)) fill(buf, e->d_name, nullptr, 0, fuse_fill_dir_flags(0));
  ::closedir(d);
  return 0;
}

int Open(const char* path, struct fuse_file_info* fi) {
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
  int fd = ::open(Real(path).c_str(), O_RDONLY);
  if (fd < 0) return -errno;
  fi->fh = uint64_t(fd);
  fi->direct_io = 1;  // reads reach the source: a change underneath is seen at once
  return 0;
}

int Read(const char*, char* buf, size_t size, off_t offset, struct fuse_file_info* fi) {
  ssize_t n = ::pread(int(fi->fh), buf, size, offset);
  return n < 0 ? -errno : int(n);
}

int Release(const char*, struct fuse_file_info* fi) {
  ::close(int(fi->fh));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s SOURCE_DIR MOUNTPOINT\n", argv[0]);
    return 2;
  }
  char real[PATH_MAX];
  if (!::realpath(argv[1], real)) {
    std::perror(argv[1]);
    return 2;
  }
  g_source = real;
  struct fuse_operations ops;
  std::memset(&ops, 0, sizeof ops);
  ops.init = Init;
  ops.getattr = GetAttr;
  ops.readdir = ReadDir;
  ops.open = Open;
  ops.read = Read;
  ops.release = Release;
  char* args[] = {argv[0], const_cast<char*>("-f"), const_cast<char*>("-s"), argv[2], nullptr};
  return fuse_main(4, args, &ops, nullptr);
}
