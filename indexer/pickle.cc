// How the restricted unpickler works (what and why: pickle.h): the
// machine. The value tree's accessors are in pickle_value.cc, the allowlist
// of globals in pickle_allowlist.cc, the text codecs in pickle_text.cc.
//
// The machine mirrors CPython's C unpickler (Modules/_pickle.c): a value
// stack, a mark stack whose top is a fence no fixed-arity pop may cross, and a
// memo. Values live in a deque owned by the PickleDocument and point at each
// other with raw pointers, so destruction is flat (no recursion, whatever the
// nesting) and shared references cost nothing. Containers are mutated in
// place (APPEND, SETITEM, BUILD) because memoized references must see the
// mutation, as in Python.
//
// Opcode reference: CPython Lib/pickletools.py.
#include "indexer/pickle.h"

#include <bit>
#include <charconv>
#include <cstring>
#include <deque>
#include <limits>
#include <unordered_map>
#include <unordered_set>

#include "indexer/pickle_text.h"

namespace ckptfs {

struct PickleDocument::Storage {
  std::deque<PickleValue> values;
};

PickleDocument::PickleDocument() : storage_(std::make_unique<Storage>()) {}
PickleDocument::~PickleDocument() = default;
size_t PickleDocument::value_count() const { return storage_->values.size(); }

namespace {

using Kind = PickleValue::Kind;
using pickle_text::AppendUtf8;
using pickle_text::HexValue;
using pickle_text::IsValidUtf8;
using pickle_text::Latin1Encode;
using pickle_text::TwosComplementToDecimal;

// Opcode bytes (pickletools names).
enum Op : uint8_t {
  MARK = '(', STOP = '.', POP = '0', POP_MARK = '1', DUP = '2', FLOAT = 'F', INT = 'I',
  BININT = 'J', BININT1 = 'K', LONG = 'L', BININT2 = 'M', NONE = 'N', PERSID = 'P',
  BINPERSID = 'Q', REDUCE = 'R', STRING = 'S', BINSTRING = 'T', SHORT_BINSTRING = 'U',
  UNICODE = 'V', BINUNICODE = 'X', APPEND = 'a', BUILD = 'b', GLOBAL = 'c', DICT = 'd',
  EMPTY_DICT = '}', APPENDS = 'e', GET = 'g', BINGET = 'h', INST = 'i', LONG_BINGET = 'j',
  LIST = 'l', EMPTY_LIST = ']', OBJ = 'o', PUT = 'p', BINPUT = 'q', LONG_BINPUT = 'r',
  SETITEM = 's', TUPLE = 't', EMPTY_TUPLE = ')', SETITEMS = 'u', BINFLOAT = 'G',
  // protocol 2
  PROTO = 0x80, NEWOBJ = 0x81, EXT1 = 0x82, EXT2 = 0x83, EXT4 = 0x84, TUPLE1 = 0x85,
  TUPLE2 = 0x86, TUPLE3 = 0x87, NEWTRUE = 0x88, NEWFALSE = 0x89, LONG1 = 0x8a, LONG4 = 0x8b,
  // protocol 3
  BINBYTES = 'B', SHORT_BINBYTES = 'C',
  // protocol 4
  SHORT_BINUNICODE = 0x8c, BINUNICODE8 = 0x8d, BINBYTES8 = 0x8e, EMPTY_SET = 0x8f,
  ADDITEMS = 0x90, FROZENSET = 0x91, NEWOBJ_EX = 0x92, STACK_GLOBAL = 0x93, MEMOIZE = 0x94,
  FRAME = 0x95,
  // protocol 5
  BYTEARRAY8 = 0x96, NEXT_BUFFER = 0x97, READONLY_BUFFER = 0x98,
};

const char* OpName(uint8_t op) {
  switch (op) {
    case MARK: return "MARK";
    case STOP: return "STOP";
    case POP: return "POP";
    case POP_MARK: return "POP_MARK";
    case DUP: return "DUP";
    case FLOAT: return "FLOAT";
    case INT: return "INT";
    case BININT: return "BININT";
    case BININT1: return "BININT1";
    case LONG: return "LONG";
    case BININT2: return "BININT2";
    case NONE: return "NONE";
    case PERSID: return "PERSID";
    case BINPERSID: return "BINPERSID";
    case REDUCE: return "REDUCE";
    case STRING: return "STRING";
    case BINSTRING: return "BINSTRING";
    case SHORT_BINSTRING: return "SHORT_BINSTRING";
    case UNICODE: return "UNICODE";
    case BINUNICODE: return "BINUNICODE";
    case APPEND: return "APPEND";
    case BUILD: return "BUILD";
    case GLOBAL: return "GLOBAL";
    case DICT: return "DICT";
    case EMPTY_DICT: return "EMPTY_DICT";
    case APPENDS: return "APPENDS";
    case GET: return "GET";
    case BINGET: return "BINGET";
    case INST: return "INST";
    case LONG_BINGET: return "LONG_BINGET";
    case LIST: return "LIST";
    case EMPTY_LIST: return "EMPTY_LIST";
    case OBJ: return "OBJ";
    case PUT: return "PUT";
    case BINPUT: return "BINPUT";
    case LONG_BINPUT: return "LONG_BINPUT";
    case SETITEM: return "SETITEM";
    case TUPLE: return "TUPLE";
    case EMPTY_TUPLE: return "EMPTY_TUPLE";
    case SETITEMS: return "SETITEMS";
    case BINFLOAT: return "BINFLOAT";
    case PROTO: return "PROTO";
    case NEWOBJ: return "NEWOBJ";
    case EXT1: return "EXT1";
    case EXT2: return "EXT2";
    case EXT4: return "EXT4";
    case TUPLE1: return "TUPLE1";
    case TUPLE2: return "TUPLE2";
    case TUPLE3: return "TUPLE3";
    case NEWTRUE: return "NEWTRUE";
    case NEWFALSE: return "NEWFALSE";
    case LONG1: return "LONG1";
    case LONG4: return "LONG4";
    case BINBYTES: return "BINBYTES";
    case SHORT_BINBYTES: return "SHORT_BINBYTES";
    case SHORT_BINUNICODE: return "SHORT_BINUNICODE";
    case BINUNICODE8: return "BINUNICODE8";
    case BINBYTES8: return "BINBYTES8";
    case EMPTY_SET: return "EMPTY_SET";
    case ADDITEMS: return "ADDITEMS";
    case FROZENSET: return "FROZENSET";
    case NEWOBJ_EX: return "NEWOBJ_EX";
    case STACK_GLOBAL: return "STACK_GLOBAL";
    case MEMOIZE: return "MEMOIZE";
    case FRAME: return "FRAME";
    case BYTEARRAY8: return "BYTEARRAY8";
    case NEXT_BUFFER: return "NEXT_BUFFER";
    case READONLY_BUFFER: return "READONLY_BUFFER";
  }
  return nullptr;
}


}  // namespace

// ---------------------------------------------------------------------------
// The machine.

// The memo of PUT/GET. Picklers number it 0, 1, 2, ...: that part is a
// vector; anything else (a hostile LONG_BINPUT 4e9) goes to the map, so
// memory follows the number of PUTs, not the largest index.
class PickleMemo {
 public:
  // The value at `index`, or null when none was put there.
  PickleValue* Get(uint64_t index) const {
    if (index < dense_.size()) return dense_[index];
    auto it = sparse_.find(index);
    return it == sparse_.end() ? nullptr : it->second;
  }
  // Puts `v` at `index`, over what was there.
  void Put(uint64_t index, PickleValue* v) {
    if (index < dense_.size()) {
      dense_[index] = v;
    } else if (index == dense_.size() && !sparse_.count(index)) {
      dense_.push_back(v);
    } else {
      sparse_[index] = v;
    }
  }
  // Indexes put so far.
  uint64_t count() const { return dense_.size() + sparse_.size(); }

