// prefill_attention's kernel on Intel AMX tiles (Sapphire Rapids and later): the flash
// attention of prefill_attention.cpp (its file comment: per block of keys, a row's scores,
// online softmax, bf16 weights times V), with both products on TDPBF16PS and the scores
// transposed so that the softmax runs down the lanes.
//
// Tile algebra (Intel SDM vol. 1 ch. 20): TDPBF16PS C[16 x 16 fp32] += A[16 x 32 bf16] . B,
// B one 1 KiB tile of 16 pairs x 16 columns x 2 bf16; row i of C depends on row i of A and
// column j on column j of B only. A block of 16 query rows (a vector's lanes) goes through
// its keys in steps of 32 (D = 64) or 64 keys:
//   scores   S^T [32 keys x 16 queries] = K . Q^T per 32 keys: A = 16 keys' rows (32
//            dimensions), B = 16 dimension pairs of the 16 queries; C tiles 4-5, stored for
//            the vectors;
//   softmax  one vector per key, a query per lane: the maximum, exp and sum run across
//            vectors (no horizontal reductions); p is rounded to bf16 in key pairs, P^T;
//   values   O^T [D x 16 queries] += V^T . P^T per 32 keys: A = 16 dimensions' rows of V^T,
//            B = P^T (16 key pairs of the 16 queries), C tiles 0-3 per 64 dimensions.
// At D = 64, O^T stays in tiles 0-3 and Q^T in tiles 4-5 from the block's first key to its
// last (a round trip of O^T through memory per step was a fifth of the kernel's time; Q^T
// reloaded per step, two of its eleven tile loads, ran 0.90-0.94x at 1,500-4,096 tokens); the
// scores go through tile 6, 16 keys at a time (K rows in tile 7), and the values' products
// take V^T in tile 6 and P^T in tile 7. At larger D, O^T goes through memory once per step of
// 64 keys, C tiles 4-5 take the scores, and tiles 6 (A) and 7 (B) carry the operands. The next
// step's scores are issued before this step's softmax, so that the tile unit works while the
// vector units take the exponentials.
//
// Per query (a lane), with c = scale x log2(e) and a reference maximum m that moves lazily:
//   t  = max_j s_j over the step               (raw dot products; keys j > pos masked)
//   m' = t where c (t - m) > kSlack or m = -inf, else m   (p_j <= 2^kSlack: no overflow)
//   p_j = 2^(c s_j - c m'), rounded to bf16;   l' = l x 2^(c m - c m') + sum_j p_j (unrounded)
//   o' = o x 2^(c m - c m') + sum_j p_j v_j,   and at the end out = o / l
// (FlashAttention's online softmax, Dao et al. 2022, with the rescaling skipped while the
// maximum rises by less than kSlack, as FlashAttention-4 does on GPUs). A query's lane takes
// the keys 0 .. pos in steps aligned to absolute positions, with arithmetic that depends on
// its own lane only (masked keys add exact zeros): a position's output does not depend on
// chunking, prefix-cache hits or batching (it differs from the VDPBF16PS kernel's in the last
// bits; a CPU always takes the same kernel).
//
// Packing, once per call and KV head (read in place from the pool through the block table,
// zeros past the context: a free slot may hold NaN, and 0 x NaN is NaN), per 64 keys:
//   K tile   [4][D/32][16 keys][32] bf16    (A rows: a key's 32 dimensions, 1 KiB a tile)
//   V^T tile [2 halves][D][32 keys] bf16    (A rows: a dimension's keys in a step, 64 B)
// A work item is one KV head and kPos positions, its G query heads' rows (position-major)
// sharing every tile, Q^T [row blocks][D/2 pairs][16 rows] gathered once per item: every
// operand tile is 1 KiB contiguous. The tile configuration is per thread: each item loads it
// and releases the tiles at its end.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "ops.h"
#include "paged_context.h"
#include "prefill_tiles.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_AMX_ATTENTION 1
#endif

