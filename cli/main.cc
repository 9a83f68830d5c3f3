// ckptfs: mount sharded training checkpoints as the files tools expect.
//
// Thin by design: each subcommand parses its flags and calls the libraries.
// kCommands below is the one list of subcommands: `ckptfs --help` lists it
// and the parsed command line is dispatched through it. A new subcommand is
// a row here and a file that defines it (cli/commands.h says what the file
// provides). Exit codes: cli/cli.h, docs/CLI.md.
#include <cstdio>
#include <string>
#include <exception>
#include <utility>
#include <vector>

#include "cli/commands.h"

namespace ckptfs {
namespace {

const char kVersion[] = "ckptfs " CKPTFS_VERSION;

const char kExamples[] = R"(
Examples:
  ckptfs index  /ckpts/step_100                 # build the index (once per checkpoint)
  ckptfs mount  /ckpts/step_100 /mnt/s100       # serve it; unmount with fusermount3 -u /mnt/s100
  ls -l /mnt/s100/model/consolidated/           # a Hugging Face folder, computed on read
  ckptfs ls     /ckpts/step_100 model/consolidated
  ckptfs cat    /ckpts/step_100 model/consolidated/model.safetensors.index.json
  ckptfs export /ckpts/step_100 model/consolidated /tmp/hf   # materialise a view
  ckptfs mount  s3://bucket/run1 /mnt/run1      # object storage (AWS_* variables, ~/.aws)
  ckptfs mount  s3://bucket/run1 /mnt/run1 --cache ~/.cache/ckptfs-blocks --max-cache-size 50G

Docs: CLI.md (flags, exit codes), SEMANTICS.md (what the mount serves): docs/ in the source,
/usr/share/doc/ckptfs/ when installed; `man ckptfs`.
)";

Handler DefineVersion(CLI::App*, Common&) {
  return [] { return std::printf("%s\n", kVersion), int(kExitOk); };
}

// `ckptfs help [COMMAND]`: the program's --help, or COMMAND's. (CLI11's
// App::help() would print the page of the parsed subcommand, `help` itself.)
Handler DefineHelp(CLI::App* cmd, Common&) {
  auto command = std::make_shared<std::string>();
  cmd->add_option("COMMAND", *command, "The subcommand whose --help to print");
  const CLI::App* app = cmd->get_parent();
  return [app, command] {
    const CLI::App* page = app;
    std::string name = app->get_name();
    if (!command->empty()) {
      page = nullptr;
      for (const CLI::App* sub : app->get_subcommands({}))
        if (sub->get_name() == *command) page = sub;
      if (!page) {
        Error("help: no command '" + *command + "' (`ckptfs --help` lists them)");
        return int(kExitUsage);
      }
      name += " " + *command;
    }
    std::printf("%s", page->get_formatter()->make_help(page, name, CLI::AppFormatMode::Normal).c_str());
    return int(kExitOk);
  };
}

// Every subcommand, in the order `ckptfs --help` lists them.
const Command kCommands[] = {
    {"index", "Build the index of a checkpoint tree (RocksDB)", DefineIndex},
    {"mount", "Mount a checkpoint tree read-only (indexes it first if needed)", DefineMount},
    {"ls", "List tensors (no PATH) or a directory of the virtual tree (PATH), without mounting", DefineLs},
    {"inspect", "Show one tensor: chunks, files, byte ranges, and statistics read from it", DefineInspect},
    {"cat", "Write a file of the virtual tree to stdout, without mounting", DefineCat},
    {"export", "Copy a file or directory of the virtual tree to real files", DefineExport},
    {"check", "Report holes, overlaps, changed sources and unreadable items", DefineCheck},
    {"verify", "Read every byte of every virtual file and validate each safetensors file", DefineVerify},
    {"version", "Print the version", DefineVersion},
    {"help", "Print this help", DefineHelp},
};

bool IsCommand(const std::string& name) {
  for (const Command& row : kCommands)
    if (name == row.name) return true;
  return false;
}

std::string CommandNames() {
  std::string out;
  for (const Command& row : kCommands) out += (out.empty() ? "" : ", ") + std::string(row.name);
  return out;
}

// A command line CLI11 refused: what it said, and which --help to read.
int UsageError(const CLI::App& app, const std::string& what) {
  std::string sub;
  for (const CLI::App* cmd : app.get_subcommands())
    if (cmd->parsed()) sub = cmd->get_name();
  if (sub.empty()) Error(what + " (`ckptfs --help` lists the commands)");
  else Error(sub + ": " + what + " (`ckptfs " + sub + " --help` lists its arguments and flags)");
  return kExitUsage;
}

// The flags every subcommand shares, checked and completed once parsed.
int ResolveCommon(Common& c) {
  auto size = ParseSize(c.max_file_size);
  if (!size) {
    Error("--max-file-size: cannot read '" + c.max_file_size + "' as a size above zero (try 5GB or 512MiB)");
    return kExitUsage;
  }
  c.max_file_bytes = *size;
  if (int rc = CheckS3FlagsFitRoot(c); rc != kExitOk) return rc;
  return ResolveCacheFlags(c);
}

int Main(int argc, char** argv) {
  CLI::App app{"ckptfs: mount sharded training checkpoints as Hugging Face folders, computed on read."};
  app.footer(kExamples);
  app.require_subcommand(1);
  app.set_version_flag("--version", kVersion);
  Common common;
  std::vector<std::pair<const CLI::App*, Handler>> handlers;
  for (const Command& row : kCommands) {
    CLI::App* cmd = app.add_subcommand(row.name, row.summary);
    cmd->footer("");  // not the program's examples: each command says its own
    handlers.emplace_back(cmd, row.define(cmd, common));
  }
  if (argc > 1 && argv[1][0] != '-' && !IsCommand(argv[1])) {
    Error("no command '" + std::string(argv[1]) + "'; the commands are " + CommandNames() +
          " (`ckptfs --help` says what each does)");
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e), kExitOk;  // --help, --version
    return UsageError(app, e.what());
  }
  if (int rc = ResolveCommon(common); rc != kExitOk) return rc;
  for (const auto& [cmd, run] : handlers)
    if (cmd->parsed()) return run();
  return kExitUsage;  // unreachable: require_subcommand(1)
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