 private:
  std::vector<PickleValue*> dense_;
  std::unordered_map<uint64_t, PickleValue*> sparse_;
};

class Unpickler {
 public:
  Unpickler(std::string_view in, const UnpickleLimits& limits, PickleDocument& doc)
      : in_(in), lim_(limits), doc_(doc), values_(doc.storage_->values) {}

  Status Run();

 private:
  // --- errors ---
  // Corruption: the opcode at op_pos_ is malformed (`what`).
  Status Fail(const std::string& what) const;
  // NotSupported: the opcode is valid but refused (`why`).
  Status Refuse(const std::string& why) const;

  // --- input ---
  uint64_t remaining() const { return in_.size() - pos_; }
  // Takes `n` argument bytes; `what` names them for the error ("length 7").
  Result<std::string_view> Take(uint64_t n, const std::string& what);
  Result<uint64_t> ReadUint(int bytes);
  // A '\n'-terminated argument of a text opcode, without the newline.
  Result<std::string_view> ReadLine();
  // Length-prefixed payload: the declared length is checked against the
  // input and the string cap before anything is allocated.
  Result<std::string_view> ReadCounted(uint64_t len);

  // --- values ---
  Result<PickleValue*> New(Kind kind);
  Result<PickleValue*> NewText(Kind kind, std::string text);
  Result<PickleValue*> NewStr(std::string_view utf8);
  Result<PickleValue*> NewInt(int64_t i);
  Result<PickleValue*> NewItems(Kind kind, std::vector<const PickleValue*> items);
  Result<PickleValue*> NewDict();
  // None, True and False are immutable (every mutating opcode refuses them),
  // so one value each is shared.
  Result<PickleValue*> Singleton(PickleValue*& slot, Kind kind, int64_t i);
  Result<PickleValue*> MakeGlobal(std::string_view module, std::string_view name);
  Result<PickleValue*> MakeReduce(PickleValue* callable, PickleValue* args);
  Result<PickleValue*> ParseIntText(std::string_view text, bool allow_bool);
  Result<PickleValue*> DecodeLong(std::string_view le);

  // --- stack ---
  size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }
  Status Push(PickleValue* v);
  Result<PickleValue*> Pop();
  Result<PickleValue*> Top();
  Result<std::vector<const PickleValue*>> PopMark();
  Result<std::vector<PickleDictEntry>> Pairs(const std::vector<const PickleValue*>& items);

  // --- mutation targets ---
  static PickleValue* MutableUnwrapped(PickleValue* v);
  PickleValue::ObjectItems& ObjectItemsOf(PickleValue* v);
  Status CheckLength(size_t n) const;
  Status AddListItems(PickleValue* target, const std::vector<const PickleValue*>& items, Kind want);
  Status AddDictItems(PickleValue* target, const std::vector<PickleDictEntry>& entries);
  Status Build();

  // --- memo ---
  Status MemoPut(uint64_t index);
  Result<PickleValue*> MemoGet(uint64_t index);

  // --- opcodes (Step dispatches to a group) ---
  Status Step(bool& done);
  Status UnknownOp() const;
  Status PushNew(Result<PickleValue*> v);
  Result<uint64_t> ReadSignedCount4();
  Result<uint64_t> ReadMemoIndexLine();
  Status FramingOp(bool& done);
  Status StackOp();
  Result<PickleValue*> NumberOp();
  Result<PickleValue*> FloatOp();
  Result<PickleValue*> TextOp();
  Result<std::string> UnquotePy2String(std::string_view line) const;
  Result<std::string> RawUnicodeEscapeToUtf8(std::string_view line) const;
  Result<PickleValue*> ContainerOp();
  Status FillOp();
  Status MemoOp();
  Result<PickleValue*> ObjectOp();

  Status CheckTree(const PickleValue* root);

