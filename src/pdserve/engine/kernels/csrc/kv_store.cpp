#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pdserve {
namespace {

void check_rows(const at::Tensor& x, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == cache.scalar_type() && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2) && x.size(1) == cache.size(2) &&
                  x.size(2) == cache.size(3),
              name, " must be [T, KVH, D] of the cache's dtype and head layout, heads "
              "contiguous");
}

// One int64 block and offset per row, each slot inside a pool of num_blocks blocks of bs.
void check_slots(const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t t,
                 int64_t num_blocks, int64_t bs) {
  TORCH_CHECK(slot_blocks.numel() == t && slot_offsets.numel() == t &&
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
  const int64_t t = k.size(0);
  TORCH_CHECK(v.size(0) == t, "k and v must have the same rows");
  check_slots(slot_blocks, slot_offsets, t, k_cache.size(0), k_cache.size(1));
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
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

void mla_store_(const at::Tensor& kv, const at::Tensor& norm_weight, double eps,
                const at::Tensor& cos, const at::Tensor& sin, bool interleave, at::Tensor& cache,
                const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kBFloat16 && cache.stride(2) == 1 &&
                  cache.stride(1) == cache.size(2),
              "cache must be one layer's bf16 latent pool [num_blocks, block_size, latent] with "
              "contiguous slots");
  const int64_t t = kv.size(0), width = cache.size(2), r = norm_weight.numel();
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1 && kv.scalar_type() == at::kBFloat16 &&
                  kv.size(1) == width,
              "kv must be bf16 [T, ", width, "] (the pool's latent width) with contiguous rows");
  TORCH_CHECK(norm_weight.dim() == 1 && norm_weight.is_contiguous() &&
                  norm_weight.scalar_type() == at::kBFloat16 && r > 0 && r < width &&
                  (width - r) % 2 == 0,
              "the norm weight must be contiguous bf16 [r], r < ", width,
              " leaving an even rotary width");
  const int64_t half = (width - r) / 2;
  check_mla_tables(cos, sin, t, half, "kv");
  check_slots(slot_blocks, slot_offsets, t, cache.size(0), cache.size(1));
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const bf16* src = kv.data_ptr<bf16>();
  const bf16* w = norm_weight.data_ptr<bf16>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  bf16* base = cache.data_ptr<bf16>();
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> a(half), b(half);
    for (int64_t i = r0; i < r1; ++i) {
      const bf16* in = src + i * kv.stride(0);
      bf16* out = base + blocks[i] * cache.stride(0) + offsets[i] * cache.stride(1);
      norm_row(in, w, out, r, static_cast<float>(eps));
      rotate_mla_row(in + r, out + r, cp + i * half, sp + i * half, half, interleave, a.data(),
                     b.data());
    }
  });
}

}  // namespace pdserve
