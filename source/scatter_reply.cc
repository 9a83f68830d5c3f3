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
  if (iov_.size() <= max_pieces) return Status::OK();
  // Too many for one writev: one gathered piece (the copy the scatter list
  // saves elsewhere).
  Buffer all = Buffer::Heap(length_);
  CopyTo(all.data());
  iov_.assign(1, {all.data(), length_});
  buffers_.push_back(std::move(all));
  return Status::OK();
}

void ScatterReply::CopyTo(char* dst) const {
  for (const struct iovec& v : iov_) {
    std::memcpy(dst, v.iov_base, v.iov_len);
    dst += v.iov_len;
  }
}

}  // namespace ckptfs
