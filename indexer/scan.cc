#include "indexer/scan.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <set>

#include "indexer/file_table.h"
#include "indexer/format_reader.h"
#include "indexer/readers.h"

namespace ckptfs {

bool DirListing::has_file(const std::string& name) const {
  return std::binary_search(files.begin(), files.end(), name);
}

std::vector<std::unique_ptr<FormatReader>> AllReaders() {
  std::vector<std::unique_ptr<FormatReader>> r;
  // Order matters: a folder with both safetensors and .bin files (common on
  // the Hub) is read as safetensors; a DCP folder's common.pt is not a
  // torch.save checkpoint of its own.
  r.push_back(MakeByteCheckpointReader());
  r.push_back(MakeSafetensorsReader());
  r.push_back(MakeDcpReader());
  r.push_back(MakeTorchSaveReader());
  return r;
}

namespace {

Result<DirListing> ListDir(const std::string& root, const std::string& rel) {
  DirListing d;
  d.rel = rel;
  d.abs = rel.empty() ? root : root + "/" + rel;
  DIR* dir = ::opendir(d.abs.c_str());
  if (!dir) return Status::IOError(d.abs + ": " + std::strerror(errno));
  while (struct dirent* e = ::readdir(dir)) {
    std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    if (::stat((d.abs + "/" + name).c_str(), &st) != 0) continue;  // dangling link
    if (S_ISDIR(st.st_mode)) d.dirs.push_back(name);
    else if (S_ISREG(st.st_mode)) d.files.push_back(name);
  }
  ::closedir(dir);
  std::sort(d.files.begin(), d.files.end());
  std::sort(d.dirs.begin(), d.dirs.end());
  return d;
}

}  // namespace

Result<Catalog> ScanSource(const std::string& root_arg, const ScanOptions& options) {
  char real[PATH_MAX];
  if (!::realpath(root_arg.c_str(), real))
    return Status::IOError(root_arg + ": " + std::strerror(errno));
  Catalog catalog;
  catalog.root = real;
  struct stat st;
  if (::stat(real, &st) != 0 || !S_ISDIR(st.st_mode))
    return Status::InvalidArgument(root_arg + ": not a directory");

  FileTable files(catalog.root);
  auto readers = AllReaders();
  std::vector<std::string> pending{""};
  std::set<std::pair<dev_t, ino_t>> seen;  // symlinked directories can loop
  size_t done = 0;
  while (!pending.empty()) {
    std::string rel = pending.back();
    pending.pop_back();
    auto listing = ListDir(catalog.root, rel);
    if (!listing.ok()) {
      if (rel.empty()) return listing.status();
      continue;
    }
    struct stat ds;
    if (::stat(listing->abs.c_str(), &ds) != 0 || !seen.insert({ds.st_dev, ds.st_ino}).second) continue;
    std::vector<std::string> claimed;
    for (const auto& r : readers) {
      if (!r->Recognise(*listing)) continue;
      Checkpoint ckpt;
      ckpt.dir = rel;
      RETURN_IF_ERROR(r->Read(*listing, files, ckpt));
      claimed = r->ClaimedSubdirs(*listing);
      if (!options.file_index_mapping.empty()) {
        Status s = LoadFileIndexMapping(options.file_index_mapping, ckpt);
        if (!s.ok()) return s;
      }
      catalog.checkpoints.push_back(std::move(ckpt));
      break;
    }
    for (auto it = listing->dirs.rbegin(); it != listing->dirs.rend(); ++it)
      if (std::find(claimed.begin(), claimed.end(), *it) == claimed.end())
        pending.push_back(rel.empty() ? *it : rel + "/" + *it);
    ++done;
    if (options.progress) options.progress(done, catalog.checkpoints.size());
  }
  std::sort(catalog.checkpoints.begin(), catalog.checkpoints.end(),
            [](const Checkpoint& a, const Checkpoint& b) { return a.dir < b.dir; });
  catalog.files = files.Take();
  catalog.indexed_at_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::system_clock::now().time_since_epoch())
                              .count();
  return catalog;
}

}  // namespace ckptfs