  std::string_view in_;
  uint64_t pos_ = 0;
  uint64_t op_pos_ = 0;
  uint8_t op_ = 0;
  const UnpickleLimits& lim_;
  PickleDocument& doc_;
  std::deque<PickleValue>& values_;
  int protocol_ = 0;
  std::vector<PickleValue*> stack_;
  std::vector<size_t> marks_;
  PickleMemo memo_;
  std::unordered_set<std::string> unknown_seen_;
  PickleValue* none_ = nullptr;
  PickleValue* true_ = nullptr;
  PickleValue* false_ = nullptr;
};

Status Unpickler::Fail(const std::string& what) const {
  const char* name = OpName(op_);
  return Status::Corruption("pickle: offset " + std::to_string(op_pos_) + ": " + (name ? name : "opcode") + " " +
                            what);
}

Status Unpickler::Refuse(const std::string& why) const {
  return Status::NotSupported("pickle: offset " + std::to_string(op_pos_) + ": " + OpName(op_) +
                              " is refused: " + why);
}

Result<std::string_view> Unpickler::Take(uint64_t n, const std::string& what) {
  if (n > remaining())
    return Fail(what + " exceeds remaining " + std::to_string(remaining()) + " bytes");
  std::string_view s = in_.substr(pos_, n);
  pos_ += n;
  return s;
}

Result<uint64_t> Unpickler::ReadUint(int bytes) {
  ASSIGN_OR_RETURN(std::string_view s, Take(bytes, "argument of " + std::to_string(bytes) + " bytes"));
  uint64_t v = 0;
  for (int i = bytes; i-- > 0;) v = (v << 8) | uint8_t(s[i]);
  return v;
}

Result<std::string_view> Unpickler::ReadLine() {
  uint64_t window = std::min<uint64_t>(remaining(), lim_.max_string_bytes + 1);
  const void* nl = std::memchr(in_.data() + pos_, '\n', window);
  if (!nl) {
    if (window < remaining())
      return Fail("line longer than the limit of " + std::to_string(lim_.max_string_bytes) + " bytes");
    return Fail("line is not terminated before the end of input");
  }
  size_t len = static_cast<const char*>(nl) - (in_.data() + pos_);
  std::string_view s = in_.substr(pos_, len);
  pos_ += len + 1;
  return s;
}

Result<std::string_view> Unpickler::ReadCounted(uint64_t len) {
  if (len > remaining())
    return Fail("length " + std::to_string(len) + " exceeds remaining " + std::to_string(remaining()) +
                " bytes");
  if (len > lim_.max_string_bytes)
    return Fail("length " + std::to_string(len) + " exceeds the limit of " +
                std::to_string(lim_.max_string_bytes) + " bytes");
  return Take(len, "length");
}

Result<PickleValue*> Unpickler::New(Kind kind) {
  if (values_.size() >= lim_.max_values)
    return Fail("would create more than " + std::to_string(lim_.max_values) + " values");
  PickleValue& v = values_.emplace_back();
  v.kind_ = kind;
  v.index_ = static_cast<uint32_t>(values_.size() - 1);
  return &v;
}

Result<PickleValue*> Unpickler::NewText(Kind kind, std::string text) {
  ASSIGN_OR_RETURN(PickleValue * v, New(kind));
  v->body_ = std::move(text);
  return v;
}

Result<PickleValue*> Unpickler::NewStr(std::string_view utf8) {
  if (!IsValidUtf8(utf8)) return Fail("string is not valid UTF-8");
  return NewText(Kind::kStr, std::string(utf8));
}

Result<PickleValue*> Unpickler::NewInt(int64_t i) {
  ASSIGN_OR_RETURN(PickleValue * v, New(Kind::kInt));
  v->int_ = i;
  return v;
}

Result<PickleValue*> Unpickler::NewItems(Kind kind, std::vector<const PickleValue*> items) {
  if (items.size() > lim_.max_container_length)
    return Fail("container of " + std::to_string(items.size()) + " items exceeds the limit of " +
                std::to_string(lim_.max_container_length));
  ASSIGN_OR_RETURN(PickleValue * v, New(kind));
  v->body_ = std::move(items);
  return v;
}

Result<PickleValue*> Unpickler::NewDict() {
  ASSIGN_OR_RETURN(PickleValue * v, New(Kind::kDict));
  v->body_ = PickleValue::Entries();
  return v;
}

Result<PickleValue*> Unpickler::Singleton(PickleValue*& slot, Kind kind, int64_t i) {
  if (!slot) {
    ASSIGN_OR_RETURN(slot, New(kind));
    slot->int_ = i;
  }
  return slot;
}

Status Unpickler::Push(PickleValue* v) {
  if (stack_.size() >= lim_.max_container_length)
    return Fail("stack exceeds " + std::to_string(lim_.max_container_length) + " values");
  stack_.push_back(v);
  return Status::OK();
}

Result<PickleValue*> Unpickler::Pop() {
  if (stack_.size() <= fence()) return Fail("needs a value on the stack (stack underflow)");
  PickleValue* v = stack_.back();
  stack_.pop_back();
  return v;
}

Result<PickleValue*> Unpickler::Top() {
  if (stack_.size() <= fence()) return Fail("needs a value on the stack (stack underflow)");
  return stack_.back();
}

Result<std::vector<const PickleValue*>> Unpickler::PopMark() {
  if (marks_.empty()) return Fail("has no MARK to pop to");
  size_t m = marks_.back();
  marks_.pop_back();
  std::vector<const PickleValue*> items(stack_.begin() + m, stack_.end());
  stack_.resize(m);
  return items;
}

Result<std::vector<PickleDictEntry>> Unpickler::Pairs(const std::vector<const PickleValue*>& items) {
  if (items.size() % 2) return Fail("has an odd number of items (" + std::to_string(items.size()) + ")");
  std::vector<PickleDictEntry> out;
  out.reserve(items.size() / 2);
  for (size_t i = 0; i < items.size(); i += 2) out.push_back({items[i], items[i + 1]});
  return out;
}

PickleValue* Unpickler::MutableUnwrapped(PickleValue* v) {
  while (v->kind_ == Kind::kBuild) v = const_cast<PickleValue*>(std::get<PickleValue::Items>(v->body_)[0]);
  return v;
}

