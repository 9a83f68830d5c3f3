// Background mounts without fork after start-up.
//
// `ckptfs mount` without -f forks first, before anything is opened: the
// child indexes, opens the store (RocksDB starts threads, which do not
// survive fork), mounts, and only then detaches (new session, cwd "/",
// stdio on /dev/null) and tells the parent, which exits 0. Until then the
// child's errors go to the user's terminal and the parent exits with the
// child's exit status, as a foreground command would.
#pragma once

#include <functional>

namespace ckptfs {

// Runs body(detach) in a forked child and returns, in the parent, the exit
// status to exit with: 0 once the child called detach(), else the status the
// child ended with. body's own return value ends the child.
int RunInBackground(const std::function<int(std::function<void()> detach)>& body);

}  // namespace ckptfs
