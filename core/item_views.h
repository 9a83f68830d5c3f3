// The views with one file per item: tensors/<fqn>.npy (one NumPy file per
// tensor) and bytes/<key>.pt (each non-tensor item as saved), and the
// reversible file names of items. Pure.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/meta.h"
#include "core/status.h"
#include "core/views.h"

namespace ckptfs {

// tensors/: one NumPy .npy file per tensor (NPY 1.0 header + C-order data),
// named EscapeFileName(fqn) + ".npy". Dtypes NumPy lacks (BF16, F8_*, F4,
// F6_*) are presented as float32, converted on read; C64 as complex64.
Result<std::vector<ViewFile>> TensorsView(const Checkpoint& ckpt);
// One file of tensors/.
Result<ViewFile> NpyFile(std::shared_ptr<const TensorMeta> t);

// bytes/: each non-tensor item (DCP BYTE_IO) as `<escaped key>.pt`, its
// bytes exactly as saved (a torch.save blob: torch.load reads it).
std::vector<ViewFile> BytesView(const Checkpoint& ckpt);

// A file name for any fqn, reversibly: '%' -> "%25", '/' -> "%2F", and a
// name that is empty, "." or ".." gets its characters escaped too.
std::string EscapeFileName(const std::string& fqn);
std::string UnescapeFileName(const std::string& name);

// The NPY 1.0 header for a C-order array of `descr` ('<f4', '|b1', ...)
// and `shape`, padded so the data starts on a 64-byte boundary.
std::string NpyHeader(const std::string& descr, const Shape& shape);
// NumPy's descr for a dtype as stored in .npy views ('<f4' for converted ones).
std::string NpyDescr(DType t);

}  // namespace ckptfs
