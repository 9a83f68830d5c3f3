#include "cli/store_loader.h"

#include "indexer/index_store.h"

namespace ckptfs {

StoreLoader::StoreLoader(std::string index_path, std::string abs_root)
    : index_path_(std::move(index_path)), root_(std::move(abs_root)) {}

StoreLoader::~StoreLoader() = default;

Result<std::shared_ptr<Store>> StoreLoader::Reader() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!reader_) {
    ASSIGN_OR_RETURN(std::unique_ptr<Store> opened, Store::Open(index_path_, root_, Store::Access::kReadOnly));
    reader_ = std::move(opened);
  }
  return reader_;
}

// A store that fails a load (damaged, or rebuilt under us by `ckptfs index`)
// is opened again for the next one: the files this handle has open may be
// the damaged ones, or deleted.
void StoreLoader::Drop(const std::shared_ptr<Store>& failed) {
  std::lock_guard<std::mutex> lock(mu_);
  if (reader_ == failed) reader_.reset();
}

Result<Checkpoint> StoreLoader::Load(const std::string& dir) {
  ASSIGN_OR_RETURN(std::shared_ptr<Store> store, Reader());
  auto ckpt = store->Load(dir);
  if (!ckpt.ok() && ckpt.status().code() == Status::Code::kNotFound) {
    if (Status caught = store->CatchUp(); caught.ok()) ckpt = store->Load(dir);
    else ckpt = caught;
  }
  if (!ckpt.ok() && ckpt.status().code() != Status::Code::kNotFound) Drop(store);
  return ckpt;
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
