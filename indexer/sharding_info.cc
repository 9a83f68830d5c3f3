#include "indexer/sharding_info.h"

#include <algorithm>

#include <nlohmann/json.hpp>

namespace ckptfs {
namespace {

using nlohmann::json;

enum class State { kNoList, kOk, kBadInts };

struct Entry {
  std::string fqn;
  State state = State::kNoList;
  Dims offsets;
};

// Depth 1 inside the top-level object, 2 inside an fqn's object, 3 inside
// its saved_offsets array. Containers that do not matter are skipped by
// counting them in `skip_`.
class OffsetsSax {
 public:
  explicit OffsetsSax(std::vector<Entry>& out) : out_(out) {}

  bool null() { return Value(); }
  bool boolean(bool) { return Value(); }
  bool number_integer(json::number_integer_t v) { return v >= 0 ? Uint(static_cast<uint64_t>(v)) : Value(); }
  bool number_unsigned(json::number_unsigned_t v) { return Uint(v); }
  bool number_float(json::number_float_t, const std::string&) { return Value(); }
  bool string(std::string&) { return Value(); }
  bool binary(json::binary_t&) { return Value(); }
  bool key(std::string& k);
  bool start_object(std::size_t) { return Open(false); }
  bool end_object() { return Close(); }
  bool start_array(std::size_t) { return Open(true); }
  bool end_array() { return Close(); }
  bool parse_error(std::size_t, const std::string&, const json::exception&) { return false; }

  bool top_is_object() const { return top_is_object_; }

 private:
  // A scalar, or a container about to be skipped, where the position wants
  // an object (depth 0, 1), a list (saved_offsets) or an integer (depth 3).
  bool Value();
  bool Uint(uint64_t v);
  bool Open(bool array);
  bool Close();

  std::vector<Entry>& out_;
  int depth_ = 0;
  int skip_ = 0;
  bool in_offsets_field_ = false;  // depth 2: the current key is saved_offsets
  bool top_is_object_ = false;
};

bool OffsetsSax::Value() {
  if (skip_ > 0) return true;
  if (depth_ == 3) out_.back().state = State::kBadInts;
  else if (depth_ == 2 && in_offsets_field_) out_.back().state = State::kNoList;
  return true;
}

bool OffsetsSax::Uint(uint64_t v) {
  if (skip_ == 0 && depth_ == 3) {
    out_.back().offsets.push_back(v);
    return true;
  }
  return Value();
}

bool OffsetsSax::key(std::string& k) {
  if (skip_ > 0) return true;
  if (depth_ == 1) out_.push_back(Entry{k, State::kNoList, {}});
  if (depth_ == 2) in_offsets_field_ = k == "saved_offsets";
  return true;
}

bool OffsetsSax::Open(bool array) {
  if (skip_ > 0) {
    ++skip_;
    return true;
  }
  const bool wanted = (depth_ == 0 && !array) || (depth_ == 1 && !array) || (depth_ == 2 && array && in_offsets_field_);
  if (!wanted) {
    Value();
    skip_ = 1;
    return true;
  }
  if (depth_ == 0) top_is_object_ = true;
  if (depth_ == 2) out_.back() = Entry{std::move(out_.back().fqn), State::kOk, {}};
  ++depth_;
  return true;
}

bool OffsetsSax::Close() {
  if (skip_ > 0) --skip_;
  else --depth_;
  return true;
}

// Sorted by fqn; of a repeated fqn, the last.
void SortKeepingLast(std::vector<Entry>& entries) {
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.fqn < b.fqn; });
  auto last = std::unique(entries.rbegin(), entries.rend(), [](const Entry& a, const Entry& b) { return a.fqn == b.fqn; });
  entries.erase(entries.begin(), last.base());
}

}  // namespace

Result<ShardingInfo> ShardingInfo::Parse(const std::string& key, std::string_view text) {
  std::vector<Entry> entries;
  OffsetsSax sax(entries);
  if (!json::sax_parse(text, &sax) || !sax.top_is_object()) return Status::Corruption(key + " is not a JSON object");
  SortKeepingLast(entries);
  ShardingInfo info;
  info.entries_.reserve(entries.size());
  for (Entry& e : entries) {
    if (e.state == State::kNoList) return Status::Corruption(key + "['" + e.fqn + "'] has no saved_offsets list");
    if (e.state == State::kBadInts)
      return Status::Corruption(key + "['" + e.fqn + "'] saved_offsets are not non-negative integers");
    info.entries_.emplace_back(std::move(e.fqn), std::move(e.offsets));
  }
  return info;
}

const Dims* ShardingInfo::Find(std::string_view fqn) const {
  auto it = std::lower_bound(entries_.begin(), entries_.end(), fqn,
                             [](const auto& e, std::string_view name) { return e.first < name; });
  return it != entries_.end() && it->first == fqn ? &it->second : nullptr;
}

}  // namespace ckptfs