PickleValue::ObjectItems& Unpickler::ObjectItemsOf(PickleValue* v) {
  if (!v->object_items_) v->object_items_ = std::make_unique<PickleValue::ObjectItems>();
  return *v->object_items_;
}

Status Unpickler::CheckLength(size_t n) const {
  if (n > lim_.max_container_length)
    return Fail("container grows past the limit of " + std::to_string(lim_.max_container_length) + " items");
  return Status::OK();
}

Result<PickleValue*> Unpickler::MakeGlobal(std::string_view module, std::string_view name) {
  if (!IsValidUtf8(module) || !IsValidUtf8(name)) return Fail("name is not valid UTF-8");
  // Python's fix_imports: protocol 0-2 pickles use Python 2 module names.
  if (protocol_ < 3) {
    if (module == "__builtin__") module = "builtins";
    else if (module == "copy_reg") module = "copyreg";
  }
  std::string text;
  text.reserve(module.size() + name.size());
  text.append(module).append(name);
  ASSIGN_OR_RETURN(PickleValue * v, NewText(Kind::kGlobal, std::move(text)));
  v->int_ = static_cast<int64_t>(module.size());
  v->flag_ = IsAllowedGlobal(module, name);
  if (!v->flag_) {
    std::string full = std::string(module) + "." + std::string(name);
    if (unknown_seen_.insert(full).second) doc_.unknown_globals_.push_back(std::move(full));
  }
  return v;
}

// Calls whose result is plain data become that data (pickle.h); nothing is
// called, the arguments are only read. Everything else stays a Reduce node.
Result<PickleValue*> Unpickler::MakeReduce(PickleValue* callable, PickleValue* args) {
  const auto* a = args->AsTuple();
  if (callable->IsGlobal() && a) {
    if (callable->IsGlobal("collections", "OrderedDict") && a->empty()) {
      ASSIGN_OR_RETURN(PickleValue * d, NewDict());
      d->flag_ = true;
      return d;
    }
    bool is_set = callable->IsGlobal("builtins", "set");
    if (is_set || callable->IsGlobal("builtins", "frozenset")) {
      Kind k = is_set ? Kind::kSet : Kind::kFrozenSet;
      if (a->empty()) return NewItems(k, {});
      if (a->size() == 1 && (*a)[0]->AsSequence()) return NewItems(k, *(*a)[0]->AsSequence());
    }
    if (callable->IsGlobal("_codecs", "encode") || callable->IsGlobal("builtins", "bytearray")) {
      if (a->size() == 2 && (*a)[0]->AsStr() && (*a)[1]->AsStr() &&
          (*(*a)[1]->AsStr() == "latin1" || *(*a)[1]->AsStr() == "latin-1")) {
        if (auto bytes = Latin1Encode(*(*a)[0]->AsStr())) return NewText(Kind::kBytes, std::move(*bytes));
      }
    }
    if (callable->IsGlobal("builtins", "bytearray") && a->size() == 1 && (*a)[0]->AsBytes())
      return NewText(Kind::kBytes, *(*a)[0]->AsBytes());
    if ((callable->IsGlobal("builtins", "bytes") || callable->IsGlobal("builtins", "bytearray")) &&
        a->empty())
      return NewText(Kind::kBytes, "");
  }
  return NewItems(Kind::kReduce, {callable, args});
}

Result<PickleValue*> Unpickler::ParseIntText(std::string_view text, bool allow_bool) {
  if (allow_bool && text == "00") return Singleton(false_, Kind::kBool, 0);
  if (allow_bool && text == "01") return Singleton(true_, Kind::kBool, 1);
  std::string_view digits = text;
  bool negative = false;
  if (!digits.empty() && (digits[0] == '-' || digits[0] == '+')) {
    negative = digits[0] == '-';
    digits.remove_prefix(1);
  }
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos)
    return Fail("argument '" + std::string(text.substr(0, 40)) + "' is not an integer");
  int64_t v;
  std::string signed_digits = (negative ? "-" : "") + std::string(digits);
  auto r = std::from_chars(signed_digits.data(), signed_digits.data() + signed_digits.size(), v);
  if (r.ec == std::errc() && r.ptr == signed_digits.data() + signed_digits.size()) return NewInt(v);
  // Too wide for int64: keep the decimal text (bounded like LONG4).
  if (digits.size() > lim_.max_bigint_bytes * 3)
    return Fail("integer of " + std::to_string(digits.size()) + " digits exceeds the limit");
  size_t nz = digits.find_first_not_of('0');
  return NewText(Kind::kBigInt, (negative ? "-" : "") + std::string(digits.substr(nz)));
}

Result<PickleValue*> Unpickler::DecodeLong(std::string_view le) {
  size_t n = le.size();
  if (n == 0) return NewInt(0);
  bool negative = uint8_t(le[n - 1]) & 0x80;
  // Fits int64 when every byte above the eighth is sign fill and the eighth
  // byte's top bit agrees with the sign.
  bool fits = true;
  if (n > 8) {
    uint8_t fill = negative ? 0xFF : 0x00;
    for (size_t i = 8; i < n; ++i)
      if (uint8_t(le[i]) != fill) fits = false;
    if (bool(uint8_t(le[7]) & 0x80) != negative) fits = false;
  }
  if (!fits) {
    if (n > lim_.max_bigint_bytes)
      return Fail("integer of " + std::to_string(n) + " bytes exceeds the limit of " +
                  std::to_string(lim_.max_bigint_bytes));
    return NewText(Kind::kBigInt, TwosComplementToDecimal(le));
  }
  uint64_t u = negative ? ~uint64_t(0) : 0;
  size_t m = std::min<size_t>(n, 8);
  for (size_t i = 0; i < m; ++i) {
    u &= ~(uint64_t(0xFF) << (8 * i));
    u |= uint64_t(uint8_t(le[i])) << (8 * i);
  }
  return NewInt(static_cast<int64_t>(u));
}