namespace pdserve {

#ifdef PDSERVE_AMX_ATTENTION
namespace {

constexpr int64_t kTile = 64;   // keys per packed tile
constexpr int64_t kStep = 32;   // keys per pass of scores (two C tiles); a step takes 1 or 2
constexpr int64_t kPos = 32;    // query positions per work item
constexpr int64_t kBlock = 16;  // query rows per block: the lanes of a vector
constexpr int64_t kTileBf16 = 16 * 32;   // bf16 in a 1 KiB operand tile (16 rows x 64 bytes)
constexpr int64_t kTilePairs = 16 * 16;  // the same tile as bf16 pairs (Q^T's elements)
constexpr int64_t kResidentD = 64;  // the head size whose Q^T and O^T stay in tiles
// How far (log2 units) a lane's maximum may rise above the one its weights use before O is
// rescaled: p <= 2^8, far inside fp32 and bf16.
constexpr float kSlack = 8.f;
// A step's weights that sum to at most 2^(kSlack - 1) are each below it: no reference moves.
constexpr float kSettled = 128.f;

void configure() {  // tiles 0-7 of 16 rows x 64 bytes
  const TileConfig cfg;
  load_tile_config(cfg);
}

// The KV heads' tiles (per_tile: 64 x D bf16), K and V^T alike (the file comment).
using Tiles = KVTiles<bf16>;

struct TilesTag;

// Where keys [16 b, 16 b + 16) x dimensions [32 kc, 32 kc + 32) of a K tile start: each such
// A tile's 1 KiB contiguous (loaded from [64 keys][D] rows it read 16 lines 2 D bytes apart).
inline int64_t k_rows(int64_t b, int64_t kc, int64_t d) {
  return (b * (d / 32) + kc) * kTileBf16;
}

// Tile t of KV head g: K copied a key's 32 dimensions at a time to its A tile (k_rows); V
// transposed 16 keys x 32 dimensions at a time (a 32-bit transpose of dimension pairs, then
// each vector's pairs split into its two dimensions' rows, which go to the half of the tile
// their keys are in).
void pack_tile(const PagedContext& pool, int64_t g, int64_t t, int64_t len, bf16* kt, bf16* vt) {
  const int64_t d = pool.d, first = t * kTile;
  const int64_t valid = std::min(kTile, len - first);
  for (int64_t j = 0; j < kTile; ++j)
    for (int64_t e0 = 0; e0 < d; e0 += 32) {
      bf16* dst = kt + k_rows(j / 16, e0 / 32, d) + j % 16 * 32;
      if (j < valid)
        std::memcpy(dst, pool.k + pool.row(first + j, g) + e0, 32 * sizeof(bf16));
      else
        std::memset(dst, 0, 32 * sizeof(bf16));
    }
  // 16-bit index: even elements (the first dimension of each pair) to the low half
  alignas(64) int16_t index[32];
  for (int i = 0; i < 16; ++i) {
    index[i] = static_cast<int16_t>(2 * i);
    index[16 + i] = static_cast<int16_t>(2 * i + 1);
  }
  const __m512i split = _mm512_load_si512(index);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j0 = 0; j0 < kTile; j0 += 16)
    for (int64_t e0 = 0; e0 < d; e0 += 32) {
      __m512i r[16], c[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j0 + j < valid ? _mm512_loadu_si512(pool.v + pool.row(first + j0 + j, g) + e0)
                              : zero;
      // c[p] lane i: key j0 + i, dimensions e0 + 2p and e0 + 2p + 1
      prefill_tiles::transpose16(r, c);
      for (int64_t p = 0; p < 16; ++p) {
        const __m512i rows = _mm512_permutexvar_epi16(split, c[p]);
        bf16* row = vt + (j0 / kStep * d + e0 + 2 * p) * kStep + j0 % kStep;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), _mm512_castsi512_si256(rows));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + kStep),
                            _mm512_extracti64x4_epi64(rows, 1));
      }
    }
}

