#include "source/scatter_reply.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace ckptfs {

void ScatterReply::ReserveGather(uint64_t bytes) {
  gather_ = Buffer::Heap(bytes);
  gather_used_ = 0;
}

char* ScatterReply::Reserve(uint64_t dst_offset, uint64_t length) {
  if (gather_used_ + length > gather_.size())
    throw std::logic_error("ScatterReply::Reserve beyond ReserveGather's bytes");
  char* at = gather_.data() + gather_used_;
  gather_used_ += length;
  Add(dst_offset, at, length);
  return at;
}

void ScatterReply::Add(uint64_t dst_offset, const char* data, uint64_t length) {
  if (length > 0) pieces_.push_back({dst_offset, data, length});
}

Status ScatterReply::Finish(size_t max_pieces) {
  std::sort(pieces_.begin(), pieces_.end(),
            [](const Piece& a, const Piece& b) { return a.dst_offset < b.dst_offset; });
  iov_.clear();
  length_ = 0;
  for (const Piece& p : pieces_) {
    if (p.dst_offset != length_)
      return Status::Corruption("read reply: " + std::string(p.dst_offset < length_ ? "overlap" : "hole") +
                                " at byte " + std::to_string(std::min(p.dst_offset, length_)));
    char* data = const_cast<char*>(p.data);
    if (!iov_.empty() && static_cast<char*>(iov_.back().iov_base) + iov_.back().iov_len == data)
      iov_.back().iov_len += p.length;
    else
      iov_.push_back({data, p.length});
    length_ += p.length;
  }
  pieces_.clear();
  if (iov_.size() > max_pieces) GatherRun(iov_.size() - std::max<size_t>(max_pieces, 1) + 1);
  return Status::OK();
}

void ScatterReply::GatherRun(size_t run) {
  // The window of `run` neighbours with the fewest bytes (a sliding sum).
  uint64_t sum = 0;
  for (size_t i = 0; i < run; ++i) sum += iov_[i].iov_len;
  size_t best = 0;
  uint64_t best_sum = sum;
  for (size_t i = run; i < iov_.size(); ++i) {
    sum += iov_[i].iov_len - iov_[i - run].iov_len;
    if (sum < best_sum) {
      best_sum = sum;
      best = i - run + 1;
    }
  }
  Buffer joined = Buffer::Heap(best_sum);
  char* at = joined.data();
  for (size_t i = best; i < best + run; ++i) {
    std::memcpy(at, iov_[i].iov_base, iov_[i].iov_len);
    at += iov_[i].iov_len;
  }
  iov_[best] = {joined.data(), best_sum};
  iov_.erase(iov_.begin() + best + 1, iov_.begin() + best + run);
  buffers_.push_back(std::move(joined));
}

void ScatterReply::CopyTo(char* dst) const {
  for (const struct iovec& v : iov_) {
    std::memcpy(dst, v.iov_base, v.iov_len);
    dst += v.iov_len;
  }
}

}  // namespace ckptfs
