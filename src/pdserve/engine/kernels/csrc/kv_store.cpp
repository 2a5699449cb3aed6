#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

namespace pdserve {
namespace {

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == cache.scalar_type() && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(1) == cache.size(2) &&
                  x.size(2) == cache.size(3),
              name, " must be [T, KVH, D] of the cache's dtype and head layout, heads "
              "contiguous");
}

}  // namespace

void check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3) &&
                  k_cache.stride(1) >= k_cache.size(2) * k_cache.size(3),
              "k_cache and v_cache must be [blocks, block_size, KVH, D] with each slot's heads "
              "contiguous (a slot may hold more heads than the view: a tensor-parallel rank's "
              "heads of a shared pool)");
}

void store_kv_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
               const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  check_kv_cache(k_cache, v_cache);
  check_rows(k, k_cache, "k");
  check_rows(v, v_cache, "v");
  const int64_t t = k.size(0), num_blocks = k_cache.size(0), bs = k_cache.size(1);
  TORCH_CHECK(v.size(0) == t && slot_blocks.numel() == t && slot_offsets.numel() == t &&
                  slot_blocks.scalar_type() == at::kLong &&
                  slot_offsets.scalar_type() == at::kLong && slot_blocks.is_contiguous() &&
                  slot_offsets.is_contiguous(),
              "one int64 block and offset per row");
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(blocks[r] >= 0 && blocks[r] < num_blocks && offsets[r] >= 0 && offsets[r] < bs,
                "slot (block ", blocks[r], ", offset ", offsets[r], ") is outside the pool of ",
                num_blocks, " blocks of ", bs);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t item = k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  at::parallel_for(0, t, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {  // one slot row: every KV head's K (then V) of a token
      const int64_t at = (blocks[r] * k_cache.stride(0) + offsets[r] * k_cache.stride(1)) * item;
      std::memcpy(kc + at, kp + r * k.stride(0) * item, row_bytes);
      std::memcpy(vc + at, vp + r * v.stride(0) * item, row_bytes);
    }
  });
}

}  // namespace pdserve
