// `ckptfs index`: build (or dump) the index of a checkpoint tree.
#include <iostream>
#include <memory>

#include "cli/commands.h"

namespace ckptfs {

Handler DefineIndex(CLI::App* cmd, Common& c) {
  struct Flags {
    bool quiet = false, dump = false;
  };
  auto f = std::make_shared<Flags>();
  cmd->add_option("ROOT", c.root, "Checkpoint directory (or a tree of them)")->required();
  cmd->add_option("--mapping", c.mapping, "JSON {fqn: 1-based file index} deciding consolidated/ file split");
  cmd->add_flag("-q,--quiet", f->quiet, "Print only problems");
  cmd->add_flag("--dump", f->dump, "Print every row of the index as JSON lines ({key, value}) and exit");
  AddCommon(cmd, c, false);
  cmd->footer("\nExample:\n  ckptfs index /ckpts/step_100\n\nExit status 5 when the checkpoint has problems (holes, truncated or corrupt files):\nthey are listed, and reads of the affected tensors fail with EIO.\n");
  return [f, &c] { return f->dump ? DumpIndex(c, std::cout) : BuildIndex(c, f->quiet); };
}

}  // namespace ckptfs
