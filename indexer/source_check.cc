#include "indexer/source_check.h"

#include "source/identities_now.h"
#include "source/posix_source.h"

namespace ckptfs {

Status CheckSources(const std::string& root, const std::vector<SourceFile>& files) {
  return CheckSources(*PosixSourceAt(root), files);
}

Status CheckSources(const Source& source, const std::vector<SourceFile>& files) {
  std::string changed;
  int count = 0;
  IdentitiesNow identities(source);
  for (const SourceFile& f : files) {
    if (f.derived()) continue;  // its base file is checked
    auto now = identities.Of(f.path);
    std::string what = now.ok() ? source.DescribeChange(f, *now) : now.status().message();
    if (what.empty()) continue;
    if (++count <= 3) changed += (changed.empty() ? "" : "; ") + f.path + ": " + what;
  }
  if (count == 0) return Status::OK();
  if (count > 3) changed += "; and " + std::to_string(count - 3) + " more";
  return Status::Stale(std::to_string(count) + " source file(s) changed since indexing (" + changed +
                       "); run `ckptfs index` again");
}

Status CheckSources(const Catalog& catalog) {
  std::vector<SourceFile> files;
  for (const Checkpoint& c : catalog.checkpoints) files.insert(files.end(), c.files.begin(), c.files.end());
  return CheckSources(catalog.root, files);
}

}  // namespace ckptfs
