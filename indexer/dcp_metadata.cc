#include "indexer/dcp_metadata.h"

#include <unordered_map>
#include <unordered_set>

#include "indexer/torch_zip.h"

namespace ckptfs {

// A dataclass field: the BUILD state is the instance dict, or a
// (dict, slots) pair for classes with __slots__.
const PickleValue* Field(const PickleValue* v, std::string_view name) {
  for (const PickleValue* cur = v; cur && cur->kind() == PickleValue::Kind::kBuild; cur = cur->built_object()) {
    const PickleValue* st = cur->build_state();
    if (!st) continue;
    if (st->AsDict()) {
      if (const PickleValue* f = st->DictGet(name)) return f;
    } else if (auto parts = st->AsTuple()) {
      for (const PickleValue* part : *parts)
        if (part && part->AsDict())
          if (const PickleValue* f = part->DictGet(name)) return f;
    }
  }
  return nullptr;
}

// The class name of a NewObj/Reduce instance (after BUILD wrappers): the
// module is not checked beyond the allowlist, so both TensorProperties
// spellings (checkpoint.metadata, _shard.sharded_tensor.metadata) match.
std::string_view ClassOf(const PickleValue* v) {
  if (!v) return "";
  const PickleValue& u = v->Unwrapped();
  const PickleValue* cls = u.callable();
  return cls && cls->IsGlobal() ? cls->global_name() : std::string_view();
}

std::string_view ModuleOf(const PickleValue* v) {
  if (!v) return "";
  const PickleValue& u = v->Unwrapped();
  const PickleValue* cls = u.callable();
  return cls && cls->IsGlobal() ? cls->global_module() : std::string_view();
}

constexpr std::string_view kFloat4x2 = "float4_e2m1fn_x2";

// The torch.dtype global of TensorProperties; nullptr when it has none.
const PickleValue* PropertiesDTypeGlobal(const PickleValue* props) {
  const PickleValue* dtype = Field(props, "dtype");
  if (!dtype && props && props->kind() == PickleValue::Kind::kBuild) {
    // TensorProperties pickles its state as a 5-tuple (dtype, layout, ...).
    const PickleValue* st = props->build_state();
    if (st && st->AsTuple() && !st->AsTuple()->empty()) dtype = st->At(0);
  }
  return dtype && dtype->IsGlobal() ? dtype : nullptr;
}

std::optional<DType> PropertiesDType(const PickleValue* props) {
  const PickleValue* dtype = PropertiesDTypeGlobal(props);
  if (!dtype) return std::nullopt;
  if (dtype->global_name() == kFloat4x2) return DType::kF4;
  return DTypeFromTorchName(dtype->global_name());
}

std::optional<uint64_t> UInt(const PickleValue* v) {
  if (!v) return std::nullopt;
  auto i = v->AsInt();
  if (!i || *i < 0) return std::nullopt;
  return uint64_t(*i);
}

namespace {

// planner_data {fqn: key path}, looked up once per tensor: a map, since
// PickleValue::DictGet searches linearly and DCP metadata of 100k tensors
// would make that quadratic. Later keys win, as in DictGet and Python.
std::unordered_map<std::string_view, const PickleValue*> PlannerPaths(const PickleValue* root) {
  std::unordered_map<std::string_view, const PickleValue*> out;
  const PickleValue* planner = Field(root, "planner_data");
  if (!planner || !planner->AsDict()) return out;
  for (const PickleDictEntry& e : *planner->AsDict())
    if (const std::string* k = e.key->AsStr()) out[*k] = e.value;
  return out;
}

// One TensorStorageMetadata of state_dict_metadata: the tensor and its
// declared chunk boxes. A tensor another metadata file (per-rank
// `__R.metadata`) already declared must agree on dtype and shape: the boxes
// of both are checked against one shape.
Status ReadTensorEntry(const std::string& rel, const std::string& fqn, const PickleValue* v, const PickleValue* path,
                       std::map<std::string, TensorMeta>& tensors, std::map<std::string, std::vector<Box>>& declared) {
  const PickleValue* torch_dtype = PropertiesDTypeGlobal(Field(v, "properties"));
  auto dtype = PropertiesDType(Field(v, "properties"));
  auto size = Field(v, "size") ? AsShape(*Field(v, "size")) : std::nullopt;
  const PickleValue* chunks = Field(v, "chunks");
  if (torch_dtype && !dtype && torch_dtype->global_module() == "torch")
    return Status::NotSupported("tensor '" + fqn + "': dtype torch." + std::string(torch_dtype->global_name()) +
                                " has no safetensors or NumPy equivalent; left out (every other tensor is served)");
  if (!dtype || !size || !chunks || !chunks->AsSequence())
    return Status::Corruption(rel + ": tensor '" + fqn + "' has malformed metadata (dtype, size or chunks)");
  // float4_e2m1fn_x2 elements are bytes of two F4 values: served as F4, the last dim counted in F4 values.
  const uint64_t unpack = torch_dtype->global_name() == kFloat4x2 ? 2 : 1;
  if (unpack != 1 && size->empty())
    return Status::NotSupported("tensor '" + fqn + "': a 0-d torch.float4_e2m1fn_x2 has no F4 shape; left out");
  if (unpack != 1) size->back() *= unpack;
  if (auto known = tensors.find(fqn); known != tensors.end() && (known->second.dtype != *dtype || known->second.shape != *size))
    return Status::Corruption(rel + ": tensor '" + fqn + "' is " + std::string(DTypeName(*dtype)) + ShapeToString(*size) +
                              " here but " + std::string(DTypeName(known->second.dtype)) +
                              ShapeToString(known->second.shape) + " in another metadata file");
  TensorMeta& t = tensors[fqn];
  t.fqn = fqn;
  t.dtype = *dtype;
  t.shape = *size;
  if (path && path->AsSequence()) {
    t.path.clear();
    for (const PickleValue* part : *path->AsSequence()) {
      if (const std::string* s = part->AsStr()) t.path.push_back(*s);
      else if (auto i = part->AsInt()) t.path.push_back(std::to_string(*i));
    }
  }
  for (const PickleValue* ch : *chunks->AsSequence()) {
    auto off = Field(ch, "offsets") ? AsShape(*Field(ch, "offsets")) : std::nullopt;
    auto len = Field(ch, "sizes") ? AsShape(*Field(ch, "sizes")) : std::nullopt;
    if (!off || !len || off->size() != size->size() || len->size() != size->size())
      return Status::Corruption(rel + ": tensor '" + fqn + "' has a malformed chunk");
    if (unpack != 1) {
      off->back() *= unpack;
      len->back() *= unpack;
    }
    declared[fqn].push_back(Box{*off, *len});
  }
  return Status::OK();
}

Status ReadStateDictMetadata(const std::string& rel, const PickleValue* root,
                             std::map<std::string, TensorMeta>& tensors,
                             std::map<std::string, std::vector<Box>>& declared) {
  const PickleValue* sdm = Field(root, "state_dict_metadata");
  if (!sdm || !sdm->AsDict()) return Status::Corruption(rel + ": Metadata has no state_dict_metadata dict");
  const auto paths = PlannerPaths(root);
  std::vector<std::string> left_out;  // tensors of dtypes the index cannot hold
  // A pickled dict can repeat a key (Python would keep the last value); a
  // repeated tensor would mix the chunk boxes of two declarations.
  std::unordered_set<std::string_view> seen;
  for (const PickleDictEntry& e : *sdm->AsDict()) {
    const std::string* fqn = e.key->AsStr();
    if (!fqn) return Status::Corruption(rel + ": a state_dict_metadata key is not a string");
    if (!seen.insert(*fqn).second)
      return Status::Corruption(rel + ": '" + *fqn + "' appears twice in state_dict_metadata");
    std::string_view cls = ClassOf(e.value);
    if (cls == "BytesStorageMetadata") continue;
    if (cls != "TensorStorageMetadata")
      return Status::Corruption(rel + ": '" + *fqn + "' has metadata of class " + std::string(cls));
    auto path = paths.find(*fqn);
    Status st = ReadTensorEntry(rel, *fqn, e.value, path == paths.end() ? nullptr : path->second, tensors, declared);
    if (st.code() == Status::Code::kNotSupported) left_out.push_back(st.message());
    else RETURN_IF_ERROR(st);
  }
  if (left_out.empty()) return Status::OK();
  std::string all = left_out.front();
  for (size_t i = 1; i < left_out.size(); ++i) all += "; " + left_out[i];
  return Status::NotSupported(all);
}

// storage_data {MetadataIndex: _StorageInfo}: tensor items keyed by (fqn,
// chunk offsets), BYTE_IO items (offset None) by fqn.
Status ReadStorageData(const std::string& rel, const PickleValue* root, std::map<ChunkKey, StorageInfo>& storage,
                       std::map<std::string, StorageInfo>& byte_storage) {
  const PickleValue* sd = Field(root, "storage_data");
  if (!sd || !sd->AsDict()) return Status::Corruption(rel + ": Metadata has no storage_data dict");
  for (const PickleDictEntry& e : *sd->AsDict()) {
    const PickleValue* fqn = Field(e.key, "fqn");
    const PickleValue* path = Field(e.value, "relative_path");
    auto off = UInt(Field(e.value, "offset"));
    auto len = UInt(Field(e.value, "length"));
    if (!fqn || !fqn->AsStr() || !path || !path->AsStr() || !off || !len)
      return Status::Corruption(rel + ": malformed storage_data entry " + e.key->DebugString(200));
    if (path->AsStr()->find('/') != std::string::npos || *path->AsStr() == "..")
      return Status::Corruption(rel + ": storage_data names a file outside the checkpoint: " + *path->AsStr());
    StorageInfo si{*path->AsStr(), *off, *len, {}};
    if (const PickleValue* tr = Field(e.value, "transform_descriptors"); tr && tr->AsSequence())
      for (const PickleValue* d : *tr->AsSequence())
        if (d->AsStr()) si.transforms.push_back(*d->AsStr());
    const PickleValue* offset = Field(e.key, "offset");
    if (!offset || offset->IsNone()) {
      byte_storage[*fqn->AsStr()] = si;
    } else if (auto o = AsShape(*offset)) {
      storage[{*fqn->AsStr(), *o}] = si;
    } else {
      return Status::Corruption(rel + ": storage_data entry for '" + *fqn->AsStr() + "' has a malformed offset");
    }
  }
  return Status::OK();
}

}  // namespace

Status ReadDcpMetadata(const std::string& rel, const PickleValue* root, std::map<std::string, TensorMeta>& tensors,
                       std::map<std::string, std::vector<Box>>& declared, std::map<ChunkKey, StorageInfo>& storage,
                       std::map<std::string, StorageInfo>& byte_storage,
                       std::map<std::string, std::vector<uint64_t>>& reformulated,
                       std::map<ChunkKey, std::string>* tensor_meta) {
  // Tensors of a dtype the index cannot hold are left out (NotSupported,
  // naming them, returned last); everything else is read.
  Status left_out = ReadStateDictMetadata(rel, root, tensors, declared);
  if (left_out.code() != Status::Code::kNotSupported) RETURN_IF_ERROR(left_out);
  RETURN_IF_ERROR(ReadStorageData(rel, root, storage, byte_storage));
  // ByteCheckpoint: {MetadataIndex: pickled tensor description | None}.
  if (tensor_meta)
    if (const PickleValue* atm = Field(root, "all_tensor_metadata"); atm && atm->AsDict())
      for (const PickleDictEntry& e : *atm->AsDict()) {
        const PickleValue* fqn = Field(e.key, "fqn");
        const PickleValue* offset = Field(e.key, "offset");
        if (!fqn || !fqn->AsStr() || !offset || offset->IsNone() || !e.value->AsBytes()) continue;
        if (auto o = AsShape(*offset)) (*tensor_meta)[{*fqn->AsStr(), *o}] = *e.value->AsBytes();
      }
  // Megatron's flattened distributed-optimizer tensors.
  if (const PickleValue* mcore = Field(root, "mcore_data"); mcore && mcore->AsDict())
    for (const PickleDictEntry& e : *mcore->AsDict())
      if (e.key->AsStr() && e.value->AsDict())
        if (const PickleValue* orig = e.value->DictGet("nd_reformulated_orig_global_shape"))
          if (auto shape = AsShape(*orig)) reformulated[*e.key->AsStr()] = *shape;
  return left_out;
}

}  // namespace ckptfs