Tiles pack(const PagedContext& pool, int64_t kvh, int64_t len) {
  return pack_kv_tiles<bf16, TilesTag>(
      kvh, (len + kTile - 1) / kTile, kTile * pool.d, 4,
      [&](int64_t g, int64_t t, bf16* k, bf16* v) { pack_tile(pool, g, t, len, k, v); });
}

// C tiles 0-3 to / from 64 rows of 16 floats at c, tile i at c + i x rows16 floats.
void store_c(float* c, int64_t rows16, int64_t stride) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + rows16, stride);
  _tile_stored(2, c + 2 * rows16, stride);
  _tile_stored(3, c + 3 * rows16, stride);
}

void load_c(const float* c, int64_t rows16, int64_t stride) {
  _tile_loadd(0, c, stride);
  _tile_loadd(1, c + rows16, stride);
  _tile_loadd(2, c + 2 * rows16, stride);
  _tile_loadd(3, c + 3 * rows16, stride);
}

// C tiles 0-3 += the V^T rows of dimensions e0 .. e0 + 64 over a step's 32 keys (A, tile 6,
// rows 64 B apart) . P^T (B, tile 7, loaded by the caller).
void step_values(const bf16* vt) {
  _tile_loadd(6, vt, kStep * 2);
  _tile_dpbf16ps(0, 6, 7);
  _tile_loadd(6, vt + 16 * kStep, kStep * 2);
  _tile_dpbf16ps(1, 6, 7);
  _tile_loadd(6, vt + 32 * kStep, kStep * 2);
  _tile_dpbf16ps(2, 6, 7);
  _tile_loadd(6, vt + 48 * kStep, kStep * 2);
  _tile_dpbf16ps(3, 6, 7);
}

// 2^y for the weights' exponents, y <= kSlack (finite; masked lanes are the caller's): n =
// round(y), f = y - n in [-1/2, 1/2], 2^f by a degree-3 polynomial fitted for least maximum
// relative error on that interval (1.0e-4, a twentieth of the bf16 rounding of the weights,
// 2^-9), times 2^n by VSCALEFPS (0 below fp32's range).
inline __m512 exp2_weights(__m512 y) {
  const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, n);
  __m512 p = _mm512_set1_ps(5.50089292e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.42210959e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93282902e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The lanes that attend key `key`: those whose limit (keys attended) is past it.
inline __mmask16 keep_key(int64_t key, __m512i limit) {
  return _mm512_cmplt_epi32_mask(_mm512_set1_epi32(static_cast<int>(key)), limit);
}

// A step's weights against the reference maxima cm (c x m per lane): p [kKeys / 2 key
// pairs][16] bf16 pairs of 2^(c s - cm), keys at or past a lane's limit zero (none when
// kWhole); returns their sum per lane.
template <bool kWhole, int64_t kKeys>
__m512 weights(const float* s, int64_t first_key, __m512i limit, __m512 cv, __m512 cm,
               uint32_t* p) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kKeys; j += 2) {
    __m512 e0 = exp2_weights(_mm512_fmsub_ps(_mm512_loadu_ps(s + j * 16), cv, cm));
    __m512 e1 = exp2_weights(_mm512_fmsub_ps(_mm512_loadu_ps(s + j * 16 + 16), cv, cm));
    if (!kWhole) {
      e0 = _mm512_maskz_mov_ps(keep_key(first_key + j, limit), e0);
      e1 = _mm512_maskz_mov_ps(keep_key(first_key + j + 1, limit), e1);
    }
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // [e0 | e1] in bf16
    _mm512_storeu_si512(p + (j / 2) * 16, _mm512_permutexvar_epi16(pairs, both));
  }
  return sum;
}

