// Causal attention of a prefill's query rows over its paged context, on AVX512-BF16's
// VDPBF16PS: flash attention (Dao et al. 2022, "FlashAttention", Algorithm 1) on CPU tiles.
//
// The prompt's rows are positions [start, start + n) of a context of `len` = start + n
// positions, all of whose K and V rows are already in the paged pool (this step's were stored
// first). Row i attends to positions [0, start + i] (causal).
//
// Tiles. Keys go in tiles of kTile = 64 positions aligned to absolute positions (tile t is
// [64 t, 64 t + 64)). Each KV head's tiles are packed once per call from the pool, read in
// place through the block table (no gathered copy of the context), into VDPBF16PS order:
//   K tile: [D/2 pairs][64 keys][2]   one vector = one dimension pair of 16 keys
//   V tile: [32 key pairs][D][2]      one vector = one key pair of 16 dimensions
// Positions past `len` are packed as zeros (the pool's free slots may hold anything, NaN
// included, and 0 x NaN is NaN).
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
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "ops.h"
#include "paged_context.h"
#include "thread_buffer.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_DPBF16 1
#endif

namespace pdserve {

#ifdef PDSERVE_DPBF16
namespace {

constexpr int64_t kTile = 64;  // keys per tile: 4 vectors of 16 fp32 scores
constexpr int64_t kPos = 32;   // query positions per work item
constexpr int kRows = 6;       // rows per register block: 6 x 4 accumulators (24 of 32 zmm)

// The KV heads' packed tiles: tile t of head g at (g * tiles + t) * tile_pairs. The buffer is
// the calling thread's, kept between calls: a fresh multi-MiB allocation costs its page faults
// on every call (about as much as packing a 4,096-token context).
struct Packed {
  uint32_t* k = nullptr;  // bf16 pairs
  uint32_t* v = nullptr;
  int64_t tiles = 0, tile_pairs = 0;  // tile_pairs: uint32 per tile (64 x D / 2)

  const uint32_t* k_tile(int64_t g, int64_t t) const { return k + (g * tiles + t) * tile_pairs; }
  const uint32_t* v_tile(int64_t g, int64_t t) const { return v + (g * tiles + t) * tile_pairs; }
};

struct PackTag;
using Pool = PagedContext;

// 16 x 16 32-bit transpose in registers: out[c] lane i = r[i] lane c. Within each 128-bit lane
// L (columns 4L .. 4L + 3), unpacking 32 then 64-bit elements transposes the 4 x 4 blocks of
// rows 4k .. 4k + 3; u[4k + m] then holds, in lane L, those rows' column 4L + e(m), with
// e = (0, 2, 1, 3). Output row 4L + e(m) is lane L of u[m], u[4 + m], u[8 + m], u[12 + m]: a
// 4 x 4 transpose of 128-bit lanes, two rounds of lane shuffles.
void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16];
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  for (int k = 0; k < 16; k += 4) {
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);          // column 0 of the lane
    u[k + 1] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);  // column 2
    u[k + 2] = _mm512_unpackhi_epi64(t[k], t[k + 2]);      // column 1
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);  // column 3
  }
  constexpr int kColumn[4] = {0, 2, 1, 3};
  for (int m = 0; m < 4; ++m) {
    const __m512i s0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);  // A.L0 A.L2 B.L0 B.L2
    const __m512i s1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);  // A.L1 A.L3 B.L1 B.L3
    const __m512i s2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);
    const __m512i s3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
    const int e = kColumn[m];
    out[e] = _mm512_shuffle_i32x4(s0, s2, 0x88);       // lane 0 of A, B, C, D
    out[8 + e] = _mm512_shuffle_i32x4(s0, s2, 0xdd);   // lane 2
    out[4 + e] = _mm512_shuffle_i32x4(s1, s3, 0x88);   // lane 1
    out[12 + e] = _mm512_shuffle_i32x4(s1, s3, 0xdd);  // lane 3
  }
}

