#include "tools/store_loader.h"

#include "indexer/index_store.h"

namespace ckptfs {

StoreLoader::StoreLoader(std::string index_path, std::string abs_root)
    : index_path_(std::move(index_path)), root_(std::move(abs_root)) {}

StoreLoader::~StoreLoader() = default;

Result<Store*> StoreLoader::Reader() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!reader_) {
    ASSIGN_OR_RETURN(reader_, Store::Open(index_path_, root_, Store::Access::kReadOnly));
  }
  return reader_.get();
}

Result<Checkpoint> StoreLoader::Load(const std::string& dir) {
  ASSIGN_OR_RETURN(Store * store, Reader());
  auto ckpt = store->Load(dir);
  if (ckpt.ok() || ckpt.status().code() != Status::Code::kNotFound) return ckpt;
  RETURN_IF_ERROR(store->CatchUp());
  return store->Load(dir);
}

Status StoreLoader::Commit(const Checkpoint& ckpt) {
  ASSIGN_OR_RETURN(auto writer, Store::Open(index_path_, root_, Store::Access::kReadWrite));
  return writer->Commit(ckpt);
}

Status StoreLoader::Remove(const std::string& dir) {
  ASSIGN_OR_RETURN(auto writer, Store::Open(index_path_, root_, Store::Access::kReadWrite));
  return writer->Remove(dir);
}

}  // namespace ckptfs
