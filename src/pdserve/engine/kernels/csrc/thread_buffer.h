// Scratch memory a kernel keeps per thread between calls.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>

namespace pdserve {

// At least `count` elements of T (a trivial type), uninitialized, this thread's, kept between
// calls: a fresh multi-MiB allocation costs its page faults on every call (about as much as
// packing a 4,096-token context). Each Tag is its own buffer, so buffers in use at once take
// their own. The start is 64-byte aligned: a tile or vector row of 64 bytes across two cache
// lines reads both.
template <typename T, typename Tag>
T* thread_buffer(int64_t count) {
  static_assert(std::is_trivial_v<T>);
  thread_local std::unique_ptr<char[]> buffer;
  thread_local T* start = nullptr;
  thread_local int64_t size = 0;
  if (size < count) {
    buffer.reset(new char[count * sizeof(T) + 63]);
    const auto at = (reinterpret_cast<uintptr_t>(buffer.get()) + 63) & ~uintptr_t{63};
    start = reinterpret_cast<T*>(at);
    size = count;
  }
  return start;
}

}  // namespace pdserve
