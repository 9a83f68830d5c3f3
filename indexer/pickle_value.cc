// PickleValue: the accessors of the inert value tree and its rendering
// (DebugString). What and why: pickle.h.
#include <charconv>
#include <string>

#include "indexer/pickle.h"

namespace ckptfs {

using Kind = PickleValue::Kind;

// ---------------------------------------------------------------------------
// PickleValue accessors.

const char* PickleValue::KindName(Kind k) {
  switch (k) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kBigInt: return "big int";
    case Kind::kFloat: return "float";
    case Kind::kStr: return "str";
    case Kind::kBytes: return "bytes";
    case Kind::kTuple: return "tuple";
    case Kind::kList: return "list";
    case Kind::kDict: return "dict";
    case Kind::kSet: return "set";
    case Kind::kFrozenSet: return "frozenset";
    case Kind::kGlobal: return "global";
    case Kind::kReduce: return "reduce";
    case Kind::kNewObj: return "newobj";
    case Kind::kBuild: return "build";
    case Kind::kPersistentId: return "persistent id";
  }
  return "?";
}

std::optional<bool> PickleValue::AsBool() const {
  if (kind_ != Kind::kBool) return std::nullopt;
  return int_ != 0;
}
std::optional<int64_t> PickleValue::AsInt() const {
  if (kind_ != Kind::kInt) return std::nullopt;
  return int_;
}
std::optional<double> PickleValue::AsFloat() const {
  if (kind_ != Kind::kFloat) return std::nullopt;
  return std::bit_cast<double>(int_);
}
const std::string* PickleValue::AsStr() const {
  return kind_ == Kind::kStr ? &std::get<std::string>(body_) : nullptr;
}
const std::string* PickleValue::AsBytes() const {
  return kind_ == Kind::kBytes ? &std::get<std::string>(body_) : nullptr;
}
const std::string* PickleValue::BigIntText() const {
  return kind_ == Kind::kBigInt ? &std::get<std::string>(body_) : nullptr;
}
const std::vector<const PickleValue*>* PickleValue::AsTuple() const {
  return kind_ == Kind::kTuple ? &std::get<Items>(body_) : nullptr;
}
const std::vector<const PickleValue*>* PickleValue::AsList() const {
  return kind_ == Kind::kList ? &std::get<Items>(body_) : nullptr;
}
const std::vector<const PickleValue*>* PickleValue::AsSequence() const {
  return kind_ == Kind::kTuple || kind_ == Kind::kList ? &std::get<Items>(body_) : nullptr;
}
const std::vector<const PickleValue*>* PickleValue::AsSet() const {
  return kind_ == Kind::kSet || kind_ == Kind::kFrozenSet ? &std::get<Items>(body_) : nullptr;
}
const PickleValue* PickleValue::At(size_t i) const {
  const auto* items = AsSequence();
  return items && i < items->size() ? (*items)[i] : nullptr;
}
const std::vector<PickleDictEntry>* PickleValue::AsDict() const {
  return kind_ == Kind::kDict ? &std::get<Entries>(body_) : nullptr;
}
const PickleValue* PickleValue::DictGet(std::string_view key) const {
  const auto* entries = AsDict();
  if (!entries) return nullptr;
  for (size_t i = entries->size(); i-- > 0;) {
    const std::string* s = (*entries)[i].key->AsStr();
    if (s && *s == key) return (*entries)[i].value;
  }
  return nullptr;
}
const PickleValue* PickleValue::DictGetInt(int64_t key) const {
  const auto* entries = AsDict();
  if (!entries) return nullptr;
  for (size_t i = entries->size(); i-- > 0;) {
    auto k = (*entries)[i].key->AsInt();
    if (k && *k == key) return (*entries)[i].value;
  }
  return nullptr;
}

std::string_view PickleValue::global_module() const {
  if (kind_ != Kind::kGlobal) return {};
  return std::string_view(std::get<std::string>(body_)).substr(0, size_t(int_));
}
std::string_view PickleValue::global_name() const {
  if (kind_ != Kind::kGlobal) return {};
  return std::string_view(std::get<std::string>(body_)).substr(size_t(int_));
}
bool PickleValue::IsGlobal(std::string_view module, std::string_view name) const {
  return kind_ == Kind::kGlobal && global_module() == module && global_name() == name;
}

