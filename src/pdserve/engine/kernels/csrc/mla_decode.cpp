// Multi-head Latent Attention's decode in the absorbed form (DeepSeek-V2 paper, arXiv
// 2405.04434, section 2.1.2), one call per layer and decode group, for bf16 weights and pool.
//
// Per request b and head h, with r = kv_lora_rank, d_n / d_r / d_v the head sizes:
//   q_h     = [W_UK,h^T q_nope,h ; q_rope,h]                          [r + d_r], fp32
//   s_t     = scale (q_h . latent_t)        latent_t = [c_t ; k_rope_t], the pool's row t
//   o_lat,h = sum_t softmax(s)_t c_t                                  [r], fp32
//   out_h   = W_UV,h o_lat,h                                          [d_v], rounded to bf16 once
// Every head attends the same latent rows (MQA over one "head" of r + d_r), and no per-head K
// or V is ever built. The PyTorch form of the same (model/mla_attention.py) is a batched
// matmul, a gather of the blocks, a masked softmax and another batched matmul per layer, ~30
// operator calls; at decode's one row per request those calls, not the bytes, were the cost.
//
// Work is split by heads: an item is a run of G heads, for every request in turn. Its weight
// rows (W_UK,h and W_UV,h: 2 r (d_n + d_v) bytes a head) are read from memory for the first
// request and from cache for the next ones (G is sized for that); each latent row is read
// once per item for all its G heads.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "thread_buffer.h"
#include "vec.h"

namespace pdserve {
namespace {

// An item's weight rows should stay in a core's L2 between requests: G heads' W_UK and W_UV
// take at most this many bytes (at least one head).
constexpr int64_t kItemWeightBytes = 256 << 10;

// y[0, cols) = sum_i x[i] w(i)[0, cols): x [rows] and y fp32, each row w(i) bf16. A vector-
// matrix product with the rows streamed once per chunk of 4 kBVec columns, whose sums stay in
// registers (8 vectors, in quad order until stored) over all rows; the columns past the last
// whole chunk go one vector at a time.
template <typename Row>
void gemv_rows(const float* x, int64_t rows, const Row& w, int64_t cols, float* y) {
  constexpr int64_t kChunk = 4 * kBVec;
  int64_t c0 = 0;
  for (; c0 + kChunk <= cols; c0 += kChunk) {
    Vec acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) acc[k] = Vec(0.f);
    for (int64_t i = 0; i < rows; ++i) {
      const Vec xi(x[i]);
      const bf16* wi = w(i) + c0;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        auto [a, b] = load_quads(wi + k * kBVec);
        acc[2 * k] = at::vec::fmadd(xi, a, acc[2 * k]);
        acc[2 * k + 1] = at::vec::fmadd(xi, b, acc[2 * k + 1]);
      }
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      auto [a, b] = quads(acc[2 * k], acc[2 * k + 1]);
      a.store(y + c0 + 2 * k * kVec);
      b.store(y + c0 + (2 * k + 1) * kVec);
    }
  }
  for (; c0 < cols; c0 += kVec) {
    const int64_t c = std::min(kVec, cols - c0);
    Vec acc(0.f);
    for (int64_t i = 0; i < rows; ++i) {
      auto [a, b] = load_bf16(w(i) + c0, c);
      acc = at::vec::fmadd(Vec(x[i]), a, acc);
    }
    acc.store(y + c0, c);
  }
}

// q . x[0, n); q fp32 as `to_quads` leaves it, x bf16, summed in fp32 (four sums in flight).
float dot(const float* q, const bf16* x, int64_t n) {
  Vec acc[4] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t i = 0;
  for (; i + 2 * kBVec <= n; i += 2 * kBVec) {
#pragma GCC unroll 2
    for (int k = 0; k < 2; ++k) {
      auto [a, b] = load_quads(x + i + k * kBVec);
      acc[2 * k] = at::vec::fmadd(Vec::loadu(q + i + k * kBVec), a, acc[2 * k]);
      acc[2 * k + 1] = at::vec::fmadd(Vec::loadu(q + i + k * kBVec + kVec), b, acc[2 * k + 1]);
    }
  }
  if (i + kBVec <= n) {
    auto [a, b] = load_quads(x + i);
    acc[0] = at::vec::fmadd(Vec::loadu(q + i), a, acc[0]);
    acc[1] = at::vec::fmadd(Vec::loadu(q + i + kVec), b, acc[1]);
    i += kBVec;
  }
  float total = sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
  for (; i < n; ++i) total += q[i] * static_cast<float>(x[i]);
  return total;
}

struct Shapes {
  int64_t r, d_n, d_r, d_v, bs, block_stride, width;
};

struct ItemScratch {};  // thread_buffer's tag

