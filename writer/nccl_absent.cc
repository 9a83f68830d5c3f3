// The NCCL entry points of a build without NCCL's headers (collective.h).
#include "writer/collective.h"

namespace ckptfs {

bool BuiltWithNccl() { return false; }

Result<std::vector<std::unique_ptr<Collective>>> MakeLocalNcclGroup(int) {
  return Status::NotSupported("ckptfs was built without NCCL (its headers were not found)");
}

}  // namespace ckptfs
