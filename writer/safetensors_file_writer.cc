// One safetensors file of the HF layout (what and why: safetensors_file_writer.h).
#include "writer/safetensors_file_writer.h"

#include <algorithm>
#include <numeric>

#include "indexer/torch_zip.h"

namespace ckptfs {

int SafetensorsDTypeOrder(DType t) {
  // The crate's `Dtype` enum, in declaration order (its derived Ord).
  static constexpr DType kOrder[] = {
      DType::kBOOL,    DType::kF4,      DType::kF6_E2M3, DType::kF6_E3M2, DType::kU8,  DType::kI8,
      DType::kF8_E5M2, DType::kF8_E4M3, DType::kF8_E8M0, DType::kF8_E4M3FNUZ, DType::kF8_E5M2FNUZ,
      DType::kI16,     DType::kU16,     DType::kF16,     DType::kBF16,    DType::kI32, DType::kU32,
      DType::kF32,     DType::kC64,     DType::kF64,     DType::kI64,     DType::kU64};
  return int(std::find(std::begin(kOrder), std::end(kOrder), t) - std::begin(kOrder));
}

Result<SafetensorsType> SafetensorsTypeOf(const std::string& torch_dtype, std::vector<uint64_t> shape) {
  if (torch_dtype == "float4_e2m1fn_x2") {
    if (shape.empty())
      return Status::NotSupported("a 0-d torch.float4_e2m1fn_x2 has no F4 shape (one byte is two values; "
                                  "safetensors refuses it too)");
    shape.back() *= 2;
    return SafetensorsType{DType::kF4, std::move(shape)};
  }
  auto dt = DTypeFromTorchName(torch_dtype);
  if (!dt) return Status::NotSupported("safetensors has no dtype for torch." + torch_dtype);
  return SafetensorsType{*dt, std::move(shape)};
}

Result<std::unique_ptr<SafetensorsFileWriter>> SafetensorsFileWriter::Create(Stager* stager, const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<DcpFileWriter> file, DcpFileWriter::Create(stager, path));
  return std::unique_ptr<SafetensorsFileWriter>(new SafetensorsFileWriter(std::move(file)));
}

Result<std::unique_ptr<SafetensorsFileWriter>> SafetensorsFileWriter::CreateS3(S3Stager* stager,
                                                                             const std::string& key) {
  ASSIGN_OR_RETURN(std::unique_ptr<DcpFileWriter> file, DcpFileWriter::CreateS3(stager, key));
  return std::unique_ptr<SafetensorsFileWriter>(new SafetensorsFileWriter(std::move(file)));
}

Result<uint32_t> SafetensorsFileWriter::AddTensor(const std::string& name, const std::string& dtype,
                                                  const std::vector<uint64_t>& shape, uint64_t nbytes) {
  if (sealed_) return Status::InvalidArgument(path() + ": tensor '" + name + "' added after Seal");
  Result<SafetensorsType> st = SafetensorsTypeOf(dtype, shape);
  if (!st.ok()) return st.status().WithContext("tensor '" + name + "'");
  const uint64_t numel = std::accumulate(st->shape.begin(), st->shape.end(), uint64_t(1), std::multiplies<>());
  if (ByteSize(st->dtype, numel) != nbytes)
    return Status::InvalidArgument("tensor '" + name + "': " + std::to_string(nbytes) + " bytes do not hold " +
                                   std::to_string(numel) + " elements of " + dtype);
  if (!names_.insert(name).second)
    return Status::InvalidArgument(path() + ": tensor '" + name + "' twice (a safetensors file holds one entry per name)");
  entries_.push_back({name, st->dtype, st->shape, 0, nbytes});  // `end` holds the size until Seal
  return uint32_t(entries_.size() - 1);
}

Status SafetensorsFileWriter::Seal(const std::map<std::string, std::string>& metadata) {
  if (sealed_) return Status::InvalidArgument(path() + ": sealed twice");
  sealed_ = true;
  std::vector<uint32_t> order(entries_.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const int oa = SafetensorsDTypeOrder(entries_[a].dtype), ob = SafetensorsDTypeOrder(entries_[b].dtype);
    return oa != ob ? oa > ob : entries_[a].name < entries_[b].name;
  });
  std::vector<SafetensorsEntry> laid_out;
  uint64_t at = 0;
  for (uint32_t i : order) {
    SafetensorsEntry& e = entries_[i];
    const uint64_t n = e.end;
    e.begin = at;
    e.end = at += n;
    laid_out.push_back(e);
  }
  ASSIGN_OR_RETURN(header_, EncodeSafetensorsHeader(laid_out, metadata));
  ASSIGN_OR_RETURN(uint32_t header_item, file_->AddBytes(header_.size()));
  items_.resize(entries_.size());
  for (uint32_t i : order) {
    ASSIGN_OR_RETURN(items_[i], file_->AddBytes(entries_[i].end - entries_[i].begin));
  }
  RETURN_IF_ERROR(file_->Seal());  // S3: the upload opens now that the size is known
  return file_->Write(header_item, Slice{header_.data(), header_.size(), kHostDevice, 0}, /*copy_host=*/false);
}

std::vector<uint64_t> SafetensorsFileWriter::DataBegins() const {
  std::vector<uint64_t> out;
  for (const SafetensorsEntry& e : entries_) out.push_back(e.begin);
  return out;
}

Status SafetensorsFileWriter::Write(uint32_t item, const Slice& src, bool copy_host) {
  if (!sealed_) return Status::InvalidArgument(path() + ": write before Seal");
  if (item >= items_.size()) return Status::InvalidArgument(path() + ": no tensor " + std::to_string(item));
  return file_->Write(items_[item], src, copy_host);
}

Result<std::vector<SafetensorsItemResult>> SafetensorsFileWriter::Finish() {
  if (!sealed_) return Status::InvalidArgument(path() + ": finished before Seal");
  ASSIGN_OR_RETURN(std::vector<DcpItemResult> written, file_->Finish());
  std::vector<SafetensorsItemResult> out;
  for (uint32_t item : items_) {
    const DcpItemResult& r = written[item];
    out.push_back({r.data_offset, r.data_length, r.crc32c});
  }
  return out;
}

}  // namespace ckptfs