// Packs tile t of KV head g (see the file comment), zeros past len.
void pack_tile(const Pool& pool, int64_t g, int64_t t, int64_t len, uint32_t* kt, uint32_t* vt) {
  const int64_t d = pool.d, first = t * kTile;
  const int64_t valid = std::min(kTile, len - first);
  const __m512i zero = _mm512_setzero_si512();
  // K: 16 keys x 16 dimension pairs at a time, transposed to [pair][key]
  for (int64_t j0 = 0; j0 < kTile; j0 += 16)
    for (int64_t p0 = 0; p0 < d / 2; p0 += 16) {
      __m512i r[16], c[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j0 + j < valid ? _mm512_loadu_si512(pool.k + pool.row(first + j0 + j, g) + 2 * p0)
                              : zero;
      transpose16(r, c);
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kt + (p0 + p) * kTile + j0, c[p]);
    }
  // V: rows 2j and 2j + 1 interleaved element by element, 32 dimensions at a time
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < kTile; j += 2) {
    const bf16* a = j < valid ? pool.v + pool.row(first + j, g) : nullptr;
    const bf16* b = j + 1 < valid ? pool.v + pool.row(first + j + 1, g) : nullptr;
    uint32_t* out = vt + (j / 2) * d;
    for (int64_t e = 0; e < d; e += 32) {
      const __m512i x = a ? _mm512_loadu_si512(a + e) : zero;
      const __m512i y = b ? _mm512_loadu_si512(b + e) : zero;
      _mm512_storeu_si512(out + e, _mm512_permutex2var_epi16(x, lo, y));
      _mm512_storeu_si512(out + e + 16, _mm512_permutex2var_epi16(x, hi, y));
    }
  }
}

Packed pack(const Pool& pool, int64_t kvh, int64_t len) {
  Packed out;
  out.tiles = (len + kTile - 1) / kTile;
  out.tile_pairs = kTile * pool.d / 2;
  const int64_t count = kvh * out.tiles * out.tile_pairs;
  out.k = thread_buffer<uint32_t, PackTag>(2 * count);
  out.v = out.k + count;
  at::parallel_for(0, kvh * out.tiles, 4, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / out.tiles, t = i % out.tiles;
      pack_tile(pool, g, t, len, out.k + i * out.tile_pairs, out.v + i * out.tile_pairs);
    }
  });
  return out;
}

// s[r][0..64) = scale x (q_r . k_j) for R rows: q rows as bf16 pairs, `half` apart (one base
// address and constant offsets: no pointer per row to keep in a register), kt a packed K tile.
template <int R>
void scores(const uint32_t* q, int64_t half, const uint32_t* kt, float scale, float* s) {
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
  const __m512 sv = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kTile + c * 16, acc[r][c] * sv);
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