// Heads [h0, h0 + g) of one request (q rows, its block table and length): writes those heads'
// rows of out [H, d_v].
void attend_heads(const Shapes& s, int64_t h0, int64_t g, const bf16* q_nope, int64_t qn_head,
                  const bf16* q_rope, int64_t qr_head, const bf16* cache, const int64_t* table,
                  int64_t len, const bf16* w_uk, const bf16* w_uv, float scale, bf16* out) {
  const int64_t row = s.r + s.d_r;
  float* q = thread_buffer<float, ItemScratch>(g * row + g * len + s.r + s.d_n + s.d_v);
  float* scores = q + g * row;         // [G, len]
  float* o_lat = scores + g * len;     // [r]
  float* q_in = o_lat + s.r;           // [d_n]
  float* o = q_in + s.d_n;             // [d_v]
  for (int64_t j = 0; j < g; ++j) {  // q_j = scale [W_UK^T q_nope ; q_rope]
    const int64_t h = h0 + j;
    float* qj = q + j * row;
    for (int64_t e = 0; e < s.d_n; ++e)
      q_in[e] = scale * static_cast<float>(q_nope[h * qn_head + e]);
    const bf16* uk = w_uk + h * s.d_n * s.r;
    gemv_rows(q_in, s.d_n, [&](int64_t n) { return uk + n * s.r; }, s.r, qj);
    for (int64_t e = 0; e < s.d_r; ++e)
      qj[s.r + e] = scale * static_cast<float>(q_rope[h * qr_head + e]);
    to_quads(qj, row);  // as `dot` reads it
  }
  const auto latent = [&](int64_t t) {  // the pool's row of position t: [c_t ; k_rope_t]
    return cache + table[t / s.bs] * s.block_stride + (t % s.bs) * row;
  };
  for (int64_t t = 0; t < len; ++t) {
    const bf16* lt = latent(t);
    for (int64_t j = 0; j < g; ++j) scores[j * len + t] = dot(q + j * row, lt, row);
  }
  for (int64_t j = 0; j < g; ++j) {  // p_t = exp(s_t - max) / sum
    float* sj = scores + j * len;
    const float top = *std::max_element(sj, sj + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += (sj[t] = std::exp(sj[t] - top));
    for (int64_t t = 0; t < len; ++t) sj[t] /= total;
  }
  for (int64_t j = 0; j < g; ++j) {  // o_lat = sum_t p_t c_t; out_h = W_UV,h o_lat
    const int64_t h = h0 + j;
    gemv_rows(scores + j * len, len, latent, s.r, o_lat);
    const bf16* uv = w_uv + h * s.r * s.d_v;
    gemv_rows(o_lat, s.r, [&](int64_t i) { return uv + i * s.d_v; }, s.d_v, o);
    for (int64_t v = 0; v < s.d_v; ++v) out[h * s.d_v + v] = static_cast<bf16>(o[v]);
  }
}

}  // namespace

at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_rope, const at::Tensor& cache,
                      const at::Tensor& block_tables, const at::Tensor& lens,
                      const at::Tensor& w_uk, const at::Tensor& w_uv, double scale) {
  const auto bf16_rows = [](const at::Tensor& x) {
    return x.dim() == 3 && x.stride(2) == 1 && x.scalar_type() == at::kBFloat16;
  };
  TORCH_CHECK(bf16_rows(q_nope) && bf16_rows(q_rope),
              "q_nope and q_rope must be bf16 [B, H, d] with contiguous heads");
  TORCH_CHECK(w_uk.dim() == 3 && w_uv.dim() == 3 && w_uk.is_contiguous() &&
                  w_uv.is_contiguous() && w_uk.scalar_type() == at::kBFloat16 &&
                  w_uv.scalar_type() == at::kBFloat16,
              "w_uk and w_uv must be contiguous bf16 [H, d_n, r] and [H, r, d_v]");
  const int64_t b = q_nope.size(0), h = q_nope.size(1);
  const Shapes s{w_uk.size(2), q_nope.size(2), q_rope.size(2), w_uv.size(2),
                 cache.dim() == 3 ? cache.size(1) : 0, cache.dim() == 3 ? cache.stride(0) : 0,
                 block_tables.dim() == 2 ? block_tables.size(1) : 0};
  TORCH_CHECK(q_rope.size(0) == b && q_rope.size(1) == h && w_uk.size(0) == h &&
                  w_uk.size(1) == s.d_n && w_uv.size(0) == h && w_uv.size(1) == s.r,
              "q_nope, q_rope, w_uk and w_uv disagree on heads or sizes");
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kBFloat16 &&
                  cache.size(2) == s.r + s.d_r && cache.stride(2) == 1 &&
                  cache.stride(1) == s.r + s.d_r,
              "cache must be one layer's bf16 latent pool [num_blocks, block_size, ",
              s.r + s.d_r, "] with contiguous slots");
  check_decode_tables(block_tables, lens, b, s.bs, cache.size(0));
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  auto out = at::empty({b, h, s.d_v}, q_nope.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t head_bytes = 2 * s.r * (s.d_n + s.d_v);
  const int64_t threads = at::get_num_threads();
  const int64_t g = std::max<int64_t>(
      1, std::min(kItemWeightBytes / head_bytes, (h + threads - 1) / threads));
  const bf16* qn = q_nope.data_ptr<bf16>();
  const bf16* qr = q_rope.data_ptr<bf16>();
  at::parallel_for(0, (h + g - 1) / g, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h0 = i * g, heads = std::min(g, h - h0);
      for (int64_t r = 0; r < b; ++r)
        attend_heads(s, h0, heads, qn + r * q_nope.stride(0), q_nope.stride(1),
                     qr + r * q_rope.stride(0), q_rope.stride(1), cache.data_ptr<bf16>(),
                     tables + r * s.width, lp[r], w_uk.data_ptr<bf16>(),
                     w_uv.data_ptr<bf16>(), static_cast<float>(scale),
                     out.data_ptr<bf16>() + r * h * s.d_v);
    }
  });
  return out;
}

}  // namespace pdserve
