// The restricted unpickler: pickle bytes in, an inert value tree out.
//
// Why: DCP `.metadata` files and torch.save archives (`data.pkl`) are
// pickles, and ckptfs indexes whatever checkpoint a user points it at, so a
// pickle must never execute. Python's unpickler imports every GLOBAL and
// calls every REDUCE; this one only records them. GLOBAL / STACK_GLOBAL
// become Global nodes, REDUCE a Reduce node, NEWOBJ a NewObj node, BUILD wraps
// its object in a Build node with the state beside it (no __setstate__), and
// persistent ids (how torch.save refers to storages) become PersistentId nodes.
// Nothing is imported, called, or looked up by name.
//
// What is accepted: every protocol 0-5 opcode that only builds data (the list
// is in pickle.cc). Refused with NotSupported: INST and OBJ (protocol 0/1
// object construction), EXT1/2/4 (the copyreg extension registry: the code
// names a callable we cannot know), NEXT_BUFFER / READONLY_BUFFER
// (out-of-band buffers). Anything else is Corruption. Errors name the byte
// offset of the opcode and the opcode:
//   "pickle: offset 1234: BINUNICODE length 4294967295 exceeds remaining 12 bytes"
//
// Globals are checked against an allowlist of what torch checkpoints use
// (IsAllowedGlobal below); one that is not on it still becomes an inert Global
// node, and is listed in PickleDocument::unknown_globals() so a caller can
// refuse the file or ignore the value.
//
// A few calls whose result is plain data are interpreted without calling
// anything, so that callers see the data rather than the recipe:
//   collections.OrderedDict()          -> Dict (is_ordered_dict())
//   builtins.set(list) / frozenset(list) -> Set / FrozenSet
//   _codecs.encode(str, 'latin1')      -> Bytes (protocol 2 writes bytes so)
//   builtins.bytes() / bytearray(bytes) -> Bytes
// (`__builtin__` and `copy_reg` in protocol 0-2 pickles read as `builtins`
// and `copyreg`, as Python's fix_imports does.)
//
// Shared references work as in Python: a memoized list filled later is seen
// filled everywhere it is referenced. The finished tree is checked to be
// acyclic, no deeper than `max_depth`, and small enough when every reference
// to a shared value is counted separately (`max_tree_values`), so any
// recursive walk over it terminates quickly without a visited set.
//
// Thread safety: a PickleDocument is immutable after Unpickle returns and may
// be read from many threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "core/status.h"

namespace ckptfs {

// Every cap is checked before the memory it guards is allocated.
struct UnpickleLimits {
  uint64_t max_input_bytes = 1ull << 30;
  // One str / bytes value; also bounds text-opcode lines.
  uint64_t max_string_bytes = 1ull << 30;
  // Measured on a torch-written DCP .metadata with 200k chunks: 28 MB of
  // pickle, 6.2M values (~31 per chunk), 0.68 GB resident, ~1 s. The
  // defaults below admit ~2M chunks; raise them for larger checkpoints.
  uint64_t max_memo_entries = 1ull << 26;
  // Values created (each 64 bytes plus its payload): bounds memory.
  uint64_t max_values = 1ull << 26;
  // Nested MARKs, and the nesting depth of the finished tree.
  uint64_t max_depth = 1000;
  // Values on the stack, and items in any one container.
  uint64_t max_container_length = 100'000'000;
  // Values in the tree counting each reference to a shared value separately:
  // bounds the work of any walk (a chain of (x, x) tuples doubles per level).
  uint64_t max_tree_values = 1ull << 28;
  // LONG1/LONG4 integers wider than int64 are kept as decimal text up to this
  // many bytes (4096 bytes ~ 9865 digits; Python itself caps str(int) at 4300).
  uint64_t max_bigint_bytes = 4096;
};

class PickleValue;

// What a PickleValue is.
enum class PickleKind : uint8_t {
  kNone,
  kBool,
  kInt,       // fits int64
  kBigInt,    // wider than int64: decimal text (BigIntText())
  kFloat,
  kStr,       // UTF-8, validated
  kBytes,     // bytes, bytearray
  kTuple,
  kList,
  kDict,      // dict or OrderedDict; entries in insertion order
  kSet,
  kFrozenSet,
  kGlobal,        // module.name; never imported
  kReduce,        // callable(*args); never called
  kNewObj,        // cls.__new__(cls, *args, **kwargs); never called
  kBuild,         // object with BUILD state; __setstate__ never called
  kPersistentId,  // the pickler's persistent_id(obj) (torch: storages)
};

struct PickleDictEntry {
  const PickleValue* key;
  const PickleValue* value;
};

class PickleValue {
 public:
  using Kind = PickleKind;

  Kind kind() const { return kind_; }
  static const char* KindName(Kind k);

  // Scalars: nullopt / nullptr when the value is of another kind. No
  // conversions (a Bool is not an Int here, though Python's bool is).
  bool IsNone() const { return kind_ == Kind::kNone; }
  std::optional<bool> AsBool() const;
  std::optional<int64_t> AsInt() const;
  std::optional<double> AsFloat() const;
  const std::string* AsStr() const;
  const std::string* AsBytes() const;
  const std::string* BigIntText() const;  // "-123..." for kBigInt

  // Sequences: the items, or nullptr when the value is of another kind.
  const std::vector<const PickleValue*>* AsTuple() const;
  const std::vector<const PickleValue*>* AsList() const;
  const std::vector<const PickleValue*>* AsSequence() const;  // tuple or list
  const std::vector<const PickleValue*>* AsSet() const;       // set or frozenset
  // Item `i` of a tuple or list; nullptr when out of range or not a sequence.
  const PickleValue* At(size_t i) const;

