// ckptfs: mount sharded training checkpoints as the files tools expect.
//
// Thin by design: each subcommand parses its flags and calls the libraries.
// `cat` and `export` read through VirtualFs, the same read path as a mount.
// Exit codes are named below and documented in docs/CLI.md.
#include <fcntl.h>
#include <sys/stat.h>
#include <syslog.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <mutex>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "fs/mount.h"
#include "fs/virtual_fs.h"
#include "indexer/index_store.h"
#include "indexer/scan.h"
#include "tools/progress.h"

#include "tools/cli.h"

namespace ckptfs {
namespace {

const char kExamples[] = R"(
Examples:
  ckptfs index  /ckpts/step_100                 # build the index (once per checkpoint)
  ckptfs mount  /ckpts/step_100 /mnt/s100       # serve it; unmount with fusermount3 -u /mnt/s100
  ls -l /mnt/s100/model/consolidated/           # a Hugging Face folder, computed on read
  ckptfs ls     /ckpts/step_100 model/consolidated
  ckptfs cat    /ckpts/step_100 model/consolidated/model.safetensors.index.json
  ckptfs export /ckpts/step_100 model/consolidated /tmp/hf   # materialise a view

Docs: docs/CLI.md (flags, exit codes), docs/SEMANTICS.md (what the mount serves).
)";

void AddCommon(CLI::App* cmd, Common& c, bool view_flags) {
  cmd->add_option("--index", c.index, "Index location (default: $CKPTFS_INDEX_DIR or ~/.cache/ckptfs/<name>-<hash>)");
  if (view_flags) {
    cmd->add_option("--max-file-size", c.max_file_size,
                    "Split consolidated/ into files of at most this size when the checkpoint has no file mapping (default 5GB; units B, KB, MB, GB, KiB, MiB, GiB)");
    cmd->add_flag("--reindex", c.reindex, "Rebuild the index before opening");
    cmd->add_option("--names", c.names,
                    "JSON {fqn: name}: exactly which tensors consolidated/ and mesh/ hold, under which names "
                    "(replaces the model-weight rule)");
    cmd->add_option("--rules", c.rules,
                    "Mesh sharding rules (JSON {\"rules\": [{\"pattern\", \"kind\", \"dim\"}]}) placed before the preset's");
  }
}

int Main(int argc, char** argv) {
  CLI::App app{"ckptfs: mount sharded training checkpoints as Hugging Face folders, computed on read."};
  app.footer(kExamples);
  app.require_subcommand(1);
  app.set_version_flag("--version", "ckptfs 0.1.0");
  Common c;
  bool quiet = false, foreground = false, debug = false, allow_other = false, json = false;
  unsigned threads = 16;
  std::string mountpoint, vpath, dest, log_file;

  auto* index = app.add_subcommand("index", "Build the index of a checkpoint tree (RocksDB)");
  index->add_option("ROOT", c.root, "Checkpoint directory (or a tree of them)")->required();
  index->add_option("--mapping", c.mapping, "JSON {fqn: 1-based file index} deciding consolidated/ file split");
  index->add_flag("-q,--quiet", quiet, "Print only problems");
  AddCommon(index, c, false);
  index->footer("\nExample:\n  ckptfs index /ckpts/step_100\n\nExit status 5 when the checkpoint has problems (holes, truncated or corrupt files):\nthey are listed, and reads of the affected tensors fail with EIO.\n");

  auto* mount = app.add_subcommand("mount", "Mount a checkpoint tree read-only (indexes it first if needed)");
  mount->add_option("ROOT", c.root, "Checkpoint directory")->required();
  mount->add_option("MOUNTPOINT", mountpoint, "Empty directory to mount on")->required();
  mount->add_flag("-f,--foreground", foreground, "Stay in the foreground (logs to stderr)");
  mount->add_flag("-d,--debug", debug, "Log every FUSE request (implies -f)");
  mount->add_flag("--allow-other", allow_other, "Let other users read the mount (needs user_allow_other in /etc/fuse.conf)");
  mount->add_option("--threads", threads, "Maximum FUSE worker threads (default 16)");
  mount->add_option("--log-file", log_file, "Append log lines here (default: stderr with -f, syslog otherwise)");
  AddCommon(mount, c, true);
  mount->footer("\nExamples:\n  ckptfs mount /ckpts/step_100 /mnt/s100\n  ckptfs mount -f --max-file-size 2GB /ckpts/step_100 /mnt/s100\n  fusermount3 -u /mnt/s100     # unmount\n");

  auto* ls = app.add_subcommand("ls", "List tensors (no PATH) or a directory of the virtual tree (PATH), without mounting");
  ls->add_option("ROOT", c.root, "Checkpoint directory")->required();
  ls->add_option("PATH", vpath, "Path inside the tree: list its entries instead of the tensors");
  ls->add_flag("--json", json, "Print JSON (tensors: name, dtype, shape, chunks, bytes, files; entries: name, type, size)");
  std::string mesh_spec, pattern;
  ls->add_option("--filter", pattern, "Only tensors whose name matches this glob (e.g. '*.q_proj.weight')");
  ls->add_option("--mesh", mesh_spec, "Show the per-rank views of a layout spec (tp4, tp2-pp2, ...), or why it is impossible");
  AddCommon(ls, c, true);
  ls->footer("\nExamples:\n  ckptfs ls /ckpts/step_100                        # table of tensors\n"
             "  ckptfs ls /ckpts/step_100 --filter '*embed*' --json\n"
             "  ckptfs ls /ckpts/step_100 model/consolidated     # files of a view\n"
             "  ckptfs ls /ckpts/step_100 --mesh tp4\n");

  std::string tensor_name, against;
  auto* inspect = app.add_subcommand("inspect", "Show one tensor: chunks, files, byte ranges, and statistics read from it");
  inspect->add_option("ROOT", c.root, "Checkpoint directory")->required();
  inspect->add_option("NAME", tensor_name, "Tensor name (fqn), as `ckptfs ls` prints it")->required();
  inspect->add_flag("--json", json, "Print JSON");
  AddCommon(inspect, c, true);
  inspect->footer("\nExample:\n  ckptfs inspect /ckpts/step_100 model.embed_tokens.weight\n");

  auto* check = app.add_subcommand("check", "Report holes, overlaps, changed sources and unreadable items; prints only problems");
  check->add_option("ROOT", c.root, "Checkpoint directory")->required();
  AddCommon(check, c, false);
  check->footer("\nExample:\n  ckptfs check /ckpts/step_100 && echo clean\n\nExit status 0 when clean, 5 when there are problems.\n");

  auto* verify = app.add_subcommand("verify", "Read every byte of every virtual file and validate each safetensors file");
  verify->add_option("ROOT", c.root, "Checkpoint directory")->required();
  verify->add_option("--against", against, "Compare consolidated/ tensor by tensor with this Hugging Face folder");
  verify->add_flag("--json", json, "Print JSON");
  AddCommon(verify, c, true);
  verify->footer("\nExamples:\n  ckptfs verify /ckpts/step_100\n  ckptfs verify /ckpts/step_100 --against /models/reference-hf\n\n"
                 "Prints only problems; exit status 0 when clean, 5 when there are problems.\n");

  auto* cat = app.add_subcommand("cat", "Write a file of the virtual tree to stdout, without mounting");
  cat->add_option("ROOT", c.root, "Checkpoint directory")->required();
  cat->add_option("PATH", vpath, "File inside the tree")->required();
  AddCommon(cat, c, true);
  cat->footer("\nExample:\n  ckptfs cat /ckpts/step_100 model/consolidated/model-00001-of-00002.safetensors > out.safetensors\n");

  auto* exp = app.add_subcommand("export", "Copy a file or directory of the virtual tree to real files");
  exp->add_option("ROOT", c.root, "Checkpoint directory")->required();
  exp->add_option("PATH", vpath, "File or directory inside the tree")->required();
  exp->add_option("DEST", dest, "Destination directory (created)")->required();
  AddCommon(exp, c, true);
  exp->footer("\nExample:\n  ckptfs export /ckpts/step_100 model/consolidated /tmp/hf\n");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  auto size = ParseSize(c.max_file_size);
  if (!size) {
    Error("--max-file-size: cannot read '" + c.max_file_size + "' as a size (try 5GB or 512MiB)");
    return kExitUsage;
  }
  c.max_file_bytes = *size;

  if (*index) return BuildIndex(c, quiet);
  if (*check) return RunCheck(c);

  int rc = kExitOk;
  if (*mount) {
    std::mutex log_mu;
    std::FILE* log = nullptr;
    if (!log_file.empty() && !(log = std::fopen(log_file.c_str(), "a"))) {
      Error(log_file + ": " + std::strerror(errno));
      return kExitUsage;
    }
    const bool to_stderr = (foreground || debug) && !log;
    if (!log && !to_stderr) ::openlog("ckptfs", LOG_PID, LOG_USER);
    auto fs = OpenFs(c, &rc, [&log_mu, log, to_stderr](const std::string& line) {
      std::lock_guard<std::mutex> lock(log_mu);
      if (log) std::fprintf(log, "ckptfs: %s\n", line.c_str()), std::fflush(log);
      else if (to_stderr) std::fprintf(stderr, "ckptfs: %s\n", line.c_str());
      else ::syslog(LOG_WARNING, "%s", line.c_str());
    });
    if (!fs) return rc;
    MountOptions mo;
    mo.foreground = foreground;
    mo.debug = debug;
    mo.allow_other = allow_other;
    mo.max_threads = threads;
    Status st = MountAndServe(std::move(fs), mountpoint, mo);
    if (!st.ok()) {
      Error(st.message());
      return kExitMountFailed;
    }
    return kExitOk;
  }

  auto fs = OpenFs(c, &rc);
  if (!fs) return rc;
  if (*inspect) return RunInspect(*fs, tensor_name, json);
  if (*verify) return RunVerify(*fs, against, json);
  if (*ls && vpath.empty() && mesh_spec.empty()) return RunTensorTable(fs->catalog(), pattern, json);
  if (*ls && !mesh_spec.empty()) {
    // Each checkpoint's mesh/<spec>/: opening it builds the views or says why not.
    int status = kExitOk;
    for (const Checkpoint& ck : fs->catalog().checkpoints) {
      std::string dir = (ck.dir.empty() ? "" : ck.dir + "/") + "mesh/" + mesh_spec;
      auto spec_dir = fs->Resolve(dir);
      if (!spec_dir.ok()) {  // the reason was logged by the lookup
        status = kExitNoSource;
        continue;
      }
      std::printf("%s/\n", dir.c_str());
      auto ranks = fs->ReadDir(spec_dir->ino);
      for (const auto& rank : ranks.value()) {
        std::printf("  %s/\n", rank.name.c_str());
        auto files = fs->ReadDir(rank.attr.ino);
        for (const auto& f : files.value())
          std::printf("    %14llu  %s\n", static_cast<unsigned long long>(f.attr.size), f.name.c_str());
      }
    }
    return status;
  }
  auto attr = fs->Resolve(vpath);
  if (!attr.ok()) {
    Error(vpath + ": " + attr.status().message());
    return kExitNoSource;
  }

  if (*ls) {
    std::vector<DirEntry> entries;
    if (attr->is_dir()) {
      auto e = fs->ReadDir(attr->ino);
      if (!e.ok()) {
        Error(e.status().message());
        return kExitNoSource;
      }
      entries = std::move(*e);
    } else {
      entries.push_back({std::filesystem::path(vpath).filename().string(), *attr});
    }
    if (json) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& e : entries)
        out.push_back({{"name", e.name}, {"type", e.attr.is_dir() ? "dir" : "file"}, {"size", e.attr.size},
                       {"virtual", e.attr.is_virtual}});
      std::cout << out.dump(2) << "\n";
    } else {
      for (const auto& e : entries)
        std::printf("%s %14llu  %s%s\n", e.attr.is_dir() ? "dr-xr-xr-x" : "-r--r--r--",
                    static_cast<unsigned long long>(e.attr.size), e.name.c_str(), e.attr.is_dir() ? "/" : "");
    }
    return kExitOk;
  }

  if (*cat) {
    if (attr->is_dir()) {
      Error(vpath + " is a directory (use `ckptfs ls` or `ckptfs export`)");
      return kExitUsage;
    }
    uint64_t done = 0;
    return CopyOut(*fs, *attr, vpath, stdout, nullptr, &done);
  }

  // export
  std::vector<std::pair<std::string, Attr>> files;  // relative name, attr
  std::function<bool(const std::string&, const Attr&)> walk = [&](const std::string& rel, const Attr& a) {
    if (!a.is_dir()) {
      files.push_back({rel, a});
      return true;
    }
    auto entries = fs->ReadDir(a.ino);
    if (!entries.ok()) return false;
    for (const auto& e : *entries)
      if (!walk(rel.empty() ? e.name : rel + "/" + e.name, e.attr)) return false;
    return true;
  };
  std::string base = attr->is_dir() ? "" : std::filesystem::path(vpath).filename().string();
  if (!walk(base, *attr)) {
    Error("cannot list " + vpath);
    return kExitNoSource;
  }
  uint64_t total = 0, done = 0;
  for (const auto& f : files) total += f.second.size;
  Progress progress("export " + vpath, total, "bytes");
  for (const auto& [rel, a] : files) {
    std::filesystem::path out = std::filesystem::path(dest) / rel;
    std::error_code ec;
    std::filesystem::create_directories(out.parent_path(), ec);
    std::string tmp = out.string() + ".ckptfs-partial";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) {
      Error(tmp + ": " + std::strerror(errno));
      return kExitReadError;
    }
    std::string src = vpath.empty() ? rel : (attr->is_dir() ? vpath + "/" + rel : vpath);
    int r = CopyOut(*fs, a, src, f, &progress, &done);
    if (std::fclose(f) != 0 && r == kExitOk) {
      Error(tmp + ": " + std::strerror(errno));
      r = kExitReadError;
    }
    if (r != kExitOk) {
      std::filesystem::remove(tmp, ec);  // never leave a partial file under the real name
      return r;
    }
    std::filesystem::rename(tmp, out, ec);
    if (ec) {
      Error(out.string() + ": " + ec.message());
      return kExitReadError;
    }
  }
  return kExitOk;
}

}  // namespace
}  // namespace ckptfs

int main(int argc, char** argv) {
  try {
    return ckptfs::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckptfs: internal error: %s\n", e.what());
    return 1;
  }
}
