// Causal attention of a prefill's query rows over its paged context on AVX2 + FMA, for CPUs
// without AVX512-BF16 (prefill_attention.cpp's kernel): the same flash attention (Dao et al.
// 2022, Algorithm 1) with the same contract, every product an fp32 FMA over bf16 K and V
// widened in registers.
//
// The prompt's rows are positions [start, start + n) of a context of `len` = start + n
// positions, whose K and V rows are all in the paged pool already. Row i attends to positions
// [0, start + i].
//
// Tiles. Keys go in tiles of kTile = 64 positions aligned to absolute positions. Each KV
// head's tiles are packed once per call from the pool (read in place through the block table),
// still bf16, in avx2_linear.cpp's layout: a 32-byte row holds 16 values, value 8 h + j at
// bf16 position 2 j + h, so a shift of its 32-bit lanes gives values 0..7 as fp32 and a mask
// values 8..15 (a bf16 is the top half of its fp32):
//   K tile: [4 groups of 16 keys][D][16]         one row = one dimension of 16 keys
//   V tile: [D / 16 groups of dimensions][64 keys][16]   one row = 16 dimensions of one key
// A tile is 8 KiB at D = 64 (16 KiB for K and V: fp32 tiles filled all of a 32 KiB L1 and ran
// 1.03-1.19x slower). Positions past `len` are packed as zeros (a free slot may hold NaN, and
// 0 x NaN is NaN).
//
// A work item is one KV head and kPos consecutive query positions: its G query heads at those
// positions share every K and V tile. Its rows (position-major, then head) go through a tile
// in register blocks of 6 consecutive rows, which may span positions, by 16 keys (scores) or
// 16 dimensions (o): 12 accumulators, 2 K or V vectors (one packed row) and a broadcast fill
// 15 of the 16 ymm, and each row loaded feeds 12 FMAs. (Blocks of one position's 3 heads by
// 32 keys need 17: the compiler then reloads every K and V vector for each row.) Keys past
// the block's last position are skipped: they would add exact zeros. Per key tile, each row r:
//   s_j = scale x q_r . k_j               (8 keys a vector: a broadcast of q_r[d] times K[d])
//   m'  = max(m, max_j s_j)               (keys j > pos_r are -inf)
//   p_j = exp(s_j - m'),  l' = l exp(m - m') + sum_j p_j
//   o'  = o exp(m - m') + sum_j p_j v_j   (fp32 accumulators)
// and out_r = o / l. A row takes exactly the tiles 0 .. pos_r / 64, in order, with the same
// arithmetic whatever item or step computes it: a position's output does not depend on how the
// prompt is chunked, on a prefix-cache hit, or on the rest of the step.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <utility>

#include "ops.h"
#include "paged_context.h"
#include "thread_buffer.h"
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_FMA_ATTENTION 1
#endif

namespace pdserve {

#ifdef PDSERVE_FMA_ATTENTION
namespace {

constexpr int64_t kTile = 64;              // keys per tile
constexpr int64_t kPos = 32;               // query positions per work item

// Each KV head's packed tiles (per_tile: 64 x D).
using Tiles = KVTiles<bf16>;

constexpr int64_t kGroup = 16;  // keys (K tile) or dimensions (V tile) per packed group

struct TileTag;
struct ItemTag;
using Pool = PagedContext;

inline float widen(bf16 x) { return static_cast<float>(x); }

// Index of element c (of 16) in a packed 32-byte row: 8 h + j at 2 j + h.
constexpr int64_t packed(int64_t c) { return 2 * (c % 8) + c / 8; }

void pack_tile(const Pool& pool, int64_t g, int64_t t, int64_t len, bf16* kt, bf16* vt) {
  const int64_t d = pool.d, first = t * kTile;
  const int64_t valid = std::min(kTile, len - first);
  if (valid < kTile) {
    std::fill(kt, kt + kTile * d, bf16(0.f));
    std::fill(vt, vt + kTile * d, bf16(0.f));
  }
  for (int64_t j = 0; j < valid; ++j) {
    const bf16* k_src = pool.k + pool.row(first + j, g);
    const bf16* v_src = pool.v + pool.row(first + j, g);
    bf16* k_dst = kt + (j / kGroup) * d * kGroup + packed(j % kGroup);
    for (int64_t e = 0; e < d; ++e) k_dst[e * kGroup] = k_src[e];
    for (int64_t e = 0; e < d; e += kGroup) {  // interleaving e..e+7 with e+8..e+15 packs them
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v_src + e));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v_src + e + 8));
      __m128i* dst = reinterpret_cast<__m128i*>(vt + ((e / kGroup) * kTile + j) * kGroup);
      _mm_storeu_si128(dst, _mm_unpacklo_epi16(a, b));
      _mm_storeu_si128(dst + 1, _mm_unpackhi_epi16(a, b));
    }
  }
}

