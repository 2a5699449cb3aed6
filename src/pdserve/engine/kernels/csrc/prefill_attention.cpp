// Causal attention of a prefill's query rows over its paged context, on AVX512-BF16's
// VDPBF16PS (prefill_attention_dpbf16; prefill_attention, which picks the kernel, is at the
// end): flash attention (Dao et al. 2022, "FlashAttention", Algorithm 1) on CPU tiles.
//
// The prompt's rows are positions [start, start + n) of a context of `len` = start + n
// positions, all of whose K and V rows are already in the paged pool (this step's were stored
// first). Row i attends to positions [0, start + i] (causal).
//
// Tiles. Keys go in tiles of 64 positions aligned to absolute positions, each KV head's packed
// once per call from the pool into VDPBF16PS order (prefill_tiles.h).
//
// A work item is one KV head and kPos consecutive query positions: its G query heads at those
// positions are G x kPos rows, which share every K and V tile (grouped-query attention reads
// each KV tile once for its G heads). Per key tile, each row r:
//   s_j   = scale x q_r . k_j                          (fp32 sums of bf16 products)
//   m'    = max(m, max_j s_j)                          (masked keys j > pos_r count as -inf)
//   p_j   = exp(s_j - m'),  rounded to bf16            (the weights multiply V in bf16)
//   l'    = l x exp(m - m') + sum_j p_j                (fp32 sums of the unrounded p_j)
//   o'    = o x exp(m - m') + sum_j p_j v_j            (fp32 accumulators)
// and at the end out_r = o / l. A row takes exactly the tiles 0 .. (pos_r / 64), in order,
// with the same arithmetic whatever item, block or step it is computed in: a position's output
// does not depend on how the prompt is chunked, on a prefix-cache hit, or on what else is in
// the step (chunked prefill gives the same tokens as a whole-prompt prefill).
//
// Items are taken longest first (the last positions attend to the most keys) from a shared
// counter, so the threads finish together under the causal triangle.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "ops.h"
#include "paged_context.h"
#include "prefill_tiles.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#define PDSERVE_DPBF16 1
#endif

namespace pdserve {

#ifdef PDSERVE_DPBF16
namespace {

using namespace prefill_tiles;

constexpr int64_t kPos = 32;   // query positions per work item
constexpr int kRows = 6;       // rows per register block: 6 x 4 accumulators (24 of 32 zmm)

// s[r][0..64) = q_r . k_j for R rows: q rows as bf16 pairs, `half` apart (one base
// address and constant offsets: no pointer per row to keep in a register), kt a packed K tile.
template <int R>
void scores(const uint32_t* q, int64_t half, const uint32_t* kt, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < half; ++p) {
    __m512bh b[4];
    for (int c = 0; c < 4; ++c) b[c] = (__m512bh)_mm512_loadu_si512(kt + p * kTile + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * half + p]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kTile + c * 16, acc[r][c]);
}

// o[r][c0 .. c0 + 64) = o x alpha[r] + sum_j p[r][j] v_j over a tile, for R rows: p rows as
// bf16 pairs (32 key pairs, rows 32 apart), vt a packed V tile, o rows `d` floats apart.
template <int R>
void accumulate(const uint32_t* p, const uint32_t* vt, int64_t d, int64_t c0,
                const float* alpha, float* o) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      acc[r][c] = _mm512_loadu_ps(o + r * d + c0 + c * 16) * _mm512_set1_ps(alpha[r]);
  for (int64_t j = 0; j < kTile / 2; ++j) {
    __m512bh b[4];
    for (int c = 0; c < 4; ++c)
      b[c] = (__m512bh)_mm512_loadu_si512(vt + j * d + c0 + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[r * kTile / 2 + j]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * d + c0 + c * 16, acc[r][c]);
}

template <typename F>
void by_rows(int64_t rows, F f) {  // f(first, count) over register blocks of kRows
  for (int64_t r = 0; r < rows; r += kRows) f(r, std::min<int64_t>(kRows, rows - r));
}

void scores_rows(const uint32_t* q, int64_t n, int64_t half, const uint32_t* kt, float* s) {
  switch (n) {
    case 6: return scores<6>(q, half, kt, s);
    case 5: return scores<5>(q, half, kt, s);
    case 4: return scores<4>(q, half, kt, s);
    case 3: return scores<3>(q, half, kt, s);
    case 2: return scores<2>(q, half, kt, s);
    default: return scores<1>(q, half, kt, s);
  }
}

void accumulate_rows(const uint32_t* p, int64_t n, const uint32_t* vt, int64_t d,
                     int64_t c0, const float* alpha, float* o) {
  switch (n) {
    case 6: return accumulate<6>(p, vt, d, c0, alpha, o);
    case 5: return accumulate<5>(p, vt, d, c0, alpha, o);
    case 4: return accumulate<4>(p, vt, d, c0, alpha, o);
    case 3: return accumulate<3>(p, vt, d, c0, alpha, o);
    case 2: return accumulate<2>(p, vt, d, c0, alpha, o);
    default: return accumulate<1>(p, vt, d, c0, alpha, o);
  }
}


struct Item {
  int64_t g, first;  // KV head; first query row (of the n this call computes)
};

// The rows of one item: G heads x up to kPos positions, position-major.
void attend_item(const Item& it, const at::Tensor& q, int64_t start, int64_t n, int64_t group,
                 float scale, const Packed& packed, bf16* out, int64_t heads) {
  const int64_t d = q.size(2), half = d / 2;
  const int64_t positions = std::min(kPos, n - it.first), rows = positions * group;
  std::vector<uint32_t> qrows(rows * half), p(rows * kTile / 2);  // bf16 pairs, row-major
  std::vector<float> s(rows * kTile), o(rows * d, 0.f), m(rows), l(rows, 0.f), alpha(rows);
  std::vector<int64_t> limit(rows);  // keys each row attends: pos + 1
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  gather_rows(q, it.first, positions, it.g, group, start, qrows.data(), limit.data());
  const int64_t tiles = (start + it.first + positions + kTile - 1) / kTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first_key = t * kTile;
    // rows whose causal limit starts after this tile: position-major, so a prefix of them
    // is done (limit <= first_key); the rest take the tile
    int64_t skip = 0;
    while (skip < rows && limit[skip] <= first_key) ++skip;
    const int64_t live = rows - skip;
    by_rows(live, [&](int64_t r, int64_t c) {
      scores_rows(&qrows[(skip + r) * half], c, half, packed.k_tile(it.g, t),
                  &s[(skip + r) * kTile]);
    });
    for (int64_t r = skip; r < rows; ++r)
      alpha[r] = softmax_tile(&s[r * kTile], std::min(kTile, limit[r] - first_key), scale, m[r],
                              l[r], &p[r * kTile / 2]);
    for (int64_t c0 = 0; c0 < d; c0 += kTile)  // 4 vectors of 16 dimensions at a time
      by_rows(live, [&](int64_t r, int64_t c) {
        accumulate_rows(&p[(skip + r) * kTile / 2], c, packed.v_tile(it.g, t), d, c0,
                        &alpha[skip + r], &o[(skip + r) * d]);
      });
  }
  emit_rows(o.data(), l.data(), it.first, positions, it.g, group, d, heads, out);
}

}  // namespace
#endif

