// Pages of a pinned source file stored in a virtual file's page cache by
// splice (the mount's PageStore): a FUSE_NOTIFY_STORE message whose bytes
// come from the source's page cache through a pipe, so the kernel copies
// each page once, into the virtual file's cache, and the daemon maps,
// faults and copies nothing. notify_store through libfuse takes the bytes
// from memory: a mapping of the source, faulted in, and a copy from it
// (docs/BENCHMARKS.md, "Pinned pages spliced into the page cache").
#pragma once

#include <cstddef>
#include <cstdint>

namespace ckptfs {

// Stores [fd_offset, fd_offset + len) of the open file `fd` at `offset`
// (page-aligned) of inode `ino`, through the FUSE device `dev`: one message
// per pipeful, its header written into the calling thread's pipe, its bytes
// spliced from the file after it, the whole message spliced into the
// device. The bytes must not change meanwhile (the caller's pin). Returns
// how many bytes from the front were stored: fewer than `len` when a step
// failed (no pipe, a short file, a message the device refused), and the
// caller stores the rest another way.
size_t SpliceStore(int dev, uint64_t ino, uint64_t offset, int fd, uint64_t fd_offset, size_t len);

}  // namespace ckptfs