// A packed row's 16 values as fp32: elements 0..7 and 8..15.
inline std::pair<__m256, __m256> unpack(const bf16* row) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(
                                                     static_cast<int32_t>(0xffff0000u))))};
}

Tiles pack(const Pool& pool, int64_t kvh, int64_t len) {
  return pack_kv_tiles<bf16, TileTag>(
      kvh, (len + kTile - 1) / kTile, kTile * pool.d, 1,
      [&](int64_t g, int64_t t, bf16* k, bf16* v) { pack_tile(pool, g, t, len, k, v); });
}

constexpr int kRows = 6;      // rows per register block: 6 x 2 accumulators (12 of 16 ymm)

// A block of R consecutive rows of an item (position-major, then head): views into the item's
// state.
struct Rows {
  const float* q;  // [R][D], widened
  float* s;        // [R][64]: scores, then their exp (scratch)
  float* o;        // [R][D]
  float* m;        // [R]
  float* l;        // [R]
  int64_t first;   // the block's first row's index in its item
  int64_t group;   // rows per position (query heads per KV head)
  int64_t base;    // the item's first position relative to the tile's first key
  int64_t keys;    // 1 + the block's last row's last key: the keys past it are -inf for every row

  // row r's last key in the tile (relative to its start): its position, capped at the tile
  int64_t last(int r) const { return std::min(kTile - 1, base + (first + r) / group); }
};

// s[r][0..64) = scale x q_r . k_j over one K tile; keys past row r's `last` are -inf.
// Each K row loaded feeds the R rows' FMAs (1 load and R broadcasts per 2 R FMAs). Keys
// that are -inf for every row are not computed (they would add exact zeros in `update`).
template <int R>
void scores(Rows& rows, const bf16* kt, int64_t d, float scale) {
  for (int64_t c0 = 0; c0 < rows.keys; c0 += kGroup) {
    const bf16* group = kt + c0 * d;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const auto [lo, hi] = unpack(group + e * kGroup);  // keys c0 + 0..7, c0 + 8..15
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(rows.q + r * d + e);
        acc[r][0] = _mm256_fmadd_ps(a, lo, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, hi, acc[r][1]);
      }
    }
    const __m256 sv = _mm256_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(rows.s + r * kTile + c0, _mm256_mul_ps(acc[r][0], sv));
      _mm256_storeu_ps(rows.s + r * kTile + c0 + 8, _mm256_mul_ps(acc[r][1], sv));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = rows.last(r) + 1; j < kTile; ++j)
      rows.s[r * kTile + j] = -std::numeric_limits<float>::infinity();
}

// Each row's online-softmax update over one tile: m, l and o in place.
template <int R>
void update(Rows& rows, const bf16* vt, int64_t d) {
  float alpha[R];
  const int64_t vecs = (rows.keys + kVec - 1) / kVec;  // the rest are -inf: p = 0
  for (int r = 0; r < R; ++r) {
    float* s = rows.s + r * kTile;
    Vec mv(-std::numeric_limits<float>::infinity());
    for (int64_t v = 0; v < vecs; ++v) mv = at::vec::maximum(mv, Vec::loadu(s + v * kVec));
    const float m_new = std::max(rows.m[r], max_lane(mv));
    // 0 on the first tile (m = -inf); exactly 1 while the maximum holds
    alpha[r] = m_new == rows.m[r] ? 1.f : std::exp(rows.m[r] - m_new);
    const Vec mn(m_new);
    Vec total(0.f);
    for (int64_t v = 0; v < vecs; ++v) {
      const Vec p = (Vec::loadu(s + v * kVec) - mn).exp_u20();
      p.store(s + v * kVec);
      total = total + p;
    }
    rows.l[r] = rows.l[r] * alpha[r] + sum(total);
    rows.m[r] = m_new;
  }
  for (int64_t e0 = 0; e0 < d; e0 += kGroup) {  // 16 dimensions of o at a time
    const bf16* group = vt + e0 * kTile;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_set1_ps(alpha[r]);
      acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(rows.o + r * d + e0), av);
      acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(rows.o + r * d + e0 + 8), av);
    }
    for (int64_t j = 0; j < rows.keys; ++j) {
      const auto [lo, hi] = unpack(group + j * kGroup);  // dimensions e0 + 0..7, e0 + 8..15
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_broadcast_ss(rows.s + r * kTile + j);
        acc[r][0] = _mm256_fmadd_ps(p, lo, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(p, hi, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(rows.o + r * d + e0, acc[r][0]);
      _mm256_storeu_ps(rows.o + r * d + e0 + 8, acc[r][1]);
    }
  }
}

