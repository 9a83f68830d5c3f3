#include "core/item_views.h"

#include <cstdio>
#include <map>

#include "core/cast.h"
#include "core/convert.h"
#include "core/safetensors.h"

namespace ckptfs {

std::string EscapeFileName(const std::string& fqn) {
  std::string out;
  bool all = fqn.empty() || fqn == "." || fqn == "..";
  if (fqn.empty()) return "%";  // the one name that escapes to a lone '%'
  for (unsigned char c : fqn) {
    if (all || c == '%' || c == '/' || c == 0) {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out;
}

std::string UnescapeFileName(const std::string& name) {
  if (name == "%") return "";
  std::string out;
  for (size_t i = 0; i < name.size(); ++i) {
    if (name[i] == '%' && i + 2 < name.size() && std::isxdigit(static_cast<unsigned char>(name[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(name[i + 2]))) {
      out += char(std::stoi(name.substr(i + 1, 2), nullptr, 16));
      i += 2;
    } else {
      out += name[i];
    }
  }
  return out;
}

std::string NpyDescr(DType t) {
  switch (t) {
    case DType::kBOOL: return "|b1";
    case DType::kU8: return "|u1";
    case DType::kI8: return "|i1";
    case DType::kI16: return "<i2";
    case DType::kU16: return "<u2";
    case DType::kF16: return "<f2";
    case DType::kI32: return "<i4";
    case DType::kU32: return "<u4";
    case DType::kF32: return "<f4";
    case DType::kF64: return "<f8";
    case DType::kI64: return "<i8";
    case DType::kU64: return "<u8";
    case DType::kC64: return "<c8";
    default: return "<f4";  // presented as float32 (NeedsFloat32View)
  }
}

std::string NpyHeader(const std::string& descr, const Shape& shape) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dims += ",";
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  // magic(6) + version(2) + u16 length(2) + dict + padding + '\n' = multiple of 64
  size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += char(dict.size() & 0xff);
  out += char((dict.size() >> 8) & 0xff);
  return out + dict;
}

std::vector<ViewFile> BytesView(const Checkpoint& ckpt) {
  std::vector<ViewFile> out;
  for (const auto& [key, b] : ckpt.byte_items) {
    Layout layout;
    layout.AddSource(b.file, b.offset, b.length);
    out.push_back({EscapeFileName(key) + ".pt", std::make_shared<const Layout>(std::move(layout)), ""});
  }
  return out;
}

Result<ViewFile> NpyFile(std::shared_ptr<const TensorMeta> t) {
  Layout layout;
  layout.Reserve(2);
  layout.AddLiteral(NpyHeader(NpyDescr(t->dtype), t->shape));
  const Box whole = Box::Whole(t->shape);
  std::string name = EscapeFileName(t->fqn) + ".npy";
  if (NeedsFloat32View(t->dtype)) {
    RETURN_IF_ERROR(layout.AddTensorAsFloat32(std::move(t), whole));
  } else {
    RETURN_IF_ERROR(layout.AddTensor(std::move(t), whole));
  }
  return ViewFile{std::move(name), std::make_shared<const Layout>(std::move(layout)), ""};
}

Result<std::vector<ViewFile>> TensorsView(const Checkpoint& ckpt) {
  std::vector<ViewFile> out;
  out.reserve(ckpt.tensors.size());
  for (const auto& t : ckpt.tensors) {
    ASSIGN_OR_RETURN(ViewFile f, NpyFile(t));
    out.push_back(std::move(f));
  }
  return out;
}

}  // namespace ckptfs
