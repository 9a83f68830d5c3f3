// Byte buffers sized without being zero-filled, for memory that is written
// whole before it is read (a block a computation fills, a part a GET fills):
// zeroing it first costs a pass over every byte for nothing.
#pragma once

#include <memory>
#include <utility>
#include <vector>

namespace ckptfs {

template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) {}  // NOLINT: as std::allocator
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U;  // default-initialized: no zeros
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
};

using UninitializedBytes = std::vector<char, UninitializedAllocator<char>>;

}  // namespace ckptfs