// The softmax of 16 queries over kKeys keys with a lazily moved maximum: s [kKeys][16] raw
// dot products, keys at or past a lane's limit masked (none when kWhole). A lane's reference
// m moves to the keys' maximum only when c (max - m) > kSlack (or on its first keys), and
// then alpha = 2^(c m - c m'); elsewhere alpha = 1 and O is left alone. p [kKeys / 2 key
// pairs][16] bf16 pairs; l = l alpha + sum p. Returns the lanes whose O must be scaled by
// *alpha.
// Once every lane has a reference, the weights are taken against it first, and the keys'
// maximum is needed only where they sum past kSettled (or to no number): elsewhere every
// c (s - m) < kSlack - 1, no lane's reference moves, and the weights stand. (The maximum's
// own pass over the scores was a sixth of the softmax's vector work.)
template <bool kWhole, int64_t kKeys>
__mmask16 softmax_step(const float* s, int64_t first_key, __m512i limit, float c, float* m,
                       float* l, uint32_t* p, __m512* alpha) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 m_old = _mm512_loadu_ps(m), cv = _mm512_set1_ps(c);
  const __mmask16 seen = _mm512_cmp_ps_mask(m_old, ninf, _CMP_NEQ_OQ);
  __m512 m_new = m_old, cm = _mm512_mul_ps(m_old, cv), sum;  // cm: c m', the weights' reference
  __mmask16 moved = 0;
  const bool unseen = seen != 0xFFFF;
  if (!unseen) sum = weights<kWhole, kKeys>(s, first_key, limit, cv, cm, p);
  if (unseen || _mm512_cmp_ps_mask(sum, _mm512_set1_ps(kSettled), _CMP_NLE_UQ)) {
    __m512 top = ninf;
    for (int64_t j = 0; j < kKeys; ++j) {
      const __m512 x = _mm512_loadu_ps(s + j * 16);
      top = kWhole ? _mm512_max_ps(top, x)
                   : _mm512_mask_max_ps(top, keep_key(first_key + j, limit), top, x);
    }
    const __mmask16 rise = _mm512_cmp_ps_mask(_mm512_mul_ps(_mm512_sub_ps(top, m_old), cv),
                                              _mm512_set1_ps(kSlack), _CMP_GT_OQ);
    moved = rise | static_cast<__mmask16>(~seen);
    m_new = _mm512_mask_mov_ps(m_old, moved, top);
    cm = _mm512_mul_ps(m_new, cv);
    if (moved) sum = weights<kWhole, kKeys>(s, first_key, limit, cv, cm, p);
  }
  const __mmask16 scaled = moved & seen;
  *alpha = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), scaled,
                              exp2_weights(_mm512_fmsub_ps(m_old, cv, cm)));
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_maskz_mov_ps(seen, _mm512_loadu_ps(l)), *alpha,
                                      sum));
  _mm512_storeu_ps(m, m_new);
  return scaled;
}

// One item's buffers: rows = G x positions real rows, then padding to a whole last block.
struct ItemRows {
  int64_t rows, width;        // width: columns of q_t and o_t, rows + kBlock
  // Q^T from q_t[q0], 64-byte aligned: [width / 16 blocks][D/2][16] bf16 pairs, so that a
  // block's B tile (16 pairs of its 16 rows) is 1 KiB contiguous
  std::vector<uint32_t> q_t;
  int64_t q0, pairs;
  std::vector<float> o_t;     // [D][width]
  std::vector<float> m, l;    // [width]
  std::vector<int32_t> limit;  // [width] keys each row attends: pos + 1

  uint32_t& q_at(int64_t pair, int64_t r) {
    return q_t[q0 + (r / 16 * pairs + pair) * 16 + r % 16];
  }
  const uint32_t* q_block(int64_t r0) const { return q_t.data() + q0 + r0 / 16 * pairs * 16; }
};