Status Unpickler::AddListItems(PickleValue* top, const std::vector<const PickleValue*>& items, Kind want) {
  PickleValue* t = MutableUnwrapped(top);
  if (t->kind_ == want) {
    auto& list = std::get<PickleValue::Items>(t->body_);
    RETURN_IF_ERROR(CheckLength(list.size() + items.size()));
    list.insert(list.end(), items.begin(), items.end());
    return Status::OK();
  }
  if (t->kind_ == Kind::kReduce || t->kind_ == Kind::kNewObj) {  // a list/set subclass
    auto& list = ObjectItemsOf(t).list_items;
    RETURN_IF_ERROR(CheckLength(list.size() + items.size()));
    list.insert(list.end(), items.begin(), items.end());
    return Status::OK();
  }
  return Fail(std::string("target is a ") + PickleValue::KindName(t->kind_) + ", not a " +
              PickleValue::KindName(want));
}

Status Unpickler::AddDictItems(PickleValue* top, const std::vector<PickleDictEntry>& entries) {
  PickleValue* t = MutableUnwrapped(top);
  std::vector<PickleDictEntry>* dest = nullptr;
  if (t->kind_ == Kind::kDict) dest = &std::get<PickleValue::Entries>(t->body_);
  else if (t->kind_ == Kind::kReduce || t->kind_ == Kind::kNewObj) dest = &ObjectItemsOf(t).dict_items;
  else return Fail(std::string("target is a ") + PickleValue::KindName(t->kind_) + ", not a dict");
  RETURN_IF_ERROR(CheckLength(dest->size() + entries.size()));
  dest->insert(dest->end(), entries.begin(), entries.end());
  return Status::OK();
}

// BUILD applies state to the object in place: the object's node becomes a
// Build whose first operand holds what the node was, so every reference
// (memo, containers) sees the built object, as Python's in-place
// __setstate__ would make them.
Status Unpickler::Build() {
  ASSIGN_OR_RETURN(PickleValue * state, Pop());
  ASSIGN_OR_RETURN(PickleValue * obj, Top());
  const PickleValue& inner = obj->Unwrapped();
  bool ok = inner.kind_ == Kind::kReduce || inner.kind_ == Kind::kNewObj ||
            inner.kind_ == Kind::kGlobal || inner.kind_ == Kind::kPersistentId ||
            (inner.kind_ == Kind::kDict && inner.flag_);
  // Python fails here too: builtins other than OrderedDict have no __dict__.
  if (!ok) return Fail(std::string("target is a ") + PickleValue::KindName(inner.kind_) + ", which has no state");
  ASSIGN_OR_RETURN(PickleValue * moved, New(obj->kind_));
  moved->flag_ = obj->flag_;
  moved->int_ = obj->int_;
  moved->body_ = std::move(obj->body_);
  moved->object_items_ = std::move(obj->object_items_);
  obj->kind_ = Kind::kBuild;
  obj->flag_ = false;
  obj->int_ = 0;
  obj->body_ = PickleValue::Items{moved, state};
  obj->object_items_.reset();
  return Status::OK();
}

Status Unpickler::MemoPut(uint64_t index) {
  ASSIGN_OR_RETURN(PickleValue * v, Top());
  if (!memo_.Get(index) && memo_.count() >= lim_.max_memo_entries)
    return Fail("memo exceeds " + std::to_string(lim_.max_memo_entries) + " entries");
  memo_.Put(index, v);
  return Status::OK();
}

Result<PickleValue*> Unpickler::MemoGet(uint64_t index) {
  PickleValue* v = memo_.Get(index);
  if (!v) return Fail("memo index " + std::to_string(index) + " is unset");
  return v;
}

// One opcode. Opcodes are grouped by what they act on; each group reads its
// arguments and either pushes a new value or changes the machine's state.
Status Unpickler::Step(bool& done) {
  op_pos_ = pos_;
  op_ = uint8_t(in_[pos_++]);
  switch (op_) {
    case PROTO: case FRAME: case STOP:
      return FramingOp(done);
    case MARK: case POP: case POP_MARK: case DUP:
      return StackOp();
    case NONE: case NEWTRUE: case NEWFALSE: case BININT: case BININT1: case BININT2: case INT: case LONG:
    case LONG1: case LONG4: case BINFLOAT: case FLOAT:
      return PushNew(NumberOp());
    case SHORT_BINUNICODE: case BINUNICODE: case BINUNICODE8: case SHORT_BINSTRING: case BINSTRING:
    case SHORT_BINBYTES: case BINBYTES: case BINBYTES8: case BYTEARRAY8: case STRING: case UNICODE:
      return PushNew(TextOp());
    case EMPTY_TUPLE: case TUPLE1: case TUPLE2: case TUPLE3: case TUPLE: case LIST: case FROZENSET:
    case EMPTY_LIST: case EMPTY_SET: case EMPTY_DICT: case DICT:
      return PushNew(ContainerOp());
    case APPEND: case APPENDS: case ADDITEMS: case SETITEM: case SETITEMS:
      return FillOp();
    case PUT: case BINPUT: case LONG_BINPUT: case MEMOIZE: case GET: case BINGET: case LONG_BINGET:
      return MemoOp();
    case GLOBAL: case STACK_GLOBAL: case REDUCE: case NEWOBJ: case NEWOBJ_EX: case BINPERSID: case PERSID:
      return PushNew(ObjectOp());
    case BUILD:
      return Build();
    case INST:
    case OBJ:
      return Refuse("protocol 0/1 object construction imports and calls a class");
    case EXT1:
    case EXT2:
    case EXT4:
      return Refuse("extension codes name callables from the copyreg registry");
    case NEXT_BUFFER:
    case READONLY_BUFFER:
      return Refuse("out-of-band buffers are not supported");
  }
  return UnknownOp();
}

Status Unpickler::UnknownOp() const {
  static const char kHex[] = "0123456789abcdef";
  return Status::Corruption("pickle: offset " + std::to_string(op_pos_) + ": unknown opcode 0x" +
                            kHex[op_ >> 4] + kHex[op_ & 15]);
}

