// The virtual tree without mounting: `ckptfs ls` (the tensor table, a
// directory, or a mesh layout's rank views), `cat` and `export`. They read
// through VirtualFs, the same read path as a mount.
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/progress.h"
#include "core/views.h"
#include "indexer/format_reader.h"
#include "source/source.h"

namespace ckptfs {
namespace {

// Each checkpoint's mesh/<spec>/: opening it builds the views or says why not.
int RunMeshListing(VirtualFs& fs, const std::string& spec) {
  int status = kExitOk;
  for (const std::string& ck : fs.CheckpointDirs()) {
    std::string dir = JoinRel(JoinRel(ck, ViewDirName(ViewKind::kMesh)), spec);
    auto spec_dir = fs.Resolve(dir);
    if (!spec_dir.ok()) {  // the reason was logged by the lookup
      status = kExitNoSource;
      continue;
    }
    std::printf("%s/\n", dir.c_str());
    auto ranks = fs.ReadDir(spec_dir->ino);
    for (const auto& rank : ranks.value()) {
      std::printf("  %s/\n", rank.name.c_str());
      auto files = fs.ReadDir(rank.attr.ino);
      for (const auto& file : files.value())
        std::printf("    %14llu  %s\n", static_cast<unsigned long long>(file.attr.size), file.name.c_str());
    }
  }
  return status;
}

const char* ModeString(const Attr& a) {
  if (a.is_dir()) return "dr-xr-xr-x";
  if ((a.mode & S_IFMT) == S_IFLNK) return "lrwxrwxrwx";
  return "-r--r--r--";
}

int RunListing(VirtualFs& fs, const Attr& attr, const std::string& vpath, bool as_json) {
  std::vector<DirEntry> entries;
  if (attr.is_dir()) {
    auto e = fs.ReadDir(attr.ino);
    if (!e.ok()) {
      Error(e.status().message());
      return kExitNoSource;
    }
    entries = std::move(*e);
  } else {
    entries.push_back({std::filesystem::path(vpath).filename().string(), attr});
  }
  if (as_json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& e : entries)
      out.push_back({{"name", e.name}, {"type", e.attr.is_dir() ? "dir" : "file"}, {"size", e.attr.size},
                     {"virtual", e.attr.is_virtual}});
    std::cout << out.dump(2) << "\n";
    return kExitOk;
  }
  for (const auto& e : entries)
    std::printf("%s %14llu  %s%s\n", ModeString(e.attr), static_cast<unsigned long long>(e.attr.size), e.name.c_str(),
                e.attr.is_dir() ? "/" : "");
  return kExitOk;
}

// Writes one virtual file to `out` through a partial file, never leaving a
// partial file under the real name.
int ExportFile(VirtualFs& fs, const Attr& a, const std::string& src, const std::filesystem::path& out,
               Progress* progress, uint64_t* done) {
  std::error_code ec;
  std::filesystem::create_directories(out.parent_path(), ec);
  std::string tmp = out.string() + ".ckptfs-partial";
  std::FILE* file = std::fopen(tmp.c_str(), "wb");
  if (!file) {
    Error(tmp + ": " + std::strerror(errno));
    return kExitWriteError;
  }
  int r = CopyOut(fs, a, src, file, progress, done);
  if (std::fclose(file) != 0 && r == kExitOk) {
    Error(tmp + ": " + std::strerror(errno));
    r = kExitWriteError;
  }
  if (r != kExitOk) {
    std::filesystem::remove(tmp, ec);
    return r;
  }
  std::filesystem::rename(tmp, out, ec);
  if (ec) {
    Error(out.string() + ": " + ec.message());
    return kExitWriteError;
  }
  return kExitOk;
}

int RunExport(VirtualFs& fs, const Attr& attr, const std::string& vpath, const std::string& dest) {
  std::vector<std::pair<std::string, Attr>> files;  // relative name, attr
  std::function<bool(const std::string&, const Attr&)> walk = [&](const std::string& rel, const Attr& a) {
    if (!a.is_dir()) {
      files.push_back({rel, a});
      return true;
    }
    auto entries = fs.ReadDir(a.ino);
    if (!entries.ok()) return false;
    for (const auto& e : *entries)
      if (!walk(rel.empty() ? e.name : rel + "/" + e.name, e.attr)) return false;
    return true;
  };
  std::string base = attr.is_dir() ? "" : std::filesystem::path(vpath).filename().string();
  if (!walk(base, attr)) {
    Error("cannot list " + vpath);
    return kExitNoSource;
  }
  uint64_t total = 0, done = 0;
  for (const auto& file : files) total += file.second.size;
  Progress progress("export " + vpath, total, "bytes");
  for (const auto& [rel, a] : files) {
    std::string src = vpath.empty() ? rel : (attr.is_dir() ? vpath + "/" + rel : vpath);
    int r = ExportFile(fs, a, src, std::filesystem::path(dest) / rel, &progress, &done);
    if (r != kExitOk) return r;
  }
  return kExitOk;
}

// Opens the tree of c.root and resolves `vpath` in it, then calls
// run(fs, attr). Returns an exit code.
int OnPath(const Common& c, const std::string& vpath, const std::function<int(VirtualFs&, const Attr&)>& run) {
  int rc = kExitOk;
  auto fs = OpenFs(c, &rc);
  if (!fs) return rc;
  auto attr = fs->Resolve(vpath);
  if (!attr.ok()) {
    Error(attr.status().message());
    return kExitNoSource;
  }
  return run(*fs, *attr);
}

struct LsFlags {
  bool json = false;
  std::string vpath, pattern, mesh_spec;
};

int RunLs(const LsFlags& f, const Common& c) {
  if (!f.vpath.empty() && f.mesh_spec.empty())
    return OnPath(c, f.vpath, [&](VirtualFs& fs, const Attr& a) { return RunListing(fs, a, f.vpath, f.json); });
  int rc = kExitOk;
  auto fs = OpenFs(c, &rc);
  if (!fs) return rc;
  if (!f.mesh_spec.empty()) return RunMeshListing(*fs, f.mesh_spec);
  const std::vector<LoadedCheckpoint> all = fs->LoadAll();
  if (all.empty())
    std::fprintf(stderr, "ckptfs: no checkpoint under %s (looked for %s)\n", AbsRoot(c.root).c_str(),
                 DescribeRecognised().c_str());
  return RunTensorTable(all, f.pattern, f.json);
}

}  // namespace