ItemRows gather(const at::Tensor& q, int64_t g, int64_t first, int64_t positions,
                int64_t group, int64_t start) {
  const int64_t d = q.size(2), rows = positions * group, width = rows + kBlock;
  const int64_t blocks = (width + kBlock - 1) / kBlock;
  ItemRows it{rows, width, std::vector<uint32_t>(blocks * kBlock * d / 2 + 16, 0u), 0, d / 2,
              std::vector<float>(d * width, 0.f),
              std::vector<float>(width, -std::numeric_limits<float>::infinity()),
              std::vector<float>(width, 0.f), std::vector<int32_t>(width)};
  it.q0 = (64 - reinterpret_cast<uintptr_t>(it.q_t.data()) % 64) % 64 / 4;
  const bf16* qp = q.data_ptr<bf16>();
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      const auto* src = reinterpret_cast<const uint32_t*>(
          qp + (first + i) * q.stride(0) + (g * group + h) * q.stride(1));
      for (int64_t pr = 0; pr < d / 2; ++pr) it.q_at(pr, r) = src[pr];
      it.limit[r] = static_cast<int32_t>(start + first + i + 1);
    }
  // padding rows (zero queries) attend as the last row, so no lane is all -inf
  std::fill(it.limit.begin() + rows, it.limit.end(), it.limit[rows - 1]);
  return it;
}

// S^T [32 keys][16 lanes] of the step at `first_key` to s: tiles 4-5 += K rows (A, tile 6) .
// Q^T pairs (B, tile 7), 32 dimensions at a time.
void step_scores(const ItemRows& it, int64_t r0, const Tiles& tiles, int64_t g, int64_t d,
                 int64_t first_key, float* s) {
  const bf16* kt = tiles.k_tile(g, first_key / kTile);
  const int64_t b = first_key % kTile / 16;  // the step's first 16 keys in the tile
  const uint32_t* q = it.q_block(r0);
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t kc = 0; kc < d / 32; ++kc) {
    _tile_loadd(7, q + kc * kTilePairs, 64);
    _tile_loadd(6, kt + k_rows(b, kc, d), 64);
    _tile_dpbf16ps(4, 6, 7);
    _tile_loadd(6, kt + k_rows(b + 1, kc, d), 64);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(4, s, kBlock * 4);
  _tile_stored(5, s + 16 * kBlock, kBlock * 4);
}

// The same at D = 64 with the block's Q^T resident in tiles 4-5 (its two 32-dimension halves,
// B): per 16 keys, tile 6 += K rows (A, tile 7) . tile 4, then . tile 5. Two tile loads fewer
// per step than reloading Q^T.
void step_scores_q_resident(const Tiles& tiles, int64_t g, int64_t first_key, float* s) {
  const bf16* kt = tiles.k_tile(g, first_key / kTile);
  const int64_t b = first_key % kTile / 16;
  for (int64_t h = 0; h < 2; ++h) {
    _tile_zero(6);
    _tile_loadd(7, kt + k_rows(b + h, 0, kResidentD), 64);
    _tile_dpbf16ps(6, 7, 4);
    _tile_loadd(7, kt + k_rows(b + h, 1, kResidentD), 64);
    _tile_dpbf16ps(6, 7, 5);
    _tile_stored(6, s + h * 16 * kBlock, kBlock * 4);
  }
}