const PickleValue* PickleValue::callable() const {
  if (kind_ != Kind::kReduce && kind_ != Kind::kNewObj) return nullptr;
  return std::get<Items>(body_)[0];
}
const PickleValue* PickleValue::args() const {
  if (kind_ != Kind::kReduce && kind_ != Kind::kNewObj) return nullptr;
  return std::get<Items>(body_)[1];
}
const PickleValue* PickleValue::kwargs() const {
  if (kind_ != Kind::kNewObj) return nullptr;
  const auto& items = std::get<Items>(body_);
  return items.size() > 2 ? items[2] : nullptr;
}
bool PickleValue::IsCallOf(std::string_view module, std::string_view name) const {
  const PickleValue* c = callable();
  return c && c->IsGlobal(module, name);
}
const std::vector<const PickleValue*>* PickleValue::CallArgs(std::string_view module,
                                                             std::string_view name) const {
  return IsCallOf(module, name) ? args()->AsTuple() : nullptr;
}
const PickleValue* PickleValue::built_object() const {
  return kind_ == Kind::kBuild ? std::get<Items>(body_)[0] : nullptr;
}
const PickleValue* PickleValue::build_state() const {
  return kind_ == Kind::kBuild ? std::get<Items>(body_)[1] : nullptr;
}
const PickleValue& PickleValue::Unwrapped() const {
  const PickleValue* v = this;
  while (v->kind_ == Kind::kBuild) v = std::get<Items>(v->body_)[0];
  return *v;
}
const PickleValue* PickleValue::pid() const {
  return kind_ == Kind::kPersistentId ? std::get<Items>(body_)[0] : nullptr;
}

namespace {
const std::vector<const PickleValue*> kNoItems;
const std::vector<PickleDictEntry> kNoEntries;
}  // namespace

const std::vector<const PickleValue*>& PickleValue::object_list_items() const {
  return object_items_ ? object_items_->list_items : kNoItems;
}
const std::vector<PickleDictEntry>& PickleValue::object_dict_items() const {
  return object_items_ ? object_items_->dict_items : kNoEntries;
}

size_t PickleValue::ChildCount() const {
  size_t n = 0;
  if (auto* items = std::get_if<Items>(&body_)) n += items->size();
  if (auto* entries = std::get_if<Entries>(&body_)) n += 2 * entries->size();
  if (object_items_) n += object_items_->list_items.size() + 2 * object_items_->dict_items.size();
  return n;
}

const PickleValue* PickleValue::Child(size_t i) const {
  if (auto* items = std::get_if<Items>(&body_)) {
    if (i < items->size()) return (*items)[i];
    i -= items->size();
  }
  if (auto* entries = std::get_if<Entries>(&body_)) {
    if (i < 2 * entries->size()) return i % 2 ? (*entries)[i / 2].value : (*entries)[i / 2].key;
    i -= 2 * entries->size();
  }
  const auto& list = object_items_->list_items;
  if (i < list.size()) return list[i];
  i -= list.size();
  const auto& dict = object_items_->dict_items;
  return i % 2 ? dict[i / 2].value : dict[i / 2].key;
}

// ---------------------------------------------------------------------------
// Rendering.

namespace {

void RenderQuoted(std::string& out, std::string_view s, bool bytes) {
  static const char kHex[] = "0123456789abcdef";
  if (bytes) out.push_back('b');
  out.push_back('\'');
  for (char ch : s) {
    uint8_t c = ch;
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '\'': out += "\\'"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f || (bytes && c >= 0x80)) {
          out += "\\x";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 15]);
        } else {
          out.push_back(ch);
        }
    }
  }
  out.push_back('\'');
}

void RenderValue(std::string& out, const PickleValue& v, size_t max_chars, int depth);

void RenderItems(std::string& out, const std::vector<const PickleValue*>& items, const char* open, const char* close,
                 bool one_tuple, size_t max_chars, int depth) {
  out += open;
  for (size_t i = 0; i < items.size() && out.size() < max_chars; ++i) {
    if (i) out += ", ";
    RenderValue(out, *items[i], max_chars, depth + 1);
  }
  if (one_tuple && items.size() == 1) out += ",";
  out += close;
}

