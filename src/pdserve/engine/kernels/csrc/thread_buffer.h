// Scratch memory a kernel keeps per thread between calls.
#pragma once

#include <cstdint>
#include <memory>

namespace pdserve {

// At least `count` elements of T, uninitialized, this thread's, kept between calls: a fresh
// multi-MiB allocation costs its page faults on every call (about as much as packing a
// 4,096-token context). Each Tag is its own buffer, so buffers in use at once take their own.
template <typename T, typename Tag>
T* thread_buffer(int64_t count) {
  thread_local std::unique_ptr<T[]> buffer;
  thread_local int64_t size = 0;
  if (size < count) {
    buffer.reset(new T[count]);
    size = count;
  }
  return buffer.get();
}

}  // namespace pdserve