// Block [r0, r0 + 16) of an item over all the keys its rows attend (the file comment), in
// steps of kKeys: at D = 64 (kResident) steps of 32 keys with O^T in tiles 0-3 and Q^T in
// tiles 4-5 between the first step and the last; at larger D steps of 64 keys with O^T (the
// item's o_t, columns r0 ..) through tiles 0-3 once per step and 64 dimensions. A rescale
// passes O^T through memory.
template <bool kResident>
void attend_block(ItemRows& it, int64_t r0, const Tiles& tiles, int64_t g, int64_t d,
                  float c) {
  constexpr int64_t kKeys = kResident ? kStep : 2 * kStep;
  alignas(64) float s[2][kKeys * kBlock];
  alignas(64) uint32_t p[kKeys / 2 * kBlock];
  const int64_t w = it.width, low = it.limit[r0], high = it.limit[r0 + kBlock - 1];
  const __m512i limit = _mm512_loadu_si512(it.limit.data() + r0);
  float* o = it.o_t.data() + r0;
  float* m = it.m.data() + r0;
  float* l = it.l.data() + r0;
  auto scores = [&](int64_t first_key, float* out) {
    if (kResident) return step_scores_q_resident(tiles, g, first_key, out);
    for (int64_t h = 0; h < kKeys; h += kStep)
      step_scores(it, r0, tiles, g, d, first_key + h, out + h * kBlock);
  };
  if (kResident) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, it.q_block(r0), 64);
    _tile_loadd(5, it.q_block(r0) + kTilePairs, 64);
  }
  scores(0, s[0]);
  for (int64_t first_key = 0, i = 0; first_key < high; first_key += kKeys, i ^= 1) {
    if (first_key + kKeys < high) scores(first_key + kKeys, s[i ^ 1]);
    __m512 alpha;
    const __mmask16 scaled =
        first_key + kKeys <= low
            ? softmax_step<true, kKeys>(s[i], first_key, limit, c, m, l, p, &alpha)
            : softmax_step<false, kKeys>(s[i], first_key, limit, c, m, l, p, &alpha);
    if (scaled) {  // O^T x alpha, rows of 16 lanes
      if (kResident) store_c(o, 16 * w, w * 4);
      for (int64_t e = 0; e < d; ++e)
        _mm512_storeu_ps(o + e * w, _mm512_mul_ps(_mm512_loadu_ps(o + e * w), alpha));
      if (kResident) load_c(o, 16 * w, w * 4);
    }
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      if (!kResident) load_c(o + e0 * w, 16 * w, w * 4);
      for (int64_t h = 0; h < kKeys; h += kStep) {
        const int64_t key = first_key + h;
        _tile_loadd(7, p + h / 2 * kBlock, kBlock * 4);
        step_values(tiles.v_tile(g, key / kTile) + key % kTile * d + e0 * kStep);
      }
      if (!kResident) store_c(o + e0 * w, 16 * w, w * 4);
    }
  }
  if (kResident) store_c(o, 16 * w, w * 4);
}

// The rows of one item: G heads x up to kPos positions, position-major, in blocks of 16.
void attend_item(const Tiles& tiles, int64_t g, int64_t first, const at::Tensor& q,
                 int64_t start, int64_t group, float scale, bf16* out) {
  const int64_t d = q.size(2), heads = q.size(1);
  const int64_t positions = std::min(kPos, q.size(0) - first);
  ItemRows it = gather(q, g, first, positions, group, start);
  const float c = scale * 1.44269504f;  // scale x log2(e)
  configure();
  for (int64_t r0 = 0; r0 < it.rows; r0 += kBlock) {
    if (d == kResidentD)
      attend_block<true>(it, r0, tiles, g, d, c);
    else
      attend_block<false>(it, r0, tiles, g, d, c);
  }
  _tile_release();
  std::vector<float> row(d);
  for (int64_t i = 0; i < positions; ++i)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t r = i * group + h;
      const float inv = 1.f / it.l[r];
      for (int64_t e = 0; e < d; ++e) row[e] = it.o_t[e * it.width + r] * inv;
      bf16* dst = out + ((first + i) * heads + g * group + h) * d;
      for (int64_t e = 0; e < d; e += kBVec)
        store_bf16(dst + e, Vec::loadu(&row[e]), Vec::loadu(&row[e + kVec]));
    }
}

}  // namespace

at::Tensor prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& block_table,
                                 int64_t context_len, double scale) {
  TORCH_CHECK(amx_available(), "this CPU or kernel does not grant AMX to the process");
  return prefill_by_items(q, k_cache, v_cache, block_table, context_len, kPos, pack,
                          [&](const Tiles& tiles, int64_t g, int64_t first, int64_t start,
                              int64_t group, bf16* out) {
                            attend_item(tiles, g, first, q, start, group,
                                        static_cast<float>(scale), out);
                          });
}

#else  // compiled for a CPU without AMX-BF16

at::Tensor prefill_attention_amx(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, double) {
  TORCH_CHECK(false, "built without AMX");
}

#endif

}  // namespace pdserve