void RenderEntries(std::string& out, const std::vector<PickleDictEntry>& entries, size_t max_chars, int depth) {
  out += "{";
  for (size_t i = 0; i < entries.size() && out.size() < max_chars; ++i) {
    if (i) out += ", ";
    RenderValue(out, *entries[i].key, max_chars, depth + 1);
    out += ": ";
    RenderValue(out, *entries[i].value, max_chars, depth + 1);
  }
  out += "}";
}

// callable(args)(**kwargs).extend([...]).update({...}), or cls.__new__(...).
void RenderCall(std::string& out, const PickleValue& v, size_t max_chars, int depth) {
  RenderValue(out, *v.callable(), max_chars, depth + 1);
  if (v.kind() == Kind::kNewObj) out += ".__new__";
  if (const auto* t = v.args()->AsTuple()) {
    RenderItems(out, *t, "(", ")", false, max_chars, depth);
  } else {
    out += "(*";
    RenderValue(out, *v.args(), max_chars, depth + 1);
    out += ")";
  }
  if (const PickleValue* kw = v.kwargs()) {
    out += "(**";
    RenderValue(out, *kw, max_chars, depth + 1);
    out += ")";
  }
  if (!v.object_list_items().empty()) {
    out += ".extend(";
    RenderItems(out, v.object_list_items(), "[", "]", false, max_chars, depth);
    out += ")";
  }
  if (!v.object_dict_items().empty()) {
    out += ".update(";
    RenderEntries(out, v.object_dict_items(), max_chars, depth);
    out += ")";
  }
}

// Python's repr of a float: 1.0, not 1.
void RenderFloat(std::string& out, double d) {
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);
  std::string_view s(buf, r.ptr - buf);
  out += s;
  if (s.find_first_of(".en") == std::string_view::npos) out += ".0";
}

// A value and its children up to depth 64, through PickleValue's public
// accessors only.
void RenderValue(std::string& out, const PickleValue& v, size_t max_chars, int depth) {
  if (out.size() >= max_chars) return;
  if (depth > 64) {
    out += "...";
    return;
  }
  const Kind k = v.kind();
  switch (k) {
    case Kind::kNone: out += "None"; break;
    case Kind::kBool: out += *v.AsBool() ? "True" : "False"; break;
    case Kind::kInt: out += std::to_string(*v.AsInt()); break;
    case Kind::kBigInt: out += *v.BigIntText(); break;
    case Kind::kFloat: RenderFloat(out, *v.AsFloat()); break;
    case Kind::kStr: RenderQuoted(out, *v.AsStr(), false); break;
    case Kind::kBytes: RenderQuoted(out, *v.AsBytes(), true); break;
    case Kind::kTuple: RenderItems(out, *v.AsTuple(), "(", ")", true, max_chars, depth); break;
    case Kind::kList: RenderItems(out, *v.AsList(), "[", "]", false, max_chars, depth); break;
    case Kind::kSet:
    case Kind::kFrozenSet: {
      const bool set = k == Kind::kSet;
      if (v.AsSet()->empty())
        out += set ? "set()" : "frozenset()";
      else
        RenderItems(out, *v.AsSet(), set ? "{" : "frozenset({", set ? "}" : "})", false, max_chars, depth);
      break;
    }
    case Kind::kDict:
      if (v.is_ordered_dict()) out += "OrderedDict(";
      RenderEntries(out, *v.AsDict(), max_chars, depth);
      if (v.is_ordered_dict()) out += ")";
      break;
    case Kind::kGlobal:
      out += v.global_module();
      out += ".";
      out += v.global_name();
      break;
    case Kind::kReduce:
    case Kind::kNewObj: RenderCall(out, v, max_chars, depth); break;
    case Kind::kBuild:
      RenderValue(out, *v.built_object(), max_chars, depth + 1);
      out += ".__setstate__(";
      RenderValue(out, *v.build_state(), max_chars, depth + 1);
      out += ")";
      break;
    case Kind::kPersistentId:
      out += "persistent_id(";
      RenderValue(out, *v.pid(), max_chars, depth + 1);
      out += ")";
      break;
  }
}

}  // namespace

std::string PickleValue::DebugString(size_t max_chars) const {
  std::string out;
  RenderValue(out, *this, max_chars, 0);
  if (out.size() > max_chars) {
    out.resize(max_chars);
    out += "...";
  }
  return out;
}

}  // namespace ckptfs