Handler DefineLs(CLI::App* cmd, Common& c) {
  auto f = std::make_shared<LsFlags>();
  cmd->add_option("ROOT", c.root, "Checkpoint directory")->required();
  cmd->add_option("PATH", f->vpath, "Path inside the tree: list its entries instead of the tensors");
  cmd->add_flag("--json", f->json, "Print JSON (tensors: checkpoint, name, dtype, shape, chunks, bytes, files; entries: name, type, size)");
  cmd->add_option("--filter", f->pattern, "Only tensors whose name matches this glob (e.g. '*.q_proj.weight')");
  cmd->add_option("--mesh", f->mesh_spec, "Show the per-rank views of a layout spec (tp4, tp2-pp2, ...), or why it is impossible");
  AddCommon(cmd, c, true);
  cmd->footer("\nExamples:\n  ckptfs ls /ckpts/step_100                        # table of tensors\n"
              "  ckptfs ls /ckpts/step_100 --filter '*embed*' --json\n"
              "  ckptfs ls /ckpts/step_100 model/consolidated     # files of a view\n"
              "  ckptfs ls /ckpts/step_100 --mesh tp4\n");
  return [f, &c] { return RunLs(*f, c); };
}

Handler DefineCat(CLI::App* cmd, Common& c) {
  auto vpath = std::make_shared<std::string>();
  cmd->add_option("ROOT", c.root, "Checkpoint directory")->required();
  cmd->add_option("PATH", *vpath, "File inside the tree")->required();
  AddCommon(cmd, c, true);
  cmd->footer("\nExample:\n  ckptfs cat /ckpts/step_100 model/consolidated/model-00001-of-00002.safetensors > out.safetensors\n");
  return [vpath, &c] {
    return OnPath(c, *vpath, [&](VirtualFs& fs, const Attr& a) {
      if (a.is_dir()) {
        Error(*vpath + " is a directory (use `ckptfs ls` or `ckptfs export`)");
        return int(kExitUsage);
      }
      uint64_t done = 0;
      return CopyOut(fs, a, *vpath, stdout, nullptr, &done);
    });
  };
}

Handler DefineExport(CLI::App* cmd, Common& c) {
  struct Flags {
    std::string vpath, dest;
  };
  auto f = std::make_shared<Flags>();
  cmd->add_option("ROOT", c.root, "Checkpoint directory")->required();
  cmd->add_option("PATH", f->vpath, "File or directory inside the tree")->required();
  cmd->add_option("DEST", f->dest, "Destination directory (created)")->required();
  AddCommon(cmd, c, true);
  cmd->footer("\nExample:\n  ckptfs export /ckpts/step_100 model/consolidated /tmp/hf\n");
  return [f, &c] {
    return OnPath(c, f->vpath, [&](VirtualFs& fs, const Attr& a) { return RunExport(fs, a, f->vpath, f->dest); });
  };
}

}  // namespace ckptfs