Status Unpickler::PushNew(Result<PickleValue*> v) {
  if (!v.ok()) return v.status();
  return Push(*v);
}

Result<uint64_t> Unpickler::ReadSignedCount4() {
  ASSIGN_OR_RETURN(uint64_t u, ReadUint(4));
  if (static_cast<int32_t>(static_cast<uint32_t>(u)) < 0) return Fail("byte count is negative");
  return u;
}

Result<uint64_t> Unpickler::ReadMemoIndexLine() {
  ASSIGN_OR_RETURN(std::string_view line, ReadLine());
  uint64_t index;
  auto r = std::from_chars(line.data(), line.data() + line.size(), index);
  if (line.empty() || r.ec != std::errc() || r.ptr != line.data() + line.size())
    return Fail("argument is not a memo index");
  return index;
}

Status Unpickler::FramingOp(bool& done) {
  switch (op_) {
    case PROTO: {
      ASSIGN_OR_RETURN(uint64_t p, ReadUint(1));
      if (p > 5) return Fail("protocol " + std::to_string(p) + " is newer than 5");
      protocol_ = int(p);
      doc_.protocol_ = protocol_;
      return Status::OK();
    }
    case FRAME: {  // a read-ahead hint; only its length is checked
      ASSIGN_OR_RETURN(uint64_t n, ReadUint(8));
      if (n > remaining())
        return Fail("length " + std::to_string(n) + " exceeds remaining " + std::to_string(remaining()) + " bytes");
      return Status::OK();
    }
    case STOP: {
      ASSIGN_OR_RETURN(PickleValue * v, Pop());
      doc_.root_ = v;
      doc_.end_offset_ = pos_;
      done = true;
      return Status::OK();
    }
  }
  return UnknownOp();
}

Status Unpickler::StackOp() {
  switch (op_) {
    case MARK:
      if (marks_.size() >= lim_.max_depth)
        return Fail("nesting exceeds the limit of " + std::to_string(lim_.max_depth) + " marks");
      marks_.push_back(stack_.size());
      return Status::OK();
    case POP:
      // As CPython: POP right after MARK discards the mark.
      if (!marks_.empty() && marks_.back() == stack_.size()) {
        marks_.pop_back();
        return Status::OK();
      }
      return Pop().status();
    case POP_MARK:
      return PopMark().status();
    case DUP: {
      ASSIGN_OR_RETURN(PickleValue * v, Top());
      return Push(v);
    }
  }
  return UnknownOp();
}

Result<PickleValue*> Unpickler::NumberOp() {
  switch (op_) {
    case NONE:
      return Singleton(none_, Kind::kNone, 0);
    case NEWTRUE:
      return Singleton(true_, Kind::kBool, 1);
    case NEWFALSE:
      return Singleton(false_, Kind::kBool, 0);
    case BININT: {
      ASSIGN_OR_RETURN(uint64_t u, ReadUint(4));
      return NewInt(static_cast<int32_t>(static_cast<uint32_t>(u)));
    }
    case BININT1:
    case BININT2: {
      ASSIGN_OR_RETURN(uint64_t u, ReadUint(op_ == BININT1 ? 1 : 2));
      return NewInt(static_cast<int64_t>(u));
    }
    case INT:
    case LONG: {
      ASSIGN_OR_RETURN(std::string_view line, ReadLine());
      if (op_ == LONG && !line.empty() && line.back() == 'L') line.remove_suffix(1);
      return ParseIntText(line, op_ == INT);
    }
    case LONG1:
    case LONG4: {
      uint64_t n;
      if (op_ == LONG1) {
        ASSIGN_OR_RETURN(n, ReadUint(1));
      } else {
        ASSIGN_OR_RETURN(n, ReadSignedCount4());
      }
      ASSIGN_OR_RETURN(std::string_view bytes, Take(n, "length " + std::to_string(n)));
      return DecodeLong(bytes);
    }
    case BINFLOAT:
    case FLOAT:
      return FloatOp();
  }
  return UnknownOp();
}

Result<PickleValue*> Unpickler::FloatOp() {
  uint64_t bits = 0;  // the IEEE double, kept bit for bit
  if (op_ == BINFLOAT) {
    ASSIGN_OR_RETURN(std::string_view s, Take(8, "argument of 8 bytes"));
    for (char c : s) bits = (bits << 8) | uint8_t(c);  // big-endian
  } else {
    ASSIGN_OR_RETURN(std::string_view line, ReadLine());
    while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.remove_suffix(1);
    while (!line.empty() && line.front() == ' ') line.remove_prefix(1);
    double d = 0;
    auto r = std::from_chars(line.data(), line.data() + line.size(), d);
    if (line.empty() || r.ec != std::errc() || r.ptr != line.data() + line.size())
      return Fail("argument '" + std::string(line.substr(0, 40)) + "' is not a float");
    bits = std::bit_cast<uint64_t>(d);
  }
  ASSIGN_OR_RETURN(PickleValue * v, New(Kind::kFloat));
  v->int_ = static_cast<int64_t>(bits);
  return v;
}