void scores_rows(const uint32_t* q, int64_t n, int64_t half, const uint32_t* kt,
                 float scale, float* s) {
  switch (n) {
    case 6: return scores<6>(q, half, kt, scale, s);
    case 5: return scores<5>(q, half, kt, scale, s);
    case 4: return scores<4>(q, half, kt, scale, s);
    case 3: return scores<3>(q, half, kt, scale, s);
    case 2: return scores<2>(q, half, kt, scale, s);
    default: return scores<1>(q, half, kt, scale, s);
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

// exp(x) for x <= 0 (a score less the row's maximum; -inf gives 0) as 2^y, y = x log2(e):
// n = round(y), f = y - n in [-1/2, 1/2], 2^f = e^(f ln 2) by its Taylor series to degree 5
// (relative error below (ln 2 / 2)^6 / 6! = 2.4e-6, far under the bf16 rounding of the
// weights, 2^-9), and VSCALEFPS multiplies by 2^n, flushing to 0 below fp32's range. About
// half the instructions of ATen's exp_u20, which guards the whole float range.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));  // log2(e)
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 t = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147181f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 120);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One row's online-softmax update for one tile (see the file comment): s [64] scores with
// keys >= `valid` masked; writes p [64] bf16, returns alpha = exp(m - m') and updates m, l.
float softmax_tile(const float* s, int64_t valid, float& m, float& l, uint32_t* p) {
  __m512 x[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t keep = std::clamp<int64_t>(valid - c * 16, 0, 16);
    const __mmask16 k = static_cast<__mmask16>((1u << keep) - 1u);
    x[c] = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), k,
                                s + c * 16);
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]),
                                                       _mm512_max_ps(x[2], x[3])));
  const float next = std::max(m, top);
  // 0 on the first tile (m = -inf); exactly 1 while the maximum holds
  const float alpha = next == m ? 1.f : std::exp(m - next);
  const __m512 mv = _mm512_set1_ps(next);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < 4; c += 2) {
    const int64_t keep0 = std::clamp<int64_t>(valid - c * 16, 0, 16);
    const int64_t keep1 = std::clamp<int64_t>(valid - c * 16 - 16, 0, 16);
    const __m512 e0 = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << keep0) - 1u),
                                          exp_nonpositive(_mm512_sub_ps(x[c], mv)));
    const __m512 e1 = _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << keep1) - 1u),
                                          exp_nonpositive(_mm512_sub_ps(x[c + 1], mv)));
    const __m512bh pb = _mm512_cvtne2ps_pbh(e1, e0);  // [e0 | e1] rounded to bf16
    _mm512_storeu_si512(p + c * 8, (__m512i)pb);
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
  }
  m = next;
  l = l * alpha + _mm512_reduce_add_ps(sum);
  return alpha;
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
  const bf16* qp = q.data_ptr<bf16>();
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      std::memcpy(&qrows[r * half],
                  qp + (it.first + i) * q.stride(0) + (it.g * group + h) * q.stride(1),
                  d * sizeof(bf16));
      limit[r] = start + it.first + i + 1;
    }
  const int64_t tiles = (start + it.first + positions + kTile - 1) / kTile;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t first_key = t * kTile;
    // rows whose causal limit starts after this tile: position-major, so a prefix of them
    // is done (limit <= first_key); the rest take the tile
    int64_t skip = 0;
    while (skip < rows && limit[skip] <= first_key) ++skip;
    const int64_t live = rows - skip;
    by_rows(live, [&](int64_t r, int64_t c) {
      scores_rows(&qrows[(skip + r) * half], c, half, packed.k_tile(it.g, t), scale,
                  &s[(skip + r) * kTile]);
    });
    for (int64_t r = skip; r < rows; ++r)
      alpha[r] = softmax_tile(&s[r * kTile], std::min(kTile, limit[r] - first_key), m[r], l[r],
                              &p[r * kTile / 2]);
    for (int64_t c0 = 0; c0 < d; c0 += kTile)  // 4 vectors of 16 dimensions at a time
      by_rows(live, [&](int64_t r, int64_t c) {
        accumulate_rows(&p[(skip + r) * kTile / 2], c, packed.v_tile(it.g, t), d, c0,
                        &alpha[skip + r], &o[(skip + r) * d]);
      });
  }
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      const Vec inv(1.f / l[r]);
      bf16* dst = out + ((it.first + i) * heads + it.g * group + h) * d;
      for (int64_t e = 0; e < d; e += kBVec)
        store_bf16(dst + e, Vec::loadu(&o[r * d + e]) * inv,
                   Vec::loadu(&o[r * d + e + kVec]) * inv);
    }
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

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_table,
                             int64_t context_len, double scale) {
#ifdef PDSERVE_DPBF16
  const int64_t* table = check_prefill_args(q, k_cache, v_cache, block_table, context_len);
  const int64_t n = q.size(0), h = q.size(1), d = q.size(2), kvh = k_cache.size(2);
  const Packed packed = pack(paged_context(k_cache, v_cache, table), kvh, context_len);
  auto out = at::empty({n, h, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  bf16* op = out.data_ptr<bf16>();
  const int64_t start = context_len - n, group = h / kvh;
  for_each_item(kvh, n, kPos, [&](int64_t g, int64_t first) {
    attend_item(Item{g, first}, q, start, n, group, static_cast<float>(scale), packed, op, h);
  });
  return out;
#else
  return prefill_attention_fma(q, k_cache, v_cache, block_table, context_len, scale);
#endif
}

}  // namespace pdserve