bool prefill_attention_available() {
#ifdef PDSERVE_DPBF16
  return true;
#else
  return prefill_attention_fma_available();
#endif
}

std::string prefill_attention_kernel() {
#ifdef PDSERVE_DPBF16
  return amx_available() ? "amx" : "avx512_bf16";
#else
  return prefill_attention_fma_available() ? "avx2" : "";
#endif
}

const int64_t* check_prefill_args(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  int64_t context_len) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "q must be bf16 [n, H, D] with contiguous heads");
  check_kv_cache(k_cache, v_cache);
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "k_cache and v_cache must be bf16");
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t bs = k_cache.size(1), kvh = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % kvh == 0, "q and the cache disagree on heads");
  TORCH_CHECK(d % 64 == 0, "prefill_attention supports head sizes that are multiples of 64, not ",
              d);
  TORCH_CHECK(n > 0 && context_len >= n, "context_len ", context_len, " < ", n, " query rows");
  TORCH_CHECK(block_table.dim() == 1 && block_table.is_contiguous() &&
                  block_table.scalar_type() == at::kLong &&
                  block_table.numel() * bs >= context_len,
              "block_table must be contiguous int64 covering context_len positions");
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (context_len + bs - 1) / bs; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < k_cache.size(0), "block id ", table[i],
                " is outside the pool");
  return table;
}

at::Tensor prefill_attention_dpbf16(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& block_table,
                                    int64_t context_len, double scale) {
#ifdef PDSERVE_DPBF16
  return prefill_by_items(q, k_cache, v_cache, block_table, context_len, kPos, pack,
                          [&](const Packed& packed, int64_t g, int64_t first, int64_t start,
                              int64_t group, bf16* out) {
                            attend_item(Item{g, first}, q, start, q.size(0), group,
                                        static_cast<float>(scale), packed, out, q.size(1));
                          });
#else
  TORCH_CHECK(false, "built without AVX512-BF16");
#endif
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t context_len, double scale) {
#ifdef PDSERVE_DPBF16
  if (amx_available())
    return prefill_attention_amx(q, k_cache, v_cache, block_table, context_len, scale);
  return prefill_attention_dpbf16(q, k_cache, v_cache, block_table, context_len, scale);
#else
  return prefill_attention_fma(q, k_cache, v_cache, block_table, context_len, scale);
#endif
}

}  // namespace pdserve