Result<PickleValue*> Unpickler::TextOp() {
  switch (op_) {
    case SHORT_BINUNICODE:
    case BINUNICODE:
    case BINUNICODE8: {
      ASSIGN_OR_RETURN(uint64_t n, ReadUint(op_ == SHORT_BINUNICODE ? 1 : op_ == BINUNICODE ? 4 : 8));
      ASSIGN_OR_RETURN(std::string_view s, ReadCounted(n));
      return NewStr(s);
    }
    case SHORT_BINSTRING:
    case BINSTRING: {  // Python 2 str; torch reads these as UTF-8 text
      uint64_t n;
      if (op_ == SHORT_BINSTRING) {
        ASSIGN_OR_RETURN(n, ReadUint(1));
      } else {
        ASSIGN_OR_RETURN(n, ReadSignedCount4());
      }
      ASSIGN_OR_RETURN(std::string_view s, ReadCounted(n));
      return NewStr(s);
    }
    case SHORT_BINBYTES:
    case BINBYTES:
    case BINBYTES8:
    case BYTEARRAY8: {
      ASSIGN_OR_RETURN(uint64_t n, ReadUint(op_ == SHORT_BINBYTES ? 1 : op_ == BINBYTES ? 4 : 8));
      ASSIGN_OR_RETURN(std::string_view s, ReadCounted(n));
      return NewText(Kind::kBytes, std::string(s));
    }
    case STRING: {
      ASSIGN_OR_RETURN(std::string_view line, ReadLine());
      ASSIGN_OR_RETURN(std::string s, UnquotePy2String(line));
      return NewStr(s);
    }
    case UNICODE: {
      ASSIGN_OR_RETURN(std::string_view line, ReadLine());
      ASSIGN_OR_RETURN(std::string s, RawUnicodeEscapeToUtf8(line));
      return NewText(Kind::kStr, std::move(s));
    }
  }
  return UnknownOp();
}

