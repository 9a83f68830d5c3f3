// ckptfs._writer's S3 calls (s3_module.cc).
#pragma once

#include <pybind11/pybind11.h>

namespace ckptfs {

void BindS3(pybind11::module_& m);

}  // namespace ckptfs