template <int R>
void attend_tile(Rows& rows, const bf16* kt, const bf16* vt, int64_t d, float scale) {
  scores<R>(rows, kt, d, scale);
  update<R>(rows, vt, d);
}

using TileFn = void (*)(Rows&, const bf16*, const bf16*, int64_t, float);
template <int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table(std::integer_sequence<int, R...>) {
  return {&attend_tile<R + 1>...};
}

constexpr auto kTileFns = tile_table(std::make_integer_sequence<int, kRows>{});

// The rows of KV head g at query positions [first, first + kPos) (those < n), tile by tile:
// each tile is read once for all of the item's rows that attend to it (from L1/L2 after the
// first row block), and each row still takes its tiles 0 .. pos / 64 in order. A register
// block may span positions: rows are independent, so a row's arithmetic is the same in any
// block.
void attend_item(int64_t g, int64_t first, const at::Tensor& q, int64_t start, int64_t n,
                 int64_t group, float scale, const Tiles& tiles, bf16* out, int64_t heads) {
  const int64_t d = q.size(2), positions = std::min(kPos, n - first);
  const int64_t count = positions * group;  // rows: position-major, then head
  float* qs = thread_buffer<float, ItemTag>(count * (2 * d + 2) + kRows * kTile);
  float* os = qs + count * d;
  float* ms = os + count * d;
  float* ls = ms + count;
  float* s = ls + count;
  const bf16* qp = q.data_ptr<bf16>();
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const bf16* src = qp + (first + i) * q.stride(0) + (g * group + h) * q.stride(1);
      float* dst = qs + (i * group + h) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = widen(src[e]);
    }
  std::fill(os, os + count * d, 0.f);
  std::fill(ms, ms + count, -std::numeric_limits<float>::infinity());
  std::fill(ls, ls + count, 0.f);
  const int64_t last_tile = (start + first + positions - 1) / kTile;
  for (int64_t t = 0; t <= last_tile; ++t) {
    const bf16* kt = tiles.k_tile(g, t);
    const bf16* vt = tiles.v_tile(g, t);
    // the item's positions whose last tile is behind are its first ones
    const int64_t i0 = std::max<int64_t>(0, t * kTile - start - first);
    for (int64_t r0 = i0 * group; r0 < count; r0 += kRows) {
      const int r = static_cast<int>(std::min<int64_t>(kRows, count - r0));
      Rows rows{qs + r0 * d, s, os + r0 * d, ms + r0, ls + r0, r0, group,
                start + first - t * kTile, 0};
      rows.keys = rows.last(r - 1) + 1;  // positions ascend: the block's last row has most keys
      kTileFns[r - 1](rows, kt, vt, d, scale);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t i = r / group, h = r % group;
    const Vec inv(1.f / ls[r]);
    bf16* dst = out + ((first + i) * heads + g * group + h) * d;
    const float* o = os + r * d;
    for (int64_t e = 0; e < d; e += kBVec)
      store_bf16(dst + e, Vec::loadu(o + e) * inv, Vec::loadu(o + e + kVec) * inv);
  }
}

}  // namespace

bool prefill_attention_fma_available() { return true; }

at::Tensor prefill_attention_fma(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale) {
  return prefill_by_items(q, k_cache, v_cache, block_table, context_len, kPos, pack,
                          [&](const Tiles& tiles, int64_t g, int64_t first, int64_t start,
                              int64_t group, bf16* out) {
                            attend_item(g, first, q, start, q.size(0), group,
                                        static_cast<float>(scale), tiles, out, q.size(1));
                          });
}

#else  // compiled for a CPU without AVX2 and FMA

bool prefill_attention_fma_available() { return false; }

at::Tensor prefill_attention_fma(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, double) {
  TORCH_CHECK(false, "prefill_attention needs AVX512-BF16 or AVX2 and FMA in this build");
}

#endif

}  // namespace pdserve