// The argument of STRING: repr() of a Python 2 str, quoted, with backslash
// escapes.
Result<std::string> Unpickler::UnquotePy2String(std::string_view line) const {
  while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.remove_suffix(1);
  if (line.size() < 2 || (line[0] != '\'' && line[0] != '"') || line.back() != line[0])
    return Fail("argument is not a quoted string");
  line = line.substr(1, line.size() - 2);
  std::string out;
  for (size_t i = 0; i < line.size(); ++i) {
    if (line[i] != '\\' || i + 1 == line.size()) {
      out.push_back(line[i]);
      continue;
    }
    char e = line[++i];
    switch (e) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'v': out.push_back('\v'); break;
      case '\n': break;
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'x': {
        int h = i + 2 < line.size() ? HexValue(line[i + 1]) : -1;
        int l = h >= 0 ? HexValue(line[i + 2]) : -1;
        if (l < 0) return Fail("has a bad \\x escape");
        out.push_back(char(h * 16 + l));
        i += 2;
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          int v = e - '0';
          for (int k = 0; k < 2 && i + 1 < line.size() && line[i + 1] >= '0' && line[i + 1] <= '7'; ++k)
            v = v * 8 + (line[++i] - '0');
          out.push_back(char(v & 0xFF));
        } else {  // unknown escapes are kept, as Python does
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

// The argument of UNICODE (raw-unicode-escape): latin-1 bytes, plus \u with
// 4 hex digits and \U with 8, as UTF-8.
Result<std::string> Unpickler::RawUnicodeEscapeToUtf8(std::string_view line) const {
  std::string out;
  for (size_t i = 0; i < line.size(); ++i) {
    size_t digits = 0;
    if (line[i] == '\\' && i + 1 < line.size()) digits = line[i + 1] == 'u' ? 4 : line[i + 1] == 'U' ? 8 : 0;
    if (!digits) {
      AppendUtf8(out, uint8_t(line[i]));
      continue;
    }
    if (i + 2 + digits > line.size()) return Fail("has a truncated \\u escape");
    uint32_t cp = 0;
    for (size_t k = 0; k < digits; ++k) {
      int h = HexValue(line[i + 2 + k]);
      if (h < 0) return Fail("has a bad \\u escape");
      cp = cp * 16 + h;
    }
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return Fail("escapes an invalid code point");
    AppendUtf8(out, cp);
    i += 1 + digits;
  }
  return out;
}

Result<PickleValue*> Unpickler::ContainerOp() {
  switch (op_) {
    case EMPTY_TUPLE:
      return NewItems(Kind::kTuple, {});
    case TUPLE1:
    case TUPLE2:
    case TUPLE3: {
      size_t n = op_ - TUPLE1 + 1;
      std::vector<const PickleValue*> items(n);
      for (size_t i = n; i-- > 0;) {
        ASSIGN_OR_RETURN(items[i], Pop());
      }
      return NewItems(Kind::kTuple, std::move(items));
    }
    case TUPLE:
    case LIST:
    case FROZENSET: {
      ASSIGN_OR_RETURN(auto items, PopMark());
      Kind k = op_ == TUPLE ? Kind::kTuple : op_ == LIST ? Kind::kList : Kind::kFrozenSet;
      return NewItems(k, std::move(items));
    }
    case EMPTY_LIST:
    case EMPTY_SET:
      return NewItems(op_ == EMPTY_LIST ? Kind::kList : Kind::kSet, {});
    case EMPTY_DICT:
      return NewDict();
    case DICT: {
      ASSIGN_OR_RETURN(auto items, PopMark());
      ASSIGN_OR_RETURN(auto entries, Pairs(items));
      RETURN_IF_ERROR(CheckLength(entries.size()));
      ASSIGN_OR_RETURN(PickleValue * v, NewDict());
      std::get<PickleValue::Entries>(v->body_) = std::move(entries);
      return v;
    }
  }
  return UnknownOp();
}

Status Unpickler::FillOp() {
  switch (op_) {
    case APPEND: {
      ASSIGN_OR_RETURN(PickleValue * item, Pop());
      ASSIGN_OR_RETURN(PickleValue * target, Top());
      return AddListItems(target, {item}, Kind::kList);
    }
    case APPENDS:
    case ADDITEMS: {
      ASSIGN_OR_RETURN(auto items, PopMark());
      ASSIGN_OR_RETURN(PickleValue * target, Top());
      return AddListItems(target, items, op_ == APPENDS ? Kind::kList : Kind::kSet);
    }
    case SETITEM: {
      ASSIGN_OR_RETURN(PickleValue * value, Pop());
      ASSIGN_OR_RETURN(PickleValue * key, Pop());
      ASSIGN_OR_RETURN(PickleValue * target, Top());
      return AddDictItems(target, {{key, value}});
    }
    case SETITEMS: {
      ASSIGN_OR_RETURN(auto items, PopMark());
      ASSIGN_OR_RETURN(auto entries, Pairs(items));
      ASSIGN_OR_RETURN(PickleValue * target, Top());
      return AddDictItems(target, entries);
    }
  }
  return UnknownOp();
}

Status Unpickler::MemoOp() {
  uint64_t index = 0;
  switch (op_) {
    case PUT:
    case GET: {
      ASSIGN_OR_RETURN(index, ReadMemoIndexLine());
      break;
    }
    case BINPUT:
    case BINGET:
    case LONG_BINPUT:
    case LONG_BINGET: {
      ASSIGN_OR_RETURN(index, ReadUint(op_ == BINPUT || op_ == BINGET ? 1 : 4));
      break;
    }
    case MEMOIZE:
      index = memo_.count();
      break;
    default:
      return UnknownOp();
  }
  if (op_ == PUT || op_ == BINPUT || op_ == LONG_BINPUT || op_ == MEMOIZE) return MemoPut(index);
  ASSIGN_OR_RETURN(PickleValue * v, MemoGet(index));
  return Push(v);
}

// Objects are recorded, never imported or called.
Result<PickleValue*> Unpickler::ObjectOp() {
  switch (op_) {
    case GLOBAL: {
      ASSIGN_OR_RETURN(std::string_view module, ReadLine());
      ASSIGN_OR_RETURN(std::string_view name, ReadLine());
      return MakeGlobal(module, name);
    }
    case STACK_GLOBAL: {
      ASSIGN_OR_RETURN(PickleValue * name, Pop());
      ASSIGN_OR_RETURN(PickleValue * module, Pop());
      if (!name->AsStr() || !module->AsStr()) return Fail("needs two str values");
      return MakeGlobal(*module->AsStr(), *name->AsStr());
    }
    case REDUCE: {
      ASSIGN_OR_RETURN(PickleValue * args, Pop());
      ASSIGN_OR_RETURN(PickleValue * callable, Pop());
      return MakeReduce(callable, args);
    }
    case NEWOBJ: {
      ASSIGN_OR_RETURN(PickleValue * args, Pop());
      ASSIGN_OR_RETURN(PickleValue * cls, Pop());
      return NewItems(Kind::kNewObj, {cls, args});
    }
    case NEWOBJ_EX: {
      ASSIGN_OR_RETURN(PickleValue * kwargs, Pop());
      ASSIGN_OR_RETURN(PickleValue * args, Pop());
      ASSIGN_OR_RETURN(PickleValue * cls, Pop());
      return NewItems(Kind::kNewObj, {cls, args, kwargs});
    }
    case BINPERSID: {
      ASSIGN_OR_RETURN(PickleValue * pid, Pop());
      return NewItems(Kind::kPersistentId, {pid});
    }
    case PERSID: {
      ASSIGN_OR_RETURN(std::string_view line, ReadLine());
      ASSIGN_OR_RETURN(PickleValue * pid, NewStr(line));
      return NewItems(Kind::kPersistentId, {pid});
    }
  }
  return UnknownOp();
}

// Acyclic, no deeper than max_depth, at most max_tree_values when shared
// values are counted once per reference. One iterative depth-first pass,
// linear in values plus references.
Status Unpickler::CheckTree(const PickleValue* root) {
  enum : uint8_t { kWhite, kGrey, kBlack };
  const uint64_t cap = lim_.max_tree_values;
  std::vector<uint8_t> color(values_.size(), kWhite);
  std::vector<uint32_t> height(values_.size(), 0);
  std::vector<uint64_t> size(values_.size(), 0);
  struct Frame {
    const PickleValue* v;
    size_t next;
  };
  std::vector<Frame> path{{root, 0}};
  color[root->index_] = kGrey;
  auto fail = [](const std::string& what) { return Status::Corruption("pickle: " + what); };
  while (!path.empty()) {
    Frame& f = path.back();
    if (f.next < f.v->ChildCount()) {
      const PickleValue* c = f.v->Child(f.next++);
      if (color[c->index_] == kGrey) return fail("value refers to itself (reference cycle through the memo)");
      if (color[c->index_] == kWhite) {
        if (path.size() >= lim_.max_depth)
          return fail("values nest deeper than the limit of " + std::to_string(lim_.max_depth));
        color[c->index_] = kGrey;
        path.push_back({c, 0});
      }
      continue;
    }
    uint32_t h = 0;
    uint64_t s = 1;
    for (size_t i = 0, n = f.v->ChildCount(); i < n; ++i) {
      const PickleValue* c = f.v->Child(i);
      h = std::max(h, height[c->index_]);
      s = std::min(cap + 1, s + size[c->index_]);
    }
    if (h + 1 > lim_.max_depth)
      return fail("values nest deeper than the limit of " + std::to_string(lim_.max_depth));
    if (s > cap)
      return fail("value tree expands to more than " + std::to_string(cap) +
                  " values through shared references");
    height[f.v->index_] = h + 1;
    size[f.v->index_] = s;
    color[f.v->index_] = kBlack;
    path.pop_back();
  }
  return Status::OK();
}

Status Unpickler::Run() {
  if (in_.size() > lim_.max_input_bytes)
    return Status::Corruption("pickle: input of " + std::to_string(in_.size()) + " bytes exceeds the limit of " +
                              std::to_string(lim_.max_input_bytes));
  bool done = false;
  while (!done) {
    if (pos_ >= in_.size())
      return Status::Corruption("pickle: offset " + std::to_string(pos_) +
                                ": input ends before the STOP opcode (truncated)");
    RETURN_IF_ERROR(Step(done));
  }
  return CheckTree(doc_.root_);
}

Result<std::unique_ptr<const PickleDocument>> Unpickle(std::string_view bytes, const UnpickleLimits& limits) {
  auto doc = std::make_unique<PickleDocument>();
  Unpickler u(bytes, limits, *doc);
  RETURN_IF_ERROR(u.Run());
  return std::unique_ptr<const PickleDocument>(std::move(doc));
}

}  // namespace ckptfs
