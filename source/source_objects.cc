#include "source/source_objects.h"

#include "source/identities_now.h"

namespace ckptfs {
namespace {

// A file whose identity cannot be told now. When the source says it is not
// there, it is gone: OK, with *gone saying so. Any other failure (an
// outage, a server's error) is no change and is returned as it is, so that
// the file is looked at again next time rather than marked changed for good.
Status Unidentified(const Status& st, std::string* gone) {
  if (st.code() != Status::Code::kNotFound) return st;
  *gone = "gone (" + st.message() + ")";
  return Status::OK();
}

}  // namespace

SourceObjects::SourceObjects(std::shared_ptr<const Source> source, const std::vector<SourceFile>* files)
    : source_(std::move(source)), files_(files), objects_(files->size()), stale_(files->size()) {}

Result<const SourceObject*> SourceObjects::Get(FileId id) {
  if (id >= objects_.size()) return Status::Corruption("read plan names unknown file " + std::to_string(id));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stale_[id].empty()) return Status::Stale(stale_[id]);
    if (objects_[id]) return objects_[id].get();
  }
  auto opened = source_->OpenIndexed((*files_)[id]);
  if (!opened.ok()) {
    std::string gone;
    RETURN_IF_ERROR(Unidentified(opened.status(), &gone));
    return MarkStale(id, gone);
  }
  std::unique_ptr<SourceObject> obj = std::move(opened).value();
  RETURN_IF_ERROR(CheckUnchanged(id, *obj));
  std::lock_guard<std::mutex> lock(mu_);
  if (!objects_[id]) objects_[id] = std::move(obj);  // else another thread won the race
  return objects_[id].get();
}

Status SourceObjects::MarkStale(FileId id, const std::string& what) {
  std::string why = (*files_)[id].path + ": " + what + " since indexing; run `ckptfs index` again";
  std::lock_guard<std::mutex> lock(mu_);
  if (stale_[id].empty()) stale_[id] = why;
  any_stale_.store(true);
  return Status::Stale(why);
}

Status SourceObjects::CheckUnchanged(FileId id, const SourceObject& obj) {
  const SourceFile& f = (*files_)[id];
  ASSIGN_OR_RETURN(SourceFile by_object, obj.Identity());
  std::string what = source_->DescribeChange(f, by_object);
  // The path is checked too: a file renamed over the source or deleted
  // leaves our object on the old file, whose bytes are no longer the
  // source's.
  if (what.empty() && !source_->ReadsArePinned()) {
    auto by_path = source_->Identify(f.path);
    if (by_path.ok()) what = source_->DescribeChange(f, *by_path);
    else RETURN_IF_ERROR(Unidentified(by_path.status(), &what));
  }
  return what.empty() ? Status::OK() : MarkStale(id, what);
}

Status SourceObjects::Recheck() {
  IdentitiesNow identities(*source_);
  for (FileId id = 0; id < files_->size(); ++id) {
    const SourceFile& f = (*files_)[id];
    if (f.derived()) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stale_[id].empty()) return Status::Stale(stale_[id]);
    }
    auto now = identities.Of(f.path);
    std::string what;
    if (now.ok()) what = source_->DescribeChange(f, *now);
    else RETURN_IF_ERROR(Unidentified(now.status(), &what));
    if (!what.empty()) return MarkStale(id, what);
  }
  return Status::OK();
}

Status SourceObjects::Check(FileId id) {
  ASSIGN_OR_RETURN(const SourceObject* obj, Get(id));
  return CheckUnchanged(id, *obj);
}

}  // namespace ckptfs