  // Dicts keep every SETITEM in order, duplicates included; lookups return
  // the last match, which is the value Python would keep.
  const std::vector<PickleDictEntry>* AsDict() const;
  const PickleValue* DictGet(std::string_view str_key) const;
  const PickleValue* DictGetInt(int64_t int_key) const;
  bool is_ordered_dict() const { return kind_ == Kind::kDict && flag_; }

  // Globals.
  bool IsGlobal() const { return kind_ == Kind::kGlobal; }
  bool IsGlobal(std::string_view module, std::string_view name) const;
  std::string_view global_module() const;  // "" unless a Global
  std::string_view global_name() const;
  bool is_allowed_global() const { return kind_ == Kind::kGlobal && flag_; }

  // Reduce: callable(), args(). NewObj: callable() is the class, args(),
  // kwargs() (NEWOBJ_EX only, else nullptr). nullptr for other kinds.
  const PickleValue* callable() const;
  const PickleValue* args() const;
  const PickleValue* kwargs() const;
  // True for a Reduce or NewObj whose callable is the Global module.name.
  bool IsCallOf(std::string_view module, std::string_view name) const;
  // The args tuple's items when IsCallOf(module, name) and args is a tuple.
  const std::vector<const PickleValue*>* CallArgs(std::string_view module,
                                                  std::string_view name) const;

  // Build: the object and the state BUILD gave it. A BUILD on a Build wraps
  // again (state applied twice).
  const PickleValue* built_object() const;
  const PickleValue* build_state() const;
  // Follows Build wrappers down to the object they wrap.
  const PickleValue& Unwrapped() const;

  // PersistentId: the id the pickler wrote (torch: a ('storage', ...) tuple).
  const PickleValue* pid() const;

  // Items that APPEND(S)/ADDITEMS and SETITEM(S) added to a Reduce or NewObj
  // (a list, set or dict subclass in Python). Empty for other kinds.
  const std::vector<const PickleValue*>& object_list_items() const;
  const std::vector<PickleDictEntry>& object_dict_items() const;

  // A Python-like rendering for messages and tests, cut at `max_chars`:
  //   {'a': (1, 2.5, b'x'), 'b': torch._utils._rebuild_tensor_v2(...)}
  std::string DebugString(size_t max_chars = 4096) const;

 private:
  friend class Unpickler;
  friend class PickleDocument;
  struct ObjectItems {
    std::vector<const PickleValue*> list_items;
    std::vector<PickleDictEntry> dict_items;
  };
  using Items = std::vector<const PickleValue*>;
  using Entries = std::vector<PickleDictEntry>;

  // Children in a fixed order (for the tree checks in pickle.cc).
  size_t ChildCount() const;
  const PickleValue* Child(size_t i) const;

  Kind kind_ = Kind::kNone;
  // Dict: is an OrderedDict. Global: on the allowlist.
  bool flag_ = false;
  uint32_t index_ = 0;  // creation order, for the tree checks
  // Bool/Int value; Float bits; Global: length of the module part of text.
  int64_t int_ = 0;
  // Str/Bytes/BigInt text; Global "module" + "name"; containers and the
  // operands of Reduce (callable, args), NewObj (cls, args[, kwargs]),
  // Build (object, state), PersistentId (pid); Dict entries.
  std::variant<std::monostate, std::string, Items, Entries> body_;
  std::unique_ptr<ObjectItems> object_items_;  // rare: allocated on demand
};

// Owns every value of one unpickled stream.
class PickleDocument {
 public:
  PickleDocument();
  ~PickleDocument();
  PickleDocument(const PickleDocument&) = delete;
  PickleDocument& operator=(const PickleDocument&) = delete;

  const PickleValue& root() const { return *root_; }
  // The PROTO opcode's argument; 0 when the stream has none (protocol 0/1).
  int protocol() const { return protocol_; }
  // "module.name" of each global not on the allowlist, once each, in the
  // order first seen (whether or not it ends up reachable from the root).
  const std::vector<std::string>& unknown_globals() const { return unknown_globals_; }
  bool has_unknown_globals() const { return !unknown_globals_.empty(); }
  // Offset just past STOP; Python ignores bytes after it and so do we.
  uint64_t end_offset() const { return end_offset_; }
  size_t value_count() const;

 private:
  friend class Unpickler;
  struct Storage;
  std::unique_ptr<Storage> storage_;  // stable addresses for every value
  const PickleValue* root_ = nullptr;
  int protocol_ = 0;
  std::vector<std::string> unknown_globals_;
  uint64_t end_offset_ = 0;
};

// Unpickles one stream (up to its STOP). Errors: Corruption for malformed or
// over-limit input, NotSupported for the refused opcodes above.
Result<std::unique_ptr<const PickleDocument>> Unpickle(std::string_view bytes,
                                                       const UnpickleLimits& limits = {});

// The allowlist: globals torch checkpoints are known to use (tensor rebuild
// functions, storage classes, dtypes, layouts, memory formats, torch.Size,
// torch.device, DCP metadata classes, OrderedDict, set/frozenset/bytes,
// _codecs.encode, pathlib paths, numpy scalars and dtypes).
bool IsAllowedGlobal(std::string_view module, std::string_view name);

}  // namespace ckptfs
