// The subcommands of `ckptfs`, as cli/main.cc's command table lists them.
//
// A subcommand is one row of that table (name, one-line summary, Define
// function) and one file that defines it: Define<Name>(cmd, common) adds the
// subcommand's own flags to `cmd` (CLI11 writes them into storage the
// subcommand owns) and returns the handler that runs it once the command line
// is parsed. `common` holds the flags several subcommands share (the root,
// the index, s3:// and view flags); main.cc checks and completes it (sizes
// parsed, the cache directory made absolute) before calling the handler.
// A handler returns an exit code (cli/cli.h, docs/CLI.md).
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

#include "cli/cli.h"

namespace ckptfs {

using Handler = std::function<int()>;
using DefineFn = Handler (*)(CLI::App* cmd, Common& common);

struct Command {
  const char* name;
  const char* summary;  // the line `ckptfs --help` lists it with
  DefineFn define;
};

// The flags shared by subcommands that open a checkpoint tree: --index and
// the s3:// flags; with `view_flags`, also those that shape the views
// (--max-file-size, --reindex, --names, --rules, --keep-dtype).
void AddCommon(CLI::App* cmd, Common& c, bool view_flags);

// cli/index_command.cc
Handler DefineIndex(CLI::App* cmd, Common& c);
// cli/mount_command.cc
Handler DefineMount(CLI::App* cmd, Common& c);
// cli/tree_commands.cc: the virtual tree without mounting.
Handler DefineLs(CLI::App* cmd, Common& c);
Handler DefineCat(CLI::App* cmd, Common& c);
Handler DefineExport(CLI::App* cmd, Common& c);
// cli/inspect_commands.cc
Handler DefineInspect(CLI::App* cmd, Common& c);
Handler DefineCheck(CLI::App* cmd, Common& c);
Handler DefineVerify(CLI::App* cmd, Common& c);

}  // namespace ckptfs
